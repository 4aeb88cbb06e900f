"""The pure parts of `llmfleet bench --platform-load`: its figures from hand-made records and
samples (bench/load_metrics.py), Redis's answers read (bench/process_sampler.py), and how
the load is shared by the client processes (bench/platform_load.py)."""

from __future__ import annotations

import pytest

from bench import load_metrics
from bench.load_plan import LoadPlan
from bench.platform_load import _spread, format_report
from bench.process_sampler import Sample, redis_calls, redis_clients_from
from bench.sse_load import LoadConfig, StreamRecord


def record(sent_s, accepted_s, token_times_s, end_s, *, tokens=3, error=None) -> StreamRecord:
    return StreamRecord(sent_s, accepted_s, end_s, token_times_s, tokens, error)


def sample(at_s: float, **fields) -> Sample:
    values = {
        "api_rss_bytes": 0, "api_cpu_s": 0.0, "api_fds": 0, "num_client_connections": 0,
        "num_redis_connections": 0, "redis_clients_by_name": {}, "worker_cpu_s": 0.0,
        "redis_cpu_s": 0.0, "redis_calls": {},
    } | fields  # fmt: skip
    return Sample(at_s=at_s, **values)


def test_max_concurrent_counts_an_end_before_a_start_at_the_same_time():
    assert load_metrics.max_concurrent([(0, 2), (1, 3), (2, 4)]) == 2
    assert load_metrics.max_concurrent([(0, 5), (1, 2), (1.5, 3)]) == 3
    assert load_metrics.max_concurrent([]) == 0


def test_the_hold_is_from_the_last_admission_to_the_first_end():
    records = [record(0, 1, [], 10), record(0, 3, [], 12), record(0, 0, [], 0, error="x")]
    assert load_metrics.hold_window(records) == (3, 10)
    assert load_metrics.open_intervals(records) == [(1, 10), (3, 12)]
    assert load_metrics.hold_window([record(0, 1, [], 2), record(0, 3, [], 4)]) is None


def test_errors_are_failed_streams_and_wrong_usage():
    records = [
        record(0, 1, [2], 3, tokens=3),
        record(0, 1, [2], 3, tokens=2),
        record(0, 0, [], 1, error="HTTP 429: busy"),
        record(0, 0, [], 1, error="HTTP 429: busy"),
    ]
    assert load_metrics.stream_errors(records, 3) == {
        "usage: 2 completion tokens": 1,
        "HTTP 429: busy": 2,
    }


def test_added_itl_is_each_gap_less_the_period_over_good_streams():
    records = [
        record(0, 0.1, [1.0, 1.5, 2.1], 2.2),
        record(0, 0.1, [1.0, 1.7], 1.8),
        record(0, 0.1, [1.0, 9.0], 9.1, error="closed before [DONE]"),
    ]
    added = load_metrics.added_itl_s(records, 0.5)
    assert added == pytest.approx([0.0, 0.1, 0.2])
    assert load_metrics.added_itl_s(records, 0.5, within=(1.6, 2.0)) == pytest.approx([0.2])
    assert load_metrics.num_tokens_between(records, 1.0, 1.7) == 2  # in (1.0, 1.7]: 1.5, 1.7


def test_held_figures_are_per_stream_over_the_baseline():
    baseline = sample(0, api_rss_bytes=1000, api_fds=40, num_client_connections=0,
                      num_redis_connections=10)  # fmt: skip
    held = sample(5, api_rss_bytes=1000 + 4 * 50_000, api_fds=48, num_client_connections=5,
                  num_redis_connections=14, redis_clients_by_name={"llmfleet-api-stream": 4})  # fmt: skip
    figures = load_metrics.held_figures(baseline, held, 4)
    assert figures["memory_per_stream_bytes"] == 50_000
    assert figures["fds_per_stream"] == 2
    assert figures["redis_connections_per_stream"] == 1
    assert figures["api_redis_clients_held_by_name"] == {"llmfleet-api-stream": 4}
    assert load_metrics.held_figures(baseline, baseline, 0)["memory_per_stream_bytes"] is None


