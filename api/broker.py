"""The API's side of Redis: subscribe to a request's channel, then enqueue it on its tenant's
stream; then read its events, whole and in order, whatever pub/sub drops.

Subscribing first is what makes the hand-off safe: pub/sub delivers only to listeners
present at PUBLISH time, so the confirmation of SUBSCRIBE is awaited before XADD.

Each stream's pub/sub connection comes from a pool of its own (one connection) and is closed
with the stream, the cancel a stream publishes when its client leaves going over that same
connection: redis-py's shared pool never closes an idle connection, so a burst of streams
ending together (each publishing its cancel at once) used to leave as many connections open
in it for the life of the process.

Pub/sub is at most once, so events are also read from the request's journal
(`shared/journal.py`): at the start (a resumed stream catches up), on a gap in `seq`, and
whenever the channel has been silent for `stream_idle_check_s`. A silent request whose
worker stopped heartbeating after it had started generating is ended here with
`worker_lost` (`shared/ending.py`), so a stream ends even when no other worker is left to
notice.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import anyio
import redis.asyncio as aioredis
from redis.asyncio.client import PubSub
from redis.asyncio.connection import ConnectionPool
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from shared import keys, recovery
from shared.ending import end_request, failed
from shared.journal import Journal
from shared.logs import bind_request
from shared.protocol import (
    ErrorCode,
    ErrorEvent,
    FinalEvent,
    QueuedRequest,
    TokenEvent,
    decode_event,
    encode_cancel,
)
from shared.redis_conn import BROKER_ERRORS
from shared.settings import Settings

log = logging.getLogger("llmfleet.api")

SUBSCRIBE_TIMEOUT_S = 5.0
# The Redis client name of every stream's own connection (`CLIENT LIST` tells them apart).
STREAM_CLIENT_NAME = "llmfleet-api-stream"
# How long a stream waits for the broker to come back before it gives up.
RESUBSCRIBE_TIMEOUT_S = 30.0
Event = TokenEvent | FinalEvent | ErrorEvent


@dataclass(frozen=True, slots=True)
class RequestInfo:
    """What a reader of a request's events needs; stored in Redis when it is enqueued."""

    request_id: str
    tenant_id: str
    model: str
    kind: str
    created: int

    @classmethod
    def of(cls, request: QueuedRequest) -> RequestInfo:
        return cls(
            request.request_id,
            request.tenant_id,
            request.model,
            request.kind,
            int(request.arrival_ts),
        )


@dataclass(frozen=True, slots=True)
class StreamTiming:
    """When a silent stream reads the journal (`idle_check_s`), and how long a started
    request must have been silent before its worker's missing heartbeat means it is lost
    (`lost_after_s`: a heartbeat missing just after a broker restart is not a dead worker)."""

    idle_check_s: float
    lost_after_s: float

    @classmethod
    def of(cls, settings: Settings) -> StreamTiming:
        return cls(settings.stream_idle_check_s, settings.worker_heartbeat_timeout_s)


