"""Requests admitted per model version, in time buckets: the autoscaler's arrival signal.

The API's enqueue script counts each request it enqueues (once: a retried enqueue that
finds its request already queued counts nothing) into the hash of the current
`keys.ARRIVAL_BUCKET_S` bucket, fields `requests` and `prompt_tokens`, inside the same
script: no round trip of its own. The autoscaler (`control/scaler.py`) reads the buckets of a
window and turns them into rates. A bucket expires `BUCKET_TTL_S` after its last request.

Why not the queue depth alone: depth says a backlog exists once capacity is short; the
arrival rate and its trend say it is coming (docs/architecture.md, "Autoscaling").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import redis.asyncio as aioredis

from shared import keys
from shared.redis_conn import text

BUCKET_TTL_S = 3600


def bucket_start_s(now_s: float) -> int:
    return int(now_s // keys.ARRIVAL_BUCKET_S) * keys.ARRIVAL_BUCKET_S


def bucket_key(deployment: str, now_s: float) -> str:
    return keys.arrivals(deployment, bucket_start_s(now_s))


@dataclass(frozen=True, slots=True)
class ArrivalRates:
    requests_per_s: float
    prompt_tokens_per_s: float


async def read_rates(
    redis: aioredis.Redis, deployment: str, now_s: float, window_s: float
) -> ArrivalRates:
    """The mean rates over the whole buckets of the last `window_s` before the current one
    (the current bucket is still filling: counting it would read a rise as a fall)."""
    num_buckets = max(1, math.ceil(window_s / keys.ARRIVAL_BUCKET_S))
    current = bucket_start_s(now_s)
    starts = [current - (i + 1) * keys.ARRIVAL_BUCKET_S for i in range(num_buckets)]
    async with redis.pipeline(transaction=False) as pipe:
        for start in starts:
            pipe.hmget(keys.arrivals(deployment, start), ["requests", "prompt_tokens"])
        replies = await pipe.execute()
    num_requests = sum(int(text(r[0])) for r in replies if r[0] is not None)
    num_tokens = sum(int(text(r[1])) for r in replies if r[1] is not None)
    span_s = num_buckets * keys.ARRIVAL_BUCKET_S
    return ArrivalRates(num_requests / span_s, num_tokens / span_s)
