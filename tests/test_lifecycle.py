"""Cancellation on client disconnect, and two deployments served by two workers through one API."""

from __future__ import annotations

import json
import time

import httpx
from sqlmodel import Session, select

from shared.tables import UsageRecord
from tests.helpers import auth, stream


def _wait_for_usage(db, request_id: str, timeout_s: float = 30) -> UsageRecord:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with Session(db) as session:
            record = session.exec(
                select(UsageRecord).where(UsageRecord.request_id == request_id)
            ).first()
        if record is not None:
            return record
        time.sleep(0.1)
    raise AssertionError(f"no usage record for {request_id}")


def test_client_disconnect_cancels_generation(
    api_url, tiny_worker, tiny_deployment, make_tenant, db
):
    _, key = make_tenant("cancel")
    max_tokens = 900
    body = {
        "model": tiny_deployment.model_id,
        "prompt": "go",
        "max_tokens": max_tokens,
        "stream": True,
    }
    with (
        httpx.Client(timeout=60) as client,
        client.stream("POST", f"{api_url}/v1/completions", json=body, headers=auth(key)) as r,
    ):
        request_id = r.headers["x-request-id"]
        lines = r.iter_lines()
        received = 0
        for line in lines:
            if line.startswith("data:"):
                json.loads(line[5:])
                received += 1
            if received == 3:
                break
    # Leaving the block closed the connection mid-stream.
    record = _wait_for_usage(db, request_id)
    assert record.finish_reason == "cancelled"
    assert 3 <= record.output_tokens < max_tokens


def test_two_deployments_served_through_one_api(
    api_url, tiny_worker, start_worker, tiny_deployment, tiny_deployment_b, make_tenant
):
    start_worker(tiny_deployment_b.model_id, "--batching", "one")
    _, key = make_tenant("two-models")
    body = {"prompt": "Same prompt", "max_tokens": 8, "temperature": 0}
    a = stream(api_url, "/v1/completions", key, {**body, "model": tiny_deployment.model_id})
    b = stream(api_url, "/v1/completions", key, {**body, "model": tiny_deployment_b.model_id})
    assert a.has_done and b.has_done
    assert a.chunks[0]["model"] == tiny_deployment.model_id
    assert b.chunks[0]["model"] == tiny_deployment_b.model_id
    assert a.text != b.text  # different weights, so each answer came from its own worker
    models = httpx.get(f"{api_url}/v1/models", headers=auth(key)).json()["data"]
    assert {tiny_deployment.model_id, tiny_deployment_b.model_id} <= {m["id"] for m in models}
