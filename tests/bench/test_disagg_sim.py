"""`python -m bench.disagg_sim`: aggregated against disaggregated serving on a simulated clock,
with the real scheduler in every worker and hand-offs adopted by the decode worker."""

from __future__ import annotations

import json

from bench import disagg_sim
from bench.simulate import COST_MODELS
from bench.workload import make_workload
from worker.config import EngineConfig


def _args(**overrides):
    return disagg_sim._parser().parse_args(
        [f"--{k.replace('_', '-')}={v}" for k, v in {"num_requests": 300, **overrides}.items()]
    )


def test_long_prompts_beside_decodes_cost_the_aggregated_itl_not_the_disaggregated():
    result = disagg_sim.compare(_args(rate_per_s=20))
    agg, dis = result["modes"]["aggregated"], result["modes"]["disaggregated"]
    assert agg["num_completed"] == dis["num_completed"] == 300
    # A decode step that carries a 2,048-token chunk costs ~3x one that does not (flat model).
    assert result["itl_p99_aggregated_over_disaggregated"] >= 2.0
    assert dis["kv_transfer"]["requests"] > 0 and agg["kv_transfer"]["requests"] == 0


def test_every_request_gets_all_its_tokens_once_in_both_modes():
    workload = make_workload(120, seed=3, rate_per_s=30, long_prompt_fraction=0.2,
                             long_prompt_tokens=4096, output_tokens_mean=64)  # fmt: skip
    config = EngineConfig(max_num_seqs=8, max_num_batched_tokens=512, shared_batched_tokens=None,
                          num_kv_blocks=1024)  # fmt: skip
    link = disagg_sim.Link(1.0, disagg_sim.KV_BYTES_PER_TOKEN)  # slow: transfers overlap
    for mode in ("aggregated", "disaggregated"):
        traces = disagg_sim.run(mode, workload, config, COST_MODELS["flat"], link)
        assert [len(t.token_times_s) for t in traces] == [spec.max_tokens for spec in workload]
        assert all(t.token_times_s == sorted(t.token_times_s) for t in traces)
        assert all(t.token_times_s[0] >= t.arrival_s for t in traces)
        if mode == "disaggregated":
            moved = [t for t in traces if len(t.token_times_s) > 1]
            assert all(t.kv_bytes == t.num_prompt_tokens * link.kv_bytes_per_token for t in moved)
            # The second token comes after the first's KV crossed the link.
            assert all(t.token_times_s[1] - t.token_times_s[0] >= t.transfer_s for t in moved)


def test_llmfleet_bench_runs_the_comparison_in_simulation(tmp_path):
    from typer.testing import CliRunner

    from cli.main import app

    out = tmp_path / "disagg.json"
    result = CliRunner().invoke(
        app,
        ["bench", "--disaggregation", "--simulate", "flat", "--num-requests", "60",
         "--long-prompt-fraction", "0.2", "--json", str(out)],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "ITL p99 aggregated / disaggregated" in result.output
    assert set(json.loads(out.read_text())["modes"]) == {"aggregated", "disaggregated"}
