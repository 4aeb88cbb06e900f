"""The worker process: load the model, then loop pull -> step -> publish until told to stop.

The engine step runs in a thread (torch releases the GIL in its kernels), so Redis I/O,
cancellations and heartbeats go on in the event loop while the model computes.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import RedisError
from sqlalchemy.engine import Engine

from shared import keys, model_source
from shared.protocol import decode_cancel
from shared.redis_conn import async_client
from shared.settings import Settings
from shared.tables import ModelDeployment
from worker.engine import Engine as BatchEngine
from worker.engine import StaticBatchEngine
from worker.intake import Intake
from worker.publisher import Publisher
from worker.sequence import Sequence

log = logging.getLogger("llmfleet.worker")

MAX_REMEMBERED_CANCELS = 10_000


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    batching: str = "static"  # "one" | "static"
    max_batch_size: int = 8
    device: str = "auto"


class Worker:
    def __init__(
        self, settings: Settings, db: Engine, deployment: ModelDeployment, config: WorkerConfig
    ) -> None:
        self._settings = settings
        self._db = db
        self._deployment = deployment
        self._config = config
        self.worker_id = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self._state = "starting"
        self._stopping = asyncio.Event()
        # Cancels can arrive before the entry is pulled; remember recent ones (bounded).
        self._cancelled: OrderedDict[str, None] = OrderedDict()

    def stop(self) -> None:
        """Stop pulling new work; running sequences finish, then `run` returns."""
        self._stopping.set()

    async def run(self) -> None:
        redis = async_client(self._settings.redis_url)
        heartbeat = asyncio.create_task(self._heartbeat(redis))
        try:
            self._state = "loading"
            loaded, tokenizer = await asyncio.to_thread(self._load)
            engine = self._make_engine(loaded)
            intake = Intake(redis, self._deployment.model_id, self.worker_id)
            publisher = Publisher(redis, self._db, intake)
            cancels = asyncio.create_task(self._listen_for_cancels(redis))
            self._state = "ready"
            log.info("worker %s ready for %s", self.worker_id, self._deployment.model_id)
            try:
                await self._loop(engine, intake, publisher, tokenizer, loaded.eos_token_ids)
            finally:
                cancels.cancel()
                await publisher.drain()
        finally:
            heartbeat.cancel()
            await redis.delete(keys.worker_heartbeat(self.worker_id))
            await redis.aclose()

    def _load(self):
        from worker.runner import loader

        source = model_source.resolve(self._deployment.source)
        loaded = loader.load(source, self._config.device)
        tokenizer = model_source.load_tokenizer(source, self._settings.home / "cache")
        return loaded, tokenizer

    def _make_engine(self, loaded) -> BatchEngine:
        if self._config.batching == "one":
            return StaticBatchEngine(loaded, max_batch_size=1)
        if self._config.batching == "static":
            return StaticBatchEngine(loaded, max_batch_size=self._config.max_batch_size)
        raise ValueError(f"unknown batching mode {self._config.batching!r}")

    async def _loop(self, engine, intake, publisher, tokenizer, eos_token_ids) -> None:
        idle_ms = self._settings.worker_idle_poll_ms
        while not (self._stopping.is_set() and not engine.has_work()):
            free = engine.num_free_slots()
            if free and not self._stopping.is_set():
                block_ms = None if engine.has_work() else idle_ms
                for entry in await intake.pull(free, block_ms):
                    publisher.track(entry)
                    engine.add(Sequence.from_request(entry.request, tokenizer, eos_token_ids))
            await publisher.publish(engine.abort(self._take_cancels(publisher)))
            if engine.has_work():
                outputs = await asyncio.to_thread(engine.step)
                await publisher.publish(outputs)

    def _take_cancels(self, publisher: Publisher) -> set[str]:
        return {rid for rid in self._cancelled if rid in publisher.inflight}

    async def _listen_for_cancels(self, redis: aioredis.Redis) -> None:
        pubsub = redis.pubsub()
        await pubsub.subscribe(keys.cancel_channel(self._deployment.model_id))
        async for message in pubsub.listen():
            if message["type"] == "message":
                self._cancelled[decode_cancel(message["data"])] = None
                while len(self._cancelled) > MAX_REMEMBERED_CANCELS:
                    self._cancelled.popitem(last=False)

    async def _heartbeat(self, redis: aioredis.Redis) -> None:
        key = keys.worker_heartbeat(self.worker_id)
        interval_s = self._settings.worker_heartbeat_s
        while True:
            try:
                await self._beat(redis, key, interval_s)
            except (RedisError, OSError) as exc:
                # The broker may be restarting; keep beating once it is back.
                log.warning("heartbeat failed: %s", exc)
            await asyncio.sleep(interval_s)

    async def _beat(self, redis: aioredis.Redis, key: str, interval_s: float) -> None:
        fields = {
            "model": self._deployment.model_id,
            "state": self._state,
            "pid": os.getpid(),
            "batching": self._config.batching,
            "updated_at": time.time(),
        }
        async with redis.pipeline(transaction=True) as pipe:
            pipe.hset(key, mapping=fields)
            pipe.expire(key, max(1, int(interval_s * 3)))
            await pipe.execute()
