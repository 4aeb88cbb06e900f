"""Ending a request exactly once, whoever ends it.

Its worker ends it when the engine is done with it (`worker/publisher.py`). Others end it
with an error: a worker that reclaims a dead worker's started request (`worker/recovery.py`),
a worker that shuts down with requests still running (`worker/service.py`), and an API
replica whose stream went silent while its worker stopped heartbeating (`api/broker.py`).
`end_request` takes the same steps for all of them, each retried while the broker is
unreachable (each is idempotent):

1. claim the end in the journal (`Journal.claim_end`): whoever comes second does nothing;
2. hand the usage to the control process (an arq job, `shared/usage_jobs.py`), which commits
   it to the ledger: an entry is never acknowledged before its usage is durable in Redis;
3. settle the tenant's admission (`shared/quota.py`), before the last event, so that a
   client that sends its next request on `[DONE]` finds its slot free;
4. append the last event (a final event, or an error event);
5. acknowledge and delete the request's stream entry.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from shared import keys, quota, recovery, stream_queue, usage, usage_jobs
from shared.journal import Journal
from shared.protocol import (
    ErrorCode,
    ErrorEvent,
    FinalEvent,
    FinishReason,
    QueuedRequest,
    TokenEvent,
    UsageEvent,
)
from shared.redis_conn import BROKER_ERRORS, retrying

log = logging.getLogger("llmfleet.ending")

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Ending:
    """How a request ends: its last event and what it cost."""

    last_event: FinalEvent | ErrorEvent
    # None: the tokens its journal holds, i.e. what was delivered (a request whose worker
    # is gone); computed then counts the prompt and those.
    num_output_tokens: int | None = None
    num_computed_tokens: int | None = None

    @property
    def finish_reason(self) -> FinishReason:
        if isinstance(self.last_event, FinalEvent):
            return FinishReason(self.last_event.finish_reason)
        return FinishReason.ERROR


def failed(code: ErrorCode, message: str) -> Ending:
    """An ending by an error, with the usage of what the journal says was delivered."""
    return Ending(ErrorEvent(seq=0, code=code, message=message))


async def end_request(
    redis: aioredis.Redis,
    journal: Journal,
    request: QueuedRequest,
    entry: tuple[str, str] | None,
    ending: Ending,
    *,
    claimer: str,
    retry_s: float = 0.0,
    usage_queue: str = keys.CONTROL_QUEUE,
    take_over_after_s: float | None = None,
) -> bool:
    """End `request` as `ending` says, in the steps of the module docstring; False if it was
    ended by someone else, or if its usage could not be handed over (the end is then given
    back, so that whoever tries next records it). `entry`: (stream, entry id) of its queue
    entry, or None when it is gone. A broker error after the usage is handed over is raised:
    the end stays claimed and the entry pending. With `take_over_after_s` (recovery's
    callers: the heartbeat timeout), an end claimed by a process that stopped before
    completing it is taken over and completed here (`recovery.is_claim_abandoned`): every
    step is idempotent, so the steps it had taken are not taken twice."""
    request_id = request.request_id

    async def retried(call: Callable[[], Awaitable[T]], what: str) -> T:
        return await retrying(call, within_s=retry_s, what=f"{what} of {request_id}")

    is_claimed = await retried(lambda: journal.claim_end(request_id, claimer), "the end")
    if not is_claimed and take_over_after_s is not None:
        is_claimed = await _take_over(redis, journal, request_id, claimer, take_over_after_s)
    if not is_claimed:
        log.info("request %s was ended elsewhere", request_id)
        return False
    event = await retried(lambda: _usage_event(journal, request, ending), "the usage")
    try:
        # The control process commits the job to the ledger before dropping it.
        await retried(lambda: usage_jobs.enqueue_usage(redis, event, usage_queue), "the usage")
    except BROKER_ERRORS:
        log.exception("usage of request %s not recorded; its end is given back", request_id)
        with contextlib.suppress(*BROKER_ERRORS):
            await journal.release_end(request_id, claimer)
        return False
    await _settle(redis, request, event.input_tokens + event.output_tokens)
    keeps_content = bool(request.content_retention_days)  # None or 0: never stored
    await retried(
        lambda: journal.append_end(
            request_id, claimer, ending.last_event, keeps_content=keeps_content
        ),
        "the last event",
    )
    if entry is not None:
        await retried(lambda: stream_queue.ack(redis, *entry), "the acknowledgement")
    if isinstance(ending.last_event, ErrorEvent):
        log.warning("request %s ended: %s", request_id, ending.last_event.code)
    return True


async def _take_over(
    redis: aioredis.Redis, journal: Journal, request_id: str, claimer: str, after_s: float
) -> bool:
    """Claim the request's end from a holder that abandoned it (see `end_request`)."""
    claim = await journal.end_claim(request_id)
    if claim is None:  # given back meanwhile
        return await journal.claim_end(request_id, claimer)
    holder, age_s = claim
    if not await recovery.is_claim_abandoned(redis, holder, age_s, after_s):
        return False
    if not await journal.take_over_end(request_id, holder, claimer):
        return False
    log.warning("took over the end of %s from %s, which stopped before completing it",
                request_id, holder)  # fmt: skip
    return True


async def _usage_event(journal: Journal, request: QueuedRequest, ending: Ending) -> UsageEvent:
    """The usage to record: the ending's counts, else the journal's; the whole output text
    (the journal's token events and the last delta) only for a tenant that keeps it."""
    is_kept = request.content_retention_days is not None
    delivered: list[TokenEvent] = []
    if ending.num_output_tokens is None or is_kept:
        events = await journal.read_after(request.request_id, -1)
        delivered = [e for e in events if isinstance(e, TokenEvent)]
    num_output = ending.num_output_tokens
    if num_output is None:
        num_output = sum(e.num_tokens for e in delivered)
    num_computed = ending.num_computed_tokens
    if num_computed is None:
        num_computed = len(request.prompt_token_ids) + num_output
    last_text = ending.last_event.text if isinstance(ending.last_event, FinalEvent) else ""
    return usage.usage_event(
        request,
        finish_reason=ending.finish_reason,
        num_output_tokens=num_output,
        num_computed_tokens=num_computed,
        output_text="".join(e.text for e in delivered) + last_text if is_kept else None,
    )


async def _settle(redis: aioredis.Redis, request: QueuedRequest, num_used_tokens: int) -> None:
    """Free the request's admission slots; an error is logged, never raised: an unsettled
    slot expires on its own."""
    try:
        await quota.settle(redis, request, num_used_tokens)
    except (RedisError, OSError):
        log.exception("could not settle the admission of %s", request.request_id)