@dataclass
class Subscription:
    """A request's event channel, subscribed before the request was enqueued (or before its
    journal is read, for a resumed stream)."""

    info: RequestInfo
    pubsub: PubSub
    redis: aioredis.Redis
    journal: Journal
    timing: StreamTiming
    next_seq: int = 0
    is_finished: bool = False
    is_closed: bool = False
    _silent_since_s: float = field(default_factory=time.monotonic)
    _last_event_s: float = field(default_factory=time.monotonic)

    async def events(self) -> AsyncIterator[Event]:
        """Token events from `next_seq` on, then exactly one final or error event."""
        is_catching_up = True  # first, and after a reconnect: what the journal holds
        while not self.is_finished:
            try:
                events = await self._next_events(is_catching_up)
                is_catching_up = False
            except (RedisConnectionError, RedisTimeoutError):
                # The broker restarted and redis-py's own reconnect failed (it does not retry
                # a failed reconnect): subscribe again; the journal holds what was missed.
                await self._resubscribe()
                is_catching_up = True
                continue
            for event in events:
                if (accepted := self._accept(event)) is not None:
                    yield accepted
                if self.is_finished:
                    return

    async def _next_events(self, is_catching_up: bool) -> list[Event]:
        if is_catching_up:
            return await self.journal.read_after(self.info.request_id, self.next_seq - 1)
        message = await self.pubsub.get_message(
            ignore_subscribe_messages=True, timeout=self.timing.idle_check_s
        )
        return await self._after(message)

    async def _after(self, message: dict | None) -> list[Event]:
        """The events to hand out after a pub/sub message, or after silence."""
        if message is None or message["type"] != "message":
            return await self._after_silence()
        self._silent_since_s = time.monotonic()
        event = decode_event(message["data"])
        if event.seq <= self.next_seq:
            return [event]
        # A gap: what pub/sub dropped is in the journal (the event itself is there too).
        return await self.journal.read_after(self.info.request_id, self.next_seq - 1)

    async def _after_silence(self) -> list[Event]:
        events = await self.journal.read_after(self.info.request_id, self.next_seq - 1)
        if events or time.monotonic() - self._silent_since_s < self.timing.idle_check_s:
            return events
        await self._end_if_stuck()
        self._silent_since_s = time.monotonic()
        return await self.journal.read_after(self.info.request_id, self.next_seq - 1)

    async def _resubscribe(self) -> None:
        with anyio.CancelScope(shield=True), contextlib.suppress(RedisConnectionError):
            await _close_pubsub(self.pubsub)
        deadline_s, delay_s = time.monotonic() + RESUBSCRIBE_TIMEOUT_S, 0.05
        while True:
            try:
                self.pubsub = await _subscribe(self.redis, self.info.request_id)
                return
            except (RedisConnectionError, RedisTimeoutError, RuntimeError):
                if time.monotonic() + delay_s > deadline_s:
                    raise
                await anyio.sleep(delay_s)
                delay_s = min(delay_s * 2, 1.0)

    def _accept(self, event: Event) -> Event | None:
        if event.seq < self.next_seq:
            return None  # seen already (from the journal, then from pub/sub)
        self.next_seq = event.seq + 1
        self._last_event_s = time.monotonic()
        if not isinstance(event, TokenEvent):
            self.is_finished = True
        return event

    async def _end_if_stuck(self) -> None:
        """End the request if it started and its worker stopped heartbeating
        (`worker_lost`), or if it never started and its queue deadline passed
        (`queue_timeout`, for when no worker is there to say so)."""
        meta = await self.journal.meta(self.info.request_id)
        if await self.journal.last_seq(self.info.request_id) < 0:
            queue_deadline_ts = float(meta.get("queue_deadline_ts", "inf"))
            if time.time() <= queue_deadline_ts:
                return  # waiting; a live worker will reclaim it if its puller died
            code, message = ErrorCode.QUEUE_TIMEOUT, "the request waited past its queue deadline"
        else:
            if time.monotonic() - self._last_event_s < self.timing.lost_after_s:
                return  # quiet, not yet long enough to tell a dead worker from a pause
            owner = meta.get("owner")
            if owner is None or await self.redis.exists(keys.worker_heartbeat(owner)):
                return  # its worker is alive
            if not await recovery.is_broker_settled(self.redis, self.timing.lost_after_s):
                return  # the broker just restarted: its worker may not have beaten yet
            code, message = ErrorCode.WORKER_LOST, "the worker generating this request stopped"
        stream, entry_id = meta["stream"], meta["entry_id"]
        entry: tuple[str, str] | None = (stream, entry_id)
        request = await _queued_request(self.redis, stream, entry_id)
        if request is None:
            # The entry is gone but the request never ended. Seen once in CI; the likely
            # causes are fixed (an enqueue retried by the client after it ran queued the
            # request twice, and a worker could acknowledge the very entry it was serving
            # as a "second delivery"). Kept as the last line of defence: end it anyway,
            # its usage from what was stored when it was enqueued.
            request, entry = _request_from_meta(meta), None
            if request is None:
                return
        await end_request(
            self.redis,
            self.journal,
            request,
            entry,
            failed(code, message),
            claimer=f"api-{os.getpid()}",
        )

    async def close(self, *, cancel_if_unfinished: bool = True) -> None:
        """Unsubscribe and close the stream's connection; first, if the request has not
        ended, tell the workers serving the model that its client went away (they abort it
        and record the usage so far, finish reason `cancelled`). Idempotent."""
        if self.is_closed:
            return
        self.is_closed = True
        # Shielded: this runs while a disconnected stream is being cancelled.
        with anyio.CancelScope(shield=True):
            pool = self.pubsub.connection_pool
            try:
                await self.pubsub.aclose()
                if cancel_if_unfinished and not self.is_finished:
                    # The stream's own connection, reconnected: see the module docstring.
                    await aioredis.Redis(connection_pool=pool).publish(
                        keys.cancel_channel(self.info.model), encode_cancel(self.info.request_id)
                    )
            except BROKER_ERRORS as exc:
                log.warning("could not cancel %s (%s)", self.info.request_id, exc)
            finally:
                await pool.disconnect()


