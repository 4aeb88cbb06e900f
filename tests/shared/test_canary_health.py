"""The canary's verdict against its stable version: worse by the margins, on enough samples."""

from __future__ import annotations

from shared.canary_health import Cause, Margins, Verdict, VersionHealth, judge
from shared.latency_window import LatencySummary

MARGINS = Margins(
    max_ttft_p99_ratio=1.5,
    max_itl_p99_ratio=1.5,
    min_excess_s=0.025,
    max_error_rate_increase=0.02,
    min_num_samples=20,
    window_s=60.0,
)


def _health(ttft_s: float, itl_s: float, *, n: int = 50, failed: int = 0, n_itl: int = 200):
    return VersionHealth(
        LatencySummary.of([ttft_s] * n),
        LatencySummary.of([itl_s] * n_itl),
        num_ended=n,
        num_failed=failed,
    )


def test_a_canary_three_times_slower_to_its_first_token_is_unhealthy():
    found = judge(_health(0.3, 0.02), _health(0.1, 0.02), MARGINS)
    assert (found.verdict, found.cause) == (Verdict.UNHEALTHY, Cause.TTFT_P99)
    assert "300.0 ms vs stable 100.0 ms (3.00x" in found.reason


def test_slower_tokens_and_more_errors_are_unhealthy_too():
    itl = judge(_health(0.1, 0.09), _health(0.1, 0.03), MARGINS)
    assert (itl.verdict, itl.cause) == (Verdict.UNHEALTHY, Cause.ITL_P99)
    errors = judge(
        _health(0.1, 0.02, n=100, failed=5), _health(0.1, 0.02, n=100, failed=2), MARGINS
    )
    assert (errors.verdict, errors.cause) == (Verdict.UNHEALTHY, Cause.ERROR_RATE)
    assert "5.0% vs stable 2.0%" in errors.reason


def test_within_the_margins_is_healthy():
    found = judge(
        _health(0.14, 0.029, n=100, failed=3), _health(0.1, 0.02, n=100, failed=2), MARGINS
    )
    assert found.verdict is Verdict.HEALTHY and found.cause is None
    # Far above in ratio but a few milliseconds in all: noise, not a worse version.
    tiny = judge(_health(0.012, 0.004), _health(0.004, 0.001), MARGINS)
    assert tiny.verdict is Verdict.HEALTHY


def test_too_few_samples_decide_nothing():
    few = judge(_health(0.9, 0.02, n=19), _health(0.1, 0.02), MARGINS)
    assert few.verdict is Verdict.UNDECIDED and "fewer than 20 samples" in few.reason
    # No ITL samples (one-token answers): judged on TTFT and errors alone.
    one_token = judge(_health(0.1, 0.0, n_itl=0), _health(0.1, 0.0, n_itl=0), MARGINS)
    assert one_token.verdict is Verdict.HEALTHY
    # A stable version with no traffic to compare with: nothing to decide.
    alone = judge(_health(0.1, 0.02), _health(0.1, 0.02, n=0, n_itl=0), MARGINS)
    assert alone.verdict is Verdict.UNDECIDED


def test_token_gaps_are_judged_once_enough_requests_ended():
    # 7 requests, 28 slow gaps: one stall of a worker lengthens all of a request's gaps, so
    # those are 7 samples, not 28.
    few = judge(_health(0.1, 0.9, n=7, n_itl=28), _health(0.1, 0.02, n=50), MARGINS)
    assert few.verdict is Verdict.UNDECIDED
    enough = judge(_health(0.1, 0.9, n=20, n_itl=80), _health(0.1, 0.02, n=50), MARGINS)
    assert (enough.verdict, enough.cause) == (Verdict.UNHEALTHY, Cause.ITL_P99)
