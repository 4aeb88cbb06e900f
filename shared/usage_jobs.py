"""Usage jobs on the wire: whoever ends a request (a worker's publisher, the API's or a
worker's recovery) enqueues one `record_usage` job for the control process (`control/jobs.py`).

The job id is `usage:<request id>`: a second job with that id is refused while the first
is queued or its result is kept, and the ledger's insert-if-absent makes any later one a
no-op. Jobs are JSON on the wire (arq's default is pickle).

A job is written as arq writes it (its serialized form, its key and expiry, its place in
the queue), but by one script instead of arq's `enqueue_job`. That one is a WATCHed
transaction: WATCH, EXISTS, MULTI, PSETEX, ZADD, EXEC on a connection of its own, five
round trips that no other command can share, and 28% of an echo worker's CPU per request
under an admission burst (docs/benchmarks.md, session 17). The script is one command,
pipelined with the others of its turn (`shared/auto_pipeline.py`), and atomic: a job is
there whole or not at all. Sent again after its connection broke, it finds the job there
and adds nothing.
"""

from __future__ import annotations

import json
from typing import Any

import redis.asyncio as aioredis
from arq.connections import ArqRedis
from arq.constants import job_key_prefix, result_key_prefix
from arq.jobs import serialize_job
from arq.utils import timestamp_ms

from shared import keys
from shared.lua import LuaScript
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


# KEYS: the job, its result, the queue. ARGV: the job id, its serialized form, its expiry
# (ms), its score (its enqueue time, ms). 1: enqueued; 0: the job or its result was there.
_ENQUEUE = LuaScript(
    """
if redis.call('EXISTS', KEYS[1], KEYS[2]) > 0 then
  return 0
end
redis.call('PSETEX', KEYS[1], ARGV[3], ARGV[2])
redis.call('ZADD', KEYS[3], ARGV[4], ARGV[1])
return 1
"""
)


async def enqueue_usage(
    redis: aioredis.Redis, event: UsageEvent, queue_name: str = keys.CONTROL_QUEUE
) -> bool:
    """Hand a finished request's usage to the control process: True if enqueued, False if
    it was already (queued, or done and its result kept). Raises `redis.ConnectionError`
    when it may not have got through (retry it: the second time is a no-op)."""
    job_id = usage_job_id(event.request_id)
    enqueue_time_ms = timestamp_ms()
    job = serialize_job(
        USAGE_JOB, (event.model_dump(mode="json"),), {}, None, enqueue_time_ms, serializer=dumps
    )
    keys_ = [job_key_prefix + job_id, result_key_prefix + job_id, queue_name]
    return bool(await _ENQUEUE(redis, keys_, [job_id, job, JOB_EXPIRES_MS, enqueue_time_ms]))
