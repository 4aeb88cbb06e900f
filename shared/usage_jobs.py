"""Usage jobs on the wire: whoever ends a request (a worker's publisher, the API's or a
worker's recovery) enqueues one `record_usage` job for the control process (`control/jobs.py`).

The job id is `usage:<request id>`: arq refuses a second job with that id while the first
is queued or its result is kept, and the ledger's insert-if-absent makes any later one a
no-op. Jobs are JSON on the wire (arq's default is pickle).
"""

from __future__ import annotations

import json
from typing import Any

import redis.asyncio as aioredis
from arq.connections import ArqRedis
from arq.constants import job_key_prefix, result_key_prefix
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import WatchError

from shared import keys
from shared.protocol import UsageEvent

USAGE_JOB = "record_usage"
# How long a queued job may wait for a control process before arq drops it.
JOB_EXPIRES_MS = 30 * 24 * 3600 * 1000


def usage_job_id(request_id: str) -> str:
    return f"usage:{request_id}"


def dumps(data: dict[str, Any]) -> bytes:
    # A failed job's result is its exception: kept as text, not an object.
    return json.dumps(data, default=repr).encode()


def loads(data: bytes) -> Any:
    return json.loads(data)


def arq_client(redis: aioredis.Redis) -> ArqRedis:
    """An arq client on `redis`'s connection pool (its retries included)."""
    return ArqRedis(
        redis.connection_pool,
        job_serializer=dumps,
        job_deserializer=loads,
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
