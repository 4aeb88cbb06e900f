"""The scheduler on a simulated clock (bench/simulate.py): the real scheduler, fair queue and
KV-cache manager with a runner that only costs virtual time. Deterministic, so the tenancy
targets of the policy itself are checked here, apart from the machine's speed."""

from __future__ import annotations

import pytest

from bench import scenarios, simulate
from bench.engine_direct import run_engine
from bench.scenario_driver import run_plan
from bench.workload import make_workload
from tests.factories import make_sequence
from worker.config import EngineConfig

TTFT_RATIO = "B and C TTFT p99 / alone, A floods ({queueing}) <= 1.3"


def _evaluate(name: str, cost: str, **build) -> dict[str, dict]:
    plan = scenarios.build(name, seed=0, ttft_ratio_max=scenarios.burst_ttft_ratio_max(cost, name),
                           **build)  # fmt: skip
    make_engine = simulate.engine_factory(simulate.COST_MODELS[cost])
    runs, durations = run_plan(plan, EngineConfig(), make_engine, simulate.NullDecoder())
    return plan.evaluate(runs, durations, plan)["checks"]


def _check(checks: dict[str, dict], label: str) -> dict:
    (outcome,) = [outcome for check, outcome in checks.items() if label in check]
    return outcome


def test_a_step_costs_virtual_time_by_its_shape():
    clock = simulate.VirtualClock()
    cost = simulate.StepCost(fixed_s=0.01, per_token_s=0.001, per_context_token_s=0.0001)
    engine = simulate.build_engine(EngineConfig(max_num_batched_tokens=64), clock, cost)
    engine.add(make_sequence(0, num_prompt_tokens=40, max_tokens=3))
    started_s = clock.now()
    engine.step()  # the whole prompt: 40 tokens, no decodes
    assert clock.now() - started_s == pytest.approx(0.01 + 0.040)
    engine.step()  # one decode attending to 41 tokens
    assert clock.now() - started_s == pytest.approx(0.05 + 0.01 + 0.001 + 0.0041)


def test_under_a_flat_step_cost_fair_queuing_keeps_light_tenants_ttft_where_fifo_does_not():
    # A device whose step time is flat in the batch (a GPU at this model size), loaded as the
    # CPU benchmark loads the CPU: B and C well within their share, A ten times their rate.
    checks = _evaluate("noisy-neighbour", "flat", duration_s=60, steady_rate_per_s=3.4)
    assert checks[TTFT_RATIO.format(queueing="fair")]["is_met"]
    assert not checks[TTFT_RATIO.format(queueing="fifo")]["is_met"]


def test_backlogged_weighted_tenants_get_their_shares_at_fifos_throughput():
    checks = _evaluate("weighted", "cpu", duration_s=0, steady_rate_per_s=0)
    assert checks and all(outcome["is_met"] for outcome in checks.values()), checks


def test_engine_direct_runs_hold_at_most_max_concurrency_requests_in_flight():
    # As the HTTP client does: an arrived request waits for a slot, and its time starts
    # once it holds one.
    clock = simulate.VirtualClock()
    engine = simulate.build_engine(EngineConfig(), clock, simulate.COST_MODELS["flat"])
    workload = make_workload(12, seed=0, arrival="burst", burst_window_s=0.0)
    run = run_engine(
        engine,
        simulate.NullDecoder(),
        workload,
        show_progress=False,
        clock=clock,
        max_concurrency=3,
    )
    assert all(result.is_ok and result.end_s for result in run.results)
    events = sorted(
        [(result.start_s, 1) for result in run.results]
        + [(result.end_s, -1) for result in run.results]
    )  # an end and a start at the same instant: the end first
    in_flight = peak = 0
    for _, change in events:
        in_flight += change
        peak = max(peak, in_flight)
    assert peak == 3
    # The fourth request started when the first to finish ended, not at its arrival.
    first_end = min(result.end_s for result in run.results)
    assert sorted(result.start_s for result in run.results)[3] == first_end


def test_under_a_flat_step_cost_light_tenants_keep_their_ttft_when_a_flood_fills_the_device():
    # A at 2.4 times the device's capacity: the batch is full of A's work and A's prompts
    # are always waiting. B's and C's prompts still start within their TTFT alone.
    checks = _evaluate("noisy-neighbour", "flat", duration_s=120, steady_rate_per_s=8)
    assert checks[TTFT_RATIO.format(queueing="fair")]["is_met"]
    assert not checks[TTFT_RATIO.format(queueing="fifo")]["is_met"]


