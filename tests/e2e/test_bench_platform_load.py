"""`llmfleet bench --platform-load` end to end, small: a platform of its own with echo
workers, 50 streams and a burst of 100 requests, every figure of the report filled."""

from __future__ import annotations

import json
import subprocess
import sys

NUM_STREAMS = 50
TOKENS_PER_S = 5.0


def test_platform_load_reports_every_figure_without_errors(env, tiny_model_dir, tmp_path):
    out = tmp_path / "load.json"
    args = [
        "--platform-load", "--load-streams", str(NUM_STREAMS),
        "--load-tokens-per-s", str(TOKENS_PER_S), "--load-ramp-per-s", "100",
        "--load-hold-s", "3", "--load-burst-requests", "100", "--load-burst-concurrency", "16",
        "--load-sample-interval-s", "0.5", "--source", str(tiny_model_dir), "--json", str(out),
    ]  # fmt: skip
    result = subprocess.run(
        [sys.executable, "-m", "cli", "bench", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    streams, admission = report["streams"], report["admission"]
    assert streams["num_streams"] == NUM_STREAMS and streams["num_errors"] == 0
    assert streams["max_concurrent_streams"] == NUM_STREAMS
    assert streams["tokens_delivered"] == NUM_STREAMS * report["plan"]["max_tokens"]
    assert streams["api_streams_held"] > 0 and streams["memory_per_stream_bytes"] is not None
    assert streams["api_redis_connections_held"] > 0
    assert streams["redis_connections_per_stream"] is not None
    assert streams["fds_per_stream"] is not None
    assert streams["phase"]["api_cpu_per_token_us"] > 0
    assert streams["phase"]["redis_calls_per_token"] > 0
    # The echo worker's grid: its own ITL is its period (200 ms), whatever the relay adds.
    assert 150 < streams["worker_itl_ms"]["p50"] < 300
    assert streams["added_itl_ms"]["p99"] >= streams["added_itl_ms"]["p50"]
    assert admission["num_requests"] == 100 and admission["num_errors"] == 0
    assert admission["admitted_per_s"] > 0 and admission["api_cpu_per_request_us"] > 0
    assert admission["redis_calls_per_request"] > 0
    assert report["open_files"]["soft"] >= report["open_files"]["soft_before"]
    assert "admitted/s" in result.stdout and "bytes per stream" in result.stdout
