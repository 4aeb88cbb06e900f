"""Sweeps of the autoscaling policies' parameters on traces (`bench/autoscale_sim.py`):
`llmfleet autoscale pool-sweep` (the warm pool's size on one trace: what each worker of
pool buys in SLO, and costs) and `llmfleet autoscale tune` (the predictive policies'
parameters on every trace together).

**The tuning's score** is goodput per worker-hour against the oracle's: for each trace and
each of `predictive` and `predictive+warm` (at the default pool), SLO attainment over the
oracle's, divided by worker-hours over the oracle's; the score is the geometric mean of those
ratios over all traces and both policies (1.0: as good as the oracle on every trace), so a
parameter that helps one trace at another's expense scores only its net. That score alone
trades a point of SLO attainment for a percent of worker-hours, and where a spike is missed
anyway it buys cheapness with slower recovery (docs/benchmarks.md shows where it led), so
a change is *allowed* only if it lowers no SLO attainment, overall or in the surges, of
either policy on any trace, by more than `MAX_SLO_LOSS` from the base's; and one that flaps
on a steady load (`num_changes_per_hour`, a cost the simulator does not see) is not even
simulated. The search is
coordinate-wise and greedy: from a base, each parameter alone through its values in `GRID`,
every other at the base's; the best allowed change becomes the next base, until no allowed
single change scores higher (docs/benchmarks.md records each pass).
"""

from __future__ import annotations

import dataclasses
import math
import multiprocessing
import random
from collections.abc import Callable, Iterable
from itertools import pairwise
from typing import Any

from bench.autoscale_report import add_ratios, summarize, surges
from bench.autoscale_sim import SimConfig, make, simulate, window_needs
from bench.autoscale_sim import worker_tokens_per_s as capacity_of
from bench.autoscale_traces import TraceRequest
from control.scale_policy import PolicyParams, ScaleSignals, make_policy

TUNED_POLICIES = ("predictive", "predictive+warm")
MAX_SLO_LOSS = 0.01  # a change may lower no SLO attainment by more than a point
MAX_CHANGES_PER_HOUR = 2.0  # ... nor flap: changes of the serving count on a steady load
BASELINES = ("oracle", "fixed-peak", "reactive", "predictive")
# The values each parameter is tried at, one at a time (10.0: a forecast growth not capped).
GRID: dict[str, tuple[float, ...]] = {
    "forecast_max_growth": (0.1, 0.25, 0.5, 1.0, 10.0),
    "forecast_damping_s": (180.0, 600.0, 1800.0),
    "forecast_beta": (0.02, 0.05, 0.1),
    "standby_quiet_s": (60.0, 180.0, 300.0, 600.0),
    "scale_down_delay_s": (60.0, 120.0, 240.0),
    "hysteresis": (0.1, 0.2, 0.3),
    "backlog_drain_s": (30.0, 60.0, 120.0),
    "warm_pool_baseline_s": (600.0, 1800.0, 3600.0),
}
# The figures of a policy's summary a sweep keeps (not its timeline).
KEPT = (
    "ttft_p50_s",
    "slo_attainment",
    "slo_attainment_in_surges",
    "ttft_p99_s",
    "worker_hours",
    "worker_hours_by_state",
    "max_num_waiting",
    "is_each_request_served_once",
)

# The traces of the runs in flight: a forked worker process inherits them instead of
# receiving a copy of millions of requests through a pipe.
_TRACES: dict[str, list[TraceRequest]] = {}


@dataclasses.dataclass(frozen=True, slots=True)
class _Job:
    trace: str
    policy: str
    params: PolicyParams
    config: SimConfig


def _job(trace: str, policy: str, params: PolicyParams, config: SimConfig) -> _Job:
    """A run, its parameters reduced to those the policy reads (so that equal runs are
    one): the oracle reads none but the utilisation and bounds, `predictive` no pool."""
    if policy == "oracle":
        params = PolicyParams(
            min_workers=params.min_workers,
            max_workers=params.max_workers,
            target_utilisation=params.target_utilisation,
        )
    elif policy == "predictive":
        defaults = PolicyParams()
        params = dataclasses.replace(
            params,
            warm_pool=defaults.warm_pool,
            warm_pool_baseline_s=defaults.warm_pool_baseline_s,
        )
    return _Job(trace, policy, params, config)


def _run(job: _Job) -> dict[str, Any]:
    requests = _TRACES[job.trace]
    capacity = capacity_of(requests, job.config)
    needs = window_needs(requests, job.params, job.config, capacity)
    policy = make(job.policy, needs, job.params, job.config)
    run = simulate(requests, policy, job.config, capacity)
    summary = summarize(run, job.config, surges(requests, job.config))
    return {key: summary[key] for key in KEPT if key in summary}


def _run_all(
    traces: dict[str, list[TraceRequest]], jobs: list[_Job], num_procs: int
) -> list[dict[str, Any]]:
    _TRACES.clear()
    _TRACES.update(traces)
    try:
        if num_procs <= 1:
            return [_run(job) for job in jobs]
        with multiprocessing.get_context("fork").Pool(num_procs) as pool:
            return pool.map(_run, jobs, chunksize=1)
    finally:
        _TRACES.clear()