def test_streams_are_held_when_admitted_not_when_merely_connected():
    records = [
        record(0, 1, [], 10),
        record(0, 2, [], 10),
        record(0, 0, [], 3, error="HTTP 429: x"),  # never admitted
        record(0, 6, [], 10),
    ]
    # At 5 s the API may hold more sockets (a connection waiting for its admission) than
    # streams; the held sample is the one with the most streams open by the records.
    samples = [sample(0.5), sample(5, num_client_connections=3), sample(7), sample(11)]
    assert [load_metrics.num_open_at(records, s.at_s) for s in samples] == [0, 2, 3, 0]
    assert load_metrics.sample_when_held(samples, records) == (samples[2], 3)


def test_costs_are_cpu_and_redis_commands_per_unit():
    first = sample(1.0, api_cpu_s=1.0, worker_cpu_s=2.0, redis_cpu_s=0.5,
                   redis_calls={"evalsha": 10, "publish": 10, "ping": 3})  # fmt: skip
    last = sample(3.0, api_cpu_s=1.2, worker_cpu_s=2.1, redis_cpu_s=0.54,
                  redis_calls={"evalsha": 110, "publish": 110, "ping": 3, "get": 50})  # fmt: skip
    costs = load_metrics.costs(first, last, 100, "token")
    assert costs["num_tokens"] == 100 and costs["seconds"] == 2.0
    assert costs["api_cpu_per_token_us"] == pytest.approx(2000)
    assert costs["worker_cpu_per_token_us"] == pytest.approx(1000)
    assert costs["redis_cpu_per_token_us"] == pytest.approx(400)
    assert costs["redis_calls_per_token_by_command"] == {"evalsha": 1, "get": 0.5, "publish": 1}
    assert costs["redis_calls_per_token"] == 2.5
    assert load_metrics.costs(first, last, 0, "token") == {}


def test_admission_is_admitted_requests_over_the_time_to_the_last_admission():
    records = [
        record(10.0, 10.1, [10.2], 10.3, tokens=1),
        record(10.0, 10.4, [10.5], 10.6, tokens=1),
        record(10.2, 10.5, [10.6], 10.9, tokens=1),
        record(10.3, 0, [], 10.4, tokens=-1, error="HTTP 503: x"),
    ]
    figures = load_metrics.admission_figures(records, 1)
    assert figures["num_admitted"] == 3 and figures["num_errors"] == 1
    assert figures["admitted_per_s"] == pytest.approx(3 / 0.5)
    assert figures["completed_per_s"] == pytest.approx(3 / 0.9)
    assert figures["admission_latency_ms"]["max"] == pytest.approx(400)
    assert figures["errors"] == {"HTTP 503: x": 1}


def test_redis_clients_are_those_from_the_api_sockets_by_name():
    clients = [
        {"addr": "127.0.0.1:5001", "name": "llmfleet-api-stream"},
        {"addr": "127.0.0.1:5002", "name": "llmfleet-api-stream"},
        {"addr": "127.0.0.1:5003", "name": ""},
        {"addr": "127.0.0.1:6001", "name": "llmfleet-api-stream"},  # another process's
    ]
    by_name = redis_clients_from(clients, {5001, 5002, 5003})
    assert by_name == {"llmfleet-api-stream": 2, "": 1}


def test_redis_calls_are_read_from_commandstats():
    stats = {
        "cmdstat_evalsha": {"calls": 7, "usec": 70, "usec_per_call": 10.0},
        "cmdstat_publish": {"calls": 3, "usec": 3, "usec_per_call": 1.0},
        "errorstat_ERR": {"count": 1},
    }
    assert redis_calls(stats) == {"evalsha": 7, "publish": 3}


