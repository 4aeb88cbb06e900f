"""The whole request path with a real worker process (tiny random Llama, real tokenizer)."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from openai import OpenAI
from sqlmodel import Session, select

from shared import keys
from shared.tables import ApiKey, InferenceRequest
from tests.helpers import auth, get_usage, stream, wait_for_usage_record


@pytest.fixture
def tenant(make_tenant):
    return make_tenant("stream")


def _check_openai_stream(result, object_name: str) -> None:
    assert result.status_code == 200
    assert result.has_done and result.events_after_done == 0
    request_id = result.headers["x-request-id"]
    assert all(chunk["id"] == request_id for chunk in result.chunks)
    content = [c for c in result.chunks if c["choices"]]
    assert all(c["object"] == object_name for c in result.chunks)
    # finish_reason only on the last content chunk
    reasons = [c["choices"][0]["finish_reason"] for c in content]
    assert reasons[-1] in ("stop", "length") and all(r is None for r in reasons[:-1])


def test_streamed_completion_matches_recorded_usage(api_url, tiny_worker, tiny_deployment, tenant):
    _, key = tenant
    body = {
        "model": tiny_deployment.model_id,
        "prompt": "Once upon a time",
        "max_tokens": 12,
        "temperature": 0,
        "stream_options": {"include_usage": True},
    }
    result = stream(api_url, "/v1/completions", key, body)
    _check_openai_stream(result, "text_completion")
    assert result.text
    assert result.chunks[-1]["choices"] == []  # the usage chunk comes last
    assert result.usage["completion_tokens"] == 12  # random weights: no early EOS here
    assert result.finish_reasons[-1] == "length"
    request_id = result.headers["x-request-id"]
    usage = get_usage(api_url, key, request_id).json()
    assert usage["input_tokens"] == result.usage["prompt_tokens"]
    assert usage["output_tokens"] == result.usage["completion_tokens"]


def test_model_id_alias_and_no_usage_chunk_by_default(
    api_url, tiny_worker, tiny_deployment, tenant
):
    _, key = tenant
    body = {"model_id": tiny_deployment.model_id, "prompt": "Hello", "max_tokens": 3}
    result = stream(api_url, "/v1/completions", key, body)
    _check_openai_stream(result, "text_completion")
    assert result.usage is None
    assert all("usage" not in chunk for chunk in result.chunks)


def test_non_streamed_completion_and_chat(api_url, tiny_worker, tiny_deployment, tenant):
    _, key = tenant
    model = tiny_deployment.model_id
    completion = httpx.post(
        f"{api_url}/v1/completions",
        json={"model": model, "prompt": "Hello", "max_tokens": 5, "temperature": 0},
        headers=auth(key),
        timeout=60,
    ).json()
    assert completion["object"] == "text_completion"
    assert completion["usage"]["completion_tokens"] == 5
    assert completion["choices"][0]["finish_reason"] == "length"
    chat = httpx.post(
        f"{api_url}/v1/chat/completions",
        json={"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
        headers=auth(key),
        timeout=60,
    ).json()
    assert chat["object"] == "chat.completion"
    assert chat["choices"][0]["message"]["role"] == "assistant"
    # the chat template wraps the message: many more prompt tokens than the word itself
    assert chat["usage"]["prompt_tokens"] > 5


def test_streamed_chat_first_delta_has_role(api_url, tiny_worker, tiny_deployment, tenant):
    _, key = tenant
    body = {
        "model": tiny_deployment.model_id,
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        "max_tokens": 6,
        "stream_options": {"include_usage": True},
    }
    result = stream(api_url, "/v1/chat/completions", key, body)
    _check_openai_stream(result, "chat.completion.chunk")
    deltas = [c["choices"][0]["delta"] for c in result.chunks if c["choices"]]
    assert deltas[0]["role"] == "assistant"
    assert all("role" not in d for d in deltas[1:])
    assert result.usage["completion_tokens"] == 6


def test_greedy_is_deterministic_and_seed_reproduces(api_url, tiny_worker, tiny_deployment, tenant):
    _, key = tenant
    base = {"model": tiny_deployment.model_id, "prompt": "The sky is", "max_tokens": 8}

    def text(**extra) -> str:
        return stream(api_url, "/v1/completions", key, {**base, **extra}).text

    assert text(temperature=0) == text(temperature=0)
    assert text(temperature=1.0, seed=7) == text(temperature=1.0, seed=7)
    assert text(temperature=1.0, top_p=0.9, seed=7) == text(temperature=1.0, top_p=0.9, seed=7)


def test_stop_string_ends_the_stream(api_url, tiny_worker, tiny_deployment, tenant):
    _, key = tenant
    base = {"model": tiny_deployment.model_id, "prompt": "abc", "max_tokens": 20, "temperature": 0}
    full = stream(api_url, "/v1/completions", key, base).text
    stop = full[4:6]  # two characters from inside the greedy answer
    assert stop
    stopped = stream(api_url, "/v1/completions", key, {**base, "stop": [stop]})
    assert stopped.text == full[: full.index(stop)]
    assert stopped.finish_reasons[-1] == "stop"


def test_openai_client_streams_completion_and_chat(api_url, tiny_worker, tiny_deployment, tenant):
    _, key = tenant
    client = OpenAI(base_url=f"{api_url}/v1", api_key=key)
    model = tiny_deployment.model_id
    chunks = list(
        client.completions.create(model=model, prompt="Hello there", max_tokens=5, stream=True)
    )
    assert chunks and chunks[-1].choices[0].finish_reason == "length"
    assert "".join(c.choices[0].text for c in chunks)
    chat_chunks = list(
        client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chat_chunks[0].choices[0].delta.role == "assistant"
    assert chat_chunks[-1].usage.completion_tokens == 5
    assert [m.id for m in client.models.list()].count(model) == 1


def test_tenant_cannot_read_another_tenants_usage(
    api_url, tiny_worker, tiny_deployment, make_tenant
):
    _, key_a = make_tenant("a")
    _, key_b = make_tenant("b")
    body = {"model": tiny_deployment.model_id, "prompt": "private", "max_tokens": 2}
    request_id = stream(api_url, "/v1/completions", key_a, body).headers["x-request-id"]
    url = f"{api_url}/v1/requests/{request_id}/usage"
    assert get_usage(api_url, key_a, request_id).status_code == 200
    response = httpx.get(url, headers=auth(key_b))
    assert response.status_code == 404
    assert request_id in response.json()["error"]["message"]  # same answer as for a made-up id


def test_usage_is_durable_and_stream_entry_acknowledged(
    api_url, tiny_worker, tiny_deployment, tenant, db, rdb
):
    tenant_id, key = tenant
    model = tiny_deployment.model_id
    result = stream(
        api_url, "/v1/completions", key, {"model": model, "prompt": "x", "max_tokens": 3}
    )
    request_id = result.headers["x-request-id"]
    record = wait_for_usage_record(db, request_id)
    with Session(db) as session:
        request = session.get(InferenceRequest, request_id)
    assert (record.tenant_id, record.output_tokens) == (tenant_id, 3)
    assert request.status == "completed" and request.finish_reason == "length"
    stream_key = keys.tenant_stream(tiny_deployment.name, tenant_id)
    deadline = time.monotonic() + 5
    while rdb.xpending(stream_key, keys.WORKER_GROUP)["pending"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert rdb.xpending(stream_key, keys.WORKER_GROUP)["pending"] == 0
    assert rdb.xlen(stream_key) == 0  # the prompt does not linger in Redis


def test_keys_are_stored_hashed(db, tenant):
    tenant_id, key = tenant
    with Session(db) as session:
        rows = session.exec(select(ApiKey).where(ApiKey.tenant_id == tenant_id)).all()
    assert len(rows) == 1
    assert key not in rows[0].key_hash and rows[0].key_hash != key


def test_concurrent_requests_are_all_served(api_url, tiny_worker, tiny_deployment, make_tenant):
    tenants = [make_tenant("c") for _ in range(3)]
    results: list = [None] * 9

    def run(i: int) -> None:
        _, key = tenants[i % 3]
        body = {"model": tiny_deployment.model_id, "prompt": f"request {i}", "max_tokens": 4 + i}
        results[i] = stream(
            api_url, "/v1/completions", key, body | {"stream_options": {"include_usage": True}}
        )

    threads = [threading.Thread(target=run, args=(i,)) for i in range(9)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for i, result in enumerate(results):
        assert result.has_done
        assert result.usage["completion_tokens"] == 4 + i
