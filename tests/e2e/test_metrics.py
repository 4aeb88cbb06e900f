"""Metrics: the worker's telemetry over a real engine, the latency window, the API's and the
worker's `/metrics` over HTTP."""

from __future__ import annotations

import time
import uuid

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.requests import Request

from api.errors import APIError
from api.metrics import _check_token
from cli.redis_server import free_port
from shared import deployments, keys, latency_window
from shared.fleet import FleetSnapshot, ModelSnapshot, QueueState, WorkerState
from shared.latency_window import LatencySummary, Sample
from shared.metrics import ApiMetrics
from tests.factories import CharDecoder, make_request, make_sequence_for
from tests.helpers import auth, stream
from worker.engine import ContinuousBatchingEngine
from worker.fair_queue import FairQueue
from worker.kv_cache import KVCacheManager
from worker.preemption import TenantAwarePreemption
from worker.runner.model_runner import ModelRunner
from worker.scheduler import Scheduler, SchedulerConfig
from worker.telemetry import Telemetry, timed_step

MODEL = "tiny-observed"


def _value(registry, name: str, **labels) -> float:
    return registry.get_sample_value(name, labels) or 0.0


def _small_engine(loaded, num_blocks: int) -> ContinuousBatchingEngine:
    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32),
        KVCacheManager(num_blocks, 4),
        FairQueue(quantum_tokens=8),
        TenantAwarePreemption(),
    )
    return ContinuousBatchingEngine(scheduler, ModelRunner(loaded, num_blocks, 4))


def _add(engine, telemetry: Telemetry, request) -> bool:
    """Give the engine a request and tell telemetry, as the worker loop does."""
    seq = make_sequence_for(request, CharDecoder())
    seq.arrival_s = time.time()
    refused = engine.add(seq)
    telemetry.added(seq, refused)
    return refused is None


def _run(engine, telemetry: Telemetry) -> None:
    while engine.has_work():
        telemetry.stepped(timed_step(engine))


def test_telemetry_measures_every_request_and_step(tiny_loaded):
    # Few blocks: four requests of 10 + 8 tokens (5 blocks each) cannot all fit: preemptions.
    engine = _small_engine(tiny_loaded, num_blocks=12)
    telemetry = Telemetry(MODEL, engine.stats().max_num_seqs)
    for i in range(4):
        request = make_request(i, list(range(3, 13)), 8, tenant_id=f"t{i % 2}", tier=1 + i % 2)
        assert _add(engine, telemetry, request)
    _run(engine, telemetry)
    r = telemetry.metrics.registry
    stats = engine.stats()
    assert stats.max_num_seqs == 4
    assert stats.num_preemptions > 0
    for tier in ("1", "2"):
        labels = {"model": MODEL, "tier": tier}
        assert _value(r, "llmfleet_time_to_first_token_seconds_count", **labels) == 2
        assert _value(r, "llmfleet_request_queue_time_seconds_count", **labels) == 2
        assert _value(r, "llmfleet_e2e_request_latency_seconds_count", **labels) == 2
        # 8 tokens each: a first token and 7 gaps
        assert _value(r, "llmfleet_inter_token_latency_seconds_count", **labels) == 2 * 7
        success = {**labels, "finished_reason": "length"}
        assert _value(r, "llmfleet_request_success_total", **success) == 2
    assert _value(r, "llmfleet_generation_tokens_total", model=MODEL) == 4 * 8
    assert _value(r, "llmfleet_prompt_tokens_total", model=MODEL) == 4 * 10
    preempted = sum(
        _value(r, "llmfleet_num_preemptions_total", model=MODEL, tenant=t) for t in ("t0", "t1")
    )
    assert preempted == stats.num_preemptions
    num_steps = _value(r, "llmfleet_engine_step_duration_seconds_count", model=MODEL)
    assert num_steps == _value(r, "llmfleet_batch_size_count", model=MODEL) > 0
    assert 1 <= _value(r, "llmfleet_batch_size_sum", model=MODEL) / num_steps <= 4
    assert _value(r, "llmfleet_num_requests_running", model=MODEL) == 0
    assert _value(r, "llmfleet_kv_cache_usage_perc", model=MODEL) == 0
    assert _value(r, "llmfleet_max_num_seqs", model=MODEL) == 4
    ttft, itl = telemetry.take_samples()
    assert len(ttft) == 4 and len(itl) == 4 * 7
    assert telemetry.take_samples() == ([], [])


