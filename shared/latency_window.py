"""A rolling window of recent latency samples per model version in Redis, for live percentiles.

Workers push their TTFT and inter-token-latency samples
(`llmfleet:latency:{deployment}:{kind}`, a list of `"<unix_s> <value_s>"`, newest first), and
for each request that ended a `failed` sample (1 or 0), about once a second; the list is
capped at `MAX_NUM_SAMPLES` and expires when no worker has written for `EXPIRY_S`.
`/dashboard` and `llmfleet status` read the samples of the last `window_s` and take p50 and
p99; the rollout loop compares a canary's with its stable version's (`control/rollouts.py`).

Why not the Prometheus histograms: those live in each worker's process and need a Prometheus
server to merge; this needs only Redis, gives every reader the same fleet-wide figures, and
costs one LPUSH per worker per second. The price: a window of at most `MAX_NUM_SAMPLES` per
kind (at high token rates the ITL window is the last few seconds, uniformly thinned per push),
and percentiles exact over that sample, not the whole traffic.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import redis.asyncio as aioredis

from shared import keys
from shared.redis_conn import text

KINDS = ("ttft", "itl", "failed")
MAX_NUM_SAMPLES = 2000
MAX_NUM_SAMPLES_PER_PUSH = 500
EXPIRY_S = 3600
DEFAULT_WINDOW_S = 60.0


@dataclass(frozen=True, slots=True)
class Sample:
    at_s: float  # unix time the sample was taken
    value_s: float


@dataclass(frozen=True, slots=True)
class LatencySummary:
    num_samples: int
    p50_s: float | None
    p99_s: float | None

    @classmethod
    def of(cls, values: Sequence[float]) -> LatencySummary:
        """p50 and p99 with linear interpolation (numpy's default); None without samples."""
        if not values:
            return cls(0, None, None)
        if len(values) == 1:
            return cls(1, values[0], values[0])
        cuts = statistics.quantiles(values, n=100, method="inclusive")
        return cls(len(values), cuts[49], cuts[98])


async def push(
    redis: aioredis.Redis, deployment: str, kind: str, samples: Sequence[Sample]
) -> None:
    if not samples:
        return
    stride = -(-len(samples) // MAX_NUM_SAMPLES_PER_PUSH)  # ceil: thin evenly when too many
    key = keys.latency_samples(deployment, kind)
    async with redis.pipeline(transaction=True) as pipe:
        pipe.lpush(key, *(f"{s.at_s:.3f} {s.value_s:.6f}" for s in samples[::stride]))
        pipe.ltrim(key, 0, MAX_NUM_SAMPLES - 1)
        pipe.expire(key, EXPIRY_S)
        await pipe.execute()


async def summarize(
    redis: aioredis.Redis, deployment: str, kind: str, window_s: float = DEFAULT_WINDOW_S
) -> LatencySummary:
    """p50 and p99 over the samples of the last `window_s`."""
    return LatencySummary.of(await read(redis, deployment, kind, window_s))


async def read(
    redis: aioredis.Redis, deployment: str, kind: str, window_s: float = DEFAULT_WINDOW_S
) -> list[float]:
    """The values of the samples of the last `window_s`."""
    return await read_since(redis, deployment, kind, time.time() - window_s)


async def read_since(
    redis: aioredis.Redis, deployment: str, kind: str, since_s: float
) -> list[float]:
    """The values of the samples taken at `since_s` (unix time) or later."""
    raw = await redis.lrange(keys.latency_samples(deployment, kind), 0, -1)  # type: ignore[misc]  # redis-py: async commands typed Awaitable[T] | T (redis-py#2399)
    return values_since(raw, since_s)


def values_since(raw: Sequence[bytes | str], since_s: float) -> list[float]:
    values = []
    for item in raw:
        at_s, _, value_s = text(item).partition(" ")
        # Not a break at the first old sample: pushes of several workers interleave.
        if float(at_s) >= since_s:
            values.append(float(value_s))
    return values
