"""The shared pool's tick against a real Redis and SQL: the demand it reads (undelivered
stream entries, dedicated places from heartbeats) moves a shared worker, the assignment is
written, and the assignments of workers that are gone are dropped. On a Redis of the
test's own: the session's control process runs this loop on the session's Redis."""

from __future__ import annotations

import time
import uuid

import redis.asyncio as aioredis

from control.pool import PoolSettings, rebalance
from control.pool_policy import PoolPolicy
from shared import deployments, keys, pool_assignments
from shared.pool_assignments import Assignment

SETTINGS = PoolSettings(PoolPolicy(min_dwell_s=0.0), tick_s=1.0, rate_window_s=30.0)


async def _beat(redis: aioredis.Redis, worker_id: str, **fields) -> None:
    defaults = {"version": "1", "state": "ready", "max_num_seqs": 4, "updated_at": time.time()}
    await redis.hset(keys.worker_heartbeat(worker_id), mapping=defaults | fields)


async def test_a_backlog_on_a_moves_the_shared_worker_and_the_gone_are_forgotten(
    own_redis, db, tiny_model_dir
):
    suffix = uuid.uuid4().hex[:6]
    model_a, model_b = f"rb-a-{suffix}", f"rb-b-{suffix}"
    for model in (model_a, model_b):
        deployments.register(db, model, str(tiny_model_dir))
    redis = aioredis.Redis.from_url(own_redis.url)
    try:
        await _beat(redis, "dedicated-a", model=model_a, pool="dedicated")
        await _beat(redis, "dedicated-b", model=model_b, pool="dedicated")
        shared = {"pool": "shared", "pool_models": f"{model_b},{model_a}"}
        await _beat(redis, "shared-1", model=model_b, **shared)
        await pool_assignments.write(redis, {"ghost": Assignment(model_a, 0.0)}, set())

        # Nothing waits: the shared worker keeps the model it serves; the ghost is dropped.
        assert await rebalance(redis, db, SETTINGS, time.time()) == {"shared-1": model_b}
        assert set(await pool_assignments.read_all(redis)) == {"shared-1"}

        name_a = keys.deployment_name(model_a, "1")
        stream = keys.tenant_stream(name_a, "t1")
        await redis.xgroup_create(stream, keys.WORKER_GROUP, id="0", mkstream=True)
        await redis.sadd(keys.model_tenants(name_a), "t1")
        for i in range(12):  # 12 waiting on 4 dedicated places
            await redis.xadd(stream, {"i": i})
        now_s = time.time()
        assert await rebalance(redis, db, SETTINGS, now_s) == {"shared-1": model_a}
        assert await pool_assignments.read(redis, "shared-1") == Assignment(model_a, now_s)

        # Once taken (pending, not acknowledged), entries no longer wait: nothing moves back.
        await redis.xreadgroup(keys.WORKER_GROUP, "dedicated-a", {stream: ">"})
        assert await rebalance(redis, db, SETTINGS, time.time()) == {"shared-1": model_a}
        assert (await pool_assignments.read(redis, "shared-1")).at_s == now_s
    finally:
        await redis.aclose()