def _with_ratios(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """`add_ratios` on a copy: each policy's worker-hours over the oracle's."""
    results = {name: dict(r) for name, r in results.items()}
    add_ratios(results)
    return results


# The warm pool's size.


def pool_sweep(
    requests: list[TraceRequest],
    sizes: Iterable[int],
    params: PolicyParams,
    config: SimConfig,
    num_procs: int = 1,
) -> dict[str, Any]:
    """`predictive+warm` at each pool size, and the baselines once, on one trace."""
    sizes = list(sizes)
    jobs = [_Job("trace", name, params, config) for name in BASELINES]
    jobs += [
        _Job("trace", "predictive+warm", dataclasses.replace(params, warm_pool=n), config)
        for n in sizes
    ]
    found = _run_all({"trace": requests}, jobs, num_procs)
    baselines = dict(zip(BASELINES, found[: len(BASELINES)], strict=True))
    pools = {f"warm pool {n}": r for n, r in zip(sizes, found[len(BASELINES) :], strict=True)}
    return {
        "num_requests": len(requests),
        "surges_s": surges(requests, config),
        "params": dataclasses.asdict(params),
        "results": _with_ratios(baselines | pools),
    }


# The predictive policies' parameters, on every trace together.


def goodput_ratio(result: dict[str, Any], oracle: dict[str, Any]) -> float:
    """SLO attainment over the oracle's, over worker-hours over the oracle's."""
    slo = result["slo_attainment"] / oracle["slo_attainment"]
    return slo / (result["worker_hours"] / oracle["worker_hours"])


def score(results: dict[str, dict[str, dict[str, Any]]]) -> float:
    """The geometric mean of the goodput ratios of the tuned policies over the traces."""
    ratios = [
        goodput_ratio(by_policy[name], by_policy["oracle"])
        for by_policy in results.values()
        for name in TUNED_POLICIES
    ]
    return math.exp(sum(math.log(r) for r in ratios) / len(ratios))


def num_changes_per_hour(params: PolicyParams, num_seeds: int = 20) -> float:
    """How often `predictive` changes its serving count on a steady load with noise, an hour
    long (after ten minutes), the mean over seeds: 4 workers' worth (at 1,000 tokens a
    second each), 10% noise on each 5-s tick's arrivals. The simulator charges nothing for a
    change (a parked worker is taken back in seconds), the platform does (a KV cache
    dropped and refilled): this is the check the sweep cannot make. The defaults before the
    tuning: 1.0."""
    num_changes = 0
    for seed in range(num_seeds):
        rng = random.Random(seed)
        policy = make_policy("predictive", params)
        counts = []
        for k in range(840):
            load = 4 * (1 + rng.gauss(0, 0.1))
            signals = ScaleSignals(
                now_s=5.0 * k, arrival_rate_per_s=load, arrival_tokens_per_s=1000 * load,
                num_waiting=0, num_running=round(rng.gauss(256, 16)),
                worker_tokens_per_s=1000.0, num_ready=0, num_standby=0, num_loading=0,
                num_draining=0,
            )  # fmt: skip
            counts.append(policy.decide(signals).num_ready)
        num_changes += sum(a != b for a, b in pairwise(counts[120:]))
    return num_changes / num_seeds


def worst_slo_change(results: dict[str, Any], base: dict[str, Any]) -> float:
    """The largest fall (negative) of SLO attainment, overall or in the surges, of either
    tuned policy on any trace, from the base's."""
    changes = [0.0]
    for trace, by_policy in results.items():
        for name in TUNED_POLICIES:
            for key in ("slo_attainment", "slo_attainment_in_surges"):
                found, was = by_policy[name][key], base[trace][name][key]
                if found is not None and was is not None:
                    changes.append(found - was)
    return min(changes)


def variants(
    base: PolicyParams, grid: dict[str, tuple[float, ...]]
) -> list[tuple[str, PolicyParams]]:
    """The base, then each parameter of the grid alone at each of its other values."""
    found = [("base", base)]
    for name, values in grid.items():
        found += [
            (f"{name}={value:g}", dataclasses.replace(base, **{name: value}))  # type: ignore[arg-type]
            for value in values
            if value != getattr(base, name)
        ]
    return found


def tune(
    traces: dict[str, list[TraceRequest]],
    base: PolicyParams,
    config: SimConfig,
    grid: dict[str, tuple[float, ...]] = GRID,
    num_procs: int = 1,
    progress: Callable[[str], None] = lambda line: None,
) -> dict[str, Any]:
    """Each variant of `base` on every trace: its figures and its score, best first."""
    flapping = {label: num_changes_per_hour(params) for label, params in variants(base, grid)}
    tried = [
        (label, params)
        for label, params in variants(base, grid)
        if label == "base" or flapping[label] <= MAX_CHANGES_PER_HOUR
    ]
    jobs = {_job(t, "oracle", base, config) for t in traces}
    jobs |= {
        _job(t, p, params, config) for _, params in tried for t in traces for p in TUNED_POLICIES
    }
    ordered = sorted(jobs, key=repr)
    found = dict(zip(ordered, _run_all(traces, ordered, num_procs), strict=True))
    rows: list[dict[str, Any]] = []
    for label, params in tried:
        results = {
            t: _with_ratios(
                {p: found[_job(t, p, params, config)] for p in ("oracle", *TUNED_POLICIES)}
            )
            for t in traces
        }
        rows.append({"variant": label, "score": round(score(results), 4), "results": results})
    for row in rows:
        row["num_changes_per_hour"] = flapping[row["variant"]]
        row["worst_slo_change"] = round(worst_slo_change(row["results"], rows[0]["results"]), 5)
        row["is_allowed"] = row["worst_slo_change"] >= -MAX_SLO_LOSS
        progress(f"{row['variant']}: score {row['score']:.4f}, SLO {row['worst_slo_change']:+.2%}")
    return {
        "traces": {t: len(requests) for t, requests in traces.items()},
        "base": dataclasses.asdict(base),
        "grid": grid,
        "variants": sorted(rows, key=lambda row: -row["score"]),
        "flapping": {label: n for label, n in flapping.items() if n > MAX_CHANGES_PER_HOUR},
    }
