"""The worker process: load the model, then loop intake -> cancels -> step -> publish until
told to stop.

The engine step runs on a dedicated thread (torch releases the GIL in its kernels), so Redis
I/O, cancellations and heartbeats go on in the event loop while the model computes.

A worker's states, as its heartbeat says them: `loading` (weights and tokenizer on their
way), `standby` (loaded, but no engine and no KV pool: it pulls nothing and is no ready
capacity), `ready` (serving), `draining` (pulling nothing, its requests that have not
started handed back, the running ones finishing). A dedicated worker follows the role the
autoscaler gives it (`worker/role.py`): `active` builds the engine over the loaded weights
(`worker/weights.py`) and serves; `standby` drains as SIGTERM does, then drops the engine
and keeps the weights. Same worker id and heartbeat throughout; SIGTERM ends any state.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import os
import socket
import time
import uuid
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from shared import heap, keys
from shared.ending import end_request, failed
from shared.handoff import HandOffs
from shared.journal import Journal
from shared.pool_assignments import POOL_DEDICATED
from shared.protocol import ErrorCode, decode_cancel
from shared.redis_conn import BROKER_ERRORS, async_client, retrying
from shared.settings import Settings
from shared.tables import ModelDeployment
from worker import handoff, heartbeat, role, telemetry
from worker.config import EngineConfig
from worker.detokenizer import Decoder
from worker.engine import ContinuousBatchingEngine, Engine, EngineStats
from worker.intake import Intake, StreamEntry
from worker.pool_service import PoolService
from worker.publisher import Publisher
from worker.recovery import Reclaimer
from worker.sequence import Sequence, SequenceOutput
from worker.weights import (
    Weights,
    build_engine,
    import_loaders,
    load_weights,
    release_engine_memory,
)

log = logging.getLogger("llmfleet.worker")

MAX_REMEMBERED_CANCELS = 10_000
KV_WASTE_INTERVAL_S = 1.0
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
    # A dedicated worker's role until the autoscaler gives it one (`worker/role.py`): on
    # standby (`--standby`: weights loaded, no engine, nothing pulled), or serving.
    standby: bool = False
    # Fault injection, for tests only (`LLMFLEET_FAULT_STEP_DELAY_MS`): wait this long before
    # each engine step, a deliberately slow version.
    fault_step_delay_s: float = 0.0
    # Prefill/decode disaggregation (`worker/handoff.py`): `both` serves requests whole;
    # `prefill` computes prompts and first tokens and hands the sequences to `decode`
    # workers, which stream the rest and pull nothing from the queues. A decode worker
    # takes the KV at `kv_host`:`kv_port` (0: a free port), which its heartbeat advertises.
    role: str = handoff.ROLE_BOTH
    kv_host: str = "127.0.0.1"
    kv_port: int = 0
    # The endpoint prefill workers reach a decode worker at, where it is not the bound one
    # (a NAT, a proxy, a service name): `tcp://HOST:PORT`.
    kv_advertise: str | None = None


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
        # Stop pulling and drain what is held: on SIGTERM, or on the way to standby.
        self._draining = asyncio.Event()
        self._beat_soon = asyncio.Event()  # the state changed: beat now, not a period later
        self._start_role = role.STANDBY if config.standby else role.ACTIVE
        # The autoscaler's roles are for dedicated workers: a shared one follows the pool's
        # assignments (`worker/pool_member.py`).
        self._follows_roles = config.pool == POOL_DEDICATED
        self._telemetry: telemetry.Telemetry | None = None  # once the weights are loaded
        self._activation_s: float | None = None  # the last activation from standby
        # Cancels can arrive before the entry is pulled; remember recent ones (bounded).
        self._cancelled: OrderedDict[str, None] = OrderedDict()
        # Cancels to act on at the next step: those that came since, and those of requests
        # taken in since that were cancelled before they came.
        self._to_cancel: set[str] = set()
        self._stats: EngineStats | None = None  # as of the last step, for the heartbeat
        self._next_kv_waste_s = 0.0
        self._heartbeat_timeout_s = settings.worker_heartbeat_timeout_s
        # While serving: keep this worker's entries claimed, reclaim dead workers'. The lock
        # keeps a reclaim in flight from adding entries once serving has ended.
        self._recovery: tuple[Publisher, Reclaimer] | None = None
        self._recovery_lock = asyncio.Lock()
        self._reclaimed: list[StreamEntry] = []
        # All torch work (load, KV pool allocation, every step) runs on this one thread: each
        # thread that runs a parallel torch op gets an OpenMP team of its own, and with two
        # teams in the process a decode step measured 125 ms instead of 93 (batch 32, CPU).
        self._engine_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        # Disaggregation, while serving: a prefill worker's sender and the offers no decode
        # worker took (back into the batch at the next turn), or a decode worker's receiver.
        self._sender: handoff.Sender | None = None
        self._sending: set[asyncio.Task] = set()
        self._taken_back: list[handoff.Offer] = []
        self._receiver: handoff.Receiver | None = None
        self._handoffs: HandOffs | None = None  # a decode worker's: it accepts in Redis
        self._arrived = asyncio.Event()  # a hand-off came: an idle decode loop wakes

    async def _on_engine_thread(self, fn):
        return await asyncio.get_running_loop().run_in_executor(self._engine_thread, fn)

    def stop(self) -> None:
        """Graceful shutdown (SIGTERM), in any state: stop pulling, hand the requests that
        have not started back to the queue, let running ones finish within
        `worker_drain_timeout_s`, end the rest with `worker_shutdown`, then `run` returns.
        Its heartbeat says `draining`, so the API stops routing new requests of a canary
        version to it. A worker on standby holds nothing: it exits at once."""
        if self._state == "ready":
            self._set_state("draining")
        self._stopping.set()
        self._draining.set()

    async def run(self) -> None:
        redis = async_client(self._settings.redis_url, auto_pipeline=True)
        beating = asyncio.create_task(self._heartbeat(redis))
        try:
            weights = await self._load_weights()
            observed = self._telemetry = telemetry.Telemetry(
                self._deployment.model_id,
                self._config.engine.max_num_seqs_in_batch,
                version=self._deployment.version,
            )
            # For the worker's life, in every state: its /metrics (a standby worker still
            # answers a scrape), and the cancels of requests still queued, which it may
            # serve once active.
            lifelong = [
                asyncio.create_task(
                    telemetry.export(
                        observed, redis, self._config.metrics_port, self._config.metrics_host
                    )
                ),
                asyncio.create_task(self._listen_for_cancels(redis)),
            ]
            try:
                while await self._until_active(redis):
                    await self._serve(redis, weights, observed)
                    if not self._stopping.is_set():
                        await self._park(weights)
            finally:
                for task in lifelong:
                    task.cancel()
        finally:
            beating.cancel()
            if not self._keep_heartbeat:
                await redis.delete(keys.worker_heartbeat(self.worker_id))
            await redis.zrem(keys.ready_workers(self._deployment.name), self.worker_id)
            await redis.zrem(keys.model_capacity(self._deployment.name), self.worker_id)
            await redis.aclose()

    async def _load_weights(self) -> Weights:
        self._set_state("loading")
        # The modules first: a load timed without them is what a shared worker's move to this
        # model costs (its process has them already), which the pool weighs.
        await self._on_engine_thread(functools.partial(import_loaders, self._config.engine))
        loading_since_s = time.monotonic()
        weights = await self._on_engine_thread(
            functools.partial(
                load_weights,
                self._deployment.source,
                self._settings.home / "cache",
                self._config.engine,
                self._config.device,
                self._config.dtype,
            )
        )
        # The engine's build is added when the worker serves at once (`_ready`).
        self._load_times_s[self._deployment.model_id] = time.monotonic() - loading_since_s
        heap.freeze_long_lived()  # the model and modules: out of every collection
        return weights

    async def _until_active(self, redis: aioredis.Redis) -> bool:
        """On standby until the role says `active` (True), or until stopped (False). A
        worker that starts active and has no role saying otherwise goes on at once."""
        while not self._stopping.is_set():
            if await self._read_role(redis) == role.ACTIVE:
                return True
            if self._state != "standby":
                self._set_state("standby")
                log.info("worker %s on standby for %s", self.worker_id, self._deployment.name)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), role.ROLE_POLL_S)
        return False

    async def _read_role(self, redis: aioredis.Redis) -> str | None:
        """The role wanted now; None while the broker does not answer (nothing changes)."""
        if not self._follows_roles:
            return self._start_role
        try:
            entry = await role.read_entry(redis, self.worker_id)
        except (RedisError, OSError):
            return None  # the heartbeat says what is wrong with the broker
        return role.role_of(entry, self._start_role)

    async def _serve(
        self, redis: aioredis.Redis, weights: Weights, observed: telemetry.Telemetry
    ) -> None:
        """Build the engine (its KV pool) and the serving machinery over the loaded weights,
        serve until stopped or sent to standby, drain, and take the machinery down."""
        is_activation, since_s = self._state == "standby", time.monotonic()
        engine = await self._on_engine_thread(
            functools.partial(build_engine, weights, self._config.engine)
        )
        self._stats = engine.stats()
        intake = Intake(
            redis,
            self._deployment.name,
            self.worker_id,
            is_fair=is_fair(self._config.engine),
            preferred_tenants=self._config.preferred_tenants,
        )
        journal = Journal(redis, self._settings.journal_ttl_s, self._settings.resume_grace_s)
        publisher = Publisher(redis, intake, journal, self.worker_id, self._settings.broker_retry_s)
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
            engine, observed, intake, publisher, self._pool_service(redis), weights.tokenizer,
            weights.eos_token_ids,
        )  # fmt: skip
        watching = [asyncio.create_task(self._watch_role(redis))]
        watching += self._start_hand_offs(redis, engine)
        self._ready(observed, is_activation, time.monotonic() - since_s)
        try:
            await self._loop(serving)
            await self._end_unfinished(redis, journal, serving)
        finally:
            for task in watching:
                task.cancel()
            self._stop_hand_offs()
            await publisher.drain()
            await self._end_recovery(intake)

    def _start_hand_offs(self, redis: aioredis.Redis, engine: Engine) -> list[asyncio.Task]:
        """A prefill worker's sender (the engine's hand-off callback, and a task that keeps
        the decode workers' room current), or a decode worker's receiver."""
        config, handoffs = self._config, HandOffs(redis, self._settings.journal_ttl_s)
        if config.role == handoff.ROLE_BOTH:
            return []
        if not isinstance(engine, ContinuousBatchingEngine):  # the CLI refuses such a role
            raise ValueError("prefill and decode workers batch continuously on a model")
        if config.role == handoff.ROLE_PREFILL:
            self._sender = handoff.Sender(
                redis, engine.runner, handoffs, self.worker_id, self._settings.broker_retry_s
            )
            engine.set_hand_off(self._sender)
            return [asyncio.create_task(self._watch_decoders(self._sender))]
        if config.role == handoff.ROLE_DECODE:
            loop = asyncio.get_running_loop()
            self._receiver = handoff.Receiver(
                f"tcp://{config.kv_host}:{config.kv_port}",
                wake=lambda: loop.call_soon_threadsafe(self._arrived.set),
            )
            self._handoffs = handoffs
            log.info("worker %s takes hand-offs at %s", self.worker_id, self._receiver.endpoint)
        return []

    def _kv_endpoint(self) -> str | None:
        """Where a decode worker takes hand-offs, as its heartbeat advertises it."""
        if self._receiver is None:
            return None
        return self._config.kv_advertise or self._receiver.endpoint

    def _stop_hand_offs(self) -> None:
        if self._sender is not None:
            self._sender.close()
            self._sender = None
        if self._receiver is not None:
            self._receiver.close()
            self._receiver = None

    async def _watch_decoders(self, sender: handoff.Sender) -> None:
        """A prefill worker: the decode workers and their room, read a few times a second."""
        while True:
            try:
                await sender.refresh_decoders(self._deployment.name)
            except BROKER_ERRORS as exc:
                sender.decoders = []  # decode here until the broker answers again
                log.warning("could not read the decode workers: %s", exc)
            await asyncio.sleep(handoff.DECODERS_REFRESH_S)

    def _ready(self, observed: telemetry.Telemetry, is_activation: bool, build_s: float) -> None:
        if is_activation:
            self._activation_s = build_s
            observed.activated(build_s)
            log.info("worker %s activated for %s in %.3f s", self.worker_id,
                     self._deployment.name, build_s)  # fmt: skip
        else:
            self._load_times_s[self._deployment.model_id] += build_s
            log.info("worker %s ready for %s", self.worker_id, self._deployment.name)
        # Stopped, or sent back to standby, while the engine was being built: `_loop` drains
        # at once.
        self._set_state("draining" if self._draining.is_set() else "ready")

    async def _watch_role(self, redis: aioredis.Redis) -> None:
        """While serving: drain for standby once the role says so (a poll, off the steps)."""
        while self._follows_roles and not self._draining.is_set():
            if await self._read_role(redis) == role.STANDBY:
                log.info("worker %s goes to standby: draining", self.worker_id)
                self._set_state("draining")
                self._draining.set()
                return
            await asyncio.sleep(role.ROLE_POLL_S)

    async def _park(self, weights: Weights) -> None:
        """After a drain for standby: free the engine and its KV pool, keep the weights. No
        reference to the engine is left once `_serve` has returned."""
        self._stats = None  # no KV pool, no capacity to report
        await self._on_engine_thread(functools.partial(release_engine_memory, weights))
        self._draining.clear()
        self._set_state("standby")
        log.info("worker %s on standby for %s: engine and KV pool released", self.worker_id,
                 self._deployment.name)  # fmt: skip

    async def _end_recovery(self, intake: Intake) -> None:
        """Serving has ended: no more keeping or reclaiming entries (a standby worker holds
        none). Entries reclaimed and not taken in yet go back to the queue at once."""
        async with self._recovery_lock:
            self._recovery = None
            reclaimed, self._reclaimed = self._reclaimed, []
        if not reclaimed:
            return
        try:
            await intake.hand_back(reclaimed)
        except BROKER_ERRORS as exc:
            # They stay pending, unrefreshed: recovery serves them after the heartbeat timeout.
            log.warning("could not hand back %d reclaimed requests: %s", len(reclaimed), exc)

    def _pool_service(self, redis: aioredis.Redis) -> PoolService | None:
        """The pool's shared service counters, for a fair-queuing worker of pool scope."""
        if is_fair(self._config.engine) and self._config.fairness_scope == "pool":
            return PoolService(redis, self._deployment.name)
        return None

    async def _loop(self, serving: _Serving) -> None:
        """Until stopped and drained: take new entries, end what was cancelled or expired,
        step, publish. A step's outputs are published while the next step computes
        (publishes keep their call order: `Publisher.publish`); at most one step's is
        behind."""
        engine, publisher = serving.engine, serving.publisher
        drain_deadline_s = math.inf
        publishing: asyncio.Task | None = None
        while engine.has_work() or self._is_handing_off() or not self._draining.is_set():
            if self._draining.is_set() and drain_deadline_s == math.inf:
                drain_deadline_s = time.monotonic() + self._settings.worker_drain_timeout_s
                await self._hand_back(serving)
            if time.monotonic() > drain_deadline_s:
                break  # `_end_unfinished` ends what is left
            await self._take_new(serving)
            await self._take_hand_offs(serving)
            await self._end_cancelled(serving)
            if engine.has_work():
                outputs = await self._step(serving)  # its stats are the heartbeat's
                if publishing is not None:
                    await publishing
                publishing = publisher.publish(outputs)
                self._send_offers(serving, publishing)
                continue
            if self._is_handing_off():
                await asyncio.sleep(0.005)  # a send in flight: its outcome comes to the loop
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
        if self._config.role == handoff.ROLE_DECODE:
            if not (engine.has_work() or entries or self._draining.is_set()):
                with contextlib.suppress(TimeoutError):  # until a hand-off comes
                    await asyncio.wait_for(
                        self._arrived.wait(), self._settings.worker_idle_poll_ms / 1000
                    )
            self._arrived.clear()
        elif not self._draining.is_set():
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
            if entry.request.request_id in self._cancelled:
                self._to_cancel.add(entry.request.request_id)
            seq = Sequence.from_request(entry.request, serving.tokenizer, serving.eos_token_ids)
            refused = engine.add(seq)
            serving.telemetry.added(seq, refused)
            if refused is not None:
                await publisher.publish([refused])

    def _is_handing_off(self) -> bool:
        return bool(self._sending or self._taken_back)

    def _send_offers(self, serving: _Serving, published: asyncio.Task) -> None:
        """A prefill worker: send the sequences the step let go, once its tokens are out."""
        if self._sender is None:
            return
        for offer in self._sender.take_offers():
            task = asyncio.create_task(self._send_offer(serving, offer, published))
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)

    async def _send_offer(
        self, serving: _Serving, offer: handoff.Offer, published: asyncio.Task
    ) -> None:
        await asyncio.wait([published])  # the first token's event: the decode worker's follow
        request_id, publisher, sender = offer.request_id, serving.publisher, self._sender
        flight = publisher.inflight.get(request_id)
        if flight is None or flight.is_orphaned or sender is None:
            return  # ended (or served elsewhere) meanwhile
        try:
            is_sent = await sender.send(offer, flight.entry, flight.num_events)
        except BROKER_ERRORS as exc:
            log.warning("hand-off of %s failed (%s): decoding it here", request_id, exc)
            is_sent = False
        if is_sent:  # the decode worker counts its tokens and its end
            publisher.forget([request_id])
            serving.telemetry.handed_back({request_id})
        else:
            self._taken_back.append(offer)

    async def _take_hand_offs(self, serving: _Serving) -> None:
        """Between two steps: a prefill worker takes back what no decode worker took; a
        decode worker adopts what came."""
        if self._taken_back:
            await self._take_back(serving)
        if self._receiver is not None:
            for arrival in self._receiver.take():
                if not arrival.verdict.set_running_or_notify_cancel():
                    continue  # the sender was told no: it keeps the request
                try:
                    await self._adopt(serving, arrival)
                    arrival.verdict.set_result(None)
                except Exception as exc:  # refused: the prefill worker keeps it
                    arrival.verdict.set_exception(exc)

    async def _take_back(self, serving: _Serving) -> None:
        offers, self._taken_back = self._taken_back, []
        for offer in offers:
            flight = serving.publisher.inflight.get(offer.request_id)
            if flight is None or self._sender is None:
                continue
            seq = handoff.continued_sequence(
                flight.entry.request, offer.seq.output_token_ids[0], serving.tokenizer,
                serving.eos_token_ids,
            )  # fmt: skip
            taken = functools.partial(self._sender.take_back, serving.engine, offer, seq)
            if not await self._on_engine_thread(taken):
                self._taken_back.append(offer)  # no room yet: after the next step
            elif offer.request_id in self._cancelled:
                self._to_cancel.add(offer.request_id)

    async def _adopt(self, serving: _Serving, arrival: handoff.Arrival) -> None:
        """A decode worker: into the batch if it has room, then the request is this
        worker's (the hand-off accepted in Redis, its stream entry claimed); raises to
        refuse it."""
        engine, entry = serving.engine, arrival.entry()
        assert isinstance(engine, ContinuousBatchingEngine)  # a decode worker's
        request_id = entry.request.request_id
        seq = handoff.continued_sequence(
            entry.request, arrival.header["first_token_id"], serving.tokenizer,
            serving.eos_token_ids,
        )  # fmt: skip
        runner: Any = engine.runner  # a `ModelRunner`: it imports KV
        layout, payload = arrival.layout(), arrival.transfer.payload

        def adopt() -> bool:
            if not engine.adopt(seq, lambda blocks: runner.import_kv(blocks, layout, payload)):
                return False
            runner.import_sampling_state(request_id, seq.sampling, arrival.sampling_state())
            return True

        if not await self._on_engine_thread(adopt):
            raise handoff.HandOffRefused("no room in the batch or the KV cache")
        try:
            assert self._handoffs is not None
            if not await self._handoffs.accept(request_id, self.worker_id):
                raise handoff.HandOffRefused("the offer was withdrawn")
            await serving.intake.keep_claimed([entry])  # crash recovery follows it here
            await serving.publisher.adopt(entry, arrival.header["num_events"])
        except BaseException:
            await self._on_engine_thread(functools.partial(engine.abort, {request_id}))
            raise
        serving.telemetry.adopted(seq)
        if request_id in self._cancelled:
            self._to_cancel.add(request_id)

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
        # The KV cache's waste (a pass over every running sequence) once a second at most:
        # the heartbeat reports no more often.
        with_kv_waste = (now_s := time.monotonic()) >= self._next_kv_waste_s
        if with_kv_waste:
            self._next_kv_waste_s = now_s + KV_WASTE_INTERVAL_S
        report = await self._on_engine_thread(
            functools.partial(telemetry.timed_step, engine, with_kv_waste=with_kv_waste)
        )
        serving.telemetry.stepped(report)
        stats = report.stats
        if not with_kv_waste and self._stats is not None:
            stats = replace(stats, kv_cache_waste=self._stats.kv_cache_waste)
        self._stats = stats
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
        # The new cancels only: not every request in flight on every step.
        to_cancel, self._to_cancel = self._to_cancel, set()
        return {rid for rid in to_cancel if rid in publisher.inflight}

    async def _listen_for_cancels(self, redis: aioredis.Redis) -> None:
        """Remember cancels; subscribe again when the connection is lost (cancels published
        meanwhile are missed: those requests run to their end)."""
        while True:
            pubsub = redis.pubsub()
            try:
                await pubsub.subscribe(keys.cancel_channel(self._deployment.model_id))
                async for message in pubsub.listen():
                    if message["type"] == "message":
                        request_id = decode_cancel(message["data"])
                        self._cancelled[request_id] = None
                        self._to_cancel.add(request_id)
                        while len(self._cancelled) > MAX_REMEMBERED_CANCELS:
                            self._cancelled.popitem(last=False)
            except BROKER_ERRORS as exc:
                log.warning("cancel subscription lost (%s); subscribing again", exc)
                await asyncio.sleep(self._settings.worker_heartbeat_s)
            finally:
                with contextlib.suppress(*BROKER_ERRORS):
                    await pubsub.aclose()

    def _set_state(self, state: str) -> None:
        """The heartbeat says a new state at once (and the ready set follows it)."""
        self._state = state
        self._beat_soon.set()

    async def _heartbeat(self, redis: aioredis.Redis) -> None:
        interval_s = self._settings.worker_heartbeat_s
        while True:
            self._beat_soon.clear()
            try:
                await self._beat(redis)
                await self._recover()
            except (RedisError, OSError) as exc:
                # The broker may be restarting; keep beating once it is back.
                log.warning("heartbeat failed: %s", exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._beat_soon.wait(), interval_s)

    async def _recover(self) -> None:
        """Keep this worker's entries claimed; take over dead workers' entries."""
        async with self._recovery_lock:
            if self._recovery is None:
                return
            publisher, reclaimer = self._recovery
            # Reclaimed entries waiting for the loop too: idle, they would be reclaimed again.
            held = [flight.entry for flight in publisher.inflight.values()] + self._reclaimed
            await reclaimer.keep_claimed(held)
            if not self._draining.is_set():
                self._reclaimed += await reclaimer.reclaim()

    async def _beat(self, redis: aioredis.Redis) -> None:
        observed, config = self._telemetry, self._config
        beat = heartbeat.Beat(
            self.worker_id,
            self._deployment,
            self._state,
            config.engine.batching,
            config.pool,
            config.pool_models,
            self._serving_since_s,
            num_served_tokens=observed.num_served_tokens if observed else 0,
            num_finished_requests=observed.num_finished_requests if observed else 0,
            activation_s=self._activation_s,
            load_times_s=self._load_times_s,
            stats=self._stats,
            role=config.role,
            kv_endpoint=self._kv_endpoint(),
        )
        await heartbeat.write(redis, beat, self._heartbeat_timeout_s, time.time())
