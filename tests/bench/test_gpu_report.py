"""The GPU check's report (`bench/gpu_report.py`) and the sizes its scenarios take
(`bench/gpu_check.scale_scenarios`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import gpu_report


def _write(path: Path, name: str, data: dict) -> Path:
    path.write_text(json.dumps({name: data}))
    return path


def test_merge_keeps_every_section_and_says_which_did_not_finish(tmp_path):
    device = {"type": "cuda", "name": "H200", "torch": "2.11", "cuda": "13.0"}
    files = [
        _write(tmp_path / "c.json", "correctness", {"status": "ok", "device": device}),
        _write(tmp_path / "t.json", "throughput", {"status": "running", "runs": {"1": "x"}}),
        tmp_path / "missing.json",
    ]
    merged = gpu_report.merge(files, {"model": "m"})
    sections = merged["sections"]
    assert merged["model"] == "m" and merged["device"] == device
    assert sections["correctness"]["status"] == "ok"
    assert sections["throughput"]["status"].startswith("timed out")
    assert sections["throughput"]["runs"] == {"1": "x"}  # what it measured is kept
    assert sections["roofline"] == sections["scenarios"] == {"status": "did not run"}
    lines = "\n".join(gpu_report.summary(merged))
    assert "== throughput: timed out" in lines and "H200" in lines


def test_scenario_sizes_overload_the_measured_capacity():
    import torch

    from bench.gpu_check import NOISY_MEAN_OUTPUT_TOKENS, plan_for, scale_scenarios

    plan = plan_for(torch.device("cuda"), quick=False)
    for capacity in (2_000.0, 20_000.0):
        sizes = scale_scenarios(plan, capacity)
        assert sizes["burst_size"] == 4 * plan.scenario_engine.max_num_seqs  # > the batch
        a_tokens_per_s = 10 * sizes["noisy_steady_rate_per_s"] * NOISY_MEAN_OUTPUT_TOKENS
        assert a_tokens_per_s == pytest.approx(1.5 * capacity)  # A alone: above capacity
        light_tokens_per_s = 2 * sizes["noisy_steady_rate_per_s"] * NOISY_MEAN_OUTPUT_TOKENS
        assert light_tokens_per_s < 0.5 * capacity  # B and C alone: well within it
        # B's requests arrive while A's burst drains (128 tokens each), or for 4 s at least
        drain_s = sizes["burst_size"] * 128 / capacity
        assert sizes["burst_duration_s"] == pytest.approx(min(max(drain_s, 4.0), 32.0))
