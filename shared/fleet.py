"""The fleet as Redis holds it right now: per model version, queues per tenant, live workers,
recent latencies.

One snapshot feeds the API's `/metrics` (queue gauges), `/dashboard/data` and `llmfleet
status`, so the three always agree. Queue depth is XLEN of the tenant's stream: entries are
deleted when acknowledged, so it counts both the entries no worker has taken yet and the
pending ones (taken, not acknowledged; XINFO GROUPS on the `workers` group). Worker figures
come from the heartbeat hashes (`worker/heartbeat.py`), at most one heartbeat period old.
Under `llmfleet up`, the processes it supervises (restarts, last exit) come from its record
(`shared/supervised.py`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import redis.asyncio as aioredis
from sqlalchemy.engine import Engine

from shared import (
    deployments,
    keys,
    latency_window,
    rollouts,
    scale_decisions,
    supervised,
    tenants,
)
from shared.keys import deployment_name, split_deployment_name
from shared.latency_window import LatencySummary
from shared.pool_assignments import POOL_DEDICATED
from shared.redis_conn import text
from shared.scale_decisions import ScaleView
from shared.supervised import ProcessState


@dataclass(frozen=True, slots=True)
class QueueState:
    tenant_id: str
    num_entries: int  # XLEN: undelivered plus pending
    num_pending: int  # taken by a worker, not acknowledged
    num_consumers: int

    @property
    def num_undelivered(self) -> int:
        return max(0, self.num_entries - self.num_pending)


@dataclass(frozen=True, slots=True)
class WorkerState:
    worker_id: str
    model: str
    state: str  # loading, standby, ready or draining (`worker/service.py`)
    heartbeat_age_s: float
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float | None = None  # continuous batching only
    max_num_seqs: int | None = None
    num_preemptions: int = 0
    version: str = ""
    pool: str = POOL_DEDICATED
    pool_models: tuple[str, ...] = ()  # a shared worker's: those it may serve
    serving_since_s: float | None = None  # when it began serving this version
    load_s: Mapping[str, float] = field(default_factory=dict)  # its measured loads, per model
    # Running totals since the worker started: tokens served (prompts and outputs) and
    # requests ended; a rate is the difference between two heartbeats over their ages.
    num_served_tokens: int = 0
    num_finished_requests: int = 0
    activation_s: float | None = None  # its last activation from standby: role read to ready

    @property
    def deployment_name(self) -> str:
        return deployment_name(self.model, self.version)

    @classmethod
    def from_heartbeat(cls, worker_id: str, fields: Mapping[str, str], now_s: float) -> WorkerState:
        def number(name: str, kind=int):
            return kind(float(fields[name])) if name in fields else None

        return cls(
            worker_id=worker_id,
            model=fields.get("model", ""),
            state=fields.get("state", "unknown"),
            heartbeat_age_s=max(0.0, now_s - (number("updated_at", float) or now_s)),
            num_running=number("num_running") or 0,
            num_waiting=number("num_waiting") or 0,
            kv_cache_usage=number("kv_cache_usage", float),
            max_num_seqs=number("max_num_seqs"),
            num_preemptions=number("num_preemptions") or 0,
            version=fields.get("version", ""),
            pool=fields.get("pool", POOL_DEDICATED),
            pool_models=tuple(m for m in fields.get("pool_models", "").split(",") if m),
            serving_since_s=number("serving_since", float),
            load_s=json.loads(fields.get("load_s", "{}")),
            num_served_tokens=number("num_served_tokens") or 0,
            num_finished_requests=number("num_finished_requests") or 0,
            activation_s=number("activation_s", float),
        )


@dataclass(frozen=True, slots=True)
class ModelSnapshot:
    """One version of a model: its queues, workers and latencies."""

    model: str
    queues: list[QueueState]
    workers: list[WorkerState]
    ttft: LatencySummary
    itl: LatencySummary
    version: str = "1"
    scale: ScaleView | None = None  # the autoscaler's latest decision, if one runs

    @property
    def name(self) -> str:
        return deployment_name(self.model, self.version)

    def num_workers_by_state(self) -> Counter[str]:
        return Counter(w.state for w in self.workers)

    def num_workers_by_pool(self) -> Counter[str]:
        return Counter(w.pool for w in self.workers)

    @property
    def num_queued(self) -> int:
        return sum(q.num_entries for q in self.queues)

    @property
    def kv_cache_usage(self) -> float | None:
        """Mean KV-cache usage over the workers that report one."""
        usages = [w.kv_cache_usage for w in self.workers if w.kv_cache_usage is not None]
        return sum(usages) / len(usages) if usages else None

    @property
    def batch_occupancy(self) -> float | None:
        """Places taken in the batches of the model's workers, over the places they have."""
        sized = [w for w in self.workers if w.max_num_seqs]
        if not sized:
            return None
        return sum(w.num_running for w in sized) / sum(w.max_num_seqs or 0 for w in sized)


@dataclass(frozen=True, slots=True)
class RolloutView:
    """A model's latest rollout, as SQL holds it (`shared/rollouts.py`)."""

    model: str
    canary_version: str
    state: str
    percent: float


