"""Worker intake: read the model's tenant streams through the `workers` consumer group.

A worker pulls only what it can start soon, so that it never hoards work another worker
could serve, yet its fair queue sees every waiting tenant: when it has `n` free places it
reads up to ceil(n / number of tenant streams) entries from each stream, skipping tenants
that already have that many waiting in the worker. So it holds at most one entry per tenant
beyond what it has room for, and the fair queue, not the stream order, decides who starts.
A FIFO worker (the baseline) instead reads up to `n` entries from every stream and starts
them in arrival order.

An entry is acknowledged (and deleted: the stream is a queue, and it holds prompt tokens)
only after the request's usage is committed to SQL; until then it stays in the group's
pending list, where it can be reclaimed if this worker dies.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass

import redis.asyncio as aioredis
from pydantic import ValidationError
from redis.exceptions import ResponseError

from shared import keys
from shared.protocol import QueuedRequest

log = logging.getLogger("llmfleet.worker")


@dataclass(frozen=True, slots=True)
class StreamEntry:
    stream: str
    entry_id: str
    request: QueuedRequest


class Intake:
    def __init__(
        self, redis: aioredis.Redis, model: str, consumer: str, *, is_fair: bool = True
    ) -> None:
        self._redis = redis
        self._model = model
        self._consumer = consumer
        self._is_fair = is_fair
        self._streams_with_group: set[str] = set()

    async def pull(
        self, max_count: int, block_ms: int | None, num_waiting: Mapping[str, int]
    ) -> list[StreamEntry]:
        """New entries for about `max_count` free places, spread over the tenants' streams
        (`num_waiting`: entries each tenant already has waiting in this worker); waits up to
        `block_ms` when there are none."""
        streams = await self._streams()
        if self._is_fair:
            count = math.ceil(max_count / max(1, len(streams)))
            wanted = [s for tenant, s in streams.items() if num_waiting.get(tenant, 0) < count]
        else:
            count, wanted = max_count, list(streams.values())
        if not wanted:
            if block_ms:
                await asyncio.sleep(block_ms / 1000)
            return []
        reply = await self._redis.xreadgroup(
            keys.WORKER_GROUP,
            self._consumer,
            {stream: ">" for stream in wanted},
            count=count,
            block=block_ms,
        )
        entries = []
        for stream, messages in reply or []:
            for entry_id, fields in messages:
                entry = await self._decode(_text(stream), _text(entry_id), fields)
                if entry is not None:
                    entries.append(entry)
        return await self._drop_ended(entries)

    async def _drop_ended(self, entries: list[StreamEntry]) -> list[StreamEntry]:
        """A request can be delivered again after it ended (handed back, reclaimed in a
        race): acknowledge those instead of serving them twice."""
        if not entries:
            return entries
        async with self._redis.pipeline(transaction=False) as pipe:
            for entry in entries:
                pipe.exists(keys.request_done(entry.request.request_id))
            is_ended = await pipe.execute()
        for entry, ended in zip(entries, is_ended, strict=True):
            if ended:
                await self.ack(entry)
        return [entry for entry, ended in zip(entries, is_ended, strict=True) if not ended]

    async def keep_claimed(self, entries: list[StreamEntry]) -> None:
        """Reset the idle time of entries this worker holds, so no one reclaims them."""
        by_stream: dict[str, list[str]] = {}
        for entry in entries:
            by_stream.setdefault(entry.stream, []).append(entry.entry_id)
        async with self._redis.pipeline(transaction=False) as pipe:
            for stream, entry_ids in by_stream.items():
                pipe.xclaim(stream, keys.WORKER_GROUP, self._consumer, 0, entry_ids, justid=True)
            await pipe.execute()

    async def hand_back(self, entries: list[StreamEntry]) -> None:
        """Put entries back on their streams for any worker (at the tail: a stream entry id
        cannot go back in time), acknowledging and deleting the ones this worker held."""
        for entry in entries:
            new_id = await self._redis.xadd(entry.stream, entry.request.to_fields())
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.xack(entry.stream, keys.WORKER_GROUP, entry.entry_id)
                pipe.xdel(entry.stream, entry.entry_id)
                pipe.hset(keys.request_meta(entry.request.request_id), "entry_id", new_id)
                await pipe.execute()

    async def give_to(self, entry: StreamEntry, consumer: str) -> None:
        """Hand an entry claimed by mistake back to the live worker that holds it."""
        await self._redis.xclaim(
            entry.stream, keys.WORKER_GROUP, consumer, 0, [entry.entry_id], justid=True
        )

    async def claim_idle(self, min_idle_ms: int, max_count: int) -> list[StreamEntry]:
        """Entries idle for `min_idle_ms` (their worker stopped keeping them), now this
        worker's (`XAUTOCLAIM`)."""
        entries = []
        for stream in (await self._streams()).values():
            reply = await self._redis.xautoclaim(
                stream, keys.WORKER_GROUP, self._consumer, min_idle_ms, count=max_count
            )
            for entry_id, fields in reply[1]:
                if fields and (entry := await self._decode(stream, _text(entry_id), fields)):
                    entries.append(entry)
        return entries

    async def ack(self, entry: StreamEntry) -> None:
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.xack(entry.stream, keys.WORKER_GROUP, entry.entry_id)
            pipe.xdel(entry.stream, entry.entry_id)
            await pipe.execute()

    async def _streams(self) -> dict[str, str]:
        """Tenant id -> that tenant's stream for this model."""
        tenants = sorted(
            _text(t) for t in await self._redis.smembers(keys.model_tenants(self._model))
        )
        streams = {tenant: keys.tenant_stream(self._model, tenant) for tenant in tenants}
        for stream in streams.values():
            if stream not in self._streams_with_group:
                await self._ensure_group(stream)
        return streams

    async def _ensure_group(self, stream: str) -> None:
        # Created at id 0, so entries appended before the group existed are still delivered.
        try:
            await self._redis.xgroup_create(stream, keys.WORKER_GROUP, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        self._streams_with_group.add(stream)

    async def _decode(self, stream: str, entry_id: str, fields: dict) -> StreamEntry | None:
        try:
            return StreamEntry(stream, entry_id, QueuedRequest.from_fields(fields))
        except (ValidationError, TypeError, ValueError):
            # Nobody can serve a malformed entry, and nobody is waiting on it by id: drop it.
            log.error("dropping malformed entry %s on %s", entry_id, stream)
            await self._redis.xack(stream, keys.WORKER_GROUP, entry_id)
            await self._redis.xdel(stream, entry_id)
            return None


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
