"""A canary's health: its latencies and error rate against its stable version's, over one window.

Each version's workers push their TTFT and ITL samples, and one `failed` sample per request
that ended (1: it failed by the server's doing, `worker/telemetry.is_failure`), to the
version's windows in Redis (`shared/latency_window.py`). `read` takes a version's figures
over the samples since `since_s`; `judge` compares the canary's with the stable version's:

- **unhealthy** when, with at least `min_num_samples` on both sides, the canary's TTFT p99
  or ITL p99 is above `ratio` times the stable's *and* at least `min_excess_s` above it
  (p99s of a few milliseconds differ by scheduling noise, not by version), or its error rate
  is more than `max_error_rate_increase` above the stable's. Samples are counted in
  requests: a request's token gaps are not independent (one stall of its worker lengthens
  them all), so ITL is judged once `min_num_samples` requests have ended on both sides;
- **healthy** when TTFT and the error rate had enough samples on both sides and nothing
  was worse (ITL only counts once it has samples: a workload of one-token answers has none);
- **undecided** otherwise: too few samples to tell; the rollout holds where it is.

Pure except `read`; `control/rollouts.py` acts on the verdict, `llmfleet rollout status`
shows it.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from datetime import UTC
from enum import StrEnum

import redis.asyncio as aioredis

from shared import latency_window
from shared.latency_window import LatencySummary
from shared.settings import Settings
from shared.tables import ModelDeployment, Rollout


class Cause(StrEnum):
    """What made a canary unhealthy: a rollback's cause (a metric label)."""

    TTFT_P99 = "ttft_p99"
    ITL_P99 = "itl_p99"
    ERROR_RATE = "error_rate"


class Verdict(StrEnum):
    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"
    UNDECIDED = "undecided"


@dataclass(frozen=True, slots=True)
class Margins:
    """How much worse than stable a canary may be, and on how many samples that is judged."""

    max_ttft_p99_ratio: float
    max_itl_p99_ratio: float
    min_excess_s: float
    max_error_rate_increase: float
    min_num_samples: int
    window_s: float

    @classmethod
    def of(cls, settings: Settings) -> Margins:
        return cls(
            max_ttft_p99_ratio=settings.rollout_max_ttft_p99_ratio,
            max_itl_p99_ratio=settings.rollout_max_itl_p99_ratio,
            min_excess_s=settings.rollout_min_latency_excess_ms / 1000,
            max_error_rate_increase=settings.rollout_max_error_rate_increase,
            min_num_samples=settings.rollout_min_num_samples,
            window_s=settings.rollout_window_s,
        )


@dataclass(frozen=True, slots=True)
class VersionHealth:
    """One version's figures over the window."""

    ttft: LatencySummary
    itl: LatencySummary
    num_ended: int
    num_failed: int

    @property
    def error_rate(self) -> float | None:
        return self.num_failed / self.num_ended if self.num_ended else None

    def as_json(self) -> dict:
        return {
            "num_ttft_samples": self.ttft.num_samples,
            "ttft_p50_s": self.ttft.p50_s,
            "ttft_p99_s": self.ttft.p99_s,
            "num_itl_samples": self.itl.num_samples,
            "itl_p50_s": self.itl.p50_s,
            "itl_p99_s": self.itl.p99_s,
            "num_ended": self.num_ended,
            "error_rate": self.error_rate,
        }


@dataclass(frozen=True, slots=True)
class Judgement:
    verdict: Verdict
    cause: Cause | None  # when unhealthy
    reason: str  # what was found, in a sentence, with the figures


@dataclass(frozen=True, slots=True)
class Assessment:
    """A canary judged now: the verdict, and the figures it was made from."""

    judgement: Judgement
    canary: VersionHealth
    stable: VersionHealth
    window_s: float

    def as_json(self) -> dict:
        return {
            "verdict": self.judgement.verdict,
            "cause": self.judgement.cause,
            "reason": self.judgement.reason,
            "window_s": round(self.window_s, 1),
            "canary": self.canary.as_json(),
            "stable": self.stable.as_json(),
        }


