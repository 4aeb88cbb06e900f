"""Metrics over HTTP: the API's and a worker's `/metrics`, scraped from their processes."""

from __future__ import annotations

import time
import uuid

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cli.redis_server import free_port
from shared import deployments, keys
from tests.helpers import auth, stream


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
    assert depths[tenant_id].labels == {
        "model": tiny_deployment.model_id,
        "version": "1",
        "tenant": tenant_id,
    }
    assert depths[tenant_id].value == 0  # acknowledged entries are deleted
    workers = families["llmfleet_workers"]
    ready = {"model": tiny_deployment.model_id, "version": "1", "state": "ready"}
    assert any(s.labels == ready for s in workers)


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
        if rdb.llen(keys.latency_samples(f"{model}@1", "itl")) >= 3 * 4:
            break
        time.sleep(0.2)
    assert rdb.llen(keys.latency_samples(f"{model}@1", "ttft")) == 3
    assert rdb.llen(keys.latency_samples(f"{model}@1", "itl")) == 3 * 4
    assert rdb.llen(keys.latency_samples(f"{model}@1", "failed")) == 3
    heartbeats = [rdb.hgetall(k) for k in rdb.scan_iter(keys.worker_heartbeat_pattern())]
    assert any(
        h.get(b"model") == model.encode() and h.get(b"max_num_seqs") == b"6" for h in heartbeats
    )
