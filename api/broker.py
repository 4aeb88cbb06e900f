"""The API's side of Redis: subscribe to a request's channel, then enqueue it on its tenant's
stream; then read its events, whole and in order, whatever pub/sub drops.

Subscribing first is what makes the hand-off safe: pub/sub delivers only to listeners
present at PUBLISH time, so the confirmation of SUBSCRIBE is awaited before XADD. The
subscription is on one of the process's few shared pub/sub connections
(`api/subscriber.py`), whatever the number of streams.

Pub/sub is at most once, so events are also read from the request's journal
(`shared/journal.py`): at the start (a resumed stream catches up), on a gap in `seq`, when
the stream's inbox dropped messages or its shared connection was lost and opened again,
and whenever the channel has been silent for `stream_idle_check_s`. A silent request whose
worker stopped heartbeating after it had started generating is ended here with
`worker_lost` (`shared/ending.py`), so a stream ends even when no other worker is left to
notice. A request still waiting in its queue checks less and less often (the wait doubles
after each silent check, up to `lost_after_s`): what it waits for is a worker's first
event or its queue deadline, and thousands of queued streams would otherwise cost Redis a
journal read and a meta read each, every second.

A stream can also be interrupted by this process (`Interruption`): it then ends at an
event's boundary, and its SSE layer says why.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

import anyio
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError
from redis.exceptions import TimeoutError as RedisTimeoutError

from api.subscriber import Inbox, Notice, Subscriber
from shared import arrivals, keys, recovery
from shared.ending import end_request, failed
from shared.journal import Journal
from shared.logs import bind_request
from shared.lua import LuaScript
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

# How long a stream waits for an unreachable broker to come back before it gives up.
BROKER_WAIT_S = 30.0
Event = TokenEvent | FinalEvent | ErrorEvent


class Interruption(StrEnum):
    """Why this API process ended a stream before its request ended: the `code` of the SSE
    error event its client gets (`api/streaming.py`)."""

    # The process is shutting down (`api/shutdown.py`): the request runs on, and its client
    # resumes the stream on another replica.
    API_SHUTDOWN = "api_shutdown"
    # Its client took nothing for `stream_send_timeout_s`: the request is cancelled.
    STREAM_STALLED = "stream_stalled"
    # Its client left (`api/sse_response.py`): the request is cancelled; nothing is written.
    CLIENT_GONE = "client_gone"


class Keepalive:
    """What `Subscription.events` hands out, when asked to, after `keepalive_s` without an
    event: the stream writes a comment line, so that no proxy closes it as idle."""


KEEPALIVE = Keepalive()


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


@dataclass(frozen=True, slots=True)
class Broker:
    """What a stream needs of Redis: commands, the journal, the shared subscriber."""

    redis: aioredis.Redis
    journal: Journal
    subscriber: Subscriber
    timing: StreamTiming

    async def submit(self, request: QueuedRequest) -> Subscription:
        """Subscribe to the request's channel, then enqueue it on its tenant's stream."""
        info = RequestInfo.of(request)
        bind_request(info.request_id, info.tenant_id, info.model)
        inbox = await self.subscriber.listen(keys.request_channel(info.request_id))
        try:
            await _enqueue(self.redis, self.journal, info, request)
        except BaseException:
            self.subscriber.stop_listening(inbox)
            raise
        # Subscribed before it was enqueued: every event of it reaches the inbox (or a notice
        # that some did not), so there is no journal to catch up on first.
        return Subscription(info, inbox, self, needs_catch_up=False)

    async def resume(self, info: RequestInfo, next_seq: int) -> Subscription:
        """Follow a request's events from `next_seq` (a reconnecting client)."""
        bind_request(info.request_id, info.tenant_id, info.model)
        inbox = await self.subscriber.listen(keys.request_channel(info.request_id))
        return Subscription(info, inbox, self, next_seq=next_seq)


