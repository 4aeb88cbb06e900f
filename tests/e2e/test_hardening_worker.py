"""The worker's hardening, with a real worker, API and Redis: for a tenant that keeps no
content, neither the dead-letter stream nor the request journal keeps its prompt or output
past the stream's end and a short resume grace (bad sampling values at engine level:
tests/worker/test_hardening_worker.py)."""

from __future__ import annotations

import time
import uuid

import httpx
import pytest

from shared import deployments, keys, tenants
from shared.protocol import QueuedRequest
from tests.helpers import auth, stream

# --- Content kept only as long as needed -------------------------------------------------

POISON_TOKEN_ID = 7777  # in the tiny model's vocabulary; the worker's step fails on it
RESUME_GRACE_S = 8


@pytest.fixture
def content_worker(db, tiny_model_dir, start_worker):
    """A deployment of its own, served by a worker whose model fails on the poison token and
    whose never-store journals outlive their end by `RESUME_GRACE_S`."""
    deployment = deployments.register(
        db, f"tiny-content-{uuid.uuid4().hex[:6]}", str(tiny_model_dir)
    )
    env = {
        "LLMFLEET_FAULT_TOKEN_ID": str(POISON_TOKEN_ID),
        "LLMFLEET_RESUME_GRACE_S": str(RESUME_GRACE_S),
    }
    start_worker(deployment.model_id, "--dtype", "float32", env_overrides=env)
    return deployment.model_id


def _tenant(db, settings, retention_days: int | None) -> tuple[str, str]:
    tenant = tenants.create_tenant(
        db, f"content-{uuid.uuid4().hex[:8]}", content_retention_days=retention_days
    )
    return tenant.id, tenants.create_key(db, tenant.id, settings.pepper)


def _complete(api_url: str, key: str, model: str, prompt: list[int]):
    body = {"model": model, "prompt": prompt, "max_tokens": 8, "ignore_eos": True}
    result = stream(api_url, "/v1/completions", key, body)
    assert result.status_code == 200 and result.has_done, result.chunks
    return result.headers["x-request-id"], result


def _dead_letter(rdb, model: str, request_id: str) -> dict[bytes, bytes]:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for _, fields in rdb.xrange(keys.dead_letter(model)):
            if fields[b"request_id"] == request_id.encode():
                return fields
        time.sleep(0.1)
    raise AssertionError(f"no dead letter for {request_id}")


def test_a_never_store_tenants_dead_letter_holds_no_prompt(
    api_url, content_worker, db, settings, rdb
):
    poison = [1500, POISON_TOKEN_ID, 1501]
    never_id, never_key = _tenant(db, settings, None)
    _, keep_key = _tenant(db, settings, 3)
    never_rid, never = _complete(api_url, never_key, content_worker, poison)
    keep_rid, keep = _complete(api_url, keep_key, content_worker, poison)
    for result in (never, keep):
        assert result.chunks[-1]["error"]["code"] == "model_error"

    letter = {
        k.decode(): v.decode() for k, v in _dead_letter(rdb, content_worker, never_rid).items()
    }
    assert letter["tenant_id"] == never_id and letter["code"] == "model_error"
    assert letter["num_prompt_tokens"] == "3" and letter["num_output_tokens"] == "0"
    assert "body" not in letter and not any("prompt_token_ids" in v for v in letter.values())
    # A tenant that keeps content keeps the whole request there, to replay the poison.
    kept = _dead_letter(rdb, content_worker, keep_rid)
    assert QueuedRequest.from_fields(kept).prompt_token_ids == poison
    # The failed request's journal (its error event) is on the short clock too.
    assert 0 < rdb.pttl(keys.request_events(never_rid)) <= RESUME_GRACE_S * 1000


def test_a_never_store_tenants_journal_outlives_the_end_only_by_the_grace(
    api_url, content_worker, db, settings, rdb
):
    _, never_key = _tenant(db, settings, None)
    _, keep_key = _tenant(db, settings, 3)
    prompt = [1000, 1001, 1002]
    never_rid, never = _complete(api_url, never_key, content_worker, prompt)
    keep_rid, _ = _complete(api_url, keep_key, content_worker, prompt)
    assert never.text and never.finish_reasons[-1] == "length"
    events, meta = keys.request_events(never_rid), keys.request_meta(never_rid)
    assert 0 < rdb.pttl(events) <= RESUME_GRACE_S * 1000
    assert 0 < rdb.pttl(meta) <= RESUME_GRACE_S * 1000
    # Within the grace a client that lost its connection gets the whole answer back.
    resumed = stream(api_url, f"/v1/requests/{never_rid}/events", never_key, {}, method="GET")
    assert resumed.status_code == 200 and resumed.text == never.text

    deadline = time.monotonic() + RESUME_GRACE_S + 5
    while rdb.exists(events, meta) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not rdb.exists(events, meta), "the output text outlived the grace"
    gone = httpx.get(f"{api_url}/v1/requests/{never_rid}/events", headers=auth(never_key))
    assert gone.status_code == 404
    # The done marker (no content) stays: a late second delivery is still refused.
    assert rdb.get(keys.request_done(never_rid)) is not None
    # A tenant that keeps content keeps the journal `journal_ttl_s` as before.
    assert rdb.ttl(keys.request_events(keep_rid)) > settings.journal_ttl_s - 60
