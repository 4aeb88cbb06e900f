"""A worker's heartbeat: the hash `keys.worker_heartbeat(worker_id)`, rewritten whole every
`worker_heartbeat_s` and at once when the worker's state changes, expiring after the
heartbeat timeout; with it the worker's entries in its version's ready set (the API routes
to ready workers) and KV capacity set (the API refuses what no worker's KV cache holds).
`shared/fleet.py` reads it back (`WorkerState.from_heartbeat`).

Its fields: `model`, `version`, `deployment_id`, `state` (`loading`, `standby`, `ready`,
`draining`), `pid`, `batching`, `pool` (and a shared worker's `pool_models`),
`serving_since`, `updated_at`; the running totals since the worker started,
`num_served_tokens` (prompt tokens once per request, and every token generated) and
`num_finished_requests`, which the autoscaler differences into served rates; `role` (`both`,
`prefill` or `decode`) and a decode worker's `kv_endpoint`; `activation_s`
after an activation from standby (reading the role `active` to ready); `load_s` (JSON:
model id -> seconds its load took); and the engine's stats while it has an engine
(`EngineStats.heartbeat_fields`: none on standby, which holds no KV pool).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

import redis.asyncio as aioredis

from shared import keys
from shared.pool_assignments import POOL_SHARED
from shared.redis_conn import text
from shared.tables import ModelDeployment
from worker.engine import EngineStats


@dataclass(frozen=True, slots=True)
class Beat:
    """What one heartbeat says."""

    worker_id: str
    deployment: ModelDeployment
    state: str
    batching: str
    pool: str
    pool_models: tuple[str, ...]
    serving_since_s: float
    num_served_tokens: int
    num_finished_requests: int
    activation_s: float | None
    load_times_s: Mapping[str, float]
    stats: EngineStats | None  # None: no engine (loading, standby)
    role: str = "both"  # prefill/decode disaggregation (`worker/handoff.py`)
    kv_endpoint: str | None = None  # a decode worker's: where prefill workers send KV

    @property
    def free_kv_blocks(self) -> int:
        """Blocks a hand-off could take now (0 with the batch full): what prefill workers
        rank decode workers by."""
        stats = self.stats
        if stats is None or stats.kv_cache_blocks is None or stats.kv_cache_usage is None:
            return 0
        if stats.num_running >= stats.max_num_seqs:
            return 0
        return int(stats.kv_cache_blocks * (1.0 - stats.kv_cache_usage))

    def fields(self, now_s: float) -> dict[str, str | int | float]:
        deployment = self.deployment
        fields: dict[str, str | int | float] = {
            "model": deployment.model_id,
            "version": deployment.version,
            "deployment_id": deployment.id or 0,
            "state": self.state,
            "pid": os.getpid(),
            "batching": self.batching,
            "pool": self.pool,
            "serving_since": self.serving_since_s,
            "updated_at": now_s,
            "num_served_tokens": self.num_served_tokens,
            "num_finished_requests": self.num_finished_requests,
            **(self.stats.heartbeat_fields() if self.stats is not None else {}),
        }
        if self.activation_s is not None:
            fields["activation_s"] = round(self.activation_s, 4)
        if self.load_times_s:  # the shared pool's policy weighs a move against loads
            fields["load_s"] = json.dumps(dict(self.load_times_s))
        if self.pool == POOL_SHARED:
            fields["pool_models"] = ",".join(self.pool_models)
        fields["role"] = self.role
        if self.kv_endpoint is not None:
            fields["kv_endpoint"] = self.kv_endpoint
        return fields

    @property
    def capacity_tokens(self) -> int | None:
        """The most tokens one sequence can hold in its KV cache; None without one."""
        return self.stats.max_num_tokens_per_sequence if self.stats is not None else None


async def write(redis: aioredis.Redis, beat: Beat, timeout_s: float, now_s: float) -> None:
    """The heartbeat, the ready set and the capacity set, in one transaction."""
    worker_id, name = beat.worker_id, beat.deployment.name
    key, ready, capacity = (
        keys.worker_heartbeat(worker_id), keys.ready_workers(name), keys.model_capacity(name),
    )  # fmt: skip
    async with redis.pipeline(transaction=True) as pipe:
        pipe.delete(key)  # all of it anew: a shared worker's last model left fields
        pipe.hset(key, mapping=beat.fields(now_s))
        pipe.expire(key, max(1, math.ceil(timeout_s)))
        if beat.capacity_tokens is not None:
            pipe.zadd(capacity, {worker_id: beat.capacity_tokens})
        else:  # on standby: no KV cache, no capacity
            pipe.zrem(capacity, worker_id)
        # The API routes to a version only while it has a ready worker (`api/router.py`);
        # a draining or standby one takes no new work, and a dead one's score goes stale.
        if beat.state == "ready":
            pipe.zadd(ready, {worker_id: now_s})
        else:
            pipe.zrem(ready, worker_id)
        pipe.zremrangebyscore(ready, "-inf", now_s - timeout_s)
        # A decode worker takes hand-offs while it serves (`worker/handoff.py`).
        if beat.kv_endpoint is not None and beat.state == "ready":
            pipe.zadd(keys.decode_workers(name), {worker_id: beat.free_kv_blocks})
        else:
            pipe.zrem(keys.decode_workers(name), worker_id)
        await pipe.execute()
    await _forget_dead_workers(redis, name)


async def _forget_dead_workers(redis: aioredis.Redis, name: str) -> None:
    """Drop capacity and decode entries of workers whose heartbeat expired (they died
    uncleanly)."""
    for zset in (keys.model_capacity(name), keys.decode_workers(name)):
        for member in await redis.zrange(zset, 0, -1):
            worker_id = text(member)
            if not await redis.exists(keys.worker_heartbeat(worker_id)):
                await redis.zrem(zset, worker_id)
