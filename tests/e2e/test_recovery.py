"""Crash recovery end to end (real Redis, API and worker processes, tiny model): a killed
worker's started stream ends with `worker_lost`, its waiting entries are served by another
worker, SIGTERM loses nothing, and a stream resumes on another API replica."""

from __future__ import annotations

import contextlib
import json
import signal
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from redis.exceptions import ResponseError
from sqlmodel import Session, select

from shared import deployments, keys
from shared.protocol import decode_event
from shared.tables import UsageRecord
from tests.factories import make_request
from tests.helpers import auth, stream, wait_for_usage_record, wait_pending_drained

# Workers that are found dead within 2 s.
FAST_HEARTBEAT = {"LLMFLEET_WORKER_HEARTBEAT_S": "0.5", "LLMFLEET_WORKER_HEARTBEAT_TIMEOUT_S": "2"}
TINY = ("--dtype", "float32")


@pytest.fixture
def deployment(db, tiny_model_dir, request):
    """A deployment of its own per test, so no other test's worker serves it."""
    return deployments.register(db, f"tiny-{request.node.name[:40]}", str(tiny_model_dir))


def _body(model: str, max_tokens: int) -> dict:
    return {"model": model, "prompt": "go", "max_tokens": max_tokens, "ignore_eos": True}


def test_a_killed_workers_started_stream_ends_with_worker_lost(
    api_url, start_worker, deployment, make_tenant, db
):
    worker = start_worker(deployment.model_id, *TINY, env_overrides=FAST_HEARTBEAT)
    _, key = make_tenant("lost")
    body = {**_body(deployment.model_id, 1000), "stream": True}
    chunks, error, has_done = [], None, False
    with (
        httpx.Client(timeout=60) as client,
        client.stream("POST", f"{api_url}/v1/completions", json=body, headers=auth(key)) as r,
    ):
        request_id = r.headers["x-request-id"]
        give_up_at = time.monotonic() + 90  # fail, never hang (keep-alive pings come every 15 s)
        for line in r.iter_lines():
            if time.monotonic() > give_up_at:
                break
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                has_done = True
                break
            event = json.loads(data)
            if "error" in event:
                error = event["error"]
                continue
            chunks.append(event)
            if len(chunks) == 5:
                worker.kill()  # SIGKILL, mid-generation
                killed_at = time.monotonic()
    assert has_done and error is not None, (len(chunks), error)
    assert error["code"] == "worker_lost"
    assert time.monotonic() - killed_at < 15
    record = wait_for_usage_record(db, request_id)
    assert record.finish_reason == "error"
    # What was delivered (the stream's chunks, whether they came by pub/sub or journal).
    assert record.output_tokens == len(chunks)


def test_a_dead_workers_waiting_entry_is_served_by_another_worker(
    api_url, start_worker, deployment, make_tenant, rdb
):
    tenant_id, key = make_tenant("reclaim")
    model = deployment.model_id
    stream_key = keys.tenant_stream(deployment.name, tenant_id)
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(
            httpx.post,
            f"{api_url}/v1/completions",
            json=_body(model, 8),
            headers=auth(key),
            timeout=120,
        )
        deadline = time.monotonic() + 30
        while rdb.xlen(stream_key) < 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        # A worker pulled the entry and died before starting it: it is pending, idle.
        with contextlib.suppress(ResponseError):  # BUSYGROUP: it exists
            rdb.xgroup_create(stream_key, keys.WORKER_GROUP, id="0")
        rdb.xreadgroup(keys.WORKER_GROUP, "dead-worker", {stream_key: ">"}, count=1)
        start_worker(model, *TINY, env_overrides=FAST_HEARTBEAT)
        response = answer.result(timeout=120)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["finish_reason"] == "length"
    assert wait_pending_drained(rdb, [stream_key]) == {stream_key: 0}


def test_sigterm_finishes_running_work_and_loses_nothing(
    api_url, start_worker, deployment, make_tenant
):
    model = deployment.model_id
    worker = start_worker(model, *TINY, "--max-num-seqs", "1", env_overrides=FAST_HEARTBEAT)
    _, key = make_tenant("drain")
    with ThreadPoolExecutor(3) as pool:
        answers = [
            pool.submit(
                httpx.post,
                f"{api_url}/v1/completions",
                json=_body(model, 300),
                headers=auth(key),
                timeout=120,
            )
            for _ in range(3)
        ]
        time.sleep(1.0)  # one request is running
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(timeout=60) == 0
        start_worker(model, *TINY, env_overrides=FAST_HEARTBEAT)
        responses = [a.result(timeout=120) for a in answers]
    assert [r.status_code for r in responses] == [200, 200, 200], [r.text for r in responses]
    assert [r.json()["usage"]["completion_tokens"] for r in responses] == [300, 300, 300]


