"""`llmfleet bench` end to end, on the tiny model: over HTTP against the running stack, and
engine-direct with --compare."""

from __future__ import annotations

import json
import subprocess
import sys

from bench.workload import make_workload

SMALL = ["--num-requests", "4", "--prompt-tokens-max", "40", "--output-tokens-mean", "6",
         "--output-tokens-max", "10", "--burst-window-s", "0.2"]  # fmt: skip


def _bench(env, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cli", "bench", *SMALL, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_bench_over_http_with_kv_samples(
    env, api_url, tiny_worker, tiny_deployment, make_tenant, redis_server, tmp_path
):
    _, key = make_tenant("bench")
    out = tmp_path / "http.json"
    result = _bench(
        env, "--url", api_url, "--api-key", key, "--model", tiny_deployment.model_id,
        "--redis-url", redis_server.url, "--json", str(out), "--plot", str(tmp_path / "p.png"),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    payload = json.loads(out.read_text())
    summary = payload["summaries"][f"http:{tiny_deployment.model_id}"]
    assert summary["num_ok"] == 4 and summary["num_failed"] == 0
    assert summary["total_output_tokens"] == sum(
        r["num_output_tokens"] for r in payload["requests"][f"http:{tiny_deployment.model_id}"]
    )
    assert summary["ttft_s"]["p50"] > 0
    assert "api_key" not in payload["arguments"]
    assert (tmp_path / "p.png").stat().st_size > 0


def test_bench_compare_engine_direct(env, tiny_model_dir, tmp_path):
    out = tmp_path / "compare.json"
    result = _bench(
        env, "--compare", "--source", str(tiny_model_dir), "--dtype", "float32", "--json", str(out)
    )
    assert result.returncode == 0, result.stderr
    payload = json.loads(out.read_text())
    assert set(payload["summaries"]) == {"engine:one", "engine:static", "engine:continuous"}
    # Same workload, forced lengths (ignore_eos): every engine produces the same token count.
    totals = {s["total_output_tokens"] for s in payload["summaries"].values()}
    assert len(totals) == 1
    assert "continuous / static (throughput)" in payload["ratios"]
    assert "continuous / one (throughput)" in result.stdout


def test_bench_disaggregation_over_the_whole_stack(env, tiny_model_dir, tmp_path):
    """Two platforms of its own: two `both` workers, then a prefill and a decode worker,
    each pinned to a core; every request of the second that outlives its first token is
    handed off, its KV bytes and transfer time recorded."""
    out = tmp_path / "disagg.json"
    options = {"num_requests": 6, "seed": 3, "arrival": "poisson", "rate_per_s": 16.0,
               "prompt_tokens_max": 40,
               "output_tokens_mean": 6.0, "output_tokens_max": 10,
               "long_prompt_fraction": 0.5, "long_prompt_tokens": 300}  # fmt: skip
    result = _bench(
        env, "--disaggregation", "--source", str(tiny_model_dir), "--dtype", "float32",
        *[arg for name, value in options.items()
          for arg in (f"--{name.replace('_', '-')}", str(value))],
        "--json", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    workload = make_workload(**options)
    handed_off = [r for r in workload if r.max_tokens > 1]  # the rest end at their first
    assert 0 < len(handed_off) < len(workload)
    payload = json.loads(out.read_text())
    aggregated, disaggregated = payload["aggregated"], payload["disaggregated"]
    for mode in (aggregated, disaggregated):
        assert (mode["num_ok"], mode["num_failed"]) == (len(workload), 0)
    assert aggregated["total_output_tokens"] == disaggregated["total_output_tokens"]
    assert aggregated["kv_transfer"]["num_handed_off"] == 0
    kv = disaggregated["kv_transfer"]
    assert kv["num_handed_off"] == len(handed_off)
    # The tiny model's KV: 512 bytes a token, whole blocks of 16 tokens.
    longest = max(len(r.prompt_token_ids) for r in handed_off)
    assert kv["bytes"]["max"] == 512 * 16 * -(-longest // 16) and kv["transfer_s"]["p50"] > 0
    assert "ITL p99 aggregated / disaggregated" in result.stdout