async def assess(
    redis: aioredis.Redis,
    margins: Margins,
    rollout: Rollout,
    canary: ModelDeployment,
    stable: ModelDeployment,
) -> Assessment:
    """A rollout's canary judged now, over the samples since the rollout started, at most the
    last `margins.window_s`; with the rollout's own minimum of samples, if it has one."""
    if rollout.min_num_samples is not None:
        margins = dataclasses.replace(margins, min_num_samples=rollout.min_num_samples)
    started_at = rollout.started_at
    if started_at.tzinfo is None:  # SQLite gives back naive datetimes; all stored are UTC
        started_at = started_at.replace(tzinfo=UTC)
    now_s = time.time()
    since_s = max(now_s - margins.window_s, started_at.timestamp())
    canary_now = await read(redis, canary.name, since_s)
    stable_now = await read(redis, stable.name, since_s)
    judgement = judge(canary_now, stable_now, margins)
    return Assessment(judgement, canary_now, stable_now, max(0.0, now_s - since_s))


async def read(redis: aioredis.Redis, deployment: str, since_s: float) -> VersionHealth:
    """A version's figures over its samples since `since_s` (unix time)."""
    ttft = await latency_window.read_since(redis, deployment, "ttft", since_s)
    itl = await latency_window.read_since(redis, deployment, "itl", since_s)
    failed = await latency_window.read_since(redis, deployment, "failed", since_s)
    return VersionHealth(
        LatencySummary.of(ttft), LatencySummary.of(itl), len(failed), int(sum(failed))
    )


def judge(canary: VersionHealth, stable: VersionHealth, margins: Margins) -> Judgement:
    """The canary's verdict against the stable version (module docstring)."""
    num_requests = min(canary.num_ended, stable.num_ended)
    ratios = (margins.max_ttft_p99_ratio, margins.max_itl_p99_ratio)
    checks = [
        _latency(Cause.TTFT_P99, canary.ttft, stable.ttft, ratios[0], margins),
        _latency(Cause.ITL_P99, canary.itl, stable.itl, ratios[1], margins, num_requests),
        _errors(canary, stable, margins),
    ]
    for cause, is_worse, reason in checks:
        if is_worse:
            return Judgement(Verdict.UNHEALTHY, cause, reason)
    judged = {cause for cause, is_worse, _ in checks if is_worse is not None}
    if {Cause.TTFT_P99, Cause.ERROR_RATE} <= judged:
        return Judgement(Verdict.HEALTHY, None, "; ".join(r for _, _, r in checks))
    return Judgement(
        Verdict.UNDECIDED,
        None,
        f"fewer than {margins.min_num_samples} samples to compare: "
        + "; ".join(r for _, _, r in checks),
    )


def _latency(
    cause: Cause,
    canary: LatencySummary,
    stable: LatencySummary,
    max_ratio: float,
    margins: Margins,
    num_requests: int | None = None,
) -> tuple[Cause, bool | None, str]:
    """(cause, whether the canary is worse or None when there are too few samples, why);
    `num_requests`: the fewer requests of the two sides, when samples are not requests."""
    counts = f"{canary.num_samples}/{stable.num_samples} samples"
    num = min(canary.num_samples, stable.num_samples, num_requests or canary.num_samples)
    if num < margins.min_num_samples:
        return cause, None, f"{cause} {counts}"
    assert canary.p99_s is not None and stable.p99_s is not None
    ratio = canary.p99_s / stable.p99_s if stable.p99_s > 0 else float("inf")
    is_worse = ratio > max_ratio and canary.p99_s - stable.p99_s >= margins.min_excess_s
    figures = (
        f"{cause} {canary.p99_s * 1000:.1f} ms vs stable {stable.p99_s * 1000:.1f} ms "
        f"({ratio:.2f}x, limit {max_ratio:g}x; {counts})"
    )
    return cause, is_worse, figures


def _errors(
    canary: VersionHealth, stable: VersionHealth, margins: Margins
) -> tuple[Cause, bool | None, str]:
    cause = Cause.ERROR_RATE
    counts = f"{canary.num_ended}/{stable.num_ended} requests"
    if min(canary.num_ended, stable.num_ended) < margins.min_num_samples:
        return cause, None, f"{cause} {counts}"
    assert canary.error_rate is not None and stable.error_rate is not None
    increase = canary.error_rate - stable.error_rate
    figures = (
        f"{cause} {canary.error_rate:.1%} vs stable {stable.error_rate:.1%} "
        f"(limit +{margins.max_error_rate_increase:.1%}; {counts})"
    )
    return cause, increase > margins.max_error_rate_increase, figures
