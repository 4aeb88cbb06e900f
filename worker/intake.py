"""Worker intake: read the tenant streams of the model version it serves through the `workers`
consumer group.

A worker pulls only what it can start soon, so that it never hoards work another worker
could serve, yet its fair queue sees every waiting tenant (`plan_pull`): when it has `n`
free places it reads up to ceil(n / number of tenant streams) entries from each stream,
skipping tenants that already have that many waiting in the worker. With no free place, it
still reads the head of each stream whose tenant has nothing waiting here and would start
soon: at once, by displacing running work (a higher tier, or a tenant a quantum behind a
running one's service), or at the next free place, being the least served of the tenants
waiting (`FairQueue.starting_soon`). So a tenant that arrives while another's burst fills
the batch starts within a step or two instead of after the burst's first wave, and the
pool's shares hold whichever worker holds whose requests. It holds at most one entry per
tenant beyond what it has room for, each one it would start next, and the fair queue, not
the stream order, decides who starts. A FIFO worker (the baseline) instead reads up to `n`
entries from every stream and starts them in arrival order.

A worker may prefer some tenants (`--prefer-tenants`, tenant affinity: for instance to keep
their prompts' prefixes in its cache): while busy, it fills its free places from their
streams first and reads the others' by the same rule with the places left. Affinity moves
where a tenant is served, not how much: the pool's service counters
(`worker/pool_service.py`) keep every tenant's share of the pool.

An entry is acknowledged (and deleted: the stream is a queue, and it holds prompt tokens)
only after the request's usage is committed to SQL; until then it stays in the group's
pending list, where it can be reclaimed if this worker dies.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Protocol

import redis.asyncio as aioredis
from pydantic import ValidationError
from redis.exceptions import ResponseError
from redis.typing import KeyT, StreamIdT

from shared import keys, stream_queue
from shared.protocol import QueuedRequest
from shared.redis_conn import text

log = logging.getLogger("llmfleet.worker")


@dataclass(frozen=True, slots=True)
class StreamEntry:
    stream: str
    entry_id: str
    request: QueuedRequest


class IntakeView(Protocol):
    """What the intake asks of the worker's engine (`worker.engine.Engine` provides it)."""

    def num_free_slots(self) -> int: ...
    def num_waiting_by_tenant(self) -> Counter[str]: ...
    def starting_soon(self, tenant_ids: Iterable[str]) -> set[str]: ...


def plan_pull(
    num_free: int,
    tenants: list[str],
    engine: IntakeView,
    *,
    is_fair: bool = True,
    num_taken: Mapping[str, int] | None = None,
) -> dict[str, int]:
    """How many entries to read from each tenant's stream (module docstring): `num_free`
    places shared evenly by `tenants`, read from those with fewer than their share waiting
    (`num_taken`: entries just read, not in the engine yet), so one XREADGROUP; with no
    free place, the head of each tenant with nothing waiting that would start soon. (Shares in proportion to the weights were
    tried: the weighted scenario's shares got noisier, docs/benchmarks.md; the fair queue,
    not the intake, applies the weights.)"""
    if not is_fair:
        return dict.fromkeys(tenants, num_free) if num_free else {}
    waiting = engine.num_waiting_by_tenant() + Counter(num_taken or {})
    if not tenants:
        return {}
    if not num_free:
        soon = engine.starting_soon(t for t in tenants if not waiting[t])
        return {t: 1 for t in tenants if t in soon}  # in stream order: deterministic
    share = math.ceil(num_free / len(tenants))
    return {t: share for t in tenants if waiting[t] < share}


