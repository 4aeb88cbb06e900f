"""`llmfleet status`: the fleet snapshot as tables, from a constructed snapshot and from the
running stack."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid

from rich.console import Console

from cli.status import models_table, queues_table, workers_table
from shared import deployments, keys
from shared.fleet import FleetSnapshot, ModelSnapshot, QueueState, WorkerState
from shared.latency_window import LatencySummary
from tests.helpers import stream


def _render(*tables) -> str:
    console = Console(record=True, width=200)
    for table in tables:
        console.print(table)
    return console.export_text()


def test_tables_show_queues_workers_and_latencies():
    worker = WorkerState(
        "host-1-abc", "m", "ready", 1.25, num_running=3, num_waiting=1, kv_cache_usage=0.5,
        max_num_seqs=4, num_preemptions=2,
    )  # fmt: skip
    snap = ModelSnapshot(
        "m",
        [QueueState("ten_1", num_entries=7, num_pending=3, num_consumers=2)],
        [worker],
        LatencySummary(10, 0.1234, 0.9),
        LatencySummary(40, 0.02, 0.05),
    )
    fleet = FleetSnapshot(0.0, {"m": snap}, {"ten_1": "acme"})
    text = _render(models_table(fleet, 60), workers_table(fleet), queues_table(fleet))
    assert "Models (latency over the last 60 s)" in text
    model_row = next(line for line in text.splitlines() if "│ m " in line and "1/1" in line)
    for cell in ["1/1", "50.0%", "75.0%", "123.4 ms", "900.0 ms", "20.0 ms", "50.0 ms", "10/40"]:
        assert cell in model_row
    worker_row = next(line for line in text.splitlines() if "host-1-abc" in line)
    assert all(cell in worker_row for cell in ["ready", "50.0%", "1.2 s"])
    queue_row = next(line for line in text.splitlines() if "acme" in line)
    assert [c for c in queue_row.replace("│", " ").split()][-4:] == ["7", "3", "4", "2"]


def test_status_command_against_the_running_stack(
    env, api_url, tiny_worker, tiny_deployment, tiny_model_dir, db, make_tenant, rdb
):
    _, key = make_tenant("status")
    body = {"model": tiny_deployment.model_id, "prompt": "Hi there", "max_tokens": 4}
    assert stream(api_url, "/v1/completions", key, body).has_done
    # an entry of a model no worker serves: undelivered, no consumer group yet
    idle_model = f"status-idle-{uuid.uuid4().hex[:6]}"
    deployments.register(db, idle_model, str(tiny_model_dir))
    stream_key = keys.tenant_stream(idle_model, "ten_status")
    rdb.sadd(keys.model_tenants(idle_model), "ten_status")
    rdb.xadd(stream_key, {"body": "{}"})
    time.sleep(1.2)  # the worker pushes its latency samples once a second
    try:
        result = subprocess.run(
            [sys.executable, "-m", "cli", "status"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        rdb.delete(stream_key, keys.model_tenants(idle_model))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    model_row = next(line for line in lines if line.startswith("│ tiny-llama "))
    assert " ms " in model_row  # TTFT and ITL percentiles
    assert any("tiny-llama" in line and "ready" in line for line in lines)
    queue_row = next(line for line in lines if "ten_status" in line)
    assert queue_row.replace("│", " ").split()[:2] == [idle_model, "ten_status"]
    assert queue_row.replace("│", " ").split()[-4:] == ["1", "0", "1", "0"]
    idle_row = next(line for line in lines if line.startswith(f"│ {idle_model} "))
    assert idle_row.replace("│", " ").split()[1:6] == ["0/0", "0", "0", "1", "-"]
    assert any(line.startswith("│ status-") or " status-" in line for line in lines)
