"""Multi-tenant scenarios: is the batch shared fairly, and what does fairness cost?

- `noisy-neighbour`: tenants B and C send steady Poisson load; tenant A sends 10 times
  their rate, far beyond its fair share. Target: B's and C's TTFT p99 with A flooding stay
  within 1.3x of their TTFT p99 without A (same seed, same B and C requests). Also run
  under FIFO, to show what fair queuing prevents.
- `weighted`: tenants with weights 4:2:1 send the same number of requests, all at once,
  far more than the batch holds, so all three are backlogged until the heaviest-weighted
  one has been served. Targets while all are backlogged: each tenant's token service
  (prompt and output tokens) within +-10% of its weighted share, and Jain's fairness index
  over weight-normalised service >= 0.98 in every 10-second window. The same load under
  FIFO (which serves the three alike) gives the throughput baseline: fair queuing must keep
  >= 95% of FIFO's output throughput.

Runs are engine-direct (the scheduler's policy without HTTP noise), from one seed, so the
fair and FIFO runs see exactly the same requests.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from bench import metrics
from bench.client import RequestResult
from bench.workload import RequestSpec, TenantSpec, make_workload

SCENARIOS = ("noisy-neighbour", "weighted", "burst-fill", "burst-kv", "weighted-pool")
WINDOW_S = 10.0
TARGETS = {
    "noisy_neighbour_ttft_p99_ratio_max": 1.3,
    "weighted_share_error_max": 0.10,
    "weighted_jain_min": 0.98,
    "fair_over_fifo_throughput_min": 0.95,
}

A_MAX_REQUESTS_IN_FLIGHT = 16  # noisy-neighbour: A's admission limit in the limited run
BURST_TTFT_RATIO_MAX = 3.0  # burst-fill: B's TTFT p99 / alone, on this CPU
FLAT_BURST_TTFT_RATIO_MAX = 1.3  # burst-fill, burst-kv: on a device whose step time is flat
BURST_SIZE = 120  # burst-fill, burst-kv: A's requests, all at once
BURST_KV_BLOCKS = 256  # burst-kv: a KV pool of 4,096 tokens, far below what A's burst needs
POOL_SHARE_ERROR_MAX = 0.05  # weighted-pool
# Before each run's workload: requests of a tenant of their own, so that a run's first
# requests do not pay a cold process's costs (the API's first tokenizer load, the first
# step of each shape) that later ones do not. Without it, "B alone"'s TTFT p99 of 20
# requests is its first request's: 1-2 s on the real model, against 0.1-0.3 s warm.
WARMUP_TENANT = "warmup"


def warmup_workload(num_requests: int = 4, max_tokens: int = 8) -> list[RequestSpec]:
    """Short requests sent at once, before a run is measured (never part of its results)."""
    workload = make_workload(
        num_requests, seed=0, arrival="burst", burst_window_s=0.0, prompt_tokens_min=32,
        prompt_tokens_max=32, output_tokens_mean=max_tokens, output_tokens_max=max_tokens,
    )  # fmt: skip
    return [dataclasses.replace(s, max_tokens=max_tokens, tenant=WARMUP_TENANT) for s in workload]


@dataclasses.dataclass(frozen=True, slots=True)
class Run:
    """One run of a scenario, on one or more workers (`bench/scenario_driver.py`)."""

    label: str
    queueing: str  # EngineConfig.queueing
    workload: str  # a key of Scenario.workloads
    tenants: list[TenantSpec] | None = None  # None: the scenario's
    num_workers: int = 1
    fairness_scope: str = "pool"  # "pool": shared service counters; "worker": each its own
    affinity: tuple[tuple[str, ...], ...] = ()  # worker i prefers affinity[i % len] tenants
    engine: dict[str, Any] = dataclasses.field(default_factory=dict)  # EngineConfig changes
    roles: tuple[str, ...] = ()  # worker i's `--role` (disaggregation); () : every one `both`
    pin_cores: bool = False  # worker i pinned to core i (`--cpus`), modulo the machine's


@dataclasses.dataclass(frozen=True, slots=True)
class Scenario:
    tenants: list[TenantSpec]
    workloads: dict[str, list[RequestSpec]]
    runs: list[Run]
    until_tenants_done: set[str] | None  # stop a run once these tenants are served
    evaluate: Callable[[dict[str, list[RequestResult]], dict[str, float], Scenario], dict]


def build(
    name: str,
    *,
    seed: int,
    duration_s: float,
    steady_rate_per_s: float,
    num_workers: int = 2,
    requests_per_worker: int = 80,
    output_tokens_mean: float = 128.0,
    ttft_ratio_max: float | None = BURST_TTFT_RATIO_MAX,
) -> Scenario:
    """`ttft_ratio_max`: the burst scenarios' bound on the light tenant's TTFT p99 over its
    own alone (`burst_ttft_ratio_max`), or None for none."""
    if name == "noisy-neighbour":
        return noisy_neighbour(seed, duration_s, steady_rate_per_s)
    if name == "weighted":
        return weighted(seed, output_tokens_mean=output_tokens_mean)
    if name == "burst-fill":
        return burst(seed, duration_s, steady_rate_per_s, ttft_ratio_max, fills_kv=False)
    if name == "burst-kv":
        return burst(seed, duration_s, steady_rate_per_s, ttft_ratio_max, fills_kv=True)
    if name == "weighted-pool":
        return weighted_pool(seed, num_workers, requests_per_worker, output_tokens_mean)
    raise ValueError(f"unknown scenario {name!r}; one of {SCENARIOS}")


def noisy_neighbour(seed: int, duration_s: float, steady_rate_per_s: float) -> Scenario:
    num_steady = max(1, round(duration_s * steady_rate_per_s))

    def traffic(
        tenant: str, offset: int, first_index: int, rate_per_s: float, count: int
    ) -> list[RequestSpec]:
        # `offset` seeds the tenant's stream; its requests are numbered from `first_index`.
        specs = make_workload(
            count,
            seed=seed + offset,
            arrival="poisson",
            rate_per_s=rate_per_s,
            prompt_tokens_min=64,
            prompt_tokens_max=256,
            output_tokens_mean=64.0,
            output_tokens_max=128,
        )
        # Independent Poisson streams: each tenant's first request comes after its own
        # exponential gap, not all three at 0 s (make_workload starts a single stream at 0,
        # which here would make every tenant's first prompt arrive in the same instant).
        first_s = np.random.default_rng(seed + offset + 1).exponential(1 / rate_per_s)
        return [
            dataclasses.replace(
                s, tenant=tenant, index=first_index + s.index, arrival_s=first_s + s.arrival_s
            )
            for s in specs
        ]

    # A's requests first, then B's and C's: distinct indices however long the run.
    flood = traffic("A", 0, 0, 10 * steady_rate_per_s, 10 * num_steady)
    steady = traffic("B", 10_000, 10 * num_steady, steady_rate_per_s, num_steady)
    steady += traffic("C", 20_000, 11 * num_steady, steady_rate_per_s, num_steady)
    tenants = [TenantSpec("A"), TenantSpec("B"), TenantSpec("C")]
    limited = [TenantSpec("A", max_requests_in_flight=A_MAX_REQUESTS_IN_FLIGHT), *tenants[1:]]
    return Scenario(
        tenants=tenants,
        workloads={"alone": _by_arrival(steady), "flooded": _by_arrival(steady + flood)},
        runs=[
            Run("B+C alone (fair)", "fair", "alone"),
            Run("A floods (fair)", "fair", "flooded"),
            Run(
                f"A floods, <={A_MAX_REQUESTS_IN_FLIGHT} in flight (fair)",
                "fair",
                "flooded",
                limited,
            ),
            Run("A floods (fifo)", "fifo", "flooded"),
        ],
        until_tenants_done={"B", "C"},
        evaluate=_evaluate_noisy_neighbour,
    )


def weighted(
    seed: int, num_requests_per_tenant: int = 80, output_tokens_mean: float = 128.0
) -> Scenario:
    """Outputs: exponential, mean `output_tokens_mean`, at most twice that."""
    tenants = [TenantSpec("A", weight=4), TenantSpec("B", weight=2), TenantSpec("C", weight=1)]
    workload: list[RequestSpec] = []
    for offset, tenant in enumerate(tenants):
        specs = make_workload(
            num_requests_per_tenant,
            seed=seed + offset,
            arrival="burst",
            burst_window_s=0.5,
            prompt_tokens_min=32,
            prompt_tokens_max=96,
            output_tokens_mean=output_tokens_mean,
            output_tokens_max=round(2 * output_tokens_mean),
        )
        workload += [
            dataclasses.replace(s, tenant=tenant.name, index=offset * 10_000 + s.index)
            for s in specs
        ]
    return Scenario(
        tenants=tenants,
        workloads={"backlogged": _by_arrival(workload)},
        runs=[Run("4:2:1 (fair)", "fair", "backlogged"), Run("4:2:1 (fifo)", "fifo", "backlogged")],
        until_tenants_done=None,
        evaluate=_evaluate_weighted,
    )


def burst(
    seed: int,
    duration_s: float,
    rate_per_s: float,
    ttft_ratio_max: float | None,
    *,
    fills_kv: bool,
    burst_size: int = BURST_SIZE,
) -> Scenario:
    """A sends `burst_size` requests at once (a GPU's check sends more: `bench/gpu_check.py`);
    from 0.5 s, B (same tier and weight) sends one short request every 1 / `rate_per_s`
    seconds for `duration_s`. `burst-fill`: A's requests all alike (32-token prompts, 128
    tokens out), so they fill every place of the batch and finish together. `burst-kv`:
    A's are longer (prompts 64-256, 128-384 out) and the KV pool holds 4,096 tokens, far
    below what A's running requests need, so the worker preempts all the time while B
    arrives."""
    rng = np.random.default_rng(seed)

    def request(index: int, tenant: str, arrival_s: float, num_prompt: int, num_out: int):
        prompt = rng.integers(1000, 20000, size=num_prompt).tolist()
        return RequestSpec(index, arrival_s, prompt, num_out, tenant)

    if fills_kv:
        num_prompt = rng.integers(64, 256, burst_size)
        sizes = list(zip(num_prompt, rng.integers(128, 384, burst_size), strict=True))
    else:
        sizes = [(32, 128)] * burst_size
    flood = [request(i, "A", 0.0, int(p), int(o)) for i, (p, o) in enumerate(sizes)]
    num_light = max(1, round(duration_s * rate_per_s))
    light = [request(burst_size + i, "B", 0.5 + i / rate_per_s, 32, 32) for i in range(num_light)]
    engine = {"num_kv_blocks": BURST_KV_BLOCKS} if fills_kv else {}
    name = "burst-kv" if fills_kv else "burst-fill"
    return Scenario(
        tenants=[TenantSpec("A"), TenantSpec("B")],
        workloads={"alone": light, "burst": _by_arrival(flood + light)},
        runs=[
            Run("B alone (fair)", "fair", "alone", engine=engine),
            Run(f"A's burst, {name} (fair)", "fair", "burst", engine=engine),
            Run(f"A's burst, {name} (fifo)", "fifo", "burst", engine=engine),
        ],
        until_tenants_done=None,
        evaluate=lambda runs, durations, plan: _evaluate_burst(runs, plan, ttft_ratio_max),
    )


def weighted_pool(
    seed: int, num_workers: int, requests_per_worker: int = 80, output_tokens_mean: float = 128.0
) -> Scenario:
    """The weighted scenario (4:2:1, all backlogged, `requests_per_worker` requests per
    tenant per worker) over `num_workers` workers with skewed
    ingress: every other worker has an affinity for A, the rest for B (each takes its
    tenant's requests first, up to all its room), so one worker holds mostly A's requests
    and another mostly B's. Runs: the pool's shared service counters, and each worker
    with counters of its own (a fair queue per worker, as a router-level DRR would)."""
    base = weighted(seed, requests_per_worker * num_workers, output_tokens_mean)
    affinity = (("A",), ("B",))
    runs = [
        Run(f"4:2:1 over {num_workers} workers, pool counters (fair)", "fair", "backlogged",
            num_workers=num_workers, affinity=affinity),
        Run(f"4:2:1 over {num_workers} workers, a fair queue per worker", "fair", "backlogged",
            num_workers=num_workers, fairness_scope="worker", affinity=affinity),
    ]  # fmt: skip
    return dataclasses.replace(
        base,
        runs=runs,
        evaluate=lambda runs, durations, plan: _evaluate_weighted(
            runs, durations, plan, share_error_max=POOL_SHARE_ERROR_MAX
        ),
    )


def burst_ttft_ratio_max(simulate: str | None, name: str = "burst-fill") -> float | None:
    """The burst scenarios' bound on B's TTFT p99 over alone, run on this CPU or simulated
    (`--simulate`); None: none. On a CPU burst-kv has no bound: B's prompt shares its step
    with A's recompute chunks, whose cost the issue's 3x for burst-fill does not cover
    (docs/benchmarks.md, session 9); its flat-device bound checks the policy."""
    if simulate == "flat":
        return FLAT_BURST_TTFT_RATIO_MAX
    return None if name == "burst-kv" else BURST_TTFT_RATIO_MAX


def _by_arrival(specs: list[RequestSpec]) -> list[RequestSpec]:
    return sorted(specs, key=lambda s: s.arrival_s)


def tenant_of(scenario: Scenario) -> dict[int, str]:
    return {s.index: s.tenant for specs in scenario.workloads.values() for s in specs}


def per_tenant(results: list[RequestResult], tenants: dict[int, str]) -> dict[str, list]:
    grouped: dict[str, list[RequestResult]] = {}
    for result in results:
        grouped.setdefault(tenants[result.index], []).append(result)
    return grouped


def _evaluate_noisy_neighbour(runs, durations, scenario: Scenario) -> dict:
    tenants = tenant_of(scenario)
    ttft_p99 = {
        label: {
            tenant: metrics.percentiles([r.ttft_s for r in rs if r.is_ok and r.ttft_s])["p99"]
            for tenant, rs in per_tenant(results, tenants).items()
        }
        for label, results in runs.items()
    }
    alone, *flooded = (run.label for run in scenario.runs)
    target = TARGETS["noisy_neighbour_ttft_p99_ratio_max"]
    checks = {}
    for label in flooded:
        worst = max(ttft_p99[label][t] / ttft_p99[alone][t] for t in ("B", "C"))
        checks[f"B and C TTFT p99 / alone, {label} <= {target}"] = check(worst, "<=", target)
    refused = {
        label: sum(not r.is_ok for r in results if tenants[r.index] == "A")
        for label, results in runs.items()
    }
    return {"ttft_p99_s": ttft_p99, "num_refused_A": refused, "checks": checks}


def _evaluate_weighted(
    runs, durations, scenario: Scenario, share_error_max: float | None = None
) -> dict:
    """Shares, fairness index and throughput of the first run; the second (FIFO, or a fair
    queue per worker) is the throughput baseline."""
    tenants = tenant_of(scenario)
    weights = {t.name: t.weight for t in scenario.tenants}
    share_error_max = share_error_max or TARGETS["weighted_share_error_max"]
    fair, fifo = (run.label for run in scenario.runs)
    report: dict[str, Any] = {"runs": {}}
    for label, results in runs.items():
        report["runs"][label] = _weighted_service(per_tenant(results, tenants), weights)
    throughput = {
        label: sum(r.num_output_tokens for r in results) / durations[label]
        for label, results in runs.items()
    }
    fair_run = report["runs"][fair]
    share_error = max(abs(e) for e in fair_run["share_error"].values())
    min_jain = min(fair_run["jain_per_window"], default=0.0)
    ratio = throughput[fair] / throughput[fifo]
    report["output_tokens_per_s"] = throughput
    report["checks"] = {
        f"weighted service within +-{share_error_max:.0%} of 4:2:1 ({fair})": check(
            share_error, "<=", share_error_max
        ),
        f"Jain's index >= 0.98 in every 10 s window ({fair})": check(
            min_jain, ">=", TARGETS["weighted_jain_min"]
        ),
        f"output throughput, {fair} / {fifo} >= 0.95": check(
            ratio, ">=", TARGETS["fair_over_fifo_throughput_min"]
        ),
    }
    return report


def _evaluate_burst(runs, scenario: Scenario, ttft_ratio_max: float | None) -> dict:
    """B's TTFT p99 under A's burst against alone; A's output throughput under fair queuing
    against FIFO's (fairness must stay work-conserving); every request of the burst ended
    with all its tokens (preempted work is recomputed, never lost)."""
    tenants = tenant_of(scenario)
    alone, fair, fifo = (run.label for run in scenario.runs)
    grouped = {label: per_tenant(results, tenants) for label, results in runs.items()}
    ttft_p99 = {
        label: {t: _ttft_p99(rs) for t, rs in by_tenant.items()}
        for label, by_tenant in grouped.items()
    }
    throughput = {label: _throughput(grouped[label]["A"]) for label in (fair, fifo)}
    expected = {s.index: s.max_tokens for s in scenario.workloads["burst"]}
    checks = {}
    ttft_ratio = {label: ttft_p99[label]["B"] / ttft_p99[alone]["B"] for label in (fair, fifo)}
    for label, ratio in ttft_ratio.items():
        if ttft_ratio_max is not None:
            checks[f"B's TTFT p99 / alone, {label} <= {ttft_ratio_max}"] = check(
                ratio, "<=", ttft_ratio_max
            )
    ratio = throughput[fair] / throughput[fifo]
    checks[f"A's output throughput, {fair} / {fifo} >= 0.95"] = check(
        ratio, ">=", TARGETS["fair_over_fifo_throughput_min"]
    )
    num_short = sum(not r.is_ok or r.num_output_tokens != expected[r.index] for r in runs[fair])
    checks[f"requests that ended short, {fair} == 0"] = check(num_short, "==", 0)
    recomputed = {
        label: sum(r.num_computed_tokens - r.num_prompt_tokens - r.num_output_tokens + 1
                   for r in results if r.num_computed_tokens)
        for label, results in runs.items()
    }  # fmt: skip
    return {
        "ttft_p99_s": ttft_p99,
        "B_ttft_p99_over_alone": ttft_ratio,
        "A_output_tokens_per_s": throughput,
        "tokens_recomputed": recomputed,
        "checks": checks,
    }


COMPARISONS: dict[str, Callable[[float, float], bool]] = {
    "<=": lambda value, target: value <= target,
    ">=": lambda value, target: value >= target,
    "==": lambda value, target: value == target,
}


def check(value: float, op: str, target: float) -> dict[str, Any]:
    """One target of a scenario: the measured value, how it compares, and whether it is met."""
    return {"value": value, "op": op, "target": target, "is_met": COMPARISONS[op](value, target)}


def combine_repeats(evaluations: list[dict]) -> dict:
    """The checks of one scenario run several times (`llmfleet bench --repeat`): each value
    is the mean over the repeats, met as one value would be; the repeats' own values are
    kept. On this 2-core CPU one run's throughput moves 10-15% with nothing changed
    (docs/benchmarks.md), so a ratio between two runs needs several, in alternating order."""
    checks = {}
    for name, first in evaluations[0]["checks"].items():
        values = [evaluation["checks"][name]["value"] for evaluation in evaluations]
        checks[name] = check(float(np.mean(values)), first["op"], first["target"])
        checks[name]["repeats"] = values
    return {"checks": checks, "repeats": evaluations}


def _ttft_p99(results: list[RequestResult]) -> float:
    return metrics.percentiles([r.ttft_s for r in results if r.is_ok and r.ttft_s])["p99"]


def _throughput(results: list[RequestResult]) -> float:
    """Output tokens per second from the first request's start to the last one's end."""
    span_s = max(r.end_s for r in results) - min(r.start_s for r in results)
    return sum(r.num_output_tokens for r in results) / span_s


def _weighted_service(grouped: dict[str, list[RequestResult]], weights: dict[str, int]) -> dict:
    """Token service per tenant while every tenant is backlogged, overall and per window.

    Every tenant is backlogged from the moment all requests have been accepted (queued by
    the server: over HTTP the API admits a burst of hundreds of requests over seconds,
    while the workers serve whatever has arrived) until its last request starts (its first
    token); service counts output tokens when they are produced and prompt tokens with the
    first output token. Produced: when the broker published them, where that was recorded
    (full-stack runs, `bench/service_recorder.py`), else when they reached the client.
    """
    start_s = max(r.accepted_s or r.start_s for rs in grouped.values() for r in rs)
    events = {tenant: _service_events(rs) for tenant, rs in grouped.items()}
    end_s = min(max(first_s for first_s, _ in starts) for starts, _ in events.values())

    def served(tenant: str, lo_s: float, hi_s: float) -> float:
        return float(sum(n for t, n in events[tenant][1] if lo_s <= t < hi_s))

    total = {tenant: served(tenant, start_s, end_s) for tenant in grouped}
    total_weight = sum(weights[t] for t in grouped)
    all_service = sum(total.values()) or 1.0
    share_error = {t: (total[t] / all_service) / (weights[t] / total_weight) - 1.0 for t in grouped}
    windows = []
    for lo_s in np.arange(start_s, end_s - WINDOW_S + 1e-9, WINDOW_S):
        normalised = [served(t, lo_s, lo_s + WINDOW_S) / weights[t] for t in grouped]
        windows.append(jain_index(normalised))
    return {
        "backlogged_s": end_s - start_s,
        "tokens_served": total,
        "share_error": share_error,
        "jain_per_window": windows,
    }


def _service_events(results: list[RequestResult]):
    """Each request's first token (time, prompt tokens), and every (time, tokens) of service:
    the prompt with the first output token, then the output tokens."""
    starts, served = [], []
    for result in results:
        produced = result.published or [(t, 1) for t in result.chunk_times_s]
        if not produced:
            continue
        starts.append((produced[0][0], result.num_prompt_tokens))
        served += [starts[-1], *produced]
    return starts, served


def jain_index(values: list[float]) -> float:
    """Jain's fairness index: (sum x)^2 / (n * sum x^2); 1.0 when all are equal."""
    squares = sum(v * v for v in values)
    return sum(values) ** 2 / (len(values) * squares) if squares else 1.0