def test_aborted_expired_and_refused_requests_are_counted_by_reason(tiny_loaded):
    engine = _small_engine(tiny_loaded, num_blocks=4)
    telemetry = Telemetry(MODEL, 4)
    assert not _add(engine, telemetry, make_request(0, list(range(3, 20)), 8))  # never fits
    assert _add(engine, telemetry, make_request(1, [3, 4, 5], 4))
    expiring = make_request(2, [3, 4, 5], 4).model_copy(update={"queue_deadline_ts": 1.0})
    assert _add(engine, telemetry, expiring)
    ended = engine.abort({"r1"}) + engine.expire(time.time())
    telemetry.ended(ended)
    assert [o.finish_reason for o in ended] == ["cancelled", "error"]
    r = telemetry.metrics.registry
    labels = {"model": MODEL, "tier": "1", "finished_reason": "error"}
    assert _value(r, "llmfleet_request_success_total", **labels) == 2  # refused, expired
    cancelled = {**labels, "finished_reason": "cancelled"}
    assert _value(r, "llmfleet_request_success_total", **cancelled) == 1
    assert _value(r, "llmfleet_time_to_first_token_seconds_count", model=MODEL, tier="1") == 0


def test_handed_back_requests_are_not_counted_as_ended(tiny_loaded):
    engine = _small_engine(tiny_loaded, num_blocks=4)
    telemetry = Telemetry(MODEL, 4)
    for i in range(2):
        assert _add(engine, telemetry, make_request(i, [3, 4, 5], 4))
    engine.abort({"r0"})
    telemetry.handed_back({"r0"})
    assert engine.unstarted_request_ids() == ["r1"]
    _run(engine, telemetry)
    r = telemetry.metrics.registry
    labels = {"model": MODEL, "tier": "1"}
    assert _value(r, "llmfleet_request_success_total", **labels, finished_reason="length") == 1
    assert _value(r, "llmfleet_request_success_total", **labels, finished_reason="cancelled") == 0
    assert _value(r, "llmfleet_time_to_first_token_seconds_count", **labels) == 1


def test_latency_summary_matches_numpy_percentiles():
    values = list(np.random.default_rng(0).exponential(0.05, size=501))
    summary = LatencySummary.of(values)
    assert summary.num_samples == 501
    assert summary.p50_s == pytest.approx(np.percentile(values, 50))
    assert summary.p99_s == pytest.approx(np.percentile(values, 99))
    assert LatencySummary.of([]) == LatencySummary(0, None, None)
    assert LatencySummary.of([0.2]) == LatencySummary(1, 0.2, 0.2)


async def test_latency_window_keeps_recent_samples_capped(redis_server):
    from shared.redis_conn import async_client

    redis = async_client(redis_server.url)
    model = f"window-{uuid.uuid4().hex[:6]}"
    now = time.time()
    try:
        await latency_window.push(redis, model, "ttft", [Sample(now - 600, 9.0)])
        await latency_window.push(redis, model, "ttft", [Sample(now, 0.1), Sample(now, 0.3)])
        summary = await latency_window.summarize(redis, model, "ttft", window_s=60)
        assert summary.num_samples == 2 and summary.p50_s == pytest.approx(0.2)
        many = [Sample(now, 0.001 * i) for i in range(3 * latency_window.MAX_NUM_SAMPLES)]
        await latency_window.push(redis, model, "itl", many)
        key = keys.latency_samples(model, "itl")
        assert await redis.llen(key) == latency_window.MAX_NUM_SAMPLES_PER_PUSH
        assert 0 < await redis.ttl(key) <= latency_window.EXPIRY_S
    finally:
        await redis.delete(*(keys.latency_samples(model, k) for k in latency_window.KINDS))
        await redis.aclose()


def test_api_exposition_has_rejections_and_fleet_gauges():
    metrics = ApiMetrics()
    metrics.count_rejection(429, "requests_in_flight_exceeded", "rate_limit_error")
    metrics.count_rejection(400, None, "invalid_request_error")
    metrics.count_rejection(500, None, "server_error")  # not a rejection
    worker = WorkerState("w1", "m", "ready", heartbeat_age_s=0.5, num_running=2, max_num_seqs=8)
    snap = ModelSnapshot(
        "m",
        [QueueState("ten_1", num_entries=5, num_pending=2, num_consumers=1)],
        [worker],
        LatencySummary(0, None, None),
        LatencySummary(0, None, None),
    )
    text = metrics.exposition(FleetSnapshot(0.0, {"m": snap}, {"ten_1": "acme"})).decode()
    assert "acme" not in text  # tenants by id only, never by name
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    rejections = "llmfleet_request_rejections_total"
    assert samples[(rejections, (("reason", "requests_in_flight_exceeded"),))] == 1
    assert samples[(rejections, (("reason", "invalid_request_error"),))] == 1
    assert (rejections, (("reason", "server_error"),)) not in samples
    tenant = (("model", "m"), ("tenant", "ten_1"))
    assert samples[("llmfleet_queue_depth", tenant)] == 5
    assert samples[("llmfleet_queue_pending", tenant)] == 2
    assert samples[("llmfleet_workers", (("model", "m"), ("state", "ready")))] == 1
    assert samples[("llmfleet_worker_heartbeat_age_seconds", (("model", "m"),))] == 0.5
    assert snap.batch_occupancy == 0.25


