"""Worker intake: read the model's tenant streams through the `workers` consumer group.

An entry is acknowledged (and deleted: the stream is a queue, and it holds prompt tokens)
only after the request's usage is committed to SQL; until then it stays in the group's
pending list, where it can be reclaimed if this worker dies.
"""

from __future__ import annotations

import asyncio
import logging
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
    def __init__(self, redis: aioredis.Redis, model: str, consumer: str) -> None:
        self._redis = redis
        self._model = model
        self._consumer = consumer
        self._streams_with_group: set[str] = set()

    async def pull(self, max_count: int, block_ms: int | None) -> list[StreamEntry]:
        """Up to about `max_count` new entries; waits up to `block_ms` when there are none."""
        streams = await self._streams()
        if not streams:
            if block_ms:
                await asyncio.sleep(block_ms / 1000)
            return []
        reply = await self._redis.xreadgroup(
            keys.WORKER_GROUP,
            self._consumer,
            {stream: ">" for stream in streams},
            count=max_count,
            block=block_ms,
        )
        entries = []
        for stream, messages in reply or []:
            for entry_id, fields in messages:
                entry = await self._decode(_text(stream), _text(entry_id), fields)
                if entry is not None:
                    entries.append(entry)
        return entries

    async def ack(self, entry: StreamEntry) -> None:
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.xack(entry.stream, keys.WORKER_GROUP, entry.entry_id)
            pipe.xdel(entry.stream, entry.entry_id)
            await pipe.execute()

    async def _streams(self) -> list[str]:
        tenants = await self._redis.smembers(keys.model_tenants(self._model))
        streams = sorted(keys.tenant_stream(self._model, _text(t)) for t in tenants)
        for stream in streams:
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
