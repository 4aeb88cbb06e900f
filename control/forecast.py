"""The demand forecast of the predictive autoscaler: Holt's linear trend (double exponential
smoothing) with a damped trend, on samples that may come at uneven intervals. Plain,
synchronous code without I/O.

The method (Holt 1957, reprinted in the International Journal of Forecasting 20(1), 2004;
the damped trend of Gardner and McKenzie, Management Science 31(10), 1985; as taught in
Hyndman and Athanasopoulos, *Forecasting: Principles and Practice*, 3rd ed., section 8.2)
keeps a level `L` and a trend `T` (units per second). Each sample `y`, `dt` seconds after
the previous one:

    L' = a y + (1 - a) (L + T d(dt))
    T' = b (L' - L) / dt + (1 - b) T exp(-dt / tau)

and the forecast `h` seconds ahead is `L + T d(h)`, where `d(h) = tau (1 - exp(-h / tau))`
is the damped trend's reach: about `h` for a horizon well under `tau`, never more than
`tau` (undamped Holt is `tau` = infinity, `d(h) = h`): a trend is extrapolated over most
of a cold start, but a runaway one not much further. `a` and `b` are the smoothing constants for samples `interval_s` apart; a sample `dt`
after the last uses `1 - (1 - a) ** (dt / interval_s)`, so the smoothing spans the same time
whatever the tick. The first sample sets the level, with no trend.

The smoothing constants were chosen on synthetic series: with 15% noise on each 5-s sample
of a steady rate, the forecast 180 s ahead wanders by less than one sample's noise (sd ~11%;
undamped with a = 0.3, b = 0.1 it wanders by ~30%) (tests/control/test_forecast.py). The
damping, 180 s (a trend reaches 114 s of a 180-s cold start), was tuned with the policies'
other parameters on every simulated trace together (docs/benchmarks.md, "Autoscaling"):
a reach of 600 s extrapolated the rise of a spike further, and cost more on every trace.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class HoltParams:
    alpha: float = 0.2  # level smoothing per `interval_s` (a time constant of ~22 s at 5 s)
    beta: float = 0.05  # trend smoothing per `interval_s` (~97 s at 5 s)
    interval_s: float = 5.0  # the sample spacing `alpha` and `beta` are given for
    damping_s: float = 180.0  # tau: the trend's reach (114 s of a 180-s horizon); inf: none


class HoltForecast:
    """Level and damped trend of one series, fed its samples in time order."""

    def __init__(self, params: HoltParams) -> None:
        self._params = params
        self._level: float | None = None
        self._trend_per_s = 0.0
        self._at_s = 0.0

    @property
    def level(self) -> float:
        return 0.0 if self._level is None else self._level

    @property
    def trend_per_s(self) -> float:
        return self._trend_per_s

    def update(self, now_s: float, value: float) -> None:
        if self._level is None:
            self._level, self._at_s = value, now_s
            return
        dt = now_s - self._at_s
        if dt <= 0:
            return  # a sample no later than the last carries no time to learn a trend from
        alpha, beta = self._smoothing(dt)
        level = alpha * value + (1 - alpha) * (self._level + self._trend_per_s * self._reach(dt))
        decayed = self._trend_per_s * math.exp(-dt / self._params.damping_s)
        self._trend_per_s = beta * (level - self._level) / dt + (1 - beta) * decayed
        self._level, self._at_s = level, now_s

    def forecast(self, horizon_s: float) -> float:
        """The series `horizon_s` after the last sample."""
        return self.level + self._trend_per_s * self._reach(horizon_s)

    def _reach(self, horizon_s: float) -> float:
        tau = self._params.damping_s
        return horizon_s if math.isinf(tau) else tau * -math.expm1(-horizon_s / tau)

    def _smoothing(self, dt: float) -> tuple[float, float]:
        steps = dt / self._params.interval_s
        return 1 - (1 - self._params.alpha) ** steps, 1 - (1 - self._params.beta) ** steps
