"""Structured logs of the running platform: the API's and the worker's JSON lines carry the
request's ids and none of its text (the formatter itself: tests/shared/test_logs.py)."""

from __future__ import annotations

import json
import time

from tests.helpers import stream


def _json_lines(paths) -> list[dict]:
    lines = []
    for path in paths:
        for raw in path.read_text().splitlines():
            if raw.startswith("{"):
                lines.append(json.loads(raw))
    return lines


def test_request_log_lines_carry_ids_and_no_text(
    api_url, tiny_worker, tiny_deployment, make_tenant, home
):
    tenant_id, key = make_tenant("logs")
    prompt = "Zebra quantum lighthouse"
    body = {
        "model": tiny_deployment.model_id,
        "prompt": prompt,
        "max_tokens": 8,
        "ignore_eos": True,
    }
    result = stream(api_url, "/v1/completions", key, body)
    request_id = result.headers["x-request-id"]
    port = api_url.rsplit(":", 1)[1]
    paths = [home / f"api-{port}.log", *home.glob(f"worker-{tiny_deployment.model_id}-*.log")]
    deadline = time.monotonic() + 10
    while True:
        lines = [line for line in _json_lines(paths) if line.get("request_id") == request_id]
        if {line["logger"] for line in lines} >= {"uvicorn.access", "llmfleet.worker"}:
            break
        assert time.monotonic() < deadline, lines
        time.sleep(0.2)
    access = next(line for line in lines if line["logger"] == "uvicorn.access")
    assert access["tenant_id"] == tenant_id and access["model"] == tiny_deployment.model_id
    assert access["path"] == "/v1/completions" and access["status"] == 200
    finished = next(line for line in lines if line["message"] == "request finished")
    assert finished["tenant_id"] == tenant_id and finished["num_output_tokens"] == 8
    everything = "".join(path.read_text() for path in paths)
    assert prompt not in everything and key not in everything
    if len(result.text.strip()) >= 8:
        assert result.text not in everything
