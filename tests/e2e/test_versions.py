"""Versions behind one model id: each version has its own workers and queues; a request for
the model id goes to its stable version, one for `id@version` to that version, and an
unknown version is a 404."""

from __future__ import annotations

import uuid

import httpx
import pytest

from shared import deployments, keys
from tests.helpers import assert_error, auth, stream, wait_for_usage_record

TINY_WORKER_ARGS = ("--max-num-seqs", "4", "--dtype", "float32", "--kv-cache-gb", "0.015625")


@pytest.fixture(scope="module")
def two_versions(db, tiny_model_dir):
    """A model with two versions of the same weights; the first is its stable one."""
    model_id = f"tiny-versions-{uuid.uuid4().hex[:6]}"
    v1 = deployments.register(db, model_id, str(tiny_model_dir))
    v2 = deployments.register(db, model_id, str(tiny_model_dir), version="2")
    return v1, v2


def test_each_version_serves_its_own_queue_and_a_pin_reaches_its_version(
    api_url, start_worker, two_versions, make_tenant, db, rdb
):
    v1, v2 = two_versions
    start_worker(v1.model_id, *TINY_WORKER_ARGS)  # no --version: the stable one
    start_worker(v1.model_id, "--version", "2", *TINY_WORKER_ARGS)
    tenant_id, key = make_tenant("versions")
    served = {}
    for model, expected in [(v1.model_id, v1), (f"{v1.model_id}@2", v2), (v1.name, v1)]:
        for _ in range(3):
            body = {"model": model, "prompt": "Hello", "max_tokens": 3}
            result = stream(api_url, "/v1/completions", key, body)
            assert result.has_done and result.chunks[0]["model"] == model
            record = wait_for_usage_record(db, result.headers["x-request-id"])
            served.setdefault(model, set()).add(record.deployment_id)
            assert record.deployment_id == expected.id
    assert served == {v1.model_id: {v1.id}, v2.name: {v2.id}, v1.name: {v1.id}}
    # Each version's requests went through its own stream, read by its own workers.
    for version in (v1, v2):
        assert rdb.sismember(keys.model_tenants(version.name), tenant_id)
        groups = rdb.xinfo_groups(keys.tenant_stream(version.name, tenant_id))
        assert [g["consumers"] for g in groups] == [1]
    beats = [rdb.hgetall(k) for k in rdb.scan_iter(keys.worker_heartbeat_pattern())]
    mine = [b for b in beats if b.get(b"model") == v1.model_id.encode()]
    assert sorted((b[b"version"], int(b[b"deployment_id"])) for b in mine) == [
        (b"1", v1.id),
        (b"2", v2.id),
    ]
    assert all(rdb.zcard(keys.ready_workers(v.name)) == 1 for v in (v1, v2))


def test_an_unknown_version_is_a_404_and_the_models_list_names_each_version(
    api_url, two_versions, make_tenant
):
    v1, _ = two_versions
    _, key = make_tenant("versions-404")
    for model in (f"{v1.model_id}@9", f"{v1.model_id}@", "no-such-model@1"):
        body = {"model": model, "prompt": "Hello", "max_tokens": 3}
        response = httpx.post(f"{api_url}/v1/completions", json=body, headers=auth(key))
        error = assert_error(response, 404, "model_not_found")
        assert error["param"] == "model" and model in error["message"]
    models = httpx.get(f"{api_url}/v1/models", headers=auth(key)).json()["data"]
    mine = sorted((m["id"], m["version"]) for m in models if m["id"].startswith(v1.model_id))
    assert mine == [(v1.model_id, "1"), (f"{v1.model_id}@2", "2")]