def test_the_load_is_shared_by_the_clients_at_the_pace_of_the_whole():
    base = LoadConfig("h", 1, "k", "m", [1], 5, num_requests=10, start_at_s=0.0)
    configs = _spread(base, 3, 100.0)
    assert [c.num_requests for c in configs] == [4, 3, 3]
    assert [c.ramp_per_s for c in configs] == pytest.approx([100 / 3] * 3)
    # Staggered by one request's interval: together they start one every 10 ms.
    assert [c.start_at_s for c in configs] == pytest.approx([0.0, 0.01, 0.02])
    burst = _spread(base, 4, None)
    assert [c.start_at_s for c in burst] == [0.0] * 4 and burst[0].ramp_per_s is None
    assert len(_spread(base, 20, 100.0)) == 10  # never a client without a request


def test_each_stream_lasts_through_the_ramp_and_the_hold():
    plan = LoadPlan(num_streams=5000, tokens_per_s=2.0, ramp_per_s=250.0, hold_s=20.0)
    assert plan.max_tokens == 80  # 20 s of ramp, 20 s of hold, 2 tokens a second
    assert plan.stream_s == 40.0
    assert plan.stream_idle_check_s == 1.0  # the default: above the 500 ms period
    assert LoadPlan(tokens_per_s=0.5).stream_idle_check_s == 4.0


def test_the_report_reads_without_the_figures_a_short_run_lacks():
    streams = {
        "max_concurrent_streams": 5, "api_streams_held": 5, "num_errors": 0, "num_streams": 5,
        "tokens_delivered": 50, "api_rss_baseline_bytes": 2**20, "api_rss_held_bytes": 2**21,
        "memory_per_stream_bytes": None, "api_redis_connections_baseline": 3,
        "api_redis_connections_held": 8, "redis_connections_per_stream": 1.0, "api_fds_baseline": 9,
        "api_fds_held": 19, "fds_per_stream": 2.0, "step_period_ms": 500.0,
        "added_itl_ms": {"p50": 0.1, "p99": 2.0}, "worker_itl_ms": {"p50": 500.0, "p99": 501.0},
        "hold": {}, "client_cpu_s": 0.1,
    }  # fmt: skip
    admission = {"admitted_per_s": 10.0, "num_errors": 0, "num_requests": 10, "client_cpu_s": 0.1}
    report = {"streams": streams, "admission": admission,
              "open_files": {"soft": 1024, "redis_maxclients": "10000"}}  # fmt: skip
    text = format_report(report)
    assert "5 concurrent" in text and "n/a bytes per stream" in text
    assert "1.00 per stream" in text and "soft limit 1024" in text


def test_delivery_and_added_itl_are_measured_from_each_tokens_emission():
    # The worker emitted r1's second token 0.3 s late (its own lateness): the gap the
    # client saw grew with it, but the platform added only 0.05 s to that ITL.
    ok = record(0, 0.1, [1.01, 1.56, 2.12], 2.2)
    ok.request_id = "r1"
    short = record(0, 0.1, [1.0, 1.5], 1.6)  # a chunk fewer than its emissions: left out
    short.request_id = "r2"
    failed = record(0, 0.1, [1.0, 1.5], 1.6, error="closed before [DONE]")
    failed.request_id = "r3"
    emissions = load_metrics.read_emissions(
        ["r1 1.0", "r1 1.5", "r1 2.1", "r2 1.0", "r2 1.5", "r2 2.0", "r3 0.9", "r3 1.4", ""]
    )
    assert emissions["r1"] == [1.0, 1.5, 2.1]
    delivery, added = load_metrics.delivery_s([ok, short, failed], emissions)
    assert delivery == pytest.approx([0.01, 0.06, 0.02])
    assert added == pytest.approx([0.05, -0.04])
    delivery, added = load_metrics.delivery_s([ok], emissions, within=(1.5, 2.0))
    assert delivery == pytest.approx([0.06]) and added == pytest.approx([0.05])
