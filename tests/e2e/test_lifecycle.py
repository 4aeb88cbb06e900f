"""Cancellation on client disconnect, and two deployments served by two workers through one API."""

from __future__ import annotations

import json
import time
import uuid

import httpx

from shared import keys
from shared.protocol import ErrorEvent, FinalEvent, TokenEvent, decode_event, encode_cancel
from tests.conftest import TINY_KV_CAPACITY_TOKENS
from tests.factories import make_request
from tests.helpers import auth, stream, wait_for_usage_record


def test_client_disconnect_cancels_generation(
    api_url, tiny_worker, tiny_deployment, make_tenant, db, rdb
):
    _, key = make_tenant("cancel")
    max_tokens = 450
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
    record = wait_for_usage_record(db, request_id)
    assert record.finish_reason == "cancelled"
    assert 3 <= record.output_tokens < max_tokens
    # ...and its KV blocks went back to the pool (the worker reports usage in its heartbeat).
    assert _wait_for_kv_usage(rdb, tiny_worker.pid) == 0.0


def _wait_for_kv_usage(rdb, pid: int, timeout_s: float = 10) -> float:
    deadline = time.monotonic() + timeout_s
    usage = None
    while time.monotonic() < deadline:
        for key in rdb.scan_iter(keys.worker_heartbeat_pattern()):
            info = rdb.hgetall(key)
            if info.get(b"pid") == str(pid).encode() and b"kv_cache_usage" in info:
                usage = float(info[b"kv_cache_usage"])
        if usage == 0.0:
            return usage
        time.sleep(0.2)
    return usage


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


def test_kv_capacity_is_refused_at_the_api(api_url, tiny_worker, tiny_deployment, make_tenant, rdb):
    tenant_id, key = make_tenant("capacity")
    body = {"model": tiny_deployment.model_id, "prompt": "hello", "max_tokens": 600}
    response = httpx.post(f"{api_url}/v1/completions", json=body, headers=auth(key), timeout=30)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded" and "KV cache" in error["message"]
    assert str(TINY_KV_CAPACITY_TOKENS) in error["message"]
    assert rdb.exists(keys.tenant_stream(tiny_deployment.name, tenant_id)) == 0


def test_worker_refuses_what_its_kv_cache_can_never_hold(tiny_worker, tiny_deployment, rdb):
    """Should a request slip past the API's check (say, a worker with a smaller pool joined),
    the worker answers with an error event instead of failing or waiting forever."""
    request = make_request(0, list(range(1000, 1100)), 500)
    request = request.model_copy(
        update={"request_id": f"cmpl-{uuid.uuid4().hex}", "model": tiny_deployment.model_id}
    )
    pubsub = rdb.pubsub()
    pubsub.subscribe(keys.request_channel(request.request_id))
    pubsub.get_message(timeout=5)
    rdb.sadd(keys.model_tenants(request.deployment_name), request.tenant_id)
    rdb.xadd(keys.tenant_stream(request.deployment_name, request.tenant_id), request.to_fields())
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        message = pubsub.get_message(timeout=1)
        if message and message["type"] == "message":
            event = decode_event(message["data"])
            break
    else:
        raise AssertionError("no event")
    pubsub.close()
    assert isinstance(event, ErrorEvent) and event.code == "kv_cache_capacity"


def test_a_request_cancelled_while_queued_ends_cancelled_when_pulled(
    tiny_worker, tiny_deployment, rdb
):
    """Its client left before any worker pulled it: the worker remembers the cancel and
    ends the request when it pulls it, before computing a token of it."""
    request = make_request(0, list(range(1000, 1010)), 200, ignore_eos=True)
    request = request.model_copy(
        update={"request_id": f"cmpl-{uuid.uuid4().hex}", "model": tiny_deployment.model_id}
    )
    pubsub = rdb.pubsub()
    pubsub.subscribe(keys.request_channel(request.request_id))
    pubsub.get_message(timeout=5)
    rdb.publish(keys.cancel_channel(tiny_deployment.model_id), encode_cancel(request.request_id))
    time.sleep(1.0)  # the worker has heard it, with nothing of the request in flight
    rdb.sadd(keys.model_tenants(request.deployment_name), request.tenant_id)
    rdb.xadd(keys.tenant_stream(request.deployment_name, request.tenant_id), request.to_fields())
    events = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        message = pubsub.get_message(timeout=1)
        if message and message["type"] == "message":
            events.append(decode_event(message["data"]))
            if not isinstance(events[-1], TokenEvent):
                break
    pubsub.close()
    assert events, "no event"
    assert [type(e) for e in events] == [FinalEvent], events
    assert events[0].finish_reason == "cancelled"
    assert events[0].usage.completion_tokens == 0
