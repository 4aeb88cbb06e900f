"""The autoscaling simulator (bench/autoscale_sim.py, its report bench/autoscale_report.py):
on a short 5x spike a warm pool that covers it meets the SLO where reactive scaling does
not; the oracle costs no more than the peak; scaling never loses nor double-serves a
request; new and standby workers take their start."""

from __future__ import annotations

import random

import pytest

from bench.autoscale_report import compare
from bench.autoscale_sim import SimConfig, simulate, worker_tokens_per_s
from bench.autoscale_traces import Shape, TraceRequest, piecewise, requests_of
from control.scale_policy import POLICY_NAMES, PolicyParams, ScaleDecision, ScaleSignals

# 6 requests a second (one worker at the default step model), 5x within 60 s at 4 min, held
# 3 min, back: 10 minutes, ~9,000 requests of the Azure conversation mix.
SHORT_SPIKE = Shape(600.0, piecewise([(0, 6), (240, 6), (300, 30), (480, 30), (540, 6)]))
ALL = [*POLICY_NAMES, "oracle", "fixed-peak"]


@pytest.fixture(scope="module")
def spike() -> dict[str, dict]:
    # The warm pool is sized to the spike (the 4 more workers it needs at a full batch, less
    # the one the 80% target leaves spare); the default pool of 1 is not (docs/benchmarks.md).
    requests = requests_of(SHORT_SPIKE, random.Random(1))
    report, _ = compare(requests, ALL, PolicyParams(warm_pool=3), SimConfig())
    return report["results"]


def test_on_a_5x_spike_a_warm_pool_that_covers_it_meets_the_slo_where_reactive_does_not(spike):
    assert spike["predictive+warm"]["slo_attainment"] >= 0.99
    assert spike["reactive"]["slo_attainment"] < 0.9
    assert spike["reactive"]["slo_attainment_in_surges"] < 0.9
    # Without the pool the forecast alone is too late: the new workers take a cold start.
    assert spike["predictive"]["slo_attainment"] < 0.9


def test_the_oracle_meets_the_slo_and_costs_no_more_than_the_fixed_peak(spike):
    assert spike["oracle"]["slo_attainment"] >= 0.99
    assert spike["oracle"]["worker_hours"] <= spike["fixed-peak"]["worker_hours"]
    assert spike["fixed-peak"]["worker_hours_vs_oracle"] > 1.1
    assert spike["predictive+warm"]["worker_hours_by_state"]["standby"] > 0


def test_every_request_is_served_exactly_once_under_every_policy(spike):
    for name, result in spike.items():
        assert result["is_each_request_served_once"], name
        assert result["num_requests"] > 8000


class Flapping:
    """Wants a random fleet every tick: parks, wakes, starts and stops workers at random."""

    name = "flapping"

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)

    def decide(self, signals: ScaleSignals) -> ScaleDecision:
        return ScaleDecision(self._rng.randint(0, 4), self._rng.randint(0, 3))


def test_scaling_at_random_never_loses_nor_double_serves_a_request():
    requests = requests_of(Shape(300.0, lambda t: 10.0), random.Random(2))
    config = SimConfig(cold_start_s=20.0, tick_s=2.0)
    run = simulate(requests, Flapping(3), config, worker_tokens_per_s(requests, config))
    assert run.num_started == [1] * len(requests)
    assert run.num_finished == [1] * len(requests)
    assert all(ttft >= 0 for ttft in run.ttft_s)


class Scripted:
    """(ready, standby) wanted from each time on."""

    name = "scripted"

    def __init__(self, *steps: tuple[float, int, int]) -> None:
        self._steps = steps

    def decide(self, signals: ScaleSignals) -> ScaleDecision:
        _, ready, standby = [s for s in self._steps if s[0] <= signals.now_s][-1]
        return ScaleDecision(ready, standby)


def _one_request_at(at_s: float) -> list[TraceRequest]:
    return [TraceRequest(at_s, 1000, 10)]


def test_a_new_worker_takes_the_cold_start_and_a_standby_one_the_activation():
    config = SimConfig()
    prefill_s = config.step.of(1000)
    cold = simulate(_one_request_at(1.0), Scripted((0, 0, 0), (10, 1, 0)), config, 1000.0)
    assert cold.ttft_s[0] == pytest.approx(10 + 180 - 1 + prefill_s)
    warm = simulate(_one_request_at(1.0), Scripted((0, 0, 1), (10, 1, 0)), config, 1000.0)
    assert warm.ttft_s[0] == pytest.approx(10 + 2 - 1 + prefill_s)
    assert warm.worker_seconds["standby"] == pytest.approx(10)


def test_a_parked_worker_finishes_what_it_runs_and_is_taken_back_at_once():
    # A long request starts at 1 s; the worker is parked at 5 s, with the request running,
    # and wanted serving again at 10 s: it still holds its KV pool, so a request waiting
    # since 6 s starts at 10 s, not after an activation.
    requests = [TraceRequest(1.0, 100, 500), TraceRequest(6.0, 100, 10)]
    config = SimConfig()
    run = simulate(requests, Scripted((0, 1, 0), (5, 0, 1), (10, 1, 0)), config, 1000.0)
    assert run.ttft_s[1] == pytest.approx(10 - 6 + config.step.of(100))
    assert run.num_finished == [1, 1]
    assert run.worker_seconds["parking"] == pytest.approx(5)
