"""The shared pool's loop in the control process: every second, read what each model the
shared workers may serve has waiting and serving it, let the policy choose each shared
worker's model (`control/pool_policy.py`), and write the changes to Redis, where each shared
worker follows its own (`worker/pool_member.py`).

The control process decides, not the shared workers themselves: one decider sees every
shared worker at once, so a spike draws as many of them as it needs rather than all of
them moving on the same reading, and the hysteresis (each worker's dwell) has one place to
live. Without a control process the shared workers keep the model they serve.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import redis.asyncio as aioredis
from sqlalchemy.engine import Engine

from control.pool_policy import Member, ModelDemand, PoolPolicy
from shared import deployments, fleet, latency_window, pool_assignments
from shared.fleet import WorkerState
from shared.pool_assignments import POOL_DEDICATED, POOL_SHARED, Assignment
from shared.settings import Settings

log = logging.getLogger("llmfleet.control")


@dataclass(frozen=True, slots=True)
class PoolSettings:
    policy: PoolPolicy
    tick_s: float
    rate_window_s: float  # requests started per second over this window

    @classmethod
    def of(cls, settings: Settings) -> PoolSettings:
        policy = PoolPolicy(
            settings.pool_min_waiting_per_place,
            settings.pool_switch_margin,
            settings.pool_min_dwell_s,
            settings.pool_default_load_s,
        )
        return cls(policy, settings.pool_tick_s, settings.pool_rate_window_s)


async def rebalance_forever(redis: aioredis.Redis, engine: Engine, pool: PoolSettings) -> None:
    """The loop; a tick that fails (Redis or the database unavailable) is logged, and the
    next one tries again."""
    while True:
        try:
            await rebalance(redis, engine, pool, time.time())
        except Exception:
            log.warning("shared-pool tick failed", exc_info=True)
        await asyncio.sleep(pool.tick_s)


async def rebalance(
    redis: aioredis.Redis, engine: Engine, pool: PoolSettings, now_s: float
) -> dict[str, str]:
    """One tick: each live shared worker's model (worker id -> model id), as written."""
    workers = await fleet.read_workers(redis, now_s)
    shared = [w for w in workers if w.pool == POOL_SHARED]
    assigned = await pool_assignments.read_all(redis)
    gone = set(assigned) - {w.worker_id for w in shared}
    if not shared:
        await pool_assignments.write(redis, {}, gone)
        return {}
    models = sorted({model for w in shared for model in w.pool_models})
    names = await asyncio.to_thread(_stable_names, engine, models)
    demands = {
        model: await _demand(redis, model, name, workers, pool.rate_window_s)
        for model, name in names.items()
    }
    members = [_member(w, assigned.get(w.worker_id)) for w in shared]
    chosen = pool.policy.assign(demands, members, now_s)
    changed = {}
    for worker_id, model in chosen.items():
        previous = assigned.get(worker_id)
        if previous is None or previous.model != model:
            changed[worker_id] = Assignment(model, now_s)
            log.info(
                "shared pool: %s to %s (from %s); waiting per model %s",
                worker_id,
                model,
                previous.model if previous else "no assignment",
                {m: d.num_waiting for m, d in demands.items()},
            )
    await pool_assignments.write(redis, changed, gone)
    return chosen


def _stable_names(engine: Engine, models: list[str]) -> dict[str, str]:
    """Model id -> its stable version's name, for the models that have one."""
    names = {}
    for model in models:
        stable = deployments.get_stable(engine, model)
        if stable is not None:
            names[model] = stable.name
    return names


async def _demand(
    redis: aioredis.Redis, model: str, name: str, workers: list[WorkerState], window_s: float
) -> ModelDemand:
    queues = await fleet.read_queues(redis, name)
    serving = [w for w in workers if w.deployment_name == name]
    num_started = len(await latency_window.read(redis, name, "ttft", window_s))
    return ModelDemand(
        model,
        num_waiting=sum(q.num_undelivered for q in queues) + sum(w.num_waiting for w in serving),
        dedicated_places=sum(
            w.max_num_seqs or 0 for w in serving if w.pool == POOL_DEDICATED and w.state == "ready"
        ),
        start_rate_per_s=num_started / window_s,
        load_s=max((w.load_s[model] for w in workers if model in w.load_s), default=None),
    )


def _member(worker: WorkerState, assignment: Assignment | None) -> Member:
    if assignment is not None:
        serving, since_s = assignment.model, assignment.at_s
    else:  # not assigned yet: what it chose itself (its first model), no dwell
        serving, since_s = worker.model, 0.0
    return Member(
        worker.worker_id,
        worker.pool_models,
        places=worker.max_num_seqs or 1,
        serving=serving,
        since_s=since_s,
        load_s=dict(worker.load_s),
    )
