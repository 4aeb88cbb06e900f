"""Tenant admission limits through HTTP: a 429 with `Retry-After` and nothing enqueued when a
limit is reached, a 400 when no retry could help, and slots and tokens back once a request
finishes.

The 429 paths use a deployment no worker serves, so an admitted request stays queued (and
in flight) for as long as the test needs; the paths that need a request to finish use the
tiny worker. A test gives its tenant limits by updating its row in SQL: the API reads the
tenant on every request.
"""

from __future__ import annotations

import time

import httpx
import pytest
from sqlmodel import Session, func, select

from shared import deployments, keys
from shared.tables import UsageRecord
from tests.helpers import assert_error, auth, wait_for_usage_record

UNSERVED_MODEL = "tiny-llama-unserved"


@pytest.fixture(scope="module")
def unserved_deployment(db, tiny_model_dir):
    """The tiny model's weights under a model id no worker serves: requests stay queued."""
    return deployments.register(db, UNSERVED_MODEL, str(tiny_model_dir))


def _post(api_url: str, key: str, body: dict, path: str = "/v1/completions") -> httpx.Response:
    return httpx.post(f"{api_url}{path}", json=body, headers=auth(key), timeout=120)


def _admit_and_hang_up(api_url: str, key: str, body: dict) -> str:
    """Send a streaming request and hang up as soon as it is admitted; return its id."""
    with (
        httpx.Client(timeout=30) as client,
        client.stream(
            "POST", f"{api_url}/v1/completions", json={**body, "stream": True}, headers=auth(key)
        ) as response,
    ):
        assert response.status_code == 200, response.read()
        return response.headers["x-request-id"]


def _num_usage_records(db, tenant_id: str) -> int:
    with Session(db) as session:
        return session.exec(
            select(func.count()).select_from(UsageRecord).where(UsageRecord.tenant_id == tenant_id)
        ).one()


@pytest.mark.parametrize(
    ("limits", "code", "max_retry_after_s"),
    [
        ({"max_requests_in_flight": 1}, "requests_in_flight_exceeded", 1),
        ({"max_requests_queued": 1}, "requests_queued_exceeded", 1),
        ({"requests_per_minute": 1}, "requests_per_minute_exceeded", 60),
        ({"tokens_per_minute": 100}, "tokens_per_minute_exceeded", 60),
    ],
)
def test_over_a_limit_is_429_with_retry_after_and_nothing_enqueued(
    api_url, unserved_deployment, limited_tenant, rdb, db, limits, code, max_retry_after_s
):
    tenant_id, key = limited_tenant(**limits)
    body = {"model": UNSERVED_MODEL, "prompt": "hi", "max_tokens": 60}
    _admit_and_hang_up(api_url, key, body)
    stream = keys.tenant_stream(unserved_deployment.name, tenant_id)
    assert rdb.xlen(stream) == 1

    response = _post(api_url, key, body)
    error = assert_error(response, 429, code)
    assert error["type"] == "rate_limit_error" and error["param"] is None
    assert 1 <= int(response.headers["retry-after"]) <= max_retry_after_s
    assert rdb.xlen(stream) == 1
    assert rdb.zcard(keys.tenant_inflight(tenant_id)) == 1
    assert _num_usage_records(db, tenant_id) == 0


def test_max_tokens_over_the_per_request_limit_is_400(
    api_url, unserved_deployment, limited_tenant, rdb
):
    tenant_id, key = limited_tenant(max_tokens_per_request=8)
    response = _post(api_url, key, {"model": UNSERVED_MODEL, "prompt": "hi", "max_tokens": 9})
    assert assert_error(response, 400, "max_tokens_exceeds_limit")["param"] == "max_tokens"
    assert not rdb.exists(keys.tenant_stream(unserved_deployment.name, tenant_id))
    assert not rdb.exists(keys.tenant_inflight(tenant_id))


def test_a_request_larger_than_tokens_per_minute_is_400_not_429(
    api_url, unserved_deployment, limited_tenant, rdb
):
    tenant_id, key = limited_tenant(tokens_per_minute=20)
    response = _post(api_url, key, {"model": UNSERVED_MODEL, "prompt": "hi", "max_tokens": 50})
    assert assert_error(response, 400, "request_exceeds_tokens_per_minute")["param"]
    assert "retry-after" not in response.headers
    assert not rdb.exists(keys.tenant_stream(unserved_deployment.name, tenant_id))
    assert not rdb.exists(keys.tenant_inflight(tenant_id), keys.tenant_buckets(tenant_id))


def test_a_default_max_tokens_is_capped_by_the_tenant_limit(
    api_url, tiny_worker, tiny_deployment, limited_tenant
):
    _, key = limited_tenant(max_tokens_per_request=4)
    body = {
        "model": tiny_deployment.model_id,
        "messages": [{"role": "user", "content": "hi"}],
        "ignore_eos": True,
    }
    response = _post(api_url, key, body, path="/v1/chat/completions")
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 4


def test_a_finished_request_frees_its_in_flight_slot(
    api_url, tiny_worker, tiny_deployment, limited_tenant, rdb, db
):
    tenant_id, key = limited_tenant(max_requests_in_flight=1)
    body = {"model": tiny_deployment.model_id, "prompt": "hi", "max_tokens": 4}
    for _ in range(3):
        response = _post(api_url, key, body)
        assert response.status_code == 200, response.text
    assert not rdb.exists(keys.tenant_inflight(tenant_id), keys.tenant_queued(tenant_id))
    assert _wait_until(lambda: _num_usage_records(db, tenant_id) == 3)


def test_unused_tokens_come_back_when_a_request_ends(
    api_url, tiny_worker, tiny_deployment, limited_tenant, rdb, db
):
    tokens_per_minute = 500
    tenant_id, key = limited_tenant(tokens_per_minute=tokens_per_minute)
    body = {"model": tiny_deployment.model_id, "prompt": "go", "max_tokens": 400, "stream": True}
    with (
        httpx.Client(timeout=60) as client,
        client.stream("POST", f"{api_url}/v1/completions", json=body, headers=auth(key)) as r,
    ):
        request_id = r.headers["x-request-id"]
        lines = r.iter_lines()
        while not next(lines).startswith("data:"):
            pass
        # Generating: pulled by the worker (no longer queued), still in flight, and holding
        # its reservation, so a second request of the same size does not fit.
        assert _wait_until(lambda: rdb.zscore(keys.tenant_queued(tenant_id), request_id) is None)
        assert rdb.zscore(keys.tenant_inflight(tenant_id), request_id) is not None
        assert_error(
            _post(api_url, key, {**body, "stream": False}), 429, "tokens_per_minute_exceeded"
        )
    # Hanging up cancelled it; the worker settles what it did not use.
    assert _wait_until(lambda: not rdb.exists(keys.tenant_inflight(tenant_id)))
    record = wait_for_usage_record(db, request_id)
    assert record.finish_reason == "cancelled" and record.output_tokens < 400
    level = float(rdb.hget(keys.tenant_buckets(tenant_id), "tpm:level"))
    assert level >= tokens_per_minute - record.input_tokens - record.output_tokens - 1
    assert _admit_and_hang_up(api_url, key, body)


def _wait_until(predicate, timeout_s: float = 30) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True