# KEYS: the model's tenant set, the tenant's stream, the request's meta hash.
# ARGV: tenant id, meta ttl s, the entry's body, then the meta hash's field/value pairs.
# Enqueues once: a retry of a call that ran (the client retries on a broken connection)
# finds the meta hash and returns the entry id it holds instead of enqueueing again.
_ENQUEUE_LUA = """
local existing = redis.call('HGET', KEYS[3], 'entry_id')
if existing then return existing end
redis.call('SADD', KEYS[1], ARGV[1])
local id = redis.call('XADD', KEYS[2], '*', 'body', ARGV[3])
redis.call('HSET', KEYS[3], 'entry_id', id, unpack(ARGV, 4))
redis.call('EXPIRE', KEYS[3], ARGV[2])
return id
"""


async def submit(
    redis: aioredis.Redis, journal: Journal, request: QueuedRequest, timing: StreamTiming
) -> Subscription:
    info = RequestInfo.of(request)
    bind_request(info.request_id, info.tenant_id, info.model)
    pubsub = await _subscribe(redis, info.request_id)
    try:
        stream = keys.tenant_stream(request.model, request.tenant_id)
        fields = {**_info_fields(info), "stream": stream, **_usage_fields(request)}
        if request.queue_deadline_ts is not None:
            fields["queue_deadline_ts"] = str(request.queue_deadline_ts)
        await redis.register_script(_ENQUEUE_LUA)(
            keys=[keys.model_tenants(request.model), stream, keys.request_meta(request.request_id)],
            args=[
                request.tenant_id,
                journal.ttl_s,
                request.to_fields()["body"],
                *(item for pair in fields.items() for item in pair),
            ],
        )
    except BaseException:
        with anyio.CancelScope(shield=True):
            await _close_pubsub(pubsub)
        raise
    return Subscription(info, pubsub, redis, journal, timing)


async def request_info(journal: Journal, request_id: str, tenant_id: str) -> RequestInfo | None:
    """What a resumed stream needs to know of a request; None if the request is unknown,
    expired or another tenant's."""
    meta = await journal.meta(request_id)
    if meta.get("tenant_id") != tenant_id:
        return None
    return RequestInfo(request_id, tenant_id, meta["model"], meta["kind"], int(meta["created"]))


async def resume(
    redis: aioredis.Redis, journal: Journal, info: RequestInfo, next_seq: int,
    timing: StreamTiming,
) -> Subscription:  # fmt: skip
    """Follow a request's events from `next_seq` (a reconnecting client)."""
    bind_request(info.request_id, info.tenant_id, info.model)
    pubsub = await _subscribe(redis, info.request_id)
    return Subscription(info, pubsub, redis, journal, timing, next_seq=next_seq)


async def _subscribe(redis: aioredis.Redis, request_id: str) -> PubSub:
    """A subscription to the request's channel on a connection of its own (see the module
    docstring); close it with `_close_pubsub`."""
    shared = redis.connection_pool
    own = ConnectionPool(
        connection_class=shared.connection_class,
        max_connections=1,
        **{**shared.connection_kwargs, "client_name": STREAM_CLIENT_NAME},
    )
    pubsub = aioredis.Redis(connection_pool=own).pubsub()
    try:
        await pubsub.subscribe(keys.request_channel(request_id))
        confirmation = await pubsub.get_message(timeout=SUBSCRIBE_TIMEOUT_S)
        if confirmation is None or confirmation["type"] != "subscribe":
            raise RuntimeError("no SUBSCRIBE confirmation from Redis")
    except BaseException:
        with anyio.CancelScope(shield=True):
            await _close_pubsub(pubsub)
        raise
    return pubsub


async def _close_pubsub(pubsub: PubSub) -> None:
    pool = pubsub.connection_pool
    try:
        await pubsub.aclose()
    finally:
        await pool.disconnect()


def _usage_fields(request: QueuedRequest) -> dict[str, str]:
    """What recording a lost request's usage needs, without its prompt (never in meta)."""
    bare = request.model_dump_json(exclude={"prompt_token_ids", "content_retention_days"})
    return {"request": bare, "num_input_tokens": str(len(request.prompt_token_ids))}


def _request_from_meta(meta: dict[str, str]) -> QueuedRequest | None:
    if "request" not in meta:
        return None
    num_input_tokens = int(meta.get("num_input_tokens", "0"))
    # Stand-in prompt ids: only their number is used (content is not kept for such a request).
    fields = {**json.loads(meta["request"]), "prompt_token_ids": [0] * num_input_tokens}
    return QueuedRequest.model_validate(fields)


def _info_fields(info: RequestInfo) -> dict[str, str]:
    return {
        "tenant_id": info.tenant_id,
        "model": info.model,
        "kind": info.kind,
        "created": str(info.created),
    }


async def _queued_request(
    redis: aioredis.Redis, stream: str, entry_id: str
) -> QueuedRequest | None:
    entries = await redis.xrange(stream, min=entry_id, max=entry_id)
    return QueuedRequest.from_fields(entries[0][1]) if entries else None
