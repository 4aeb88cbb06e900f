"""The sweeps of the autoscaling parameters (bench/autoscale_sweep.py): the score, the
variants tried, a pool sweep's rows, and runs in worker processes as in one."""

from __future__ import annotations

import math
import random

import pytest

from bench import autoscale_sweep as sweep
from bench.autoscale_sim import SimConfig
from bench.autoscale_traces import Shape, piecewise, requests_of
from control.scale_policy import PolicyParams

SHORT_SPIKE = Shape(300.0, piecewise([(0, 3), (120, 3), (150, 15), (240, 15), (260, 3)]))


def _result(slo: float, worker_hours: float) -> dict:
    return {"slo_attainment": slo, "worker_hours": worker_hours}


def test_the_score_is_the_geometric_mean_of_goodput_per_worker_hour_against_the_oracle():
    oracle = _result(1.0, 2.0)
    assert sweep.goodput_ratio(_result(0.9, 3.0), oracle) == pytest.approx(0.9 / 1.5)
    results = {
        "a": {"oracle": oracle, "predictive": _result(1.0, 4.0), "predictive+warm": oracle},
        "b": {"oracle": oracle, "predictive": oracle, "predictive+warm": _result(0.5, 2.0)},
    }
    assert sweep.score(results) == pytest.approx(math.sqrt(math.sqrt(0.5 * 0.5)))


def test_each_parameter_is_tried_alone_at_each_of_its_other_values():
    base = PolicyParams()
    tried = dict(sweep.variants(base, {"hysteresis": (0.1, 0.2), "standby_quiet_s": (60.0,)}))
    assert list(tried) == ["base", "hysteresis=0.1", "standby_quiet_s=60"]
    assert tried["hysteresis=0.1"] == PolicyParams(hysteresis=0.1)
    assert tried["standby_quiet_s=60"].hysteresis == base.hysteresis


def test_a_pool_sweep_runs_each_size_once_and_the_baselines_the_same_in_processes():
    requests = requests_of(SHORT_SPIKE, random.Random(3))
    config = SimConfig(cold_start_s=60.0)
    params = PolicyParams(cold_start_s=60.0)
    alone = sweep.pool_sweep(requests, [0, 2], params, config)
    forked = sweep.pool_sweep(requests, [0, 2], params, config, num_procs=2)
    assert alone == forked
    results = alone["results"]
    assert results["warm pool 0"] == results["predictive"]  # a pool of none: predictive
    assert results["warm pool 2"]["worker_hours"] > results["warm pool 0"]["worker_hours"]
    assert results["oracle"]["worker_hours_vs_oracle"] == 1.0
    assert "timeline" not in results["oracle"]