@dataclass
class Subscription:
    """A request's event channel, subscribed before the request was enqueued (or before its
    journal is read, for a resumed stream)."""

    info: RequestInfo
    inbox: Inbox
    broker: Broker
    next_seq: int = 0
    needs_catch_up: bool = True  # read the journal before listening (a resumed stream)
    is_finished: bool = False
    is_closed: bool = False
    _silent_since_s: float = field(default_factory=time.monotonic)
    _last_event_s: float = field(default_factory=time.monotonic)
    _last_keepalive_s: float = 0.0
    _idle_wait_s: float | None = None  # how long silence lasts before the next check
    _check_at_s: float | None = None  # when the silence now running is checked

    @property
    def interruption(self) -> Interruption | None:
        reason = self.inbox.interruption
        return None if reason is None else Interruption(reason)

    def interrupt(self, reason: Interruption) -> None:
        """End `events` at its next event's boundary (the first reason given stays)."""
        self.inbox.interrupt(reason)

    async def events(self, keepalive_s: float | None = None) -> AsyncIterator[Event | Keepalive]:
        """Token events from `next_seq` on, then exactly one final or error event; nothing
        more once interrupted. With `keepalive_s`, also `KEEPALIVE` whenever that long has
        passed without an event (or another `KEEPALIVE`)."""
        # First (unless nothing can have been published yet), and after the broker was away:
        # what the journal holds.
        is_catching_up = self.needs_catch_up
        outage: _Outage | None = None
        while not self.is_finished and self.inbox.interruption is None:
            try:
                events = await self._next_events(is_catching_up, keepalive_s)
                is_catching_up, outage = False, None
            except (RedisConnectionError, RedisTimeoutError):
                # The broker is restarting and the client's own retries gave up: try again;
                # the journal holds what was published meanwhile.
                outage = outage or _Outage()
                if not await outage.wait():
                    raise
                is_catching_up = True
                continue
            for event in events:
                if self.inbox.interruption is not None:
                    return
                if isinstance(event, Keepalive):
                    yield event
                elif (accepted := self._accept(event)) is not None:
                    yield accepted
                if self.is_finished:
                    return

    async def _next_events(
        self, is_catching_up: bool, keepalive_s: float | None
    ) -> Sequence[Event | Keepalive]:
        if is_catching_up:
            return await self._read_journal()
        now_s = time.monotonic()
        if self._check_at_s is None:
            self._check_at_s = now_s + (self._idle_wait_s or self.broker.timing.idle_check_s)
        wake_at_s = self._check_at_s
        if keepalive_s is not None:
            keepalive_at_s = max(self._last_event_s, self._last_keepalive_s) + keepalive_s
            wake_at_s = min(wake_at_s, keepalive_at_s)
        message = await self.inbox.get(max(wake_at_s - now_s, 0.0))
        if message is Notice.INTERRUPTED:
            return []
        if message is None and time.monotonic() < self._check_at_s:
            # Woken for the keepalive: the silence check keeps its own time.
            self._last_keepalive_s = time.monotonic()
            return [KEEPALIVE]
        self._check_at_s = None
        if message is Notice.MISSED:  # dropped here, or the shared connection was lost
            return await self._read_journal()
        if message is None:
            return await self._after_silence()
        return await self._after_message(message)

    async def _after_message(self, message: bytes) -> list[Event]:
        self._silent_since_s, self._idle_wait_s = time.monotonic(), None
        event = decode_event(message)
        if event.seq <= self.next_seq:
            return [event]
        # A gap: what pub/sub dropped is in the journal (the event itself is there too).
        return await self._read_journal()

    async def _after_silence(self) -> list[Event]:
        timing = self.broker.timing
        events = await self._read_journal()
        if events or time.monotonic() - self._silent_since_s < timing.idle_check_s:
            return events
        try:
            has_ended = await self._end_if_stuck()
        except OutOfMemoryError as exc:  # Redis refuses writes for now: next time, then
            log.warning("could not end %s yet: %s", self.info.request_id, exc)
            has_ended = False
        self._silent_since_s = time.monotonic()
        if has_ended:
            return await self._read_journal()
        if self.next_seq == 0:  # still queued: check less often (module docstring)
            wait_s = 2 * (self._idle_wait_s or timing.idle_check_s)
            self._idle_wait_s = min(wait_s, max(timing.idle_check_s, timing.lost_after_s))
        return []

    async def _read_journal(self) -> list[Event]:
        return await self.broker.journal.read_after(self.info.request_id, self.next_seq - 1)

    def _accept(self, event: Event) -> Event | None:
        if event.seq < self.next_seq:
            return None  # seen already (from the journal, then from pub/sub)
        self.next_seq = event.seq + 1
        self._last_event_s = time.monotonic()
        if not isinstance(event, TokenEvent):
            self.is_finished = True
        return event

    async def _end_if_stuck(self) -> bool:
        """End the request if it started and its worker stopped heartbeating
        (`worker_lost`), or if it never started and its queue deadline passed
        (`queue_timeout`, for when no worker is there to say so); whether it did.

        Called after a journal read that found nothing new: so the request has started if
        and only if this stream has seen an event (`next_seq` > 0)."""
        redis, journal = self.broker.redis, self.broker.journal
        lost_after_s = self.broker.timing.lost_after_s
        has_started = self.next_seq > 0
        if has_started and time.monotonic() - self._last_event_s < lost_after_s:
            return False  # quiet, not yet long enough to tell a dead worker from a pause
        meta = await journal.meta(self.info.request_id)
        if not has_started:
            queue_deadline_ts = float(meta.get("queue_deadline_ts", "inf"))
            if time.time() <= queue_deadline_ts:
                return False  # waiting; a live worker will reclaim it if its puller died
            code, message = ErrorCode.QUEUE_TIMEOUT, "the request waited past its queue deadline"
        else:
            owner = meta.get("owner")
            if owner is None or await redis.exists(keys.worker_heartbeat(owner)):
                return False  # its worker is alive
            if not await recovery.is_broker_settled(redis, lost_after_s):
                return False  # the broker just restarted: its worker may not have beaten yet
            code, message = ErrorCode.WORKER_LOST, "the worker generating this request stopped"
        stream, entry_id = meta["stream"], meta["entry_id"]
        entry: tuple[str, str] | None = (stream, entry_id)
        request = await _queued_request(redis, stream, entry_id)
        if request is None:
            # The entry is gone but the request never ended. Seen once in CI; the likely
            # causes are fixed (an enqueue retried by the client after it ran queued the
            # request twice, and a worker could acknowledge the very entry it was serving
            # as a "second delivery"). Kept as the last line of defence: end it anyway,
            # its usage from what was stored when it was enqueued.
            request, entry = _request_from_meta(meta), None
            if request is None:
                return False
        await end_request(
            redis,
            journal,
            request,
            entry,
            failed(code, message),
            claimer=f"api-{os.getpid()}",
            take_over_after_s=self.broker.timing.lost_after_s,
        )
        return True  # ended here or by whoever claimed the end first: the journal says

    async def close(self, *, cancel_if_unfinished: bool = True) -> None:
        """Stop listening; then, if the request has not ended, tell the workers serving the
        model that its client went away (they abort it and record the usage so far, finish
        reason `cancelled`), unless the stream was interrupted by this process's shutdown
        (the request runs on, for its client to resume elsewhere). Idempotent."""
        if self.is_closed:
            return
        self.is_closed = True
        self.broker.subscriber.stop_listening(self.inbox)
        if not cancel_if_unfinished or self.is_finished:
            return
        if self.interruption is Interruption.API_SHUTDOWN:
            return
        # Shielded: this runs while a disconnected stream is being cancelled.
        with anyio.CancelScope(shield=True):
            try:
                await self.broker.redis.publish(
                    keys.cancel_channel(self.info.model), encode_cancel(self.info.request_id)
                )
            except BROKER_ERRORS as exc:
                log.warning("could not cancel %s (%s)", self.info.request_id, exc)


