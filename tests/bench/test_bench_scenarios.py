"""Multi-tenant benchmark scenarios: workloads, service accounting and the fairness index."""

from __future__ import annotations

from collections import Counter

import pytest

from bench import scenarios
from bench.client import RequestResult


def test_jain_index():
    assert scenarios.jain_index([3.0, 3.0, 3.0]) == pytest.approx(1.0)
    assert scenarios.jain_index([1.0, 0.0, 0.0]) == pytest.approx(1 / 3)
    assert scenarios.jain_index([2.0, 1.0]) == pytest.approx(9 / 10)


def test_noisy_neighbour_floods_at_ten_times_the_steady_rate_with_the_same_steady_requests():
    plan = scenarios.build("noisy-neighbour", seed=3, duration_s=20, steady_rate_per_s=0.5)
    alone, flooded = plan.workloads["alone"], plan.workloads["flooded"]
    count = {t: sum(s.tenant == t for s in flooded) for t in "ABC"}
    assert count == {"A": 100, "B": 10, "C": 10}
    assert [s for s in flooded if s.tenant != "A"] == alone  # B and C: identical requests
    assert len({s.index for s in flooded}) == len(flooded)
    assert plan.until_tenants_done == {"B", "C"}
    assert [run.queueing for run in plan.runs] == ["fair", "fair", "fair", "fifo"]
    (limited,) = [run for run in plan.runs if run.tenants]
    assert [t.max_requests_in_flight for t in limited.tenants] == [16, None, None]


def test_weighted_backlogs_every_tenant_with_the_same_requests_count():
    plan = scenarios.build("weighted", seed=0, duration_s=0, steady_rate_per_s=0)
    workload = plan.workloads["backlogged"]
    weights = {t.name: t.weight for t in plan.tenants}
    assert weights == {"A": 4, "B": 2, "C": 1}
    for tenant in weights:
        assert sum(s.tenant == tenant for s in workload) == 80
    assert max(s.arrival_s for s in workload) <= 0.5


def _result(index: int, start_s: float, token_times_s: list[float], num_prompt: int):
    return RequestResult(
        index, True, None, start_s, list(token_times_s), token_times_s[-1], num_prompt,
        len(token_times_s),
    )  # fmt: skip


def test_weighted_service_counts_tokens_while_every_tenant_is_backlogged():
    # A (weight 2) gets 2 tokens per second, B (weight 1) 1 per second, for 30 s; each
    # tenant's last request starts at 30 s, so only [0, 30) counts.
    a = [_result(0, 0.0, [i / 2 for i in range(60)], 0), _result(1, 0.0, [30.0, 31.0], 0)]
    b = [_result(2, 0.0, [float(i) for i in range(30)], 0), _result(3, 0.0, [30.0], 0)]
    service = scenarios._weighted_service({"A": a, "B": b}, {"A": 2, "B": 1})
    assert service["backlogged_s"] == pytest.approx(30.0)
    assert service["tokens_served"] == {"A": 60.0, "B": 30.0}
    assert service["share_error"] == {"A": pytest.approx(0.0), "B": pytest.approx(0.0)}
    assert service["jain_per_window"] == [pytest.approx(1.0)] * 3


def test_weighted_service_sees_an_unfair_window():
    # B gets nothing in the second window.
    a = [_result(0, 0.0, [float(i) for i in range(20)], 0), _result(1, 0.0, [20.0], 0)]
    b = [_result(2, 0.0, [float(i) for i in range(10)], 0), _result(3, 0.0, [20.0], 0)]
    service = scenarios._weighted_service({"A": a, "B": b}, {"A": 1, "B": 1})
    first, second = service["jain_per_window"]
    assert first == pytest.approx(1.0)
    assert second == pytest.approx(0.5)
    assert service["share_error"]["B"] == pytest.approx(10 / 30 / 0.5 - 1)


def test_weighted_service_counts_what_the_broker_published_over_what_the_client_saw():
    # The client saw B's tokens in one late burst (a slow relay); the broker published them
    # evenly, one token event of 2 tokens every 2 s, as A's: service is counted from that.
    a = [_result(0, 0.0, [float(i) for i in range(20)], 0), _result(1, 0.0, [20.0], 0)]
    b = [_result(2, 0.0, [19.0 + i / 100 for i in range(20)], 0), _result(3, 0.0, [20.0], 0)]
    b[0].published = [(2.0 * i, 2) for i in range(10)]
    b[1].published = [(20.0, 1)]
    service = scenarios._weighted_service({"A": a, "B": b}, {"A": 1, "B": 1})
    assert service["tokens_served"] == {"A": 20.0, "B": 20.0}
    assert service["jain_per_window"] == [pytest.approx(1.0)] * 2


def test_noisy_neighbour_requests_are_numbered_apart_however_long_the_run():
    # A sends ten times B's count: past 1,000 steady requests its numbers once ran into B's,
    # and a run's results (keyed by number) mixed A's requests into B's.
    plan = scenarios.build("noisy-neighbour", seed=0, duration_s=300, steady_rate_per_s=8)
    flooded = plan.workloads["flooded"]
    assert len({spec.index for spec in flooded}) == len(flooded)
    counts = Counter(spec.tenant for spec in flooded)
    assert counts["A"] == 10 * counts["B"] == 10 * counts["C"] == 24_000
