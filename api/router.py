"""The API's choice of the version that serves a request (`shared/routing.py` is the rule).

A request names a model id, or pins a version (`model@version`: that version, or a 404
`model_not_found`). For a model id, the routing table (its stable version, the running
rollout's canary and share, the sticky mode) comes from SQL, and a canary with no ready
worker (`llmfleet:ready:{deployment}`: a heartbeat within the heartbeat timeout) gets
nothing.

Decision: the table is read from SQL, the rollout's durable home, and cached per model for
`routing_cache_s` (1 s): every replica applies a change (a step, a rollback, a command)
within that, with nothing else to keep in step (a Redis copy of the table would need
writing by every command and rebuilding after a broker loss). It costs one query per model
per second per replica, where the API used to query the deployment on every request.
Readiness is cached as long.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import redis.asyncio as aioredis
from sqlalchemy.engine import Engine
from starlette.concurrency import run_in_threadpool

from api.errors import model_not_found
from shared import deployments, keys, rollouts, routing
from shared.routing import RoutingTable
from shared.tables import ModelDeployment

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class ModelVersions:
    """A model as the API routes it: its table, and its active versions by name."""

    table: RoutingTable
    by_version: dict[str, ModelDeployment]


def load_versions(engine: Engine, model_id: str) -> ModelVersions | None:
    """From SQL: the model's active versions and its routing table (the running rollout's
    canary and share, if any); None if it has none. Blocking: run it off the event loop."""
    versions = deployments.list_versions(engine, model_id)
    if not versions:
        return None
    table = RoutingTable(model_id, deployments.stable_among(versions))
    rollout = rollouts.running(engine, model_id)
    by_id = {d.id: d for d in versions}
    if rollout is not None and (canary := by_id.get(rollout.canary_deployment_id)) is not None:
        sticky = routing.sticky_mode(rollout.sticky)
        table = RoutingTable(model_id, table.stable, canary, rollout.percent, sticky)
    return ModelVersions(table, {d.version: d for d in versions})


class _Cache(Generic[T]):
    """Values kept `ttl_s`, each loaded by one caller at a time (the others wait for it)."""

    def __init__(self, ttl_s: float) -> None:
        self._ttl_s = ttl_s
        self._values: dict[str, tuple[float, T]] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    async def get(self, key: str, load: Callable[[], Awaitable[T]]) -> T:
        if (hit := self._fresh(key)) is not None:
            return hit[1]
        async with self._locks.setdefault(key, asyncio.Lock()):
            if (hit := self._fresh(key)) is not None:
                return hit[1]
            value = await load()
            self._values[key] = (time.monotonic(), value)
            return value

    def _fresh(self, key: str) -> tuple[float, T] | None:
        hit = self._values.get(key)
        return hit if hit is not None and time.monotonic() - hit[0] < self._ttl_s else None


class Router:
    """Routes a request to one version of its model (module docstring)."""

    def __init__(
        self, engine: Engine, redis: aioredis.Redis, ttl_s: float, ready_within_s: float
    ) -> None:
        self._engine = engine
        self._redis = redis
        self._ready_within_s = ready_within_s
        self._versions: _Cache[ModelVersions | None] = _Cache(ttl_s)
        self._ready: _Cache[bool] = _Cache(ttl_s)

    async def route(self, model: str, tenant_id: str, user: str | None) -> ModelDeployment:
        """The deployment that serves a request for `model` (an id, or `id@version`)."""
        model_id, pinned = keys.split_deployment_name(model)
        versions = await self._versions.get(
            model_id, lambda: run_in_threadpool(load_versions, self._engine, model_id)
        )
        if versions is None:
            raise model_not_found(model)
        if pinned is not None:
            if (deployment := versions.by_version.get(pinned)) is None:
                raise model_not_found(model)
            return deployment
        table = versions.table
        if table.canary is None or table.canary_percent <= 0:
            return table.stable
        ready_ids = {table.canary.id or 0} if await self.is_ready(table.canary) else set()
        key = table.sticky_key(tenant_id, user)
        point = random.random() if key is None else routing.point_of(table, key)
        return routing.pick(table, point, ready_ids)

    async def is_ready(self, deployment: ModelDeployment) -> bool:
        """Whether a worker of the version has beaten as ready within the heartbeat timeout."""

        async def load() -> bool:
            since_s = time.time() - self._ready_within_s
            ready = keys.ready_workers(deployment.name)
            return bool(await self._redis.zcount(ready, since_s, "+inf"))

        return await self._ready.get(deployment.name, load)
