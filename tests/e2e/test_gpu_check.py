"""`bench/gpu_check.sh` on the CPU, `--quick`, on the tiny model: every section runs and the
report holds each one, so the script is known to work before a GPU session spends its
minutes on it. What needs CUDA says so instead of running."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Generous on a loaded 2-core machine: the sections' own deadlines skip what would not fit,
# and the test wants every measurement made.
BUDGETS = "correctness:150 steps:90 throughput:240 roofline:150 scenarios:240"


def test_gpu_check_quick_on_the_cpu_reports_every_section(tiny_model_dir, tmp_path):
    out = tmp_path / "gpu_check.json"
    env = os.environ | {
        "PYTHON": sys.executable,
        "WHEELHOUSE": str(tmp_path / "no-wheelhouse"),
        "GPU_CHECK_BUDGETS": BUDGETS,
        "GPU_CHECK_TOTAL_S": "900",
    }
    command = ["bash", "bench/gpu_check.sh", str(out), "--quick", "--device", "cpu",
               "--source", str(tiny_model_dir)]  # fmt: skip
    result = subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1000
    )
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    assert report["device"]["type"] == "cpu" and report["device"]["cuda"] == "skipped: no CUDA"
    sections = report["sections"]
    assert {name: data["status"] for name, data in sections.items()} == {
        "correctness": "ok", "steps": "ok", "throughput": "ok", "roofline": "ok",
        "scenarios": "ok",
    }, result.stdout  # fmt: skip

    correctness = {(r["weights"], r.get("graphs")): r for r in sections["correctness"]["results"]}
    assert correctness["gguf", None]["status"] == "skipped: the source is not a GGUF file"
    static = correctness["hf-directory", "static-path (no CUDA: not replayed)"]
    eager = correctness["hf-directory", "eager"]
    assert static["is_identical"] and eager["is_identical"]
    assert static["num_graph_replays"] > 0 and eager["num_graph_replays"] == 0

    steps = sections["steps"]["rows"]
    assert [row["num_chunks"] for row in steps] == [3, 3]
    for row in steps:
        assert set(row["median_s"]) == {"padded", "per call"}
        assert all(seconds > 0 for seconds in row["median_s"].values())

    runs = sections["throughput"]["runs"]
    assert len(runs) == 6  # 1, 32 and 128 streams, with and without the static path
    for run in runs.values():
        assert run["num_ok"] == run["num_requests"] > 0
        assert run["output_tokens_per_s"] > 0 and run["itl_s"]["p99"] >= run["itl_s"]["p50"] > 0
        assert (run["graph_replay_fraction"] > 0) == run["graphs"]
    assert {run["streams"] for run in runs.values()} == {1, 32, 128}

    roofline = sections["roofline"]
    assert roofline["bandwidth"]["bytes_per_s"] > 0
    points = roofline["points"]
    assert points["batch 1, eager"]["fraction_of_roofline"] > 0
    assert points["batch 64, eager"]["batch_size"] == 64
    assert points["batch 64, static-path (no CUDA: not replayed)"] == "skipped: no CUDA"

    scenarios = sections["scenarios"]
    assert scenarios["sizes"]["burst_size"] == 8  # quick: one batch of 8
    assert set(scenarios["results"]) == {"noisy-neighbour", "burst-fill"}
    for outcome in scenarios["results"].values():
        assert outcome["checks"] and outcome["per_tenant"]
    assert "== scenarios: ok" in result.stdout
