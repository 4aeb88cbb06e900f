"""`llmfleet bench --pool-spike` end to end, short and repeated twice: three platforms of
its own (with a shared worker, without, with a second dedicated worker for A), every request
served, the report filled, the figures over both repeats, and the shared worker seen on its
first model before the spike."""

from __future__ import annotations

import json
import subprocess
import sys


def test_pool_spike_reports_all_three_runs_without_errors(env, tiny_model_dir, tmp_path):
    out = tmp_path / "spike.json"
    args = [
        "--pool-spike", "--spike-rate-per-s", "1", "--spike-warmup-s", "3", "--spike-s", "8",
        "--spike-repeats", "2", "--source", str(tiny_model_dir), "--json", str(out),
    ]  # fmt: skip
    result = subprocess.run(
        [sys.executable, "-m", "cli", "bench", *args],
        env=env | {"LLMFLEET_POOL_MIN_DWELL_S": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    runs = report["runs"]
    assert set(runs) == {"with_shared_worker", "without_shared_worker", "second_dedicated_a_worker"}
    for run in runs.values():
        for model in ("a", "b"):
            assert run[model]["num_requests"] > 0 and run[model]["num_errors"] == 0
            assert run[model]["ttft_p99_s"] > 0
    first_seen = runs["with_shared_worker"]["shared_states"][0]
    assert first_seen[1] == "spike-b"  # its first model
    assert runs["without_shared_worker"]["shared_states"] == []
    assert report["a_ttft_p99_ratio"] > 0 and report["b_ttft_p99_ratio_same_hosts"] > 0
    # Two repeats of each platform, and the figures over both of their spikes.
    assert len(report["repeats"]) == 2 and report["runs"] == report["repeats"][0]
    for name, pooled in report["pooled"].items():
        for model in ("a", "b"):
            num_requests = sum(runs[name][model]["num_requests"] for runs in report["repeats"])
            assert pooled[model]["num_requests"] == num_requests
            assert pooled[model]["ttft_p99_s"] >= max(
                runs[name][model]["ttft_p50_s"] for runs in report["repeats"]
            )