class Intake:
    def __init__(
        self,
        redis: aioredis.Redis,
        deployment: str,
        consumer: str,
        *,
        is_fair: bool = True,
        preferred_tenants: frozenset[str] = frozenset(),
    ) -> None:
        self._redis = redis
        self._deployment = deployment  # `model@version`: its streams are this version's
        self._consumer = consumer
        self._is_fair = is_fair
        self._preferred = preferred_tenants
        self._streams_with_group: set[str] = set()
        # The tenants' streams as the latest pull saw them: a busy pull reads them and the
        # tenant set in one round trip (`_pull`).
        self._known: dict[str, str] | None = None

    async def pull(self, engine: IntakeView, block_ms: int | None) -> list[StreamEntry]:
        """New entries for the engine's free places, spread over the tenants' streams, and
        heads that would start soon (`plan_pull`); while busy, the preferred tenants'
        first. Idle (`block_ms`), one read of every stream that waits up to `block_ms`."""
        with self._groups_recreated_if_gone():
            return await self._pull(engine, block_ms)
        return []

    async def _pull(self, engine: IntakeView, block_ms: int | None) -> list[StreamEntry]:
        room = engine.num_free_slots()
        if not room and not self._is_fair and block_ms is None:
            return []  # FIFO waits for room: nothing to read, not even the streams
        if block_ms is not None or self._known is None:
            streams = self._known = await self._streams()
            if block_ms is not None:  # idle: room for everyone, and wait for anything to arrive
                plan = plan_pull(room, list(streams), engine, is_fair=self._is_fair)
                return await self._read(streams, plan, block_ms)
            return await self._read_busy(streams, room, engine, [])
        # Busy, between two steps: the known tenants' streams are read while the tenant set is
        # read again, in one round trip (the client pipelines a turn's commands); a tenant new
        # since the latest pull is read in a second. Asking for the set first and then reading
        # took two round trips, each about a millisecond between two steps while the API takes
        # the last step's tokens (docs/benchmarks.md, session 39).
        known = self._known
        streams, taken = await asyncio.gather(
            self._streams(), self._read_busy(known, room, engine, [])
        )
        self._known = streams
        new = {t: stream for t, stream in streams.items() if t not in known}
        return await self._read_busy(new, room, engine, taken) if new else taken

    async def _read_busy(
        self,
        streams: dict[str, str],
        room: int,
        engine: IntakeView,
        taken: list[StreamEntry],
    ) -> list[StreamEntry]:
        """While busy: `taken` and what `streams` give for the `room` free places, the
        preferred tenants' first (`plan_pull`)."""
        preferred = [t for t in streams if t in self._preferred]
        for group in (preferred, [t for t in streams if t not in self._preferred]):
            # The room is shared by the group; what others just took is not its to share.
            num_taken = Counter(entry.request.tenant_id for entry in taken)
            num_free = max(0, room - sum(n for t, n in num_taken.items() if t not in group))
            plan = plan_pull(num_free, group, engine, is_fair=self._is_fair, num_taken=num_taken)
            taken = taken + await self._read(streams, plan)
        return taken

    async def _read(
        self, streams: dict[str, str], plan: dict[str, int], block_ms: int | None = None
    ) -> list[StreamEntry]:
        """Read `plan` (tenant -> count), one XREADGROUP per distinct count; with
        `block_ms`, waiting that long for anything to arrive."""
        if not plan:
            if block_ms:
                await asyncio.sleep(block_ms / 1000)
            return []
        entries = []
        for count in sorted(set(plan.values())):
            wanted: dict[KeyT, StreamIdT] = {streams[t]: ">" for t, n in plan.items() if n == count}
            reply = await self._redis.xreadgroup(
                keys.WORKER_GROUP, self._consumer, wanted, count=count, block=block_ms
            )
            for stream, messages in reply or []:
                for entry_id, fields in messages:
                    entry = await self._decode(text(stream), text(entry_id), fields)
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
        by_stream: dict[str, list[StreamIdT]] = {}
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
            new_id = await self._redis.xadd(
                entry.stream,
                entry.request.to_fields(),  # type: ignore[arg-type]  # redis-py: `fields` is an invariant Dict (redis-py#2917)
            )
            async with self._redis.pipeline(transaction=True) as pipe:
                stream_queue.ack_in(pipe, entry.stream, entry.entry_id)
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
        with self._groups_recreated_if_gone():
            for stream in (await self._streams()).values():
                reply = await self._redis.xautoclaim(
                    stream, keys.WORKER_GROUP, self._consumer, min_idle_ms, count=max_count
                )
                for entry_id, fields in reply[1]:
                    if fields and (entry := await self._decode(stream, text(entry_id), fields)):
                        entries.append(entry)
        return entries

    @contextlib.contextmanager
    def _groups_recreated_if_gone(self) -> Iterator[None]:
        """A tenant's stream, and with it the `workers` group, deleted under this worker (an
        operator's DEL or FLUSHALL, a broker restored without it): Redis answers NOGROUP.
        Nothing is read this turn, and the groups are created again at the next one."""
        try:
            yield
        except ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            log.warning("a tenant stream's consumer group is gone; creating it again: %s", exc)
            self._streams_with_group.clear()

    async def ack(self, entry: StreamEntry) -> None:
        await stream_queue.ack(self._redis, entry.stream, entry.entry_id)

    async def _streams(self) -> dict[str, str]:
        """Tenant id -> that tenant's stream for this model version."""
        tenants = sorted(
            text(t)
            for t in await self._redis.smembers(keys.model_tenants(self._deployment))  # type: ignore[misc]  # redis-py: async commands typed Awaitable[T] | T (redis-py#2399)
        )
        streams = {tenant: keys.tenant_stream(self._deployment, tenant) for tenant in tenants}
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
            await stream_queue.ack(self._redis, stream, entry_id)
            return None
