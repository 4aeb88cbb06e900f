"""A worker's capacity and a request's cost, from heartbeats (`control/capacity.py`)."""

from __future__ import annotations

import pytest

from control.capacity import CapacityEstimate, ServedRates, TokensPerRequest, WorkerTotals


def test_rates_are_the_difference_of_successive_heartbeats():
    rates = ServedRates()
    assert rates.update("w", WorkerTotals(100.0, 1000, 10, 0.5)) is None
    assert rates.update("w", WorkerTotals(100.0, 1000, 10, 0.5)) is None  # read again
    rate = rates.update("w", WorkerTotals(102.0, 1600, 13, 0.9))
    assert rate is not None
    assert (rate.tokens_per_s, rate.num_tokens, rate.num_finished) == (300.0, 600, 3)
    assert rate.occupancy == 0.9
    assert rates.update("w", WorkerTotals(104.0, 50, 1, 0.1)) is None  # restarted: reset


def test_capacity_is_the_best_busy_rate_and_fades():
    estimate = CapacityEstimate(default_tokens_per_s=500.0, half_life_s=100.0)
    rates = ServedRates()
    rates.update("w", WorkerTotals(0.0, 0, 0, 0.2))
    idle = rates.update("w", WorkerTotals(2.0, 200, 1, 0.2))
    assert idle is not None
    estimate.observe(idle, 2.0)
    assert estimate.tokens_per_s(2.0) == 500.0  # a worker with little to do says nothing
    busy = rates.update("w", WorkerTotals(4.0, 2600, 9, 0.9))
    assert busy is not None
    estimate.observe(busy, 4.0)
    assert estimate.tokens_per_s(4.0) == 1200.0
    assert estimate.tokens_per_s(104.0) == pytest.approx(600.0)  # one half-life later
    configured = CapacityEstimate(500.0, configured_tokens_per_s=2000.0)
    configured.observe(busy, 4.0)
    assert configured.tokens_per_s(4.0) == 2000.0


def test_tokens_per_request_moves_toward_what_requests_cost():
    cost = TokensPerRequest(default_tokens=300.0, weight=0.5)
    assert cost.tokens == 300.0
    cost.observe(0, 0)
    assert cost.tokens == 300.0
    cost.observe(1000, 10)
    assert cost.tokens == 100.0
    cost.observe(3000, 10)
    assert cost.tokens == 200.0
