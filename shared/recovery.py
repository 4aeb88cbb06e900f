"""Ending a request whose worker is gone, exactly once, from wherever that is noticed.

Two places notice: a worker whose `XAUTOCLAIM` picks up a dead worker's entry
(`worker/recovery.py`), and an API replica whose stream went silent while the request's
owner stopped heartbeating (`api/broker.py`). Whichever claims the end first
(`Journal.claim_end`) hands the usage (what was delivered) to the control process, settles
the tenant's admission, appends the error event (`worker_lost`) and acknowledges the entry;
the other finds the end claimed and does nothing.
"""

from __future__ import annotations

import logging

import redis.asyncio as aioredis

from shared import quota, stream_queue, usage, usage_jobs
from shared.journal import Journal
from shared.protocol import ErrorEvent, QueuedRequest, TokenEvent

log = logging.getLogger("llmfleet.recovery")


async def end_lost(
    redis: aioredis.Redis,
    journal: Journal,
    request: QueuedRequest,
    entry: tuple[str, str] | None,
    *,
    claimer: str,
    code: str = "worker_lost",
    message: str = "The worker generating this request stopped; it was not completed.",
) -> bool:
    """End `request` with an error event; False if it had been ended by someone else.
    `entry`: (stream, entry id) of its queue entry, acknowledged once the end is recorded."""
    request_id = request.request_id
    if not await journal.claim_end(request_id, claimer):
        return False
    events = await journal.read_after(request_id, -1)
    num_delivered = sum(e.num_tokens for e in events if isinstance(e, TokenEvent))
    event = usage.usage_event(
        request,
        finish_reason="error",
        num_output_tokens=num_delivered,
        num_computed_tokens=len(request.prompt_token_ids) + num_delivered,
        output_text="".join(e.text for e in events if isinstance(e, TokenEvent)),
    )
    try:
        await usage_jobs.enqueue_usage(redis, event)
    except Exception:
        # Give the end back: whoever tries next (the entry stays pending) records it.
        log.exception("usage of lost request %s not recorded; will retry", request_id)
        await journal.release_end(request_id, claimer)
        return False
    await quota.settle(redis, request, len(request.prompt_token_ids) + num_delivered)
    error = ErrorEvent(seq=0, code=code, message=message)
    keeps_content = bool(request.content_retention_days)  # None or 0: never stored
    await journal.append_end(request_id, claimer, error, keeps_content=keeps_content)
    if entry is not None:
        await stream_queue.ack(redis, *entry)
    log.warning("request %s ended: %s", request_id, code)
    return True


async def is_broker_settled(redis: aioredis.Redis, heartbeat_timeout_s: float) -> bool:
    """Whether Redis has been up long enough for a missing heartbeat to mean a dead worker.
    Just after a broker restart every heartbeat key may be gone (they expired while it was
    down, or were lost with the last second of its append-only file) while the workers are
    still reconnecting: ending their requests as lost then would end live streams."""
    info = await redis.info("server")
    return float(info.get("uptime_in_seconds", 0)) > 2 * heartbeat_timeout_s
