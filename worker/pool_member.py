"""A worker of the shared pool (`llmfleet worker --pool shared --models A,B`): it serves one
model at a time, the one the control process assigns it (`control/pool.py`), and moves
when the assignment changes.

A move is a graceful stop of the model it serves (requests not started go back to their
queue at once, running ones finish, as on SIGTERM), then a load of the next model's stable
version, under the same worker id. Before its first assignment (or with no control process
running) it serves the first model it may. It looks at its assignment every heartbeat.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from shared import keys, pool_assignments
from shared.redis_conn import async_client
from shared.settings import Settings
from shared.tables import ModelDeployment
from worker.service import Worker, WorkerConfig, new_worker_id

log = logging.getLogger("llmfleet.worker")


class PoolMember:
    def __init__(
        self,
        settings: Settings,
        config: WorkerConfig,
        stable_version: Callable[[str], ModelDeployment],
    ) -> None:
        """`stable_version`: the deployment to serve for a model id (it reads SQL)."""
        assert config.pool_models, "a shared worker needs the models it may serve"
        self._settings = settings
        self._config = config
        self._stable_version = stable_version
        self.worker_id = new_worker_id()
        self._load_times_s: dict[str, float] = {}
        self._stopping = False
        self._serving: Worker | None = None

    def stop(self) -> None:
        """Graceful shutdown: the model served now drains as a dedicated worker's would."""
        self._stopping = True
        if self._serving is not None:
            self._serving.stop()

    async def run(self) -> None:
        redis = async_client(self._settings.redis_url)
        try:
            model = await self._assigned(redis) or self._config.pool_models[0]
            while not self._stopping:
                deployment = await asyncio.to_thread(self._stable_version, model)
                worker = Worker(
                    self._settings,
                    deployment,
                    self._config,
                    worker_id=self.worker_id,
                    load_times_s=self._load_times_s,
                    keep_heartbeat=True,
                )
                self._serving = worker
                log.info("shared worker %s serves %s", self.worker_id, deployment.name)
                watching = asyncio.create_task(self._watch(redis, model))
                try:
                    await worker.run()
                finally:
                    watching.cancel()
                if not watching.cancelled() and watching.done():
                    model = watching.result()
        finally:
            await redis.delete(keys.worker_heartbeat(self.worker_id))
            await redis.aclose()

    async def _watch(self, redis: aioredis.Redis, model: str) -> str:
        """Wait for an assignment to another model; then stop serving this one, and return
        the other."""
        while True:
            await asyncio.sleep(self._settings.worker_heartbeat_s)
            assigned = await self._assigned(redis)
            if assigned is not None and assigned != model and not self._stopping:
                log.info("shared worker %s moves from %s to %s", self.worker_id, model, assigned)
                assert self._serving is not None
                self._serving.stop()
                return assigned

    async def _assigned(self, redis: aioredis.Redis) -> str | None:
        try:
            assignment = await pool_assignments.read(redis, self.worker_id)
        except (RedisError, OSError) as exc:
            log.warning("cannot read the pool assignment: %s", exc)
            return None
        if assignment is None or assignment.model not in self._config.pool_models:
            return None
        return assignment.model