@dataclass(frozen=True, slots=True)
class FleetSnapshot:
    taken_at_s: float
    models: dict[str, ModelSnapshot]  # by `model@version`
    tenant_names: Mapping[str, str] = field(default_factory=dict)
    processes: list[ProcessState] = field(default_factory=list)  # supervised by `up`
    rollouts: list[RolloutView] = field(default_factory=list)  # each model's latest
    # (model, cause) -> rollouts rolled back, all time (from SQL: survives restarts).
    num_rollbacks: Mapping[tuple[str, str], int] = field(default_factory=dict)

    def tenant_name(self, tenant_id: str) -> str:
        return self.tenant_names.get(tenant_id, tenant_id)


def catalog(engine: Engine) -> tuple[list[str], dict[str, str]]:
    """From SQL: the active model versions (`model@version`), and tenant id -> name.
    Blocking; run it off the loop."""
    names = [d.name for d in deployments.list_active(engine)]
    return names, {t.id: t.name for t in tenants.list_tenants(engine)}


def rollout_catalog(engine: Engine) -> tuple[list[RolloutView], Counter[tuple[str, str]]]:
    """From SQL: each model's latest rollout, and the rollbacks by model and cause.
    Blocking; run it off the loop."""
    views = []
    for rollout in rollouts.latest_per_model(engine):
        canary, _ = rollouts.deployments_of(engine, rollout)
        views.append(RolloutView(rollout.model_id, canary.version, rollout.state, rollout.percent))
    return views, rollouts.rollback_counts(engine)


async def snapshot(
    redis: aioredis.Redis, engine: Engine, window_s: float = latency_window.DEFAULT_WINDOW_S
) -> FleetSnapshot:
    """`read_fleet` of the active models, with tenant names and rollouts from SQL."""
    models, tenant_names = await asyncio.to_thread(catalog, engine)
    views, num_rollbacks = await asyncio.to_thread(rollout_catalog, engine)
    fleet = await read_fleet(redis, models, tenant_names, window_s)
    return dataclasses.replace(fleet, rollouts=views, num_rollbacks=num_rollbacks)


async def read_fleet(
    redis: aioredis.Redis,
    names: Iterable[str],
    tenant_names: Mapping[str, str] | None = None,
    window_s: float = latency_window.DEFAULT_WINDOW_S,
) -> FleetSnapshot:
    """The snapshot of the model versions `names` (`model@version`) and of any version a
    live worker serves."""
    now_s = time.time()
    workers = await read_workers(redis, now_s)
    snapshots = {}
    for name in sorted({*names, *(w.deployment_name for w in workers)}):
        model, version = split_deployment_name(name)
        snapshots[name] = ModelSnapshot(
            model=model,
            version=version or "",
            queues=await read_queues(redis, name),
            workers=[w for w in workers if w.deployment_name == name],
            ttft=await latency_window.summarize(redis, name, "ttft", window_s),
            itl=await latency_window.summarize(redis, name, "itl", window_s),
            scale=await scale_decisions.read(redis, name),
        )
    processes = await supervised.read(redis)
    return FleetSnapshot(now_s, snapshots, dict(tenant_names or {}), processes)


async def read_workers(redis: aioredis.Redis, now_s: float) -> list[WorkerState]:
    prefix = keys.worker_heartbeat("")
    workers = []
    async for key in redis.scan_iter(match=keys.worker_heartbeat_pattern(), count=100):
        fields = {text(k): text(v) for k, v in (await redis.hgetall(key)).items()}  # type: ignore[misc]  # redis-py: async commands typed Awaitable[T] | T (redis-py#2399)
        if fields.get("model"):  # gone between SCAN and HGETALL, or not a worker's
            workers.append(WorkerState.from_heartbeat(text(key)[len(prefix) :], fields, now_s))
    return sorted(workers, key=lambda w: w.worker_id)


async def read_queues(redis: aioredis.Redis, name: str) -> list[QueueState]:
    tenant_ids = sorted(text(t) for t in await redis.smembers(keys.model_tenants(name)))  # type: ignore[misc]  # redis-py: async commands typed Awaitable[T] | T (redis-py#2399)
    async with redis.pipeline(transaction=False) as pipe:
        for tenant_id in tenant_ids:
            stream = keys.tenant_stream(name, tenant_id)
            pipe.xlen(stream)
            pipe.xinfo_groups(stream)
        replies = await pipe.execute(raise_on_error=False)
    queues = []
    for i, tenant_id in enumerate(tenant_ids):
        num_entries, groups = replies[2 * i], replies[2 * i + 1]
        group = _workers_group(groups)
        queues.append(
            QueueState(
                tenant_id=tenant_id,
                num_entries=num_entries if isinstance(num_entries, int) else 0,
                num_pending=int(group.get("pending", 0)),
                num_consumers=int(group.get("consumers", 0)),
            )
        )
    return queues


def _workers_group(groups: object) -> dict:
    """The `workers` group's XINFO GROUPS entry; empty before a worker created it (the
    reply is then an empty list, or an error when the stream does not exist yet)."""
    if not isinstance(groups, list):
        return {}
    for group in groups:
        if text(group.get("name", b"")) == keys.WORKER_GROUP:
            return group
    return {}
