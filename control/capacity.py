"""What one ready worker serves, and what a request costs, as the autoscaler measures them
from the workers' heartbeats: plain, synchronous code without I/O (`control/scaler.py` feeds
it).

Each heartbeat carries the worker's running totals of tokens served (prompt tokens
computed plus tokens generated) and of requests finished. The difference between two
heartbeats of one worker is its served rate; the policies need two figures from them:

- a worker's *capacity* in tokens a second: the highest served rate of one worker whose
  batch was at least `min_occupancy` full (a worker with little to do serves little and says
  nothing of its capacity), forgotten with a half-life so that a slower version or a
  different mix of prompts takes over; a configured figure overrides it, and
  `default_tokens_per_s` stands until the first busy heartbeat;
- the *tokens per request*: served tokens over finished requests, a moving mean, which turns
  the arrival rate of requests into one of tokens (what a request will cost is known only
  once it ran: its prompt at admission, its output at the end).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class WorkerTotals:
    """One heartbeat's running totals of one worker."""

    at_s: float
    num_served_tokens: int
    num_finished_requests: int
    occupancy: float  # running requests over places, as of that heartbeat


@dataclass(frozen=True, slots=True)
class ServedRate:
    tokens_per_s: float
    num_tokens: int
    num_finished: int
    occupancy: float


class ServedRates:
    """Successive heartbeats of each worker, differenced."""

    def __init__(self) -> None:
        self._last: dict[str, WorkerTotals] = {}

    def update(self, worker_id: str, totals: WorkerTotals) -> ServedRate | None:
        """The rate since this worker's previous heartbeat; None for its first one, the same
        heartbeat read again, or totals that went back (the worker restarted)."""
        last = self._last.get(worker_id)
        self._last[worker_id] = totals
        if last is None or totals.at_s <= last.at_s:
            return None
        num_tokens = totals.num_served_tokens - last.num_served_tokens
        num_finished = totals.num_finished_requests - last.num_finished_requests
        if num_tokens < 0 or num_finished < 0:
            return None
        rate = num_tokens / (totals.at_s - last.at_s)
        return ServedRate(rate, num_tokens, num_finished, max(last.occupancy, totals.occupancy))

    def forget_all_but(self, worker_ids: set[str]) -> None:
        for worker_id in set(self._last) - worker_ids:
            del self._last[worker_id]


@dataclass
class CapacityEstimate:
    default_tokens_per_s: float
    configured_tokens_per_s: float | None = None
    min_occupancy: float = 0.75
    half_life_s: float = 1800.0
    _best_tokens_per_s: float | None = None
    _best_at_s: float = 0.0

    def observe(self, rate: ServedRate, now_s: float) -> None:
        if rate.occupancy < self.min_occupancy or rate.tokens_per_s <= 0:
            return
        if rate.tokens_per_s >= self._decayed(now_s):
            self._best_tokens_per_s, self._best_at_s = rate.tokens_per_s, now_s

    def tokens_per_s(self, now_s: float) -> float:
        if self.configured_tokens_per_s is not None:
            return self.configured_tokens_per_s
        best = self._decayed(now_s)
        return best if best > 0 else self.default_tokens_per_s

    def _decayed(self, now_s: float) -> float:
        if self._best_tokens_per_s is None:
            return 0.0
        age_s = max(0.0, now_s - self._best_at_s)
        return self._best_tokens_per_s * math.exp2(-age_s / self.half_life_s)


@dataclass
class TokensPerRequest:
    """A moving mean of tokens served per finished request."""

    default_tokens: float
    weight: float = 0.2  # of each new reading
    _mean: float | None = None

    def observe(self, num_tokens: int, num_finished: int) -> None:
        if num_finished <= 0 or num_tokens <= 0:
            return
        reading = num_tokens / num_finished
        self._mean = (
            reading
            if self._mean is None
            else ((1 - self.weight) * self._mean + self.weight * reading)
        )

    @property
    def tokens(self) -> float:
        return self.default_tokens if self._mean is None else self._mean
