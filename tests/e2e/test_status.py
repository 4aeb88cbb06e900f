"""`llmfleet status` against the running stack (the tables from a constructed snapshot:
tests/cli/test_status.py)."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid

from shared import deployments, keys
from tests.helpers import stream


def test_status_command_against_the_running_stack(
    env, api_url, tiny_worker, tiny_deployment, tiny_model_dir, db, make_tenant, rdb
):
    _, key = make_tenant("status")
    body = {"model": tiny_deployment.model_id, "prompt": "Hi there", "max_tokens": 4}
    assert stream(api_url, "/v1/completions", key, body).has_done
    # an entry of a model no worker serves: undelivered, no consumer group yet
    idle_model = f"status-idle-{uuid.uuid4().hex[:6]}"
    idle = deployments.register(db, idle_model, str(tiny_model_dir))
    stream_key = keys.tenant_stream(idle.name, "ten_status")
    rdb.sadd(keys.model_tenants(idle.name), "ten_status")
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
        rdb.delete(stream_key, keys.model_tenants(idle.name))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    model_row = next(line for line in lines if line.startswith("│ tiny-llama@1 "))
    assert " ms " in model_row  # TTFT and ITL percentiles
    assert any("tiny-llama" in line and "ready" in line for line in lines)
    queue_row = next(line for line in lines if "ten_status" in line)
    assert queue_row.replace("│", " ").split()[:2] == [idle.name, "ten_status"]
    assert queue_row.replace("│", " ").split()[-4:] == ["1", "0", "1", "0"]
    idle_row = next(line for line in lines if line.startswith(f"│ {idle.name} "))
    assert idle_row.replace("│", " ").split()[1:6] == ["0/0", "0", "0", "1", "-"]
    assert any(line.startswith("│ status-") or " status-" in line for line in lines)
