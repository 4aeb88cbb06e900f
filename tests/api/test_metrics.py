"""The API's metrics: the exposition of rejections and fleet gauges, and the scrape token."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.requests import Request

from api.errors import APIError
from api.metrics import _check_token
from shared.fleet import FleetSnapshot, ModelSnapshot, QueueState, RolloutView, WorkerState
from shared.latency_window import LatencySummary
from shared.metrics import ApiMetrics
from shared.scale_decisions import ScaleView


def test_api_exposition_has_rejections_and_fleet_gauges():
    metrics = ApiMetrics()
    metrics.count_rejection(429, "requests_in_flight_exceeded", "rate_limit_error")
    metrics.count_rejection(400, None, "invalid_request_error")
    metrics.count_rejection(500, None, "server_error")  # not a rejection
    worker = WorkerState(
        "w1", "m", "ready", heartbeat_age_s=0.5, num_running=2, max_num_seqs=8, version="2"
    )
    snap = ModelSnapshot(
        "m",
        [QueueState("ten_1", num_entries=5, num_pending=2, num_consumers=1)],
        [worker],
        LatencySummary(0, None, None),
        LatencySummary(0, None, None),
        version="2",
    )
    text = metrics.exposition(FleetSnapshot(0.0, {"m@2": snap}, {"ten_1": "acme"})).decode()
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
    version = (("model", "m"), ("version", "2"))  # the model version's series
    tenant = (*version[:1], ("tenant", "ten_1"), version[1])
    assert samples[("llmfleet_queue_depth", tenant)] == 5
    assert samples[("llmfleet_queue_pending", tenant)] == 2
    assert samples[("llmfleet_workers", (*version[:1], ("state", "ready"), version[1]))] == 1
    assert samples[("llmfleet_worker_heartbeat_age_seconds", version)] == 0.5
    assert snap.batch_occupancy == 0.25


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


def test_rollouts_are_exported_with_every_cause_counted_from_zero():
    rolled_back = RolloutView("m", "2", "rolled_back", 0.0)
    running = RolloutView("n", "7", "running", 25.0)
    fleet = FleetSnapshot(
        0.0, {}, rollouts=[rolled_back, running], num_rollbacks={("m", "ttft_p99"): 2}
    )
    text = ApiMetrics().exposition(fleet).decode()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    state = "llmfleet_rollout_state"
    assert samples[(state, (("model", "m"), ("state", "rolled_back"), ("version", "2")))] == 1
    assert samples[(state, (("model", "m"), ("state", "running"), ("version", "2")))] == 0
    assert samples[(state, (("model", "n"), ("state", "running"), ("version", "7")))] == 1
    assert samples[("llmfleet_rollout_canary_percent", (("model", "n"), ("version", "7")))] == 25
    rollbacks = "llmfleet_rollout_rollbacks_total"
    assert samples[(rollbacks, (("cause", "ttft_p99"), ("model", "m")))] == 2
    assert samples[(rollbacks, (("cause", "error_rate"), ("model", "m")))] == 0
    assert samples[(rollbacks, (("cause", "itl_p99"), ("model", "n")))] == 0


def test_the_autoscalers_decision_is_exported_per_model_version():
    none = LatencySummary(0, None, None)
    view = ScaleView("predictive+warm", 3, 1, 900.0, 2.5, 750.0, 400.0, 12, 0.0)
    decided = ModelSnapshot("m", [], [], none, none, version="2", scale=view)
    undecided = ModelSnapshot("n", [], [], none, none, version="1")  # no autoscaler for it
    fleet = FleetSnapshot(0.0, {"m@2": decided, "n@1": undecided})
    text = ApiMetrics().exposition(fleet).decode()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    version = (("model", "m"), ("version", "2"))
    desired = "llmfleet_autoscale_desired_workers"
    assert samples[(desired, (version[0], ("role", "ready"), version[1]))] == 3
    assert samples[(desired, (version[0], ("role", "standby"), version[1]))] == 1
    assert samples[("llmfleet_autoscale_forecast_tokens_per_second", version)] == 900.0
    assert samples[("llmfleet_autoscale_arrival_tokens_per_second", version)] == 750.0
    assert samples[("llmfleet_autoscale_worker_capacity_tokens_per_second", version)] == 400.0
    assert not any(labels[0] == ("model", "n") for _, labels in samples if labels)
