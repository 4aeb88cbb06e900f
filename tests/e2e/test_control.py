"""Content retention end to end, through the admin API and the session's control process: a
policy set at creation or later, and a tenant with one keeps its prompt and output while one
without keeps nothing (the control jobs themselves: tests/control/test_control.py)."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime, timedelta

import httpx

from shared.db import session_scope
from shared.tables import RequestContent, Tenant
from tests.helpers import auth, stream, wait_for_usage_record


def test_a_tenant_with_retention_keeps_its_prompt_and_output(
    api_url, tiny_worker, tiny_deployment, make_tenant, db, settings
):
    admin = auth(settings.admin_secret)
    results = {}
    for retention_days in (3, None):
        tenant_id, key = make_tenant("retention")
        with session_scope(db) as session:
            name = session.get(Tenant, tenant_id).name
        patched = httpx.patch(
            f"{api_url}/admin/v1/tenants/{name}",
            json={"content_retention_days": retention_days},
            headers=admin,
        )
        assert patched.json()["content_retention_days"] == retention_days, patched.text
        body = {"model": tiny_deployment.model_id, "prompt": "keep me", "max_tokens": 5}
        result = stream(api_url, "/v1/completions", key, body)
        request_id = result.headers["x-request-id"]
        wait_for_usage_record(db, request_id)
        with session_scope(db) as session:
            results[retention_days] = (result.text, session.get(RequestContent, request_id))
    text, kept = results[3]
    assert kept.output == text and json.loads(kept.prompt_token_ids_json)
    assert kept.expires_at > datetime.now(UTC) + timedelta(days=2, hours=23)
    assert results[None][1] is None
    zero = httpx.patch(
        f"{api_url}/admin/v1/tenants/{name}", json={"content_retention_days": 0}, headers=admin
    )
    assert zero.status_code == 400


def test_a_retention_policy_is_set_at_creation(api_url, settings):
    name = f"retention-new-{uuid.uuid4().hex[:6]}"
    created = httpx.post(
        f"{api_url}/admin/v1/tenants",
        json={"name": name, "content_retention_days": 5, "create_key": False},
        headers=auth(settings.admin_secret),
    )
    assert created.status_code == 201, created.text
    assert created.json()["content_retention_days"] == 5