def test_a_stream_resumes_on_another_api_replica_without_gaps_or_repeats(
    start_api, api_url, tiny_worker, tiny_deployment, make_tenant
):
    _, key = make_tenant("resume")
    body = {**_body(tiny_deployment.model_id, 200), "temperature": 0}
    expected = httpx.post(f"{api_url}/v1/completions", json=body, headers=auth(key), timeout=60)
    replica = start_api()
    first_part, last_id = [], None
    with (
        httpx.Client(timeout=60) as client,
        client.stream(
            "POST",
            f"{replica.url}/v1/completions",
            json={**body, "stream": True},
            headers=auth(key),
        ) as r,
    ):
        request_id = r.headers["x-request-id"]
        for line in r.iter_lines():
            if line.startswith("id:"):
                last_id = line[3:].strip()
            elif line.startswith("data:"):
                first_part.append(json.loads(line[5:])["choices"][0]["text"])
            if len(first_part) == 5 and last_id is not None:
                replica.process.kill()  # the API process dies mid-stream: no cancel is sent
                break
    rest = stream(
        api_url,
        f"/v1/requests/{request_id}/events",
        key,
        {},
        method="GET",
        headers={"Last-Event-ID": last_id},
    )
    assert rest.has_done and rest.status_code == 200
    text = "".join(first_part) + rest.text
    assert text == expected.json()["choices"][0]["text"]


@pytest.fixture
def short_deadline_api(start_api) -> str:
    """An API replica whose requests must start within 1 s and finish within 2 s."""
    overrides = {"LLMFLEET_REQUEST_QUEUE_TIMEOUT_S": "1", "LLMFLEET_REQUEST_TIMEOUT_S": "2"}
    return start_api(overrides).url


def test_a_request_nobody_starts_in_time_fails_with_queue_timeout(
    short_deadline_api, deployment, make_tenant, db
):
    _, key = make_tenant("queue-timeout")  # no worker serves `deployment`
    started = time.monotonic()
    result = stream(short_deadline_api, "/v1/completions", key, _body(deployment.model_id, 8))
    # Ended by the queue timeout (1 s), not left hanging (11.5 s once on a loaded machine).
    assert time.monotonic() - started < 30
    assert result.has_done
    assert result.chunks[-1]["error"]["code"] == "queue_timeout"
    record = wait_for_usage_record(db, result.headers["x-request-id"])
    assert (record.finish_reason, record.output_tokens) == ("error", 0)


def test_a_request_past_its_deadline_ends_with_finish_reason_deadline(
    short_deadline_api, start_worker, deployment, make_tenant
):
    start_worker(deployment.model_id, *TINY)
    _, key = make_tenant("deadline")
    # 1000 tokens take the tiny model well over the 2 s deadline.
    body = {**_body(deployment.model_id, 1000), "stream_options": {"include_usage": True}}
    result = stream(short_deadline_api, "/v1/completions", key, body)
    assert result.has_done
    assert result.finish_reasons[-1] == "deadline"
    assert 0 < result.usage["completion_tokens"] < 1000


def test_a_request_delivered_twice_yields_one_stream_and_one_usage_record(
    tiny_worker, tiny_deployment, make_tenant, rdb, db
):
    tenant_id, _ = make_tenant("twice")
    request = make_request(0, list(range(1000, 1010)), 40, tenant_id=tenant_id)
    request = request.model_copy(
        update={"request_id": f"cmpl-{uuid.uuid4().hex}", "model": tiny_deployment.model_id}
    )
    stream_key = keys.tenant_stream(request.deployment_name, tenant_id)
    rdb.sadd(keys.model_tenants(request.deployment_name), tenant_id)
    for _ in range(2):  # the same request twice: a reclaim race, a hand-back racing a worker
        rdb.xadd(stream_key, request.to_fields())
    deadline = time.monotonic() + 60
    while not rdb.exists(keys.request_done(request.request_id)):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    record = wait_for_usage_record(db, request.request_id)
    events = [decode_event(f[b"e"]) for _, f in rdb.xrange(keys.request_events(request.request_id))]
    assert [e.seq for e in events] == list(range(len(events)))
    assert [e.type for e in events].count("final") == 1 and events[-1].type == "final", events[-1]
    with Session(db) as session:
        rows = session.exec(
            select(UsageRecord).where(UsageRecord.request_id == request.request_id)
        ).all()
    assert len(rows) == 1 and record.output_tokens == 40
    while rdb.xpending(stream_key, keys.WORKER_GROUP)["pending"] or rdb.xlen(stream_key):
        assert time.monotonic() < deadline + 30, "the second delivery was never acknowledged"
        time.sleep(0.2)
