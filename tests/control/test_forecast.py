"""The demand forecast: Holt's linear trend with a damped trend, on uneven samples."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from control.forecast import HoltForecast, HoltParams

UNDAMPED = HoltParams(alpha=0.3, beta=0.1, interval_s=5.0, damping_s=math.inf)


def _fed(params: HoltParams, series, until_s: float, every_s: float = 5.0) -> HoltForecast:
    forecast = HoltForecast(params)
    for k in range(int(until_s / every_s) + 1):
        forecast.update(k * every_s, series(k * every_s))
    return forecast


def test_the_first_sample_sets_the_level_without_a_trend():
    forecast = HoltForecast(UNDAMPED)
    forecast.update(100.0, 42.0)
    assert forecast.level == 42.0
    assert forecast.trend_per_s == 0.0
    assert forecast.forecast(180.0) == 42.0


def test_it_tracks_a_linear_ramp_and_extrapolates_it():
    forecast = _fed(UNDAMPED, lambda t: 100 + 2 * t, until_s=600)
    assert forecast.level == pytest.approx(100 + 2 * 600, rel=0.01)
    assert forecast.trend_per_s == pytest.approx(2.0, rel=0.05)
    assert forecast.forecast(180.0) == pytest.approx(100 + 2 * 780, rel=0.02)


def test_the_trend_has_the_sign_of_the_change():
    rising = _fed(UNDAMPED, lambda t: 1000 + 3 * t, until_s=120)
    falling = _fed(UNDAMPED, lambda t: 1000 - 3 * t, until_s=120)
    flat = _fed(UNDAMPED, lambda t: 1000.0, until_s=120)
    assert rising.trend_per_s > 1.0
    assert falling.trend_per_s < -1.0
    assert flat.trend_per_s == 0.0
    assert falling.forecast(60) < falling.level < rising.level < rising.forecast(60)


def test_a_damped_trend_reaches_at_most_its_time_constant_ahead():
    damped = _fed(HoltParams(damping_s=60.0), lambda t: 100 + 2 * t, until_s=600)
    reach_s = (damped.forecast(3600) - damped.level) / damped.trend_per_s
    assert reach_s == pytest.approx(60.0, rel=0.01)
    # Well within the time constant it is nearly the undamped line.
    assert damped.forecast(5) - damped.level == pytest.approx(5 * damped.trend_per_s, rel=0.05)


def test_the_smoothing_spans_the_same_time_whatever_the_tick():
    # A step from 100 to 200 at t = 60 s, sampled every 2 s or every 5 s: 30 s after the
    # step both levels have closed the same share of the gap.
    def step(t: float) -> float:
        return 100.0 if t < 60 else 200.0

    every_2 = _fed(HoltParams(damping_s=math.inf), step, until_s=90, every_s=2.0)
    every_5 = _fed(HoltParams(damping_s=math.inf), step, until_s=90, every_s=5.0)
    assert every_2.level == pytest.approx(every_5.level, rel=0.05)


def test_with_the_defaults_noise_is_not_amplified_over_a_cold_start():
    # 15% noise on every 5-s sample of a steady rate: the forecast a cold start (180 s)
    # ahead wanders about as much as one sample does (undamped with alpha 0.3 and beta 0.1,
    # twice as much: sd ~0.3).
    def deviations(params: HoltParams) -> list[float]:
        rng = random.Random(7)
        forecast = HoltForecast(params)
        found = []
        for k in range(720):  # an hour
            forecast.update(5.0 * k, 10_000 * (1 + rng.gauss(0, 0.15)))
            if k > 60:
                found.append(forecast.forecast(180) / 10_000 - 1)
        return found

    assert statistics.pstdev(deviations(HoltParams())) < 0.18
    assert statistics.pstdev(deviations(UNDAMPED)) > 0.22


def test_a_sample_no_later_than_the_last_changes_nothing():
    forecast = _fed(UNDAMPED, lambda t: 100 + t, until_s=50)
    before = (forecast.level, forecast.trend_per_s)
    forecast.update(50.0, 10_000.0)
    assert (forecast.level, forecast.trend_per_s) == before
