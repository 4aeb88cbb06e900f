"""Worker telemetry: what passes through the engine, as Prometheus metrics and latency samples.

`ObservedEngine` wraps any `Engine` and watches its seams only: a sequence added (its
arrival time and tier), each step (wall time, the outputs it produced, the stats after it)
and every output of `abort`. From those it derives, per request: queue time (arrival to the
first step that ran it), TTFT (arrival to its first token), inter-token latency and
end-to-end latency; per step: the batch size, KV usage, running and waiting sequences,
preemptions. Arrival is the API's admission time (`QueuedRequest.arrival_ts`), so TTFT
includes the Redis queue, as a client sees it; across machines it assumes synced clocks.

`export` serves the metrics on the worker's `--metrics-port` and pushes TTFT and ITL samples
to the model's latency window in Redis (`shared/latency_window.py`) once a second.

Steps run on the engine thread and `add`/`abort` on the event loop, so request state sits
behind one lock.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import redis.asyncio as aioredis
from prometheus_client import start_http_server
from redis.exceptions import RedisError

from shared import latency_window
from shared.latency_window import Sample
from shared.metrics import WorkerMetrics
from worker.sequence import Sequence, SequenceOutput, SequenceStatus

if TYPE_CHECKING:  # worker.engine imports the model runner, so torch
    from worker.config import EngineConfig
    from worker.engine import Engine

log = logging.getLogger("llmfleet.worker")

EXPORT_INTERVAL_S = 1.0
FINISHED_OK = ("stop", "length")


@dataclass(slots=True)
class _Timing:
    seq: Sequence
    started_s: float | None = None  # start of the first step that ran it
    last_token_s: float | None = None


@dataclass(slots=True)
class _PendingSamples:
    ttft: list[Sample] = field(default_factory=list)
    itl: list[Sample] = field(default_factory=list)


def max_num_seqs_of(config: EngineConfig) -> int:
    """Places in the batch of an engine built from `config`."""
    if config.batching == "one":
        return 1
    return config.max_num_seqs if config.batching == "continuous" else config.max_batch_size


def observe(engine: Engine, model: str, config: EngineConfig) -> ObservedEngine:
    return ObservedEngine(engine, model, max_num_seqs_of(config))


class ObservedEngine:
    """An `Engine` that reports what goes through it; everything else is delegated."""

    def __init__(self, engine: Engine, model: str, max_num_seqs: int, clock=time.time) -> None:
        self._engine = engine
        self.model = model
        self._max_num_seqs = max_num_seqs
        self._clock = clock
        self.metrics = WorkerMetrics()
        self.metrics.max_num_seqs.labels(model).set(max_num_seqs)
        self._lock = threading.Lock()
        self._timings: dict[str, _Timing] = {}
        self._samples = _PendingSamples()
        self._num_preemptions_seen: Counter[str] = Counter()

    def __getattr__(self, name: str):
        return getattr(self._engine, name)

    def add(self, seq: Sequence) -> SequenceOutput | None:
        refused = self._engine.add(seq)
        if refused is None:
            with self._lock:
                self._timings[seq.request_id] = _Timing(seq)
        else:
            self._count_end(str(seq.tier), refused)
        return refused

    def abort(self, request_ids: set[str]) -> list[SequenceOutput]:
        outputs = self._engine.abort(request_ids)
        self._observe_outputs(outputs, self._clock())
        return outputs

    def hand_back(self, request_ids: set[str]) -> None:
        """Drop requests given back to the queue for another worker: they did not end here,
        so they are not counted as ended (that worker counts them)."""
        self._engine.abort(request_ids)
        with self._lock:
            for request_id in request_ids:
                self._timings.pop(request_id, None)

    def step(self) -> list[SequenceOutput]:
        started_s = self._clock()
        started = time.perf_counter()
        outputs = self._engine.step()
        duration_s = time.perf_counter() - started
        stats = self._engine.stats()
        self._observe_step(outputs, started_s, duration_s, stats)
        return outputs

    def stats(self) -> dict[str, float | dict[str, int]]:
        """The engine's stats and the batch's size, as the heartbeat carries them."""
        return {**self._engine.stats(), "max_num_seqs": self._max_num_seqs}

    def take_samples(self) -> tuple[list[Sample], list[Sample]]:
        """TTFT and ITL samples since the last call."""
        with self._lock:
            samples, self._samples = self._samples, _PendingSamples()
        return samples.ttft, samples.itl

    def _observe_step(
        self, outputs: list[SequenceOutput], started_s: float, duration_s: float, stats: dict
    ) -> None:
        m, model = self.metrics, self.model
        m.engine_step_duration_s.labels(model).observe(duration_s)
        num_running = int(stats.get("num_running", 0))
        num_finished = sum(o.is_finished for o in outputs)
        # Capped: the static engine keeps finished rows in its batch until the batch ends.
        m.batch_size.labels(model).observe(min(num_running + num_finished, self._max_num_seqs))
        m.num_requests_running.labels(model).set(num_running)
        m.num_requests_waiting.labels(model).set(stats.get("num_waiting", 0))
        if "kv_cache_usage" in stats:
            m.kv_cache_usage.labels(model).set(stats["kv_cache_usage"])
        self._count_preemptions(stats.get("num_preemptions_by_tenant", {}))
        self._mark_started(started_s)
        self._observe_outputs(outputs, started_s + duration_s)

    def _mark_started(self, step_started_s: float) -> None:
        """Queue time of the sequences this step ran for the first time."""
        with self._lock:
            for timing in self._timings.values():
                if timing.started_s is None and timing.seq.status is not SequenceStatus.WAITING:
                    timing.started_s = step_started_s
                    tier = str(timing.seq.tier)
                    self.metrics.request_queue_time_s.labels(self.model, tier).observe(
                        max(0.0, step_started_s - timing.seq.arrival_s)
                    )

    def _observe_outputs(self, outputs: list[SequenceOutput], now_s: float) -> None:
        with self._lock:
            for output in outputs:
                timing = self._timings.get(output.request_id)
                if timing is None:
                    continue
                if output.num_new_tokens:
                    self._observe_token(timing, output, now_s)
                if output.is_finished:
                    del self._timings[output.request_id]
                    self._observe_end(timing, output, now_s)

    def _observe_token(self, timing: _Timing, output: SequenceOutput, now_s: float) -> None:
        m, model, tier = self.metrics, self.model, str(timing.seq.tier)
        m.generation_tokens.labels(model).inc(output.num_new_tokens)
        if timing.last_token_s is None:
            ttft_s = max(0.0, now_s - timing.seq.arrival_s)
            m.time_to_first_token_s.labels(model, tier).observe(ttft_s)
            m.prompt_tokens.labels(model).inc(output.num_prompt_tokens)
            self._samples.ttft.append(Sample(now_s, ttft_s))
        else:
            itl_s = now_s - timing.last_token_s
            m.inter_token_latency_s.labels(model, tier).observe(itl_s)
            self._samples.itl.append(Sample(now_s, itl_s))
        timing.last_token_s = now_s

    def _observe_end(self, timing: _Timing, output: SequenceOutput, now_s: float) -> None:
        seq = timing.seq
        if output.finish_reason in FINISHED_OK:
            e2e_s = max(0.0, now_s - seq.arrival_s)
            self.metrics.e2e_request_latency_s.labels(self.model, str(seq.tier)).observe(e2e_s)
        self._count_end(str(seq.tier), output)
        # One line per request, for log search; no prompt or output text.
        log.info(
            "request finished",
            extra={
                "request_id": seq.request_id,
                "tenant_id": seq.tenant_id,
                "model": self.model,
                "tier": seq.tier,
                "finish_reason": output.finish_reason,
                "num_prompt_tokens": output.num_prompt_tokens,
                "num_output_tokens": output.num_output_tokens,
                "num_preemptions": seq.num_preemptions,
                "e2e_s": round(now_s - seq.arrival_s, 4),
            },
        )

    def _count_end(self, tier: str, output: SequenceOutput) -> None:
        reason = output.finish_reason or "unknown"
        self.metrics.request_success.labels(self.model, tier, reason).inc()

    def _count_preemptions(self, by_tenant: dict[str, int]) -> None:
        for tenant, total in by_tenant.items():
            if total > self._num_preemptions_seen[tenant]:
                delta = total - self._num_preemptions_seen[tenant]
                self.metrics.num_preemptions.labels(self.model, tenant).inc(delta)
                self._num_preemptions_seen[tenant] = total


async def export(
    engine: ObservedEngine,
    redis: aioredis.Redis,
    metrics_port: int,
    metrics_host: str,
    interval_s: float = EXPORT_INTERVAL_S,
) -> None:
    """Serve `/metrics` on `metrics_port` (0: not at all) and push latency samples to Redis,
    until cancelled. A port already taken is logged, not fatal: serving comes first."""
    server = None
    if metrics_port:
        try:
            server, _thread = start_http_server(
                metrics_port, metrics_host, registry=engine.metrics.registry
            )
            log.info("worker metrics on http://%s:%d/metrics", metrics_host, metrics_port)
        except OSError as exc:
            log.warning("no worker metrics: cannot listen on port %d: %s", metrics_port, exc)
    try:
        while True:
            await asyncio.sleep(interval_s)
            await push_samples(engine, redis)
    finally:
        if server is not None:
            server.shutdown()
            server.server_close()


async def push_samples(engine: ObservedEngine, redis: aioredis.Redis) -> None:
    ttft, itl = engine.take_samples()
    try:
        await latency_window.push(redis, engine.model, "ttft", ttft)
        await latency_window.push(redis, engine.model, "itl", itl)
    except (RedisError, OSError) as exc:
        # The broker may be restarting; these samples are lost, the histograms keep them.
        log.warning("could not push latency samples: %s", exc)
