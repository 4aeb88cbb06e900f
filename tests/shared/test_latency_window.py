"""The latency window in Redis and its percentiles."""

from __future__ import annotations

import time
import uuid

import numpy as np
import pytest

from shared import keys, latency_window
from shared.latency_window import LatencySummary, Sample


def test_latency_summary_matches_numpy_percentiles():
    values = list(np.random.default_rng(0).exponential(0.05, size=501))
    summary = LatencySummary.of(values)
    assert summary.num_samples == 501
    assert summary.p50_s == pytest.approx(np.percentile(values, 50))
    assert summary.p99_s == pytest.approx(np.percentile(values, 99))
    assert LatencySummary.of([]) == LatencySummary(0, None, None)
    assert LatencySummary.of([0.2]) == LatencySummary(1, 0.2, 0.2)


async def test_latency_window_keeps_recent_samples_capped(redis_server):
    from shared.redis_conn import async_client

    redis = async_client(redis_server.url)
    model = f"window-{uuid.uuid4().hex[:6]}"
    now = time.time()
    try:
        await latency_window.push(redis, model, "ttft", [Sample(now - 600, 9.0)])
        await latency_window.push(redis, model, "ttft", [Sample(now, 0.1), Sample(now, 0.3)])
        summary = await latency_window.summarize(redis, model, "ttft", window_s=60)
        assert summary.num_samples == 2 and summary.p50_s == pytest.approx(0.2)
        many = [Sample(now, 0.001 * i) for i in range(3 * latency_window.MAX_NUM_SAMPLES)]
        await latency_window.push(redis, model, "itl", many)
        key = keys.latency_samples(model, "itl")
        assert await redis.llen(key) == latency_window.MAX_NUM_SAMPLES_PER_PUSH
        assert 0 < await redis.ttl(key) <= latency_window.EXPIRY_S
    finally:
        await redis.delete(*(keys.latency_samples(model, k) for k in latency_window.KINDS))
        await redis.aclose()
