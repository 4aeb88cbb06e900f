"""The fleet as Redis holds it right now: queues per tenant, live workers, recent latencies.

One snapshot feeds the API's `/metrics` (queue gauges), `/dashboard/data` and `llmfleet
status`, so the three always agree. Queue depth is XLEN of the tenant's stream: entries are
deleted when acknowledged, so it counts both the entries no worker has taken yet and the
pending ones (taken, not acknowledged; XINFO GROUPS on the `workers` group). Worker figures
come from the heartbeat hashes (`worker/service.py`), at most one heartbeat period old.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import redis.asyncio as aioredis
from sqlalchemy.engine import Engine

from shared import deployments, keys, latency_window, tenants
from shared.latency_window import LatencySummary
from shared.redis_conn import text


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
    state: str
    heartbeat_age_s: float
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float | None = None  # continuous batching only
    max_num_seqs: int | None = None
    num_preemptions: int = 0

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
        )


@dataclass(frozen=True, slots=True)
class ModelSnapshot:
    model: str
    queues: list[QueueState]
    workers: list[WorkerState]
    ttft: LatencySummary
    itl: LatencySummary

    def num_workers_by_state(self) -> Counter[str]:
        return Counter(w.state for w in self.workers)

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
class FleetSnapshot:
    taken_at_s: float
    models: dict[str, ModelSnapshot]
    tenant_names: Mapping[str, str] = field(default_factory=dict)

    def tenant_name(self, tenant_id: str) -> str:
        return self.tenant_names.get(tenant_id, tenant_id)


def catalog(engine: Engine) -> tuple[list[str], dict[str, str]]:
    """From SQL: the active models, and tenant id -> name. Blocking; run it off the loop."""
    models = [d.model_id for d in deployments.list_active(engine)]
    return models, {t.id: t.name for t in tenants.list_tenants(engine)}


async def snapshot(
    redis: aioredis.Redis, engine: Engine, window_s: float = latency_window.DEFAULT_WINDOW_S
) -> FleetSnapshot:
    """`read_fleet` of the active models, with tenant names from SQL."""
    models, tenant_names = await asyncio.to_thread(catalog, engine)
    return await read_fleet(redis, models, tenant_names, window_s)


async def read_fleet(
    redis: aioredis.Redis,
    models: Iterable[str],
    tenant_names: Mapping[str, str] | None = None,
    window_s: float = latency_window.DEFAULT_WINDOW_S,
) -> FleetSnapshot:
    """The snapshot of `models` and of any model a live worker serves."""
    now_s = time.time()
    workers = await _read_workers(redis, now_s)
    snapshots = {}
    for model in sorted({*models, *(w.model for w in workers)}):
        snapshots[model] = ModelSnapshot(
            model=model,
            queues=await _read_queues(redis, model),
            workers=[w for w in workers if w.model == model],
            ttft=await latency_window.summarize(redis, model, "ttft", window_s),
            itl=await latency_window.summarize(redis, model, "itl", window_s),
        )
    return FleetSnapshot(now_s, snapshots, dict(tenant_names or {}))


async def _read_workers(redis: aioredis.Redis, now_s: float) -> list[WorkerState]:
    prefix = keys.worker_heartbeat("")
    workers = []
    async for key in redis.scan_iter(match=keys.worker_heartbeat_pattern(), count=100):
        fields = {text(k): text(v) for k, v in (await redis.hgetall(key)).items()}  # type: ignore[misc]  # redis-py: async commands typed Awaitable[T] | T (redis-py#2399)
        if fields.get("model"):  # gone between SCAN and HGETALL, or not a worker's
            workers.append(WorkerState.from_heartbeat(text(key)[len(prefix) :], fields, now_s))
    return sorted(workers, key=lambda w: w.worker_id)


async def _read_queues(redis: aioredis.Redis, model: str) -> list[QueueState]:
    tenant_ids = sorted(text(t) for t in await redis.smembers(keys.model_tenants(model)))  # type: ignore[misc]  # redis-py: async commands typed Awaitable[T] | T (redis-py#2399)
    async with redis.pipeline(transaction=False) as pipe:
        for tenant_id in tenant_ids:
            stream = keys.tenant_stream(model, tenant_id)
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
