"""The autoscaler's loop in the control process: every `autoscale_tick_s`, for each active
model version, read its signals from Redis (arrivals from the API's enqueue script, queues,
the workers' heartbeats), let the policy decide (`control/scale_policy.py`), and write the
decision where the actuators read it:

- `keys.autoscale_decision(name)`: the workers wanted serving and on standby, and the
  forecast. `llmfleet up --autoscale` starts and stops local worker processes to match it
  (`cli/autoscale_actuator.py`); on Kubernetes, KEDA reads it through the admin API
  (`GET /admin/v1/models/{model}/autoscale`, infra/keda/);
- `keys.AUTOSCALE_ROLES`: which of the live workers serve and which stand by
  (`control/scale_roles.py`): waking a standby worker takes about a second, where the
  actuator's new worker takes a cold start.

Only workers of the dedicated pool are scaled (the shared pool has its own loop,
`control/pool.py`). The loop runs only with a policy set (`LLMFLEET_AUTOSCALE_POLICY`); off by
default, so that a platform without an actuator keeps the workers it was given.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field

import redis.asyncio as aioredis
from sqlalchemy.engine import Engine

from control import scale_policy
from control.capacity import CapacityEstimate, ServedRates, TokensPerRequest, WorkerTotals
from control.scale_policy import ScaleDecision, ScalePolicy, ScaleSignals
from control.scale_roles import RoleHolder, plan_roles
from shared import arrivals, deployments, fleet, keys
from shared.fleet import WorkerState
from shared.pool_assignments import POOL_DEDICATED
from shared.redis_conn import text
from shared.scale_decisions import ScaleView
from shared.settings import Settings

log = logging.getLogger("llmfleet.control")

LOADING_STATES = frozenset({"starting", "loading"})


@dataclass(frozen=True, slots=True)
class ScalerSettings:
    policy: str
    params: scale_policy.PolicyParams
    tick_s: float
    rate_window_s: float
    worker_tokens_per_s: float | None
    default_worker_tokens_per_s: float
    default_tokens_per_request: float

    @classmethod
    def of(cls, settings: Settings) -> ScalerSettings:
        return cls(
            policy=settings.autoscale_policy,
            params=scale_policy.PolicyParams.of(settings),
            tick_s=settings.autoscale_tick_s,
            rate_window_s=settings.autoscale_rate_window_s,
            worker_tokens_per_s=settings.autoscale_worker_tokens_per_s,
            default_worker_tokens_per_s=settings.autoscale_default_worker_tokens_per_s,
            default_tokens_per_request=settings.autoscale_default_tokens_per_request,
        )


@dataclass
class _Version:
    """What the loop keeps of one model version between ticks."""

    policy: ScalePolicy
    capacity: CapacityEstimate
    tokens_per_request: TokensPerRequest
    served: ServedRates = field(default_factory=ServedRates)


class Scaler:
    def __init__(self, redis: aioredis.Redis, engine: Engine, settings: ScalerSettings) -> None:
        self._redis = redis
        self._engine = engine
        self._settings = settings
        self._versions: dict[str, _Version] = {}

    async def run_forever(self) -> None:
        """The loop; a tick that fails (Redis or the database unavailable) is logged, and the
        next one tries again."""
        while True:
            try:
                await self.tick(time.time())
            except Exception:
                log.warning("autoscale tick failed", exc_info=True)
            await asyncio.sleep(self._settings.tick_s)

    async def tick(self, now_s: float) -> dict[str, ScaleDecision]:
        """One tick: each active model version's decision, as written."""
        names = await asyncio.to_thread(_active_names, self._engine)
        workers = [
            w for w in await fleet.read_workers(self._redis, now_s) if w.pool == POOL_DEDICATED
        ]
        roles = {
            text(k): text(v)
            for k, v in (await self._redis.hgetall(keys.AUTOSCALE_ROLES)).items()  # type: ignore[misc]  # redis-py: async commands typed Awaitable[T] | T (redis-py#2399)
        }
        decisions = {}
        for name in names:
            own = [w for w in workers if w.deployment_name == name]
            version = self._version(name)
            signals = await self._signals(version, name, own, now_s)
            decision = version.policy.decide(signals)
            holders = [
                RoleHolder(w.worker_id, w.state, roles.get(w.worker_id), w.num_running) for w in own
            ]
            changes = plan_roles(holders, decision.num_ready)
            await self._write(name, decision, signals, changes)
            decisions[name] = decision
            if changes:
                log.info("autoscale %s: %s; roles %s", name, _describe(decision, signals), changes)
        gone = set(roles) - {w.worker_id for w in workers}
        if gone:
            await self._redis.hdel(keys.AUTOSCALE_ROLES, *gone)  # type: ignore[misc]  # redis-py: async commands typed Awaitable[T] | T (redis-py#2399)
        for name in set(self._versions) - set(names):
            del self._versions[name]
        return decisions

    def _version(self, name: str) -> _Version:
        if name not in self._versions:
            s = self._settings
            self._versions[name] = _Version(
                scale_policy.make_policy(s.policy, s.params),
                CapacityEstimate(s.default_worker_tokens_per_s, s.worker_tokens_per_s),
                TokensPerRequest(s.default_tokens_per_request),
            )
        return self._versions[name]

    async def _signals(
        self, version: _Version, name: str, own: list[WorkerState], now_s: float
    ) -> ScaleSignals:
        num_tokens = num_finished = 0
        for worker in own:
            rate = version.served.update(worker.worker_id, _totals(worker, now_s))
            if rate is None:
                continue
            if worker.state == "ready":
                version.capacity.observe(rate, now_s)
            num_tokens += rate.num_tokens
            num_finished += rate.num_finished
        version.served.forget_all_but({w.worker_id for w in own})
        version.tokens_per_request.observe(num_tokens, num_finished)
        rates = await arrivals.read_rates(self._redis, name, now_s, self._settings.rate_window_s)
        queues = await fleet.read_queues(self._redis, name)
        states = [w.state for w in own]
        return ScaleSignals(
            now_s=now_s,
            arrival_rate_per_s=rates.requests_per_s,
            arrival_tokens_per_s=rates.requests_per_s * version.tokens_per_request.tokens,
            num_waiting=sum(q.num_undelivered for q in queues) + sum(w.num_waiting for w in own),
            num_running=sum(w.num_running for w in own),
            worker_tokens_per_s=version.capacity.tokens_per_s(now_s),
            num_ready=states.count("ready"),
            num_standby=states.count("standby"),
            num_loading=sum(state in LOADING_STATES for state in states),
            num_draining=states.count("draining"),
        )

    async def _write(
        self, name: str, decision: ScaleDecision, signals: ScaleSignals, changes: dict[str, str]
    ) -> None:
        view = ScaleView(
            policy=self._settings.policy,
            num_ready=decision.num_ready,
            num_standby=decision.num_standby,
            forecast_tokens_per_s=decision.forecast_tokens_per_s,
            arrival_rate_per_s=round(signals.arrival_rate_per_s, 4),
            arrival_tokens_per_s=round(signals.arrival_tokens_per_s, 2),
            worker_tokens_per_s=round(signals.worker_tokens_per_s, 2),
            num_waiting=signals.num_waiting,
            updated_at_s=signals.now_s,
        )
        key = keys.autoscale_decision(name)
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.delete(key)
            pipe.hset(key, mapping=view.to_fields())
            # A decision nobody renews is dropped: the actuators then keep what runs.
            pipe.expire(key, max(10, int(10 * self._settings.tick_s)))
            if changes:
                pipe.hset(keys.AUTOSCALE_ROLES, mapping=changes)
            await pipe.execute()


def _active_names(engine: Engine) -> list[str]:
    return sorted({d.name for d in deployments.list_active(engine)})


def _totals(worker: WorkerState, now_s: float) -> WorkerTotals:
    occupancy = worker.num_running / worker.max_num_seqs if worker.max_num_seqs else 0.0
    return WorkerTotals(
        at_s=now_s - worker.heartbeat_age_s,
        num_served_tokens=worker.num_served_tokens,
        num_finished_requests=worker.num_finished_requests,
        occupancy=occupancy,
    )


def _describe(decision: ScaleDecision, signals: ScaleSignals) -> str:
    return json.dumps(
        {
            "ready": decision.num_ready,
            "standby": decision.num_standby,
            "arrivals_per_s": round(signals.arrival_rate_per_s, 2),
            "waiting": signals.num_waiting,
            "forecast_tokens_per_s": decision.forecast_tokens_per_s,
        }
    )
