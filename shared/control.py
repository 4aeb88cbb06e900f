"""The control process (`llmfleet control`): an arq worker that writes usage to the ledger,
purges prompts and outputs past their retention, and exports signed chain heads.

Whoever ends a request (a worker's publisher, or recovery) enqueues a `record_usage` job
whose id is `usage:<request id>`: arq refuses a second job with that id while the first
is queued or its result is kept, and the ledger's insert-if-absent makes any later one a
no-op. arq removes a job from its queue only once the function returned, so a job whose
control process died is run again, and one whose database is down raises `Retry` and
waits. Jobs are JSON on the wire (arq's default is pickle).
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import redis.asyncio as aioredis
from arq import Retry, cron
from arq.connections import ArqRedis
from arq.constants import job_key_prefix, result_key_prefix
from arq.worker import Worker
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import WatchError
from sqlalchemy.exc import InterfaceError, OperationalError

from shared import keys, ledger, usage
from shared.protocol import UsageEvent
from shared.redis_conn import async_client
from shared.settings import Settings

log = logging.getLogger("llmfleet.control")

USAGE_JOB = "record_usage"
# A usage job waits out a database outage of any length: retried, never dropped for tries.
MAX_TRIES = 1_000_000
MAX_RETRY_DEFER_S = 30.0
# How long a queued job may wait for a control process before arq drops it.
JOB_EXPIRES_MS = 30 * 24 * 3600 * 1000


def usage_job_id(request_id: str) -> str:
    return f"usage:{request_id}"


def _dumps(data: dict[str, Any]) -> bytes:
    # A failed job's result is its exception: kept as text, not an object.
    return json.dumps(data, default=repr).encode()


def arq_client(redis: aioredis.Redis) -> ArqRedis:
    """An arq client on `redis`'s connection pool (its retries included)."""
    return ArqRedis(
        redis.connection_pool,
        job_serializer=_dumps,
        job_deserializer=json.loads,
        default_queue_name=keys.CONTROL_QUEUE,
        expires_extra_ms=JOB_EXPIRES_MS,
    )


async def enqueue_usage(
    redis: aioredis.Redis, event: UsageEvent, queue_name: str = keys.CONTROL_QUEUE
) -> None:
    """Hand a finished request's usage to the control process (a no-op the second time).
    Raises `redis.ConnectionError` when the job did not get through (retry it)."""
    job_id = usage_job_id(event.request_id)
    try:
        job = await arq_client(redis).enqueue_job(
            USAGE_JOB, event.model_dump(mode="json"), _job_id=job_id, _queue_name=queue_name
        )
    except WatchError as exc:  # redis-py: the connection broke while a key was watched
        raise RedisConnectionError(f"usage job {job_id}: {exc}") from exc
    # arq reads a failed transaction as "another client enqueued this id meanwhile", and
    # redis-py fails a transaction whose connection broke while it watched a key the same
    # way: so "not enqueued" is believed only when the job or its result is there.
    if job is None and not await redis.exists(job_key_prefix + job_id, result_key_prefix + job_id):
        raise RedisConnectionError(f"usage job {job_id} lost with its connection")


async def record_usage(ctx: dict, event_data: dict) -> bool:
    """The job: write one usage event to the ledger; `Retry` while the database is down."""
    event = UsageEvent.model_validate(event_data)
    settings: Settings = ctx["settings"]
    try:
        return await asyncio.to_thread(usage.record, ctx["engine"], event, settings.ledger_key)
    except (OperationalError, InterfaceError) as exc:
        defer_s = min(0.5 * 2 ** min(ctx["job_try"], 8), MAX_RETRY_DEFER_S)
        log.warning("usage of %s not recorded yet (database unavailable)", event.request_id)
        raise Retry(defer=defer_s) from exc


async def purge_expired_content(ctx: dict) -> int:
    num_purged = await asyncio.to_thread(usage.purge_expired_content, ctx["engine"])
    if num_purged:
        log.info("purged %d requests' content past retention", num_purged)
    return num_purged


async def export_chain_heads(ctx: dict) -> int:
    settings: Settings = ctx["settings"]
    export = await asyncio.to_thread(
        ledger.export_heads, ctx["engine"], settings.ledger_key, settings.ledger_heads_dir
    )
    return export.id


def make_worker(
    settings: Settings, engine, *, queue_name: str = keys.CONTROL_QUEUE, burst: bool = False
) -> Worker:
    """The arq worker of the control process, on `engine` (schema migrated by the caller)."""
    # arq logs each job's arguments at INFO; a usage event may hold a retained prompt.
    logging.getLogger("arq.worker").setLevel(logging.WARNING)
    return Worker(
        functions=[record_usage],
        cron_jobs=[
            cron(purge_expired_content, minute=set(range(0, 60, 10)), run_at_startup=True),
            cron(export_chain_heads, minute=0, run_at_startup=True),
        ],
        queue_name=queue_name,
        redis_pool=arq_client(async_client(settings.redis_url)),
        ctx={"settings": settings, "engine": engine},
        max_tries=MAX_TRIES,
        burst=burst,
        poll_delay=0.1,
        handle_signals=not burst,
        job_serializer=_dumps,
        job_deserializer=json.loads,
        expires_extra_ms=JOB_EXPIRES_MS,
    )
