"""Bad input gets a clear OpenAI-style error with the right status, and nothing is enqueued."""

from __future__ import annotations

import httpx
import pytest

from shared import keys
from tests.helpers import assert_error, auth


@pytest.fixture
def tenant(make_tenant):
    return make_tenant("errors")


def _assert_nothing_enqueued(rdb, tenant_id: str, model: str) -> None:
    name = f"{model}@1"  # the model's stable version
    assert rdb.exists(keys.tenant_stream(name, tenant_id)) == 0
    assert not rdb.sismember(keys.model_tenants(name), tenant_id)


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer lf-not-a-real-key"}, {"Authorization": "Basic abc"}],
    ids=["missing", "unknown", "wrong-scheme"],
)
def test_bad_key_is_401(api_url, tiny_deployment, headers):
    body = {"model": tiny_deployment.model_id, "prompt": "hi"}
    response = httpx.post(f"{api_url}/v1/completions", json=body, headers=headers)
    assert_error(response, 401, "invalid_api_key")
    assert httpx.get(f"{api_url}/v1/models", headers=headers).status_code == 401


def test_unknown_model_is_404_and_nothing_enqueued(api_url, rdb, tenant):
    tenant_id, key = tenant
    body = {"model": "no-such-model", "prompt": "hi"}
    response = httpx.post(f"{api_url}/v1/completions", json=body, headers=auth(key))
    error = assert_error(response, 404, "model_not_found")
    assert error["param"] == "model"
    _assert_nothing_enqueued(rdb, tenant_id, "no-such-model")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "hi", "max_tokens": -3}, "max_tokens"),
        ({"prompt": "hi", "max_tokens": "ten"}, "max_tokens"),
        ({"prompt": 42}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": [1, 2, 10_000_000]}, "prompt"),
        ({"prompt": "hi", "temperature": 9}, "temperature"),
        ({"prompt": "hi", "top_p": 0}, "top_p"),
        ({"prompt": "hi", "n": 2}, "n"),
        ({"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"prompt": "hi", "stop": "x" * 100}, "stop"),
        ({"prompt": "hi", "max_tokens": 5000}, "max_tokens"),
    ],
)
def test_invalid_body_is_400_and_nothing_enqueued(
    api_url, rdb, tenant, tiny_deployment, body, param
):
    tenant_id, key = tenant
    model = tiny_deployment.model_id
    response = httpx.post(
        f"{api_url}/v1/completions", json={"model": model, **body}, headers=auth(key)
    )
    error = assert_error(response, 400)
    assert error["param"] == param
    _assert_nothing_enqueued(rdb, tenant_id, model)


def test_context_overflow_names_the_limit(api_url, rdb, tenant, tiny_deployment):
    tenant_id, key = tenant
    body = {"model": tiny_deployment.model_id, "prompt": "hello " * 1000, "max_tokens": 100}
    response = httpx.post(f"{api_url}/v1/completions", json=body, headers=auth(key))
    error = assert_error(response, 400, "context_length_exceeded")
    assert str(tiny_deployment.max_context_tokens) in error["message"]
    _assert_nothing_enqueued(rdb, tenant_id, tiny_deployment.model_id)


def test_malformed_json_is_400(api_url, rdb, tenant, tiny_deployment):
    tenant_id, key = tenant
    response = httpx.post(
        f"{api_url}/v1/completions",
        content=b'{"model": "tiny-llama", "prompt": ',
        headers={**auth(key), "content-type": "application/json"},
    )
    assert_error(response, 400, "invalid_json")
    _assert_nothing_enqueued(rdb, tenant_id, tiny_deployment.model_id)


def test_chat_without_messages_is_400(api_url, tenant, tiny_deployment):
    _, key = tenant
    body = {"model": tiny_deployment.model_id, "messages": []}
    response = httpx.post(f"{api_url}/v1/chat/completions", json=body, headers=auth(key))
    assert assert_error(response, 400)["param"] == "messages"


def test_oversized_body_is_413(api_url, tenant, tiny_deployment):
    _, key = tenant
    body = {"model": tiny_deployment.model_id, "prompt": "x" * 2_000_000}
    response = httpx.post(f"{api_url}/v1/completions", json=body, headers=auth(key))
    assert_error(response, 413, "request_too_large")


def test_unknown_usage_is_404(api_url, tenant):
    _, key = tenant
    response = httpx.get(f"{api_url}/v1/requests/cmpl-nope/usage", headers=auth(key))
    assert_error(response, 404)


def test_unknown_route_is_openai_style_404(api_url):
    assert_error(httpx.get(f"{api_url}/v1/nothing-here"), 404)


def test_models_lists_deployments(api_url, tenant, tiny_deployment):
    _, key = tenant
    response = httpx.get(f"{api_url}/v1/models", headers=auth(key))
    assert response.status_code == 200
    ids = {m["id"] for m in response.json()["data"]}
    assert tiny_deployment.model_id in ids


def test_healthz(api_url):
    assert httpx.get(f"{api_url}/healthz").json() == {"status": "ok"}
