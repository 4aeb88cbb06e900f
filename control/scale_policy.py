"""How many workers a model version wants: plain, synchronous code without I/O, shared by
the autoscaler's loop (`control/scaler.py`, signals from Redis) and the trace simulator
(`bench/autoscale_sim.py`, a virtual clock).

Three policies, made by name (`make_policy`) from one set of parameters (`PolicyParams`):

- `reactive`: today's KEDA example (infra/keda/), the baseline: one worker per
  `reactive_threshold` requests in the system, scaled as Kubernetes' HPA scales.
- `predictive`: the demand forecast over the cold start (`control/forecast.py`) over what a
  worker serves at the target utilisation, or what drains the backlog with the capacity
  already coming if more; up at once, down only after a delay, and a worker scaled down
  waits on standby before it is stopped.
- `predictive+warm`: `predictive` with a warm pool: standby workers loaded beyond the
  baseline's serving, so that the first minutes of a spike are served while new workers
  load.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from control.forecast import HoltForecast, HoltParams

if TYPE_CHECKING:
    from shared.settings import Settings

POLICY_NAMES = ("reactive", "predictive", "predictive+warm")


@dataclass(frozen=True, slots=True)
class ScaleSignals:
    """One model version at one tick."""

    now_s: float
    arrival_rate_per_s: float  # requests admitted per second since the last tick
    arrival_tokens_per_s: float  # their work in tokens (prompt + output) per second
    num_waiting: int  # requests admitted and not started (queued or waiting in a worker)
    num_running: int  # requests in the workers' batches
    worker_tokens_per_s: float  # what one ready worker serves at a full batch (capacity)
    num_ready: int  # workers serving
    num_standby: int  # loaded, parked: pull nothing, hold no KV pool
    num_loading: int  # starting: weights on their way
    num_draining: int  # leaving: finishing what they hold


@dataclass(frozen=True, slots=True)
class ScaleDecision:
    """What the policy wants: `num_ready` serving and `num_standby` parked, so the actuator
    keeps `num_ready + num_standby` worker processes (or pods) running."""

    num_ready: int
    num_standby: int
    forecast_tokens_per_s: float | None = None  # the demand it planned for, for display

    @property
    def num_workers(self) -> int:
        return self.num_ready + self.num_standby


class ScalePolicy(Protocol):
    """A policy is fed every tick in order; it may keep state between ticks (a forecast,
    the time a scale-down was first wanted)."""

    name: str

    def decide(self, signals: ScaleSignals) -> ScaleDecision: ...


@dataclass(frozen=True, slots=True)
class PolicyParams:
    """Every policy's parameters. Workers serving stay at least `min_workers`; serving plus
    standby at most `max_workers` (the warm pool gives way first). The predictive defaults
    were tuned on every shipped trace together (docs/benchmarks.md, "Autoscaling")."""

    min_workers: int = 1
    max_workers: int = 64
    # predictive, predictive+warm
    cold_start_s: float = 180.0  # the forecast's horizon: what a new worker takes to serve
    target_utilisation: float = 0.8  # of a worker's capacity, planned for
    backlog_drain_s: float = 60.0  # waiting work is planned to be served within this
    hysteresis: float = 0.2  # a scale-down must hold with this much more demand too
    scale_down_delay_s: float = 120.0  # a lower count wanted this long before it is applied
    standby_quiet_s: float = 180.0  # a parked worker unused this long is stopped
    warm_pool: int = 1  # predictive+warm: workers loaded beyond the baseline's serving
    warm_pool_baseline_s: float = 1800.0  # the baseline: the fewest serving over this long
    forecast_alpha: float = 0.2  # control/forecast.py: level smoothing per interval
    forecast_beta: float = 0.05  # trend smoothing per interval
    forecast_interval_s: float = 5.0
    forecast_damping_s: float = 180.0  # the trend's reach (114 s of a 180-s horizon)
    forecast_max_growth: float = 0.25  # the forecast a cold start ahead: at most the level +25%
    # reactive: infra/keda/scaledobject-queue-depth.yaml and the HPA's defaults
    reactive_threshold: int = 48  # requests in the system (waiting + running) per worker
    reactive_poll_s: float = 15.0  # KEDA's pollingInterval
    reactive_stabilization_s: float = 300.0  # the HPA's scale-down stabilization window
    reactive_scale_down_period_s: float = 60.0  # at most one worker fewer per period
    reactive_scale_up_workers: int = 4  # at most max(double, +4) per poll (HPA default)

    @classmethod
    def of(cls, settings: Settings) -> PolicyParams:
        """The parameters the settings carry (`LLMFLEET_AUTOSCALE_*`), the rest defaults."""
        return cls(
            min_workers=settings.autoscale_min_workers,
            max_workers=settings.autoscale_max_workers,
            cold_start_s=settings.autoscale_cold_start_s,
            warm_pool=settings.autoscale_warm_pool,
            scale_down_delay_s=settings.autoscale_scale_down_delay_s,
            standby_quiet_s=settings.autoscale_standby_quiet_s,
            warm_pool_baseline_s=settings.autoscale_warm_pool_baseline_s,
        )

    def holt(self) -> HoltParams:
        return HoltParams(
            alpha=self.forecast_alpha,
            beta=self.forecast_beta,
            interval_s=self.forecast_interval_s,
            damping_s=self.forecast_damping_s,
        )


def make_policy(name: str, params: PolicyParams) -> ScalePolicy:
    """A fresh policy (with its own state) by name: one of `POLICY_NAMES`."""
    if name == "reactive":
        return ReactivePolicy(params)
    if name == "predictive":
        return PredictivePolicy(params, warm_pool=0, name=name)
    if name == "predictive+warm":
        return PredictivePolicy(params, warm_pool=params.warm_pool, name=name)
    raise ValueError(f"unknown autoscale policy {name!r}: one of {', '.join(POLICY_NAMES)}")


class ReactivePolicy:
    """Today's KEDA rule, the baseline. Every `reactive_poll_s` it wants
    ceil((waiting + running) / `reactive_threshold`) workers serving, within min and max, and
    moves there as the HPA does: up at once, at most to max(2x, +`reactive_scale_up_workers`)
    per poll; down only to the highest count wanted within the stabilization window, and by
    at most one worker per `reactive_scale_down_period_s`. No standby: a scale-down stops the
    worker, a scale-up starts one cold."""

    name = "reactive"

    def __init__(self, params: PolicyParams) -> None:
        self._params = params
        self._wanted: deque[tuple[float, int]] = deque()
        self._polled_s = -math.inf
        self._scaled_down_s = -math.inf
        self._num_ready: int | None = None

    def decide(self, signals: ScaleSignals) -> ScaleDecision:
        p = self._params
        if self._num_ready is None or signals.now_s - self._polled_s >= p.reactive_poll_s:
            self._polled_s = signals.now_s
            self._num_ready = self._scale(signals.now_s, self._wanted_now(signals))
        return ScaleDecision(self._num_ready, 0)

    def _wanted_now(self, signals: ScaleSignals) -> int:
        in_system = signals.num_waiting + signals.num_running
        wanted = math.ceil(in_system / self._params.reactive_threshold)
        return min(max(wanted, self._params.min_workers), self._params.max_workers)

    def _scale(self, now_s: float, wanted: int) -> int:
        p = self._params
        _remember(self._wanted, now_s, wanted, p.reactive_stabilization_s)
        current = self._num_ready
        if current is None:
            return wanted  # the first tick: the fleet as found
        if wanted > current:
            return min(wanted, max(2 * current, current + p.reactive_scale_up_workers))
        stabilized = max(count for _, count in self._wanted)
        if stabilized >= current or now_s - self._scaled_down_s < p.reactive_scale_down_period_s:
            return current
        self._scaled_down_s = now_s
        return current - 1


class PredictivePolicy:
    """Plan for the demand a cold start ahead, drain a backlog with what is already coming,
    keep a warm pool over the baseline. Each tick:

    1. The arrival rate in tokens feeds Holt's damped trend (`control/forecast.py`); the
       demand planned for is the larger of its level and its forecast `cold_start_s` ahead,
       the forecast's rise capped at `forecast_max_growth` of the level. The forecast leads
       gradual change; a rise faster than that within a cold start cannot be told from a
       step whose top is unknown (extrapolating a 60-s rise over a cold start asked for
       ~1.8x a 5x spike's need), so steps are left to the warm pool and the backlog.
    2. Workers wanted serving: the planned demand over a worker's capacity at
       `target_utilisation`, or, if more, the workers that serve the arrivals and drain the
       backlog (waiting requests x tokens per request) within `backlog_drain_s` at a full
       batch. Both are bounds on one fleet, so the larger counts, not their sum. A new
       worker serves only a cold start from now, so it is wanted for the backlog only if
       the workers loaded now (serving or standby) and those still loading, each from its
       expected arrival, leave a backlog then (`_backlog_after`, a fluid model). At least
       one while requests wait.
    3. A higher count is applied at once; a lower one only once the count wanted with
       `hysteresis` more demand has stayed below the current one for `scale_down_delay_s`
       (then to the highest such count of that window).
    4. A worker scaled down is parked on standby first and stopped after `standby_quiet_s`
       unless a scale-up took it back: the rent-or-buy break-even, as long as parking costs
       what a new cold start would. The warm pool (`warm_pool`, 0 for `predictive`) is a
       floor on the workers loaded, serving plus standby: at least the baseline (the fewest
       serving over the last `warm_pool_baseline_s`) plus the pool. So it is not refilled
       while a surge's serving workers stand above it, only once the baseline itself has
       moved: refilled during a surge, it would load workers that arrive a cold start later
       and stand by through the surge, for a second spike on top of the first."""

    def __init__(self, params: PolicyParams, *, warm_pool: int, name: str) -> None:
        self.name = name
        self._params = params
        self._warm_pool = warm_pool
        self._forecast = HoltForecast(params.holt())
        self._tokens_per_request = 0.0
        self._relaxed: deque[tuple[float, int]] = deque()
        self._serving: deque[tuple[float, int]] = deque()
        self._started_s: float | None = None
        self._decided_s: float | None = None
        self._num_ready: int | None = None
        self._parked_s: list[float] = []  # when each worker on standby was parked
        self._loading_s: deque[float] = deque()  # when each loading worker was started

    def decide(self, signals: ScaleSignals) -> ScaleDecision:
        p = self._params
        self._forecast.update(signals.now_s, signals.arrival_tokens_per_s)
        if signals.arrival_rate_per_s > 0:
            self._tokens_per_request = signals.arrival_tokens_per_s / signals.arrival_rate_per_s
        self._track_loading(signals)
        planned = self._planned()
        drain = self._drain_workers(signals)
        wanted = self._workers_for(planned, drain, signals)
        relaxed = self._workers_for(planned * (1 + p.hysteresis), drain, signals)
        num_ready = self._hold(signals.now_s, wanted, relaxed)
        num_standby = self._standby(signals.now_s, num_ready)
        self._num_ready, self._decided_s = num_ready, signals.now_s
        return ScaleDecision(num_ready, num_standby, planned)

    def _planned(self) -> float:
        level = self._forecast.level
        ahead = self._forecast.forecast(self._params.cold_start_s)
        return max(level, min(ahead, level * (1 + self._params.forecast_max_growth)))

    def _workers_for(self, demand_tokens_per_s: float, drain: float, signals: ScaleSignals) -> int:
        p = self._params
        capacity = max(signals.worker_tokens_per_s, 1e-9)
        workers = max(demand_tokens_per_s / (capacity * p.target_utilisation), drain)
        if signals.num_waiting:
            workers = max(workers, 1.0)  # from zero: even before a request's cost is known
        return min(max(math.ceil(workers - 1e-9), p.min_workers), p.max_workers)

    def _drain_workers(self, signals: ScaleSignals) -> float:
        """The workers that serve the arrivals and drain the backlog within the drain time:
        from those loaded now, and new ones only for what those and the loading ones leave
        when a new one would arrive."""
        p = self._params
        capacity = max(signals.worker_tokens_per_s, 1e-9)
        backlog = signals.num_waiting * self._tokens_per_request / capacity  # worker-seconds
        if backlog <= 0:
            return 0.0
        demand = self._forecast.level / capacity  # workers at a full batch
        num_loaded = signals.num_ready + signals.num_standby
        now = min(float(num_loaded), demand + backlog / p.backlog_drain_s)
        arrivals_s = [max(0.0, s + p.cold_start_s - signals.now_s) for s in self._loading_s]
        left = _backlog_after(backlog, demand, num_loaded, arrivals_s, p.cold_start_s)
        return max(now, demand + left / p.backlog_drain_s) if left > 0 else now

    def _track_loading(self, signals: ScaleSignals) -> None:
        """When each loading worker started, oldest first: one first seen now was started by
        the previous decision; when fewer load, the oldest have arrived."""
        while len(self._loading_s) > signals.num_loading:
            self._loading_s.popleft()
        started_s = signals.now_s if self._decided_s is None else self._decided_s
        while len(self._loading_s) < signals.num_loading:
            self._loading_s.append(started_s)

    def _hold(self, now_s: float, wanted: int, relaxed: int) -> int:
        """Up at once; down only to what the relaxed count has wanted all the delay long."""
        p = self._params
        _remember(self._relaxed, now_s, relaxed, p.scale_down_delay_s)
        if self._started_s is None:
            self._started_s = now_s
        current = self._num_ready
        if current is None or wanted >= current:
            return wanted
        if now_s - self._started_s < p.scale_down_delay_s:
            return current  # not yet a whole delay of evidence
        return max(wanted, min(current, max(count for _, count in self._relaxed)))

    def _standby(self, now_s: float, num_ready: int) -> int:
        """Park what the scale-down let go, take parked workers back first on a scale-up,
        stop those parked for the quiet period; never fewer loaded than the baseline's
        serving plus the warm pool."""
        p = self._params
        change = num_ready - (num_ready if self._num_ready is None else self._num_ready)
        if change < 0:
            self._parked_s.extend([now_s] * -change)
        elif change > 0:
            del self._parked_s[max(0, len(self._parked_s) - change) :]
        self._parked_s = [s for s in self._parked_s if now_s - s < p.standby_quiet_s]
        _remember(self._serving, now_s, num_ready, p.warm_pool_baseline_s)
        baseline = min(count for _, count in self._serving)
        standby = max(len(self._parked_s), baseline + self._warm_pool - num_ready)
        return max(0, min(standby, p.max_workers - num_ready))


def _backlog_after(
    backlog: float, demand: float, num_serving: int, arrivals_s: list[float], horizon_s: float
) -> float:
    """The backlog (worker-seconds) left `horizon_s` from now, with `demand` workers' worth
    arriving all along, served at a full batch by `num_serving` workers and one more from
    each time in `arrivals_s` (seconds from now): a fluid model."""
    at_s, serving = 0.0, float(num_serving)
    for next_s in [*sorted(a for a in arrivals_s if a < horizon_s), horizon_s]:
        backlog = max(0.0, backlog + (demand - serving) * (next_s - at_s))
        at_s, serving = next_s, serving + 1
    return backlog


def _remember(window: deque[tuple[float, int]], now_s: float, count: int, span_s: float) -> None:
    """Append `count` at `now_s`, forget what is older than `span_s`."""
    window.append((now_s, count))
    while window and window[0][0] < now_s - span_s:
        window.popleft()
