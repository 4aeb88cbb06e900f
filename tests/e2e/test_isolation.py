"""Tenant isolation on every read path, and no prompt left behind in Redis or in the logs."""

from __future__ import annotations

import re
import time
import uuid
from datetime import UTC, datetime

import httpx
import pytest

from shared import keys
from tests.helpers import auth, get_usage, stream

# Every endpoint that takes a request id: tenant B must not tell A's ids from made-up ones.
ID_ENDPOINTS = ("/v1/requests/{id}/usage", "/v1/requests/{id}/events")
PROMPT_IDS = re.compile(rb'"prompt_token_ids":\s*\[')


@pytest.fixture(scope="module")
def finished(api_url, tiny_worker, tiny_deployment, db, settings):
    """Tenant A's finished request (its id, prompt, output and key), and tenant B's key."""
    from shared import tenants

    keys_by_tenant = []
    for name in ("iso-a", "iso-b"):
        tenant = tenants.create_tenant(db, f"{name}-{uuid.uuid4().hex[:8]}")
        keys_by_tenant.append((tenant.id, tenants.create_key(db, tenant.id, settings.pepper)))
    (tenant_a, key_a), (_tenant_b, key_b) = keys_by_tenant
    prompt = f"isolation secret {uuid.uuid4().hex}"
    body = {"model": tiny_deployment.model_id, "prompt": prompt, "max_tokens": 6}
    result = stream(api_url, "/v1/completions", key_a, body)
    assert result.has_done
    request_id = result.headers["x-request-id"]
    assert get_usage(api_url, key_a, request_id).status_code == 200
    return {
        "request_id": request_id,
        "tenant_a": tenant_a,
        "key_a": key_a,
        "key_b": key_b,
        "prompt": prompt,
        "output": result.text,
        "model": tiny_deployment.model_id,
        "deployment": tiny_deployment.name,
    }


@pytest.mark.parametrize("path", ID_ENDPOINTS)
def test_another_tenants_request_is_not_found(api_url, finished, path):
    url = api_url + path.format(id=finished["request_id"])
    assert httpx.get(url, headers=auth(finished["key_a"]), timeout=30).status_code == 200
    other = httpx.get(url, headers=auth(finished["key_b"]), timeout=30)
    made_up = httpx.get(
        api_url + path.format(id="cmpl-madeup"), headers=auth(finished["key_b"]), timeout=30
    )
    assert (other.status_code, made_up.status_code) == (404, 404)


def test_usage_reports_only_the_callers_tenant(api_url, finished):
    today = datetime.now(UTC).date().isoformat()
    params = {"start": today, "end": today}
    mine = httpx.get(f"{api_url}/v1/usage", params=params, headers=auth(finished["key_a"]))
    theirs = httpx.get(f"{api_url}/v1/usage", params=params, headers=auth(finished["key_b"]))
    assert [r["num_requests"] for r in mine.json()["data"]] == [1]
    assert theirs.json()["data"] == []


def test_no_redis_key_keeps_the_prompt_of_a_finished_request(rdb, finished):
    stream_key = keys.tenant_stream(finished["deployment"], finished["tenant_a"])
    deadline = time.monotonic() + 10
    while rdb.xlen(stream_key) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert rdb.xlen(stream_key) == 0  # acknowledged and deleted
    meta = rdb.hgetall(keys.request_meta(finished["request_id"]))
    assert not any(b"prompt" in field for field in meta)
    request_id = finished["request_id"].encode()
    for key in rdb.scan_iter():
        for value in _values(rdb, key):
            assert not (request_id in value and PROMPT_IDS.search(value)), key


def _values(rdb, key: bytes) -> list[bytes]:
    kind = rdb.type(key)
    if kind == b"string":
        return [rdb.get(key) or b""]
    if kind == b"hash":
        return [b"%s=%s" % item for item in rdb.hgetall(key).items()]
    if kind == b"stream":
        return [b"".join(b"%s=%s" % i for i in f.items()) for _, f in rdb.xrange(key)]
    if kind == b"list":
        return rdb.lrange(key, 0, -1)
    if kind in (b"set", b"zset"):
        return list(rdb.smembers(key)) if kind == b"set" else rdb.zrange(key, 0, -1)
    return []


def test_logs_hold_no_prompt_output_or_key(home, finished):
    texts = [finished["prompt"], finished["key_a"], finished["key_b"]]
    if len(finished["output"]) >= 12:  # a short output could occur in a log by chance
        texts.append(finished["output"])
    for log_path in home.glob("*.log"):
        content = log_path.read_text(errors="replace")
        for text in texts:
            assert text not in content, f"{log_path.name} holds a prompt, output or key"
