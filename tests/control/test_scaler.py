"""The autoscaler's tick against a real Redis and SQL (`control/scaler.py`): the signals it
reads (the API's arrival buckets, queues, heartbeats), the decision it writes where the
actuators read it, and the roles that wake a standby worker. On a Redis of the test's own."""

from __future__ import annotations

import time
import uuid

import redis.asyncio as aioredis

from control.scale_policy import PolicyParams
from control.scaler import Scaler, ScalerSettings
from shared import arrivals, deployments, keys
from shared.scale_decisions import ScaleView


def _settings(**params) -> ScalerSettings:
    return ScalerSettings(
        policy="predictive+warm",
        params=PolicyParams(cold_start_s=30.0, warm_pool=1, max_workers=4, **params),
        tick_s=2.0,
        rate_window_s=10.0,
        worker_tokens_per_s=1000.0,  # at 0.8 utilisation: 800 tokens/s planned per worker
        default_worker_tokens_per_s=500.0,
        default_tokens_per_request=100.0,
    )


async def _beat(redis: aioredis.Redis, worker_id: str, model: str, **fields) -> None:
    defaults = {
        "model": model, "version": "1", "state": "ready", "max_num_seqs": 8,
        "updated_at": time.time(), "num_served_tokens": 0, "num_finished_requests": 0,
    }  # fmt: skip
    await redis.hset(keys.worker_heartbeat(worker_id), mapping=defaults | fields)


async def _arrive(redis: aioredis.Redis, name: str, now_s: float, per_bucket: int) -> None:
    """`per_bucket` requests in each of the two whole buckets before now."""
    current = arrivals.bucket_start_s(now_s)
    for back in (1, 2):
        key = keys.arrivals(name, current - back * keys.ARRIVAL_BUCKET_S)
        await redis.hset(key, mapping={"requests": per_bucket, "prompt_tokens": 10 * per_bucket})


async def _decision(redis: aioredis.Redis, name: str) -> ScaleView | None:
    raw = await redis.hgetall(keys.autoscale_decision(name))
    return ScaleView.from_fields(raw)


async def test_a_rise_in_arrivals_wakes_the_standby_worker_and_the_decision_is_served(
    own_redis, db, tiny_model_dir
):
    model = f"as-{uuid.uuid4().hex[:6]}"
    deployments.register(db, model, str(tiny_model_dir))
    name = keys.deployment_name(model, "1")
    redis = aioredis.Redis.from_url(own_redis.url)
    scaler = Scaler(redis, db, _settings())
    try:
        await _beat(redis, "w-ready", model)
        await _beat(redis, "w-standby", model, state="standby")
        await redis.hset(keys.AUTOSCALE_ROLES, "w-gone", "active")
        now_s = time.time()
        # 2 requests a second of 100 tokens (the default until measured): one worker serves.
        await _arrive(redis, name, now_s, per_bucket=10)
        decision = (await scaler.tick(now_s))[name]
        assert (decision.num_ready, decision.num_standby) == (1, 1)
        view = await _decision(redis, name)
        assert view is not None and view.num_workers == 2 and view.policy == "predictive+warm"
        assert view.arrival_rate_per_s == 2.0 and view.worker_tokens_per_s == 1000.0
        assert 0 < await redis.ttl(keys.autoscale_decision(name)) <= 20
        assert await redis.hgetall(keys.AUTOSCALE_ROLES) == {}  # the gone worker's role too

        # 12 a second (1,200 tokens/s, 1.5 workers' worth): within a few ticks of the
        # smoothed forecast, two serving; the standby one is woken, not a new one started.
        for tick in range(1, 13):
            later_s = now_s + tick * keys.ARRIVAL_BUCKET_S
            await _arrive(redis, name, later_s, per_bucket=60)
            decision = (await scaler.tick(later_s))[name]
            if decision.num_ready == 2:
                break
        assert decision.num_ready == 2
        assert await redis.hgetall(keys.AUTOSCALE_ROLES) == {b"w-standby": b"active"}
    finally:
        await redis.aclose()


async def test_served_totals_measure_the_cost_of_a_request(own_redis, db, tiny_model_dir):
    model = f"as-{uuid.uuid4().hex[:6]}"
    deployments.register(db, model, str(tiny_model_dir))
    name = keys.deployment_name(model, "1")
    redis = aioredis.Redis.from_url(own_redis.url)
    scaler = Scaler(redis, db, _settings())
    try:
        now_s = time.time()
        await _beat(redis, "w", model, updated_at=now_s, num_served_tokens=1000)
        await _arrive(redis, name, now_s, per_bucket=10)
        await scaler.tick(now_s)
        # 4,000 tokens served over 4 finished requests: 1,000 tokens a request, not 100.
        await _beat(
            redis, "w", model, updated_at=now_s + 2, num_served_tokens=5000,
            num_finished_requests=4,
        )  # fmt: skip
        await scaler.tick(now_s + 2)
        view = await _decision(redis, name)
        assert view is not None
        assert 2.0 * 100 < view.arrival_tokens_per_s <= 2.0 * 1000
    finally:
        await redis.aclose()