@pytest.mark.parametrize("name", ["burst-fill", "burst-kv"])
def test_a_light_tenant_starts_within_its_ttft_alone_while_a_burst_fills_the_batch(name):
    # A's 120 requests at once fill every place (burst-kv: and far more than the KV pool
    # holds, so the worker preempts all along); B sends a short request 5 times a second.
    # The worker takes B's request though its batch is full, and B displaces A's work at
    # once, where FIFO, and the intake before it took heads, waited for A's first wave.
    checks = _evaluate(name, "flat", duration_s=10, steady_rate_per_s=5)
    assert _check(checks, "TTFT p99 / alone, A's burst, " + name + " (fair)")["is_met"]
    assert _check(checks, "TTFT p99 / alone, A's burst, " + name + " (fifo)")["value"] > 10
    assert _check(checks, "A's output throughput")["is_met"]  # work-conserving
    assert _check(checks, "ended short")["is_met"]  # preempted work recomputed, none lost


@pytest.mark.parametrize("num_workers", [2, 4])
def test_weighted_shares_hold_for_a_pool_whose_workers_see_mostly_one_tenant(num_workers):
    # Half the workers take A's requests first, the other half B's (affinity): C's requests
    # reach every worker only as the next in line. The pool still serves 4:2:1.
    checks = _evaluate("weighted-pool", "cpu", duration_s=0, steady_rate_per_s=0,
                       num_workers=num_workers)  # fmt: skip
    assert checks and all(outcome["is_met"] for outcome in checks.values()), checks


def test_bench_repeats_a_scenario_in_alternating_order_and_checks_the_means(tmp_path):
    # One run's throughput on a 2-core CPU moves 10-15% with nothing changed, so a ratio
    # of two runs is measured over repeats, every other one in reverse order.
    import json

    from typer.testing import CliRunner

    from cli.main import app

    path = tmp_path / "repeat.json"
    result = CliRunner().invoke(app, [
        "bench", "--scenario", "burst-fill", "--simulate", "flat", "--repeat", "2",
        "--scenario-duration-s", "2", "--steady-rate-per-s", "5", "--json", str(path),
    ])  # fmt: skip
    assert result.exit_code == 0, result.output
    started = [line.split(": ", 1)[1] for line in result.output.splitlines()
               if line.startswith("burst-fill: ") and line.endswith(" ...")]  # fmt: skip
    assert len(started) == 6 and started[3:] == started[:3][::-1]
    saved = json.loads(path.read_text())
    assert len(saved["repeats"]) == 2
    for name, outcome in saved["evaluation"]["checks"].items():
        values = [r["evaluation"]["checks"][name]["value"] for r in saved["repeats"]]
        assert outcome["repeats"] == values
        assert outcome["value"] == pytest.approx(sum(values) / 2)


def test_a_measured_engine_serves_a_warm_up_before_each_run_and_only_the_run_is_reported():
    # A measured run's first requests must not pay a cold process's costs; the warm-up's own
    # requests (a tenant of their own) are never part of the results.
    plan = scenarios.build("burst-fill", seed=0, duration_s=2, steady_rate_per_s=1,
                           ttft_ratio_max=3.0)  # fmt: skip
    make_simulated = simulate.engine_factory(simulate.COST_MODELS["flat"])
    tenants_added: list[list[str]] = []

    def make_measured(config):  # the simulated engine, timed as a real one is
        engine, _ = make_simulated(config)
        tenants_added.append([])
        add = engine.add

        def recording_add(seq):
            tenants_added[-1].append(seq.tenant_id)
            return add(seq)

        engine.add = recording_add
        return engine, None

    runs, _ = run_plan(plan, EngineConfig(), make_measured, simulate.NullDecoder())
    assert len(tenants_added) == len(plan.runs)
    for planned, added in zip(plan.runs, tenants_added, strict=True):
        workload = plan.workloads[planned.workload]
        assert added[:4] == [scenarios.WARMUP_TENANT] * 4  # first, before the run's own
        assert scenarios.WARMUP_TENANT not in added[4:]
        assert [r.index for r in runs[planned.label]] == [s.index for s in workload]