def _scrape(url: str, token: str | None = None) -> dict[str, list]:
    response = httpx.get(url, headers=auth(token) if token else None, timeout=10)
    assert response.status_code == 200, response.text
    return {f.name: f.samples for f in text_string_to_metric_families(response.text)}


def test_api_metrics_endpoint_counts_rejections_and_queues(
    api_url, tiny_worker, tiny_deployment, make_tenant, settings
):
    tenant_id, key = make_tenant("metrics")
    missing = httpx.post(
        f"{api_url}/v1/completions",
        json={"model": "no-such-model", "prompt": "hi"},
        headers=auth(key),
    )
    assert missing.status_code == 404
    body = {"model": tiny_deployment.model_id, "prompt": "Hello", "max_tokens": 4}
    assert stream(api_url, "/v1/completions", key, body).has_done
    families = _scrape(f"{api_url}/metrics", settings.metrics_secret)
    rejections = {s.labels["reason"]: s.value for s in families["llmfleet_request_rejections"]}
    assert rejections["model_not_found"] >= 1
    depths = {
        s.labels["tenant"]: s for s in families["llmfleet_queue_depth"] if s.name.endswith("depth")
    }
    assert set(depths[tenant_id].labels) == {"model", "tenant"}
    assert depths[tenant_id].value == 0  # acknowledged entries are deleted
    workers = families["llmfleet_workers"]
    assert any(s.labels == {"model": tiny_deployment.model_id, "state": "ready"} for s in workers)


@pytest.fixture(scope="module")
def observed_worker(db, tiny_model_dir, start_worker):
    """A worker of its own model (so no other test's requests reach it) serving /metrics."""
    deployment = deployments.register(
        db, f"tiny-metrics-{uuid.uuid4().hex[:6]}", str(tiny_model_dir)
    )
    port = free_port()
    start_worker(deployment.model_id, "--metrics-port", str(port), "--max-num-seqs", "6")
    return deployment.model_id, f"http://127.0.0.1:{port}/metrics"


def test_worker_serves_metrics_and_pushes_latency_samples(
    api_url, observed_worker, make_tenant, rdb
):
    model, metrics_url = observed_worker
    _, key = make_tenant("worker-metrics")
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": 5, "ignore_eos": True}
    for _ in range(3):
        assert stream(api_url, "/v1/completions", key, body).has_done
    families = _scrape(metrics_url)
    ttft = {s.name: s.value for s in families["llmfleet_time_to_first_token_seconds"]}
    assert ttft["llmfleet_time_to_first_token_seconds_count"] == 3
    gen = families["llmfleet_generation_tokens"]
    assert [s.value for s in gen if s.name.endswith("_total")] == [15]
    assert [s.value for s in families["llmfleet_max_num_seqs"]] == [6]
    # the heartbeat carries the batch size; the samples reach Redis within a second or two
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if rdb.llen(keys.latency_samples(model, "itl")) >= 3 * 4:
            break
        time.sleep(0.2)
    assert rdb.llen(keys.latency_samples(model, "ttft")) == 3
    assert rdb.llen(keys.latency_samples(model, "itl")) == 3 * 4
    heartbeats = [rdb.hgetall(k) for k in rdb.scan_iter(keys.worker_heartbeat_pattern())]
    assert any(
        h.get(b"model") == model.encode() and h.get(b"max_num_seqs") == b"6" for h in heartbeats
    )


def _request_with(authorization: str | None) -> Request:
    headers = [] if authorization is None else [(b"authorization", authorization.encode())]
    return Request({"type": "http", "method": "GET", "path": "/metrics", "headers": headers})


def test_metrics_token_is_checked():
    token = "metrics-token-0123456789"
    _check_token(_request_with(f"Bearer {token}"), token)
    for presented in [None, f"Bearer {token}x", token, "Bearer "]:
        with pytest.raises(APIError) as refused:
            _check_token(_request_with(presented), token)
        assert refused.value.status_code == 401
