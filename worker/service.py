"""The worker process: load the model, then loop intake -> cancels -> step -> publish until
told to stop.

The engine step runs on a dedicated thread (torch releases the GIL in its kernels), so Redis
I/O, cancellations and heartbeats go on in the event loop while the model computes.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import math
import os
import socket
import time
import uuid
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from shared import heap, keys, model_source
from shared.ending import end_request, failed
from shared.journal import Journal
from shared.pool_assignments import POOL_DEDICATED, POOL_SHARED
from shared.protocol import ErrorCode, decode_cancel
from shared.redis_conn import BROKER_ERRORS, async_client, retrying, text
from shared.settings import Settings
from shared.tables import ModelDeployment
from worker import echo_engine, telemetry
from worker.config import EngineConfig
from worker.detokenizer import Decoder
from worker.engine import Engine, EngineStats
from worker.intake import Intake, StreamEntry
from worker.pool_service import PoolService
from worker.publisher import Publisher
from worker.recovery import Reclaimer
from worker.sequence import Sequence, SequenceOutput

log = logging.getLogger("llmfleet.worker")

MAX_REMEMBERED_CANCELS = 10_000
FAIRNESS_SCOPES = ("pool", "worker")


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    device: str = "auto"
    dtype: str = "auto"
    metrics_port: int = 0  # the worker's Prometheus /metrics; 0: none
    metrics_host: str = "127.0.0.1"
    # Fair queuing's service counters: shared by the model's workers through Redis
    # (`worker/pool_service.py`), or each worker's own.
    fairness_scope: str = "pool"
    preferred_tenants: frozenset[str] = frozenset()  # tenant affinity (`worker/intake.py`)
    # `dedicated` to its model, or `shared` (`worker/pool_member.py`): then the models it may
    # serve, which the control process chooses among (`control/pool.py`).
    pool: str = POOL_DEDICATED
    pool_models: tuple[str, ...] = ()
    # Fault injection, for tests only (`LLMFLEET_FAULT_STEP_DELAY_MS`): wait this long before
    # each engine step, a deliberately slow version.
    fault_step_delay_s: float = 0.0


def is_fair(config: EngineConfig) -> bool:
    return config.batching == "continuous" and config.queueing == "fair"


@dataclass(slots=True)
class _Serving:
    """What the worker loop works with once the model is loaded."""

    engine: Engine
    telemetry: telemetry.Telemetry
    intake: Intake
    publisher: Publisher
    pool: PoolService | None
    tokenizer: Decoder
    eos_token_ids: frozenset[int]


def new_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class Worker:
    def __init__(
        self,
        settings: Settings,
        deployment: ModelDeployment,
        config: WorkerConfig,
        *,
        worker_id: str | None = None,
        load_times_s: dict[str, float] | None = None,
        keep_heartbeat: bool = False,
    ) -> None:
        """`worker_id` and `load_times_s` (model id -> seconds its last load took, filled
        here) are kept across the models a shared worker serves in turn; so is its
        heartbeat (`keep_heartbeat`: not deleted when `run` returns, the next model's
        overwrites it), so the worker never looks gone between two models."""
        self._settings = settings
        self._deployment = deployment
        self._config = config
        self.worker_id = worker_id or new_worker_id()
        self._load_times_s = {} if load_times_s is None else load_times_s
        self._keep_heartbeat = keep_heartbeat
        self._serving_since_s = time.time()
        self._state = "starting"
        self._stopping = asyncio.Event()
        # Cancels can arrive before the entry is pulled; remember recent ones (bounded).
        self._cancelled: OrderedDict[str, None] = OrderedDict()
        self._stats: EngineStats | None = None  # as of the last step, for the heartbeat
        self._heartbeat_timeout_s = settings.worker_heartbeat_timeout_s
        self._recovery: tuple[Publisher, Reclaimer] | None = None
        self._reclaimed: list[StreamEntry] = []
        # All torch work (load, KV pool allocation, every step) runs on this one thread: each
        # thread that runs a parallel torch op gets an OpenMP team of its own, and with two
        # teams in the process a decode step measured 125 ms instead of 93 (batch 32, CPU).
        self._engine_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")

    async def _on_engine_thread(self, fn):
        return await asyncio.get_running_loop().run_in_executor(self._engine_thread, fn)

    def stop(self) -> None:
        """Graceful shutdown (SIGTERM): stop pulling, hand the requests that have not started
        back to the queue, let running ones finish within `worker_drain_timeout_s`, end the
        rest with `worker_shutdown`, then `run` returns. Its heartbeat says `draining`, so
        the API stops routing new requests of a canary version to it."""
        if self._state == "ready":
            self._state = "draining"
        self._stopping.set()

    async def run(self) -> None:
        redis = async_client(self._settings.redis_url)
        heartbeat = asyncio.create_task(self._heartbeat(redis))
        try:
            self._state = "loading"
            # The modules first: a load timed without them is what a shared worker's move to
            # this model costs (its process has them already), which the pool weighs.
            await self._on_engine_thread(self._import_loaders)
            loading_since_s = time.monotonic()
            engine, tokenizer, eos_token_ids = await self._on_engine_thread(self._load)
            self._load_times_s[self._deployment.model_id] = time.monotonic() - loading_since_s
            self._stats = engine.stats()
            observed = telemetry.Telemetry(
                self._deployment.model_id,
                self._stats.max_num_seqs,
                version=self._deployment.version,
            )
            intake = Intake(
                redis,
                self._deployment.name,
                self.worker_id,
                is_fair=is_fair(self._config.engine),
                preferred_tenants=self._config.preferred_tenants,
            )
            journal = Journal(redis, self._settings.journal_ttl_s, self._settings.resume_grace_s)
            publisher = Publisher(
                redis, intake, journal, self.worker_id, self._settings.broker_retry_s
            )
            reclaimer = Reclaimer(
                redis,
                intake,
                journal,
                self.worker_id,
                self._heartbeat_timeout_s,
                is_own=lambda request_id: (
                    request_id in publisher.inflight
                    or any(e.request.request_id == request_id for e in self._reclaimed)
                ),
            )
            self._recovery = (publisher, reclaimer)
            serving = _Serving(
                engine, observed, intake, publisher, self._pool_service(redis), tokenizer,
                eos_token_ids,
            )  # fmt: skip
            cancels = asyncio.create_task(self._listen_for_cancels(redis))
            exporter = asyncio.create_task(
                telemetry.export(
                    observed, redis, self._config.metrics_port, self._config.metrics_host
                )
            )
            heap.freeze_long_lived()  # the model and modules: out of every collection
            self._state = "ready"
            log.info("worker %s ready for %s", self.worker_id, self._deployment.name)
            try:
                await self._loop(serving)
                await self._end_unfinished(redis, journal, serving)
            finally:
                cancels.cancel()
                exporter.cancel()
                await publisher.drain()
        finally:
            heartbeat.cancel()
            if not self._keep_heartbeat:
                await redis.delete(keys.worker_heartbeat(self.worker_id))
            await redis.zrem(keys.ready_workers(self._deployment.name), self.worker_id)
            await redis.zrem(keys.model_capacity(self._deployment.name), self.worker_id)
            await redis.aclose()

    def _pool_service(self, redis: aioredis.Redis) -> PoolService | None:
        """The pool's shared service counters, for a fair-queuing worker of pool scope."""
        if is_fair(self._config.engine) and self._config.fairness_scope == "pool":
            return PoolService(redis, self._deployment.name)
        return None

    def _import_loaders(self) -> None:
        """The modules `_load` needs: transformers, and torch for a model (not for echo)."""
        model_source.import_loaders()
        if self._config.engine.engine != "echo":
            import worker.model_engine
            import worker.runner.loader  # noqa: F401

    def _load(self):
        """The engine, the tokenizer and the end-of-sequence ids. The echo engine loads the
        tokenizer alone; the model's modules (torch) are imported only for a model."""
        source = model_source.resolve(self._deployment.source)
        tokenizer = model_source.load_tokenizer(source, self._settings.home / "cache")
        if self._config.engine.engine == "echo":
            engine = echo_engine.build_echo_engine(self._config.engine, len(tokenizer))
            return engine, tokenizer, echo_engine.eos_token_ids(tokenizer)
        from worker.model_engine import build_engine
        from worker.runner import loader

        loaded = loader.load(source, self._config.device, self._config.dtype)
        return build_engine(loaded, self._config.engine), tokenizer, loaded.eos_token_ids

    async def _loop(self, serving: _Serving) -> None:
        """Until stopped and drained: take new entries, end what was cancelled or expired,
        step, publish. A step's outputs are published while the next step computes
        (publishes keep their call order: `Publisher.publish`); at most one step's is
        behind."""
        engine, publisher = serving.engine, serving.publisher
        drain_deadline_s = math.inf
        publishing: asyncio.Task | None = None
        while engine.has_work() or not self._stopping.is_set():
            if self._stopping.is_set() and drain_deadline_s == math.inf:
                drain_deadline_s = time.monotonic() + self._settings.worker_drain_timeout_s
                await self._hand_back(serving)
            if time.monotonic() > drain_deadline_s:
                break  # `_end_unfinished` ends what is left
            await self._take_new(serving)
            await self._end_cancelled(serving)
            if engine.has_work():
                outputs = await self._step(serving)  # its stats are the heartbeat's
                if publishing is not None:
                    await publishing
                publishing = publisher.publish(outputs)
                continue
            self._stats = engine.stats()  # idle: what cancels and deadlines left
            if serving.pool is not None and (updates := engine.take_service_updates()):
                await serving.pool.sync(updates)  # the last step's service, once idle
        if publishing is not None:
            await publishing

    async def _take_new(self, serving: _Serving) -> None:
        """Intake: the entries reclaimed from dead workers and what the streams give (waiting
        for some while idle), into the engine; a refusal is published at once."""
        engine, publisher, intake = serving.engine, serving.publisher, serving.intake
        entries, self._reclaimed = self._reclaimed, []
        if not self._stopping.is_set():
            idle_ms = self._settings.worker_idle_poll_ms
            block_ms = None if engine.has_work() or entries else idle_ms
            entries += await self._pull(intake, block_ms, engine)
        for entry in entries:
            if (flight := publisher.inflight.get(entry.request.request_id)) is not None:
                if flight.entry.entry_id != entry.entry_id:
                    # A second entry for a request served here.
                    await retrying(
                        functools.partial(intake.ack, entry),
                        within_s=self._settings.broker_retry_s,
                        what="a second entry's acknowledgement",
                    )
                continue  # the very entry being served: never acknowledge that one
            publisher.track(entry)
            seq = Sequence.from_request(entry.request, serving.tokenizer, serving.eos_token_ids)
            refused = engine.add(seq)
            serving.telemetry.added(seq, refused)
            if refused is not None:
                await publisher.publish([refused])

    async def _end_cancelled(self, serving: _Serving) -> None:
        """Cancels: what clients cancelled, what was orphaned here (served or ended
        elsewhere) and what passed its deadline. Usually nothing: no publish (a task) for
        an empty list on every step."""
        engine, publisher = serving.engine, serving.publisher
        aborted = self._take_cancels(publisher) | publisher.take_orphans()
        if ended := engine.abort(aborted) + engine.expire(time.time()):
            serving.telemetry.ended(ended)
            await publisher.publish(ended)

    async def _step(self, serving: _Serving) -> list[SequenceOutput]:
        """One engine step; the pool's counters are synced while it computes (what the
        step computes goes with the next sync) and applied once it is done."""
        engine, pool = serving.engine, serving.pool
        if self._config.fault_step_delay_s:
            await asyncio.sleep(self._config.fault_step_delay_s)
        sync = asyncio.create_task(pool.sync(engine.take_service_updates())) if pool else None
        report = await self._on_engine_thread(functools.partial(telemetry.timed_step, engine))
        serving.telemetry.stepped(report)
        self._stats = report.stats
        if pool is not None and sync is not None and (counters := await sync) is not None:
            engine.apply_pool_service(counters)
            pool_sync_s = serving.telemetry.metrics.pool_sync_s
            pool_sync_s.labels(*serving.telemetry.labels).observe(pool.last_sync_s)
        return report.outputs

    async def _pull(self, intake: Intake, block_ms: int | None, engine):
        """New entries; none this turn while the broker is unreachable. (A pull whose reply
        was lost leaves entries pending here unseen: recovery serves them after the heartbeat
        timeout.)"""
        try:
            return await intake.pull(engine, block_ms)
        except BROKER_ERRORS as exc:
            log.warning("pull failed: %s", exc)
            if not engine.has_work():
                await asyncio.sleep(self._settings.worker_idle_poll_ms / 1000)
            return []

    async def _hand_back(self, serving: _Serving) -> None:
        """Give the requests that have not started to the other workers, at once."""
        request_ids = serving.engine.unstarted_request_ids()
        entries = serving.publisher.forget(request_ids)
        serving.engine.abort(set(request_ids))  # their ends are the other workers' to count
        serving.telemetry.handed_back(set(request_ids))
        await serving.intake.hand_back(entries)
        if entries:
            log.info("handed %d waiting requests back to the queue", len(entries))

    async def _end_unfinished(self, redis, journal: Journal, serving: _Serving) -> None:
        """After the drain timeout: end what still runs (`worker_shutdown`), usage recorded."""
        publisher, engine = serving.publisher, serving.engine
        request_ids = list(publisher.inflight)
        shutdown = failed(
            ErrorCode.WORKER_SHUTDOWN,
            "The worker serving this request shut down before it finished.",
        )
        for entry in publisher.forget(request_ids):
            await end_request(
                redis,
                journal,
                entry.request,
                (entry.stream, entry.entry_id),
                shutdown,
                claimer=self.worker_id,
            )
        serving.telemetry.ended(engine.abort(set(request_ids)))

    def _take_cancels(self, publisher: Publisher) -> set[str]:
        # Scan what is in flight (at most a batch), not the remembered cancels (up to 10k).
        return {rid for rid in publisher.inflight if rid in self._cancelled}

    async def _listen_for_cancels(self, redis: aioredis.Redis) -> None:
        """Remember cancels; subscribe again when the connection is lost (cancels published
        meanwhile are missed: those requests run to their end)."""
        while True:
            pubsub = redis.pubsub()
            try:
                await pubsub.subscribe(keys.cancel_channel(self._deployment.model_id))
                async for message in pubsub.listen():
                    if message["type"] == "message":
                        self._cancelled[decode_cancel(message["data"])] = None
                        while len(self._cancelled) > MAX_REMEMBERED_CANCELS:
                            self._cancelled.popitem(last=False)
            except BROKER_ERRORS as exc:
                log.warning("cancel subscription lost (%s); subscribing again", exc)
                await asyncio.sleep(self._settings.worker_heartbeat_s)
            finally:
                with contextlib.suppress(*BROKER_ERRORS):
                    await pubsub.aclose()

    async def _heartbeat(self, redis: aioredis.Redis) -> None:
        key = keys.worker_heartbeat(self.worker_id)
        interval_s = self._settings.worker_heartbeat_s
        while True:
            try:
                await self._beat(redis, key, interval_s)
                await self._recover()
            except (RedisError, OSError) as exc:
                # The broker may be restarting; keep beating once it is back.
                log.warning("heartbeat failed: %s", exc)
            await asyncio.sleep(interval_s)

    async def _recover(self) -> None:
        """Keep this worker's entries claimed; take over dead workers' entries."""
        if self._recovery is None:
            return
        publisher, reclaimer = self._recovery
        # Reclaimed entries waiting for the loop too: idle, they would be reclaimed again.
        held = [flight.entry for flight in publisher.inflight.values()] + self._reclaimed
        await reclaimer.keep_claimed(held)
        if not self._stopping.is_set():
            self._reclaimed += await reclaimer.reclaim()

    async def _beat(self, redis: aioredis.Redis, key: str, interval_s: float) -> None:
        deployment, name = self._deployment, self._deployment.name
        now_s = time.time()
        fields = {
            "model": deployment.model_id,
            "version": deployment.version,
            "deployment_id": deployment.id or 0,
            "state": self._state,
            "pid": os.getpid(),
            "batching": self._config.engine.batching,
            "pool": self._config.pool,
            "serving_since": self._serving_since_s,
            "updated_at": now_s,
            **(self._stats.heartbeat_fields() if self._stats is not None else {}),
        }
        if self._load_times_s:  # the shared pool's policy weighs a move against loads
            fields["load_s"] = json.dumps(self._load_times_s)
        if self._config.pool == POOL_SHARED:
            fields["pool_models"] = ",".join(self._config.pool_models)
        ready = keys.ready_workers(name)
        async with redis.pipeline(transaction=True) as pipe:
            pipe.delete(key)  # all of it anew: a shared worker's last model left fields
            pipe.hset(key, mapping=fields)
            pipe.expire(key, max(1, math.ceil(self._heartbeat_timeout_s)))
            capacity = self._stats.max_num_tokens_per_sequence if self._stats else None
            if capacity is not None:
                pipe.zadd(keys.model_capacity(name), {self.worker_id: capacity})
            # The API routes to a version only while it has a ready worker (`api/router.py`);
            # a draining one takes no new work, and a dead one's score goes stale.
            if self._state == "ready":
                pipe.zadd(ready, {self.worker_id: now_s})
            else:
                pipe.zrem(ready, self.worker_id)
            pipe.zremrangebyscore(ready, "-inf", now_s - self._heartbeat_timeout_s)
            await pipe.execute()
        await self._forget_dead_workers(redis, name)

    async def _forget_dead_workers(self, redis: aioredis.Redis, name: str) -> None:
        """Drop capacity entries of workers whose heartbeat expired (they died uncleanly)."""
        for member in await redis.zrange(keys.model_capacity(name), 0, -1):
            worker_id = text(member)
            if not await redis.exists(keys.worker_heartbeat(worker_id)):
                await redis.zrem(keys.model_capacity(name), worker_id)
