"""Worker telemetry: what passes through the engine, as Prometheus metrics and latency samples.

The worker loop tells `Telemetry` what happens at the engine's seams: a sequence added (its
arrival time and tier) or refused, each step (`timed_step`: its wall time, its outputs, the
stats after it), and the outputs of cancels and deadlines. From those it derives, per
request: queue time (arrival to the first step that ran it), TTFT (arrival to its first
token), inter-token latency and end-to-end latency; per step: the batch size, KV usage,
running and waiting sequences, preemptions. Arrival is the API's admission time
(`QueuedRequest.arrival_ts`), so TTFT includes the Redis queue, as a client sees it; across
machines it assumes synced clocks. Every call comes from the event loop, between steps.
One `Telemetry` lives as long as its worker, over every engine the worker builds (a standby
worker drops its engine and builds another when active again: `worker/service.py`).

`export` serves the metrics on the worker's `--metrics-port` and pushes TTFT and ITL samples,
and one sample per ended request saying whether it failed, to the version's window in Redis
(`shared/latency_window.py`) once a second: `llmfleet status` and the rollout loop's health
check (`control/rollouts.py`) read them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import redis.asyncio as aioredis
from prometheus_client import start_http_server
from redis.exceptions import RedisError

from shared import latency_window
from shared.keys import deployment_name
from shared.latency_window import Sample
from shared.metrics import WorkerMetrics
from shared.protocol import CLIENT_ERROR_CODES, FinishReason
from worker.engine import Engine, EngineStats
from worker.sequence import Sequence, SequenceOutput, SequenceStatus

log = logging.getLogger("llmfleet.worker")

EXPORT_INTERVAL_S = 1.0
FINISHED_OK = (FinishReason.STOP, FinishReason.LENGTH)


@dataclass(slots=True)
class _Timing:
    seq: Sequence
    started_s: float | None = None  # start of the first step that ran it
    last_token_s: float | None = None


@dataclass(slots=True)
class Samples:
    """Samples taken since the last push, by kind of window (`latency_window.KINDS`)."""

    ttft: list[Sample] = field(default_factory=list)
    itl: list[Sample] = field(default_factory=list)
    failed: list[Sample] = field(default_factory=list)  # 1.0: the request failed, 0.0: not


def is_failure(output: SequenceOutput) -> bool:
    """Whether an ended request counts against its version's health: an error of the
    server's making, or a deadline passed while it ran; not a client's invalid input, nor
    a cancel."""
    if output.finish_reason is FinishReason.DEADLINE:
        return True
    if output.finish_reason is not FinishReason.ERROR:
        return False
    return output.error is None or output.error.code not in CLIENT_ERROR_CODES


@dataclass(frozen=True, slots=True)
class StepReport:
    """One engine step as the engine thread saw it (`timed_step`)."""

    outputs: list[SequenceOutput]
    started_s: float  # wall clock, comparable with arrival times
    duration_s: float
    stats: EngineStats


def timed_step(
    engine: Engine, clock: Callable[[], float] = time.time, *, with_kv_waste: bool = True
) -> StepReport:
    """Run one step and time it, on the thread that runs the engine."""
    started_s, started = clock(), time.perf_counter()
    outputs = engine.step()
    duration_s = time.perf_counter() - started  # the step's, not the stats' after it
    return StepReport(outputs, started_s, duration_s, engine.stats(with_kv_waste=with_kv_waste))


class Telemetry:
    """Metrics and latency samples of one worker's engine, fed by the worker loop."""

    def __init__(
        self,
        model: str,
        max_num_seqs: int,
        clock: Callable[[], float] = time.time,
        *,
        version: str = "1",
    ):
        self.model = model
        self.version = version
        self.deployment_name = deployment_name(model, version)
        self.labels = (model, version)  # every series of a worker's
        self._max_num_seqs = max_num_seqs
        self._clock = clock
        self.metrics = WorkerMetrics()
        self.metrics.max_num_seqs.labels(*self.labels).set(max_num_seqs)
        self._timings: dict[str, _Timing] = {}
        self._unstarted: dict[str, _Timing] = {}  # of those, the ones no step has run yet
        self._samples = Samples()
        self._num_preemptions_seen: Counter[str] = Counter()
        self._prefix_seen = (0, 0)  # the engine's prefix-cache counters last counted
        # Since the worker started, over all its engines (standby drops one): tokens served,
        # a request's prompt once, at its first token, and every token generated (the sum of
        # `llmfleet_prompt_tokens` and `llmfleet_generation_tokens`), and requests ended here
        # (handed back ones are not). The heartbeat carries both; the autoscaler takes
        # served tokens per second, and per request, from two heartbeats.
        self.num_served_tokens = 0
        self.num_finished_requests = 0

    def added(self, seq: Sequence, refused: SequenceOutput | None) -> None:
        """`seq` was given to the engine, which took it, or refused it at once."""
        if refused is None:
            self._timings[seq.request_id] = self._unstarted[seq.request_id] = _Timing(seq)
        else:
            self._count_end(str(seq.tier), refused, self._clock())

    def ended(self, outputs: list[SequenceOutput]) -> None:
        """Outputs from outside a step: cancels and expired deadlines."""
        self._observe_outputs(outputs, self._clock())

    def adopted(self, seq: Sequence) -> None:
        """A decode worker took `seq` over from the prefill worker that sampled its first
        token (`worker/handoff.py`): its TTFT and prompt were counted there; its next
        inter-token latency here runs from now, and its end is counted here."""
        timing = self._timings[seq.request_id] = _Timing(seq)
        timing.started_s = timing.last_token_s = self._clock()

    def handed_back(self, request_ids: set[str]) -> None:
        """Requests given back to the queue for another worker: they did not end here, so
        they are not counted as ended (that worker counts them)."""
        for request_id in request_ids:
            self._timings.pop(request_id, None)
            self._unstarted.pop(request_id, None)

    def stepped(self, report: StepReport) -> None:
        m, labels, stats = self.metrics, self.labels, report.stats
        m.engine_step_duration_s.labels(*labels).observe(report.duration_s)
        num_finished = sum(o.is_finished for o in report.outputs)
        # Capped: the static engine keeps finished rows in its batch until the batch ends.
        batch_size = min(stats.num_running + num_finished, self._max_num_seqs)
        m.batch_size.labels(*labels).observe(batch_size)
        m.num_requests_running.labels(*labels).set(stats.num_running)
        m.num_requests_waiting.labels(*labels).set(stats.num_waiting)
        if stats.kv_cache_usage is not None:
            m.kv_cache_usage.labels(*labels).set(stats.kv_cache_usage)
        self._count_preemptions(stats.num_preemptions_by_tenant)
        self._count_prefix_cache(stats)
        self._mark_started(report.started_s)
        self._observe_outputs(report.outputs, report.started_s + report.duration_s)

    def activated(self, activation_s: float) -> None:
        """A standby worker serves again, `activation_s` after it read its role `active`."""
        self.metrics.activation_s.labels(*self.labels).observe(activation_s)

    def take_samples(self) -> Samples:
        """The samples since the last call."""
        samples, self._samples = self._samples, Samples()
        return samples

    def _mark_started(self, step_started_s: float) -> None:
        """Queue time of the sequences this step ran for the first time."""
        started = [
            request_id
            for request_id, timing in self._unstarted.items()
            if timing.seq.status is not SequenceStatus.WAITING
        ]
        for request_id in started:
            timing = self._unstarted.pop(request_id)
            if timing.started_s is None:
                timing.started_s = step_started_s
                tier = str(timing.seq.tier)
                self.metrics.request_queue_time_s.labels(*self.labels, tier).observe(
                    max(0.0, step_started_s - timing.seq.arrival_s)
                )

    def _observe_outputs(self, outputs: list[SequenceOutput], now_s: float) -> None:
        for output in outputs:
            timing = self._timings.get(output.request_id)
            if timing is None:
                continue
            if output.num_new_tokens:
                self._observe_token(timing, output, now_s)
            if output.is_finished:
                del self._timings[output.request_id]
                self._unstarted.pop(output.request_id, None)
                self._observe_end(timing, output, now_s)

    def _observe_token(self, timing: _Timing, output: SequenceOutput, now_s: float) -> None:
        m, labels, tier = self.metrics, self.labels, str(timing.seq.tier)
        m.generation_tokens.labels(*labels).inc(output.num_new_tokens)
        self.num_served_tokens += output.num_new_tokens
        if timing.last_token_s is None:
            ttft_s = max(0.0, now_s - timing.seq.arrival_s)
            m.time_to_first_token_s.labels(*labels, tier).observe(ttft_s)
            m.prompt_tokens.labels(*labels).inc(output.num_prompt_tokens)
            self.num_served_tokens += output.num_prompt_tokens
            self._samples.ttft.append(Sample(now_s, ttft_s))
        else:
            itl_s = now_s - timing.last_token_s
            m.inter_token_latency_s.labels(*labels, tier).observe(itl_s)
            self._samples.itl.append(Sample(now_s, itl_s))
        timing.last_token_s = now_s

    def _observe_end(self, timing: _Timing, output: SequenceOutput, now_s: float) -> None:
        seq = timing.seq
        if output.finish_reason in FINISHED_OK:
            e2e_s = max(0.0, now_s - seq.arrival_s)
            self.metrics.e2e_request_latency_s.labels(*self.labels, str(seq.tier)).observe(e2e_s)
        self._count_end(str(seq.tier), output, now_s)
        # One line per request, for log search; no prompt or output text.
        log.info(
            "request finished",
            extra={
                "request_id": seq.request_id,
                "tenant_id": seq.tenant_id,
                "model": self.model,
                "version": self.version,
                "deployment": self.deployment_name,
                "tier": seq.tier,
                "finish_reason": output.finish_reason,
                "num_prompt_tokens": output.num_prompt_tokens,
                "num_output_tokens": output.num_output_tokens,
                "num_preemptions": seq.num_preemptions,
                "e2e_s": round(now_s - seq.arrival_s, 4),
            },
        )

    def _count_end(self, tier: str, output: SequenceOutput, now_s: float) -> None:
        reason = output.finish_reason or "unknown"
        self.metrics.request_success.labels(*self.labels, tier, reason).inc()
        self.num_finished_requests += 1
        self._samples.failed.append(Sample(now_s, 1.0 if is_failure(output) else 0.0))

    def _count_prefix_cache(self, stats: EngineStats) -> None:
        queried, hits = stats.prefix_cache_queried_tokens, stats.prefix_cache_hit_tokens
        m, labels = self.metrics, self.labels
        m.prefix_cache_queries.labels(*labels).inc(queried - self._prefix_seen[0])
        m.prefix_cache_hits.labels(*labels).inc(hits - self._prefix_seen[1])
        self._prefix_seen = (queried, hits)

    def _count_preemptions(self, by_tenant: dict[str, int]) -> None:
        for tenant, total in by_tenant.items():
            if total > self._num_preemptions_seen[tenant]:
                delta = total - self._num_preemptions_seen[tenant]
                self.metrics.num_preemptions.labels(*self.labels, tenant).inc(delta)
                self._num_preemptions_seen[tenant] = total


async def export(
    telemetry: Telemetry,
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
                metrics_port, metrics_host, registry=telemetry.metrics.registry
            )
            log.info("worker metrics on http://%s:%d/metrics", metrics_host, metrics_port)
        except OSError as exc:
            log.warning("no worker metrics: cannot listen on port %d: %s", metrics_port, exc)
    try:
        while True:
            await asyncio.sleep(interval_s)
            await push_samples(telemetry, redis)
    finally:
        if server is not None:
            server.shutdown()
            server.server_close()


async def push_samples(telemetry: Telemetry, redis: aioredis.Redis) -> None:
    samples, name = telemetry.take_samples(), telemetry.deployment_name
    try:
        await latency_window.push(redis, name, "ttft", samples.ttft)
        await latency_window.push(redis, name, "itl", samples.itl)
        await latency_window.push(redis, name, "failed", samples.failed)
    except (RedisError, OSError) as exc:
        # The broker may be restarting; these samples are lost, the histograms keep them.
        log.warning("could not push latency samples: %s", exc)
