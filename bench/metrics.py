"""Metrics: turn per-request timings into one plain, JSON-able summary of a run.

Latencies are taken over successful requests only; a failed request shows up in
`num_failed` and in lower throughput and goodput, not as a fast or slow sample.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from bench.client import RequestResult

PERCENTILES = {"p50": 50.0, "p90": 90.0, "p99": 99.0}


def percentiles(values: list[float]) -> dict[str, float]:
    """p50, p90, p99 (linear interpolation), max and mean of `values`.

    An empty input gives 0.0 everywhere, not NaN, so a summary stays strict JSON; read
    `num_ok` next to it to tell "no samples" from "fast".
    """
    if not values:
        return {name: 0.0 for name in [*PERCENTILES, "max", "mean"]}
    array = np.asarray(values, dtype=np.float64)
    summary = {
        name: float(np.percentile(array, q, method="linear")) for name, q in PERCENTILES.items()
    }
    return {**summary, "max": float(array.max()), "mean": float(array.mean())}


def summarize(
    results: list[RequestResult],
    duration_s: float,
    *,
    slo_ttft_s: float = 2.0,
    slo_tpot_s: float = 0.2,
) -> dict[str, Any]:
    """Throughput, latency percentiles and goodput of one run, as a plain dict.

    Goodput counts successful requests whose TTFT is within `slo_ttft_s` and whose TPOT is
    within `slo_tpot_s`; a request with fewer than two output tokens has no TPOT and is
    judged on TTFT alone, one with no text chunk at all has no TTFT and misses the SLO.
    """
    ok = [r for r in results if r.is_ok]
    num_within_slo = sum(_is_within_slo(r, slo_ttft_s, slo_tpot_s) for r in ok)
    total_output_tokens = sum(r.num_output_tokens for r in ok)
    return {
        "num_requests": len(results),
        "num_ok": len(ok),
        "num_failed": len(results) - len(ok),
        "duration_s": duration_s,
        "output_tokens_per_s": _per_s(total_output_tokens, duration_s),
        "requests_per_s": _per_s(len(ok), duration_s),
        "total_output_tokens": total_output_tokens,
        "total_prompt_tokens": sum(r.num_prompt_tokens for r in ok),
        "ttft_s": percentiles([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_s": percentiles([r.tpot_s for r in ok if r.tpot_s is not None]),
        "itl_s": percentiles([gap_s for r in ok for gap_s in r.itl_s]),
        "e2e_s": percentiles([r.e2e_s for r in ok]),
        "goodput_requests_per_s": _per_s(num_within_slo, duration_s),
        "slo": {"ttft_s": slo_ttft_s, "tpot_s": slo_tpot_s, "num_within_slo": num_within_slo},
    }


def _is_within_slo(result: RequestResult, slo_ttft_s: float, slo_tpot_s: float) -> bool:
    ttft_s, tpot_s = result.ttft_s, result.tpot_s
    if ttft_s is None or ttft_s > slo_ttft_s:
        return False
    return tpot_s is None or tpot_s <= slo_tpot_s


def _per_s(count: float, duration_s: float) -> float:
    return count / duration_s if duration_s > 0 else 0.0
