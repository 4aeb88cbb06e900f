"""`llmfleet bench` end to end, on the tiny model: over HTTP against the running stack, and
engine-direct with --compare."""

from __future__ import annotations

import json
import subprocess
import sys

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
