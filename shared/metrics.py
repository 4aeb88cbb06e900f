"""Every Prometheus metric of llmfleet: name, help, labels and buckets, defined here once.

Names follow vLLM's where they mean the same thing (`vllm:time_to_first_token_seconds` is
`llmfleet_time_to_first_token_seconds` here), so a reader who knows vLLM's dashboards knows
ours. Latency histograms are labelled by model and tier only; per-tenant series (queue
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
  snapshot `/dashboard` and `llmfleet status` show (`shared/fleet.py`). Every API replica
  reports the same Redis-wide values, so queries take `max` over instances, not `sum`.

No registry is global: each owner builds its own, so several apps or engines in one process
(tests) never collide.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from shared.fleet import FleetSnapshot

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

MODEL_TIER = ("model", "tier")


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
            ("model", "tier", "finished_reason"), registry=r,
        )  # fmt: skip
        self.num_requests_running = Gauge(
            "llmfleet_num_requests_running", "Sequences in the batch.", ("model",), registry=r
        )
        self.num_requests_waiting = Gauge(
            "llmfleet_num_requests_waiting",
            "Sequences pulled by the worker, waiting for a place in the batch.",
            ("model",), registry=r,
        )  # fmt: skip
        self.kv_cache_usage = Gauge(
            "llmfleet_kv_cache_usage_perc",
            "Fraction (0-1, as vLLM's) of the KV-cache blocks in use.",
            ("model",), registry=r,
        )  # fmt: skip
        self.pool_sync_s = Histogram(
            "llmfleet_pool_sync_seconds",
            "Round trip of a step's sync of the pool's fair-queuing counters with Redis "
            "(it runs while the step computes).",
            ("model",), buckets=ITL_BUCKETS_S, registry=r,
        )  # fmt: skip
        self.max_num_seqs = Gauge(
            "llmfleet_max_num_seqs",
            "Places in the batch (--max-num-seqs; --max-batch-size for static batching).",
            ("model",), registry=r,
        )  # fmt: skip
        self.batch_size = Histogram(
            "llmfleet_batch_size",
            "Sequences holding a place in the batch during one engine step.",
            ("model",), buckets=BATCH_SIZE_BUCKETS, registry=r,
        )  # fmt: skip
        self.engine_step_duration_s = Histogram(
            "llmfleet_engine_step_duration_seconds",
            "Wall time of one engine step (schedule, forward pass, sampling).",
            ("model",), buckets=ITL_BUCKETS_S, registry=r,
        )  # fmt: skip
        self.prompt_tokens = Counter(
            "llmfleet_prompt_tokens",
            "Prompt tokens prefilled, counted when the request's first token is sampled.",
            ("model",), registry=r,
        )  # fmt: skip
        self.generation_tokens = Counter(
            "llmfleet_generation_tokens", "Tokens generated.", ("model",), registry=r
        )
        self.num_preemptions = Counter(
            "llmfleet_num_preemptions",
            "Running sequences preempted for KV-cache blocks (recomputed later), by tenant.",
            ("model", "tenant"), registry=r,
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
    entries, live workers by state and the oldest heartbeat's age."""

    def __init__(self, fleet: FleetSnapshot) -> None:
        self._fleet = fleet

    def collect(self) -> Iterator[GaugeMetricFamily]:
        tenant_labels = ["model", "tenant"]
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
            "Workers with a live heartbeat, by state.",
            labels=["model", "state"],
        )
        age = GaugeMetricFamily(
            "llmfleet_worker_heartbeat_age_seconds",
            "Age of the oldest live heartbeat of the model's workers.",
            labels=["model"],
        )
        for model, snap in sorted(self._fleet.models.items()):
            for queue in snap.queues:
                labels = [model, queue.tenant_id]
                depth.add_metric(labels, queue.num_entries)
                pending.add_metric(labels, queue.num_pending)
            for state, count in sorted(snap.num_workers_by_state().items()):
                workers.add_metric([model, state], count)
            if snap.workers:
                age.add_metric([model], max(w.heartbeat_age_s for w in snap.workers))
        yield from (depth, pending, workers, age)
