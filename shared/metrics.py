"""Every Prometheus metric of llmfleet: name, help, labels and buckets, defined here once.

Names follow vLLM's where they mean the same thing (`vllm:time_to_first_token_seconds` is
`llmfleet_time_to_first_token_seconds` here), so a reader who knows vLLM's dashboards knows
ours. Latency histograms are labelled by model, version and tier only; per-tenant series (queue
depth, pending entries, preemptions) exist because tenants are a bounded set an operator
administers (the SQL `Tenant` table), not an open one. They carry the tenant's id only, never
its name: a scrape tells nobody who the customers are (`llmfleet tenant list` maps ids to
names for an operator).

Three groups, by the process that owns them:

- `WorkerMetrics`: observed by each worker process (`worker/telemetry.py`) and served on its
  own `--metrics-port`.
- `ApiMetrics`: counted by the API's processes; with several uvicorn workers they are summed
  by prometheus_client's multiprocess mode (`PROMETHEUS_MULTIPROC_DIR`, set by `llmfleet api`).
- `FleetCollector`: read from Redis when the API is scraped (queues, live workers): the same
  snapshot `/dashboard` and `llmfleet status` show (`shared/fleet.py`), and the rollouts from
  SQL (their rollbacks are a counter kept by SQL, so it survives every restart). Every API
  replica reports the same values, so queries take `max` over instances, not `sum`.

No registry is global: each owner builds its own, so several apps or engines in one process
(tests) never collide.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from shared.canary_health import Cause
from shared.fleet import FleetSnapshot
from shared.rollouts import RolloutState

MULTIPROC_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"

# Buckets as vLLM's, plus finer ones at the low end for GPU decode steps.
TTFT_BUCKETS_S = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS_S = (
    0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_BUCKETS_S = (
    0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
ACTIVATION_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0, 60.0)

# A worker serves one version of a model: its series carry both.
MODEL = ("model", "version")
MODEL_TIER = ("model", "version", "tier")


class WorkerMetrics:
    """What a worker observes of its engine: latencies per request, the batch per step."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.time_to_first_token_s = Histogram(
            "llmfleet_time_to_first_token_seconds",
            "Time to first token: from admission by the API (arrival) to the first token "
            "sampled, so queueing and prefill included.",
            MODEL_TIER, buckets=TTFT_BUCKETS_S, registry=r,
        )  # fmt: skip
        self.inter_token_latency_s = Histogram(
            "llmfleet_inter_token_latency_seconds",
            "Time between two consecutive tokens of one request.",
            MODEL_TIER, buckets=ITL_BUCKETS_S, registry=r,
        )  # fmt: skip
        self.e2e_request_latency_s = Histogram(
            "llmfleet_e2e_request_latency_seconds",
            "From arrival to the last token, for requests that finished (stop or length).",
            MODEL_TIER, buckets=REQUEST_BUCKETS_S, registry=r,
        )  # fmt: skip
        self.request_queue_time_s = Histogram(
            "llmfleet_request_queue_time_seconds",
            "From arrival to the first step that scheduled the request (Redis stream and the "
            "worker's waiting queue together).",
            MODEL_TIER, buckets=REQUEST_BUCKETS_S, registry=r,
        )  # fmt: skip
        self.request_success = Counter(
            "llmfleet_request_success",
            "Requests that ended, by finish reason (stop, length, cancelled, error).",
            ("model", "version", "tier", "finished_reason"), registry=r,
        )  # fmt: skip
        self.num_requests_running = Gauge(
            "llmfleet_num_requests_running", "Sequences in the batch.", MODEL, registry=r
        )
        self.num_requests_waiting = Gauge(
            "llmfleet_num_requests_waiting",
            "Sequences pulled by the worker, waiting for a place in the batch.",
            MODEL, registry=r,
        )  # fmt: skip
        self.kv_cache_usage = Gauge(
            "llmfleet_kv_cache_usage_perc",
            "Fraction (0-1, as vLLM's) of the KV-cache blocks in use.",
            MODEL, registry=r,
        )  # fmt: skip
        self.pool_sync_s = Histogram(
            "llmfleet_pool_sync_seconds",
            "Round trip of a step's sync of the pool's fair-queuing counters with Redis "
            "(it runs while the step computes).",
            MODEL, buckets=ITL_BUCKETS_S, registry=r,
        )  # fmt: skip
        self.max_num_seqs = Gauge(
            "llmfleet_max_num_seqs",
            "Places in the batch (--max-num-seqs; --max-batch-size for static batching).",
            MODEL, registry=r,
        )  # fmt: skip
        self.batch_size = Histogram(
            "llmfleet_batch_size",
            "Sequences holding a place in the batch during one engine step.",
            MODEL, buckets=BATCH_SIZE_BUCKETS, registry=r,
        )  # fmt: skip
        self.engine_step_duration_s = Histogram(
            "llmfleet_engine_step_duration_seconds",
            "Wall time of one engine step (schedule, forward pass, sampling).",
            MODEL, buckets=ITL_BUCKETS_S, registry=r,
        )  # fmt: skip
        self.prompt_tokens = Counter(
            "llmfleet_prompt_tokens",
            "Prompt tokens prefilled, counted when the request's first token is sampled.",
            MODEL, registry=r,
        )  # fmt: skip
        self.generation_tokens = Counter(
            "llmfleet_generation_tokens", "Tokens generated.", MODEL, registry=r
        )
        self.num_preemptions = Counter(
            "llmfleet_num_preemptions",
            "Running sequences preempted for KV-cache blocks (recomputed later), by tenant.",
            ("model", "version", "tenant"), registry=r,
        )  # fmt: skip
        self.prefix_cache_queries = Counter(
            "llmfleet_prefix_cache_queries",
            "Tokens of admitted sequences looked up in the prefix cache (as vLLM's).",
            MODEL, registry=r,
        )  # fmt: skip
        self.prefix_cache_hits = Counter(
            "llmfleet_prefix_cache_hits",
            "Of them, tokens found cached (a tenant's own earlier blocks) and not computed.",
            MODEL, registry=r,
        )  # fmt: skip
        self.activation_s = Histogram(
            "llmfleet_worker_activation_seconds",
            "A standby worker's activation: from reading its role `active` to serving (the "
            "engine built, its KV pool allocated, the serving machinery started).",
            MODEL, buckets=ACTIVATION_BUCKETS_S, registry=r,
        )  # fmt: skip

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class ApiMetrics:
    """What an API process counts. In multiprocess mode the values live in files under
    `PROMETHEUS_MULTIPROC_DIR`, one per process, and `exposition` sums them."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.request_rejections = Counter(
            "llmfleet_request_rejections",
            "Requests refused with a 4xx before they were queued, by error code "
            "(e.g. requests_in_flight_exceeded, context_length_exceeded, model_not_found).",
            ("reason",),
            registry=self.registry,
        )

    def count_rejection(self, status_code: int, code: str | None, kind: str) -> None:
        if 400 <= status_code < 500:
            self.request_rejections.labels(reason=code or kind).inc()

    def exposition(self, fleet: FleetSnapshot | None = None) -> bytes:
        registry = self.registry
        if multiproc_dir := os.environ.get(MULTIPROC_DIR_ENV):
            registry = CollectorRegistry(auto_describe=True)
            MultiProcessCollector(registry, multiproc_dir)
        text = generate_latest(registry)
        if fleet is not None:
            fleet_registry = CollectorRegistry(auto_describe=True)
            fleet_registry.register(FleetCollector(fleet))
            text += generate_latest(fleet_registry)
        return text


class FleetCollector(Collector):
    """Queues and workers as Redis holds them at scrape time: per-tenant queue depth (stream
    length: waiting plus pending, since entries are deleted on acknowledgement), pending
    entries, live workers by state and the oldest heartbeat's age; each model's latest
    rollout and its rollbacks."""

    def __init__(self, fleet: FleetSnapshot) -> None:
        self._fleet = fleet

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        tenant_labels = ["model", "version", "tenant"]
        depth = GaugeMetricFamily(
            "llmfleet_queue_depth",
            "Entries on the tenant's stream: waiting for a worker plus taken, not acknowledged.",
            labels=tenant_labels,
        )
        pending = GaugeMetricFamily(
            "llmfleet_queue_pending",
            "Entries taken by a worker and not acknowledged yet (XPENDING).",
            labels=tenant_labels,
        )
        workers = GaugeMetricFamily(
            "llmfleet_workers",
            "Workers with a live heartbeat, by state: loading, standby (weights loaded, no KV "
            "pool, pulling nothing), ready, draining.",
            labels=["model", "version", "state"],
        )
        age = GaugeMetricFamily(
            "llmfleet_worker_heartbeat_age_seconds",
            "Age of the oldest live heartbeat of the model version's workers.",
            labels=["model", "version"],
        )
        by_pool = GaugeMetricFamily(
            "llmfleet_pool_workers",
            "Workers with a live heartbeat serving the model version, by pool (dedicated, "
            "or shared: assigned by the control process).",
            labels=["model", "version", "pool"],
        )
        for _name, snap in sorted(self._fleet.models.items()):
            version = [snap.model, snap.version]
            for queue in snap.queues:
                labels = [*version, queue.tenant_id]
                depth.add_metric(labels, queue.num_entries)
                pending.add_metric(labels, queue.num_pending)
            for state, count in sorted(snap.num_workers_by_state().items()):
                workers.add_metric([*version, state], count)
            if snap.workers:
                age.add_metric(version, max(w.heartbeat_age_s for w in snap.workers))
            for pool, count in sorted(snap.num_workers_by_pool().items()):
                by_pool.add_metric([*version, pool], count)
        yield from (depth, pending, workers, age, by_pool)
        yield from self._autoscale()
        yield from self._rollouts()

    def _autoscale(self) -> Iterator[GaugeMetricFamily]:
        """The autoscaler's latest decision per model version (none while no autoscaler
        runs): the workers it wants, by role, and the rates it decided from."""
        labels = ["model", "version"]
        wanted = GaugeMetricFamily(
            "llmfleet_autoscale_desired_workers",
            "Workers the autoscaler wants, by role: ready (serving) or standby (loaded, parked).",
            labels=[*labels, "role"],
        )
        arrivals = GaugeMetricFamily(
            "llmfleet_autoscale_arrival_tokens_per_second",
            "The arrival rate the autoscaler measured, in tokens a second (prompt plus output).",
            labels=labels,
        )
        forecast = GaugeMetricFamily(
            "llmfleet_autoscale_forecast_tokens_per_second",
            "The predictive policy's forecast of the arrival rate one cold start ahead.",
            labels=labels,
        )
        capacity = GaugeMetricFamily(
            "llmfleet_autoscale_worker_capacity_tokens_per_second",
            "A worker's capacity as the autoscaler plans with it (measured or configured).",
            labels=labels,
        )
        for _name, snap in sorted(self._fleet.models.items()):
            if snap.scale is None:
                continue
            version = [snap.model, snap.version]
            wanted.add_metric([*version, "ready"], snap.scale.num_ready)
            wanted.add_metric([*version, "standby"], snap.scale.num_standby)
            arrivals.add_metric(version, snap.scale.arrival_tokens_per_s)
            if snap.scale.forecast_tokens_per_s is not None:
                forecast.add_metric(version, snap.scale.forecast_tokens_per_s)
            capacity.add_metric(version, snap.scale.worker_tokens_per_s)
        yield from (wanted, arrivals, forecast, capacity)

    def _rollouts(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        """Each model's latest rollout, and its rollbacks by cause (every cause from 0 once
        the model has had a rollout, so that the first rollback is an increase)."""
        state = GaugeMetricFamily(
            "llmfleet_rollout_state",
            "Each model's latest rollout (version: its canary): 1 for its state, 0 for the others.",
            labels=["model", "version", "state"],
        )
        percent = GaugeMetricFamily(
            "llmfleet_rollout_canary_percent",
            "The share of the model's requests its latest rollout's canary gets, in percent.",
            labels=["model", "version"],
        )
        rollbacks = CounterMetricFamily(
            "llmfleet_rollout_rollbacks",
            "Rollouts the control loop rolled back, by cause (ttft_p99, itl_p99, error_rate).",
            labels=["model", "cause"],
        )
        for view in self._fleet.rollouts:
            for name in RolloutState:
                state.add_metric([view.model, view.canary_version, name], view.state == name)
            percent.add_metric([view.model, view.canary_version], view.percent)
            for cause in Cause:
                num = self._fleet.num_rollbacks.get((view.model, cause), 0)
                rollbacks.add_metric([view.model, cause], num)
        yield from (state, percent, rollbacks)