@dataclass
class _Outage:
    """Backoff while the broker is unreachable, for up to `BROKER_WAIT_S`."""

    deadline_s: float = field(default_factory=lambda: time.monotonic() + BROKER_WAIT_S)
    delay_s: float = 0.05

    async def wait(self) -> bool:
        """Wait before the next try; False (at once) if that would pass the deadline."""
        if time.monotonic() + self.delay_s > self.deadline_s:
            return False
        await anyio.sleep(self.delay_s)
        self.delay_s = min(self.delay_s * 2, 1.0)
        return True


# KEYS: the model's tenant set, the tenant's stream, the request's meta hash, the model
# version's arrivals bucket (`shared/arrivals.py`, the autoscaler's signal).
# ARGV: tenant id, meta ttl s, the entry's body, prompt tokens, arrivals ttl s, then the meta
# hash's field/value pairs.
# Enqueues once: a retry of a call that ran (the client retries on a broken connection)
# finds the meta hash and returns the entry id it holds instead of enqueueing (or counting)
# again.
_ENQUEUE_LUA = """
local existing = redis.call('HGET', KEYS[3], 'entry_id')
if existing then return existing end
redis.call('SADD', KEYS[1], ARGV[1])
local id = redis.call('XADD', KEYS[2], '*', 'body', ARGV[3])
redis.call('HSET', KEYS[3], 'entry_id', id, unpack(ARGV, 6))
redis.call('EXPIRE', KEYS[3], ARGV[2])
redis.call('HINCRBY', KEYS[4], 'requests', 1)
redis.call('HINCRBY', KEYS[4], 'prompt_tokens', ARGV[4])
redis.call('EXPIRE', KEYS[4], ARGV[5])
return id
"""
_ENQUEUE = LuaScript(_ENQUEUE_LUA)


async def _enqueue(
    redis: aioredis.Redis, journal: Journal, info: RequestInfo, request: QueuedRequest
) -> None:
    stream = keys.tenant_stream(request.deployment_name, request.tenant_id)
    fields = {**_info_fields(info), "stream": stream, **_usage_fields(request)}
    if request.queue_deadline_ts is not None:
        fields["queue_deadline_ts"] = str(request.queue_deadline_ts)
    await _ENQUEUE(
        redis,
        keys=[
            keys.model_tenants(request.deployment_name),
            stream,
            keys.request_meta(request.request_id),
            arrivals.bucket_key(request.deployment_name, time.time()),
        ],
        args=[
            request.tenant_id,
            journal.ttl_s,
            request.to_fields()["body"],
            len(request.prompt_token_ids),
            arrivals.BUCKET_TTL_S,
            *(item for pair in fields.items() for item in pair),
        ],
    )


async def request_info(journal: Journal, request_id: str, tenant_id: str) -> RequestInfo | None:
    """What a resumed stream needs to know of a request; None if the request is unknown,
    expired or another tenant's."""
    meta = await journal.meta(request_id)
    if meta.get("tenant_id") != tenant_id:
        return None
    return RequestInfo(request_id, tenant_id, meta["model"], meta["kind"], int(meta["created"]))


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
