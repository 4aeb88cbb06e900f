"""Usage reports: `usage.totals`, `GET /v1/usage` (the caller's tenant) and the
`llmfleet usage report|verify|export-heads` commands."""

from __future__ import annotations

import uuid
from datetime import UTC, date, datetime, timedelta

import httpx
import pytest
from sqlmodel import select

from control import usage_writer
from shared import usage
from shared.db import session_scope
from shared.protocol import QueuedRequest, SamplingParams
from shared.tables import ModelDeployment, Tenant
from tests.helpers import add_deployment, auth, llmfleet


@pytest.fixture(scope="module")
def deployment(db) -> ModelDeployment:
    return add_deployment(db, f"report-{uuid.uuid4().hex[:6]}")


def record(
    db, settings, tenant_id: str, deployment_id: int, finished: datetime, num_output: int
) -> str:
    request_id = f"rep-{uuid.uuid4().hex[:10]}"
    request = QueuedRequest(
        request_id=request_id,
        tenant_id=tenant_id,
        model="m",
        deployment_id=deployment_id,
        kind="completion",
        prompt_token_ids=[1, 2],
        sampling=SamplingParams(),
        arrival_ts=finished.timestamp() - 1,
    )
    event = usage.usage_event(
        request,
        finish_reason="stop",
        num_output_tokens=num_output,
        num_computed_tokens=2 + num_output,
    )
    usage_writer.record(
        db, event.model_copy(update={"finished_ts": finished.timestamp()}), settings.ledger_key
    )
    return request_id


DAY = date(2026, 3, 10)
NOON = datetime(2026, 3, 10, 12, tzinfo=UTC)


def test_totals_per_model_and_day(db, settings, make_tenant, deployment):
    tenant_id, _key = make_tenant("report")
    record(db, settings, tenant_id, deployment.id, NOON, 3)
    record(db, settings, tenant_id, deployment.id, NOON + timedelta(hours=11, minutes=59), 4)
    record(db, settings, tenant_id, deployment.id, NOON + timedelta(days=1), 5)
    record(db, settings, tenant_id, deployment.id, NOON + timedelta(days=3), 6)  # after `end`
    rows = usage.totals(db, DAY, DAY + timedelta(days=1), tenant_id)
    assert [(r.day, r.num_requests, r.input_tokens, r.output_tokens) for r in rows] == [
        (DAY, 2, 4, 7),
        (DAY + timedelta(days=1), 1, 2, 5),
    ]
    assert rows[0].model_id == deployment.model_id and rows[0].computed_tokens == 11


def test_the_endpoint_reports_only_the_callers_tenant(
    db, settings, make_tenant, deployment, api_url
):
    tenant_a, key_a = make_tenant("report-a")
    tenant_b, key_b = make_tenant("report-b")
    record(db, settings, tenant_a, deployment.id, NOON, 3)
    record(db, settings, tenant_b, deployment.id, NOON, 30)
    params = {"start": "2026-03-10", "end": "2026-03-10"}
    for key, num_output in ((key_a, 3), (key_b, 30)):
        response = httpx.get(f"{api_url}/v1/usage", params=params, headers=auth(key))
        assert response.status_code == 200, response.text
        [row] = [r for r in response.json()["data"] if r["model"] == deployment.model_id]
        assert (row["day"], row["num_requests"], row["output_tokens"]) == (
            "2026-03-10",
            1,
            num_output,
        )


@pytest.mark.parametrize(
    "params",
    [
        {},
        {"start": "2026-03-10"},
        {"start": "yesterday", "end": "2026-03-10"},
        {"start": "2026-03-11", "end": "2026-03-10"},
    ],
)
def test_the_endpoint_refuses_bad_dates(make_tenant, api_url, params):
    _tenant, key = make_tenant("report-bad")
    response = httpx.get(f"{api_url}/v1/usage", params=params, headers=auth(key))
    assert response.status_code == 400


def test_the_endpoint_needs_a_key(api_url):
    params = {"start": "2026-03-10", "end": "2026-03-10"}
    assert httpx.get(f"{api_url}/v1/usage", params=params).status_code == 401


def test_report_and_verify_commands(db, env, settings, make_tenant, deployment):
    tenant_id, _key = make_tenant("report-cli")
    with session_scope(db) as session:
        name = session.get(Tenant, tenant_id).name
    record(db, settings, tenant_id, deployment.id, NOON, 3)
    report = llmfleet(env, "usage", "report", "--start", "2026-03-10", "--end", "2026-03-10")
    assert report.returncode == 0, report.stderr
    [line] = [line for line in report.stdout.splitlines() if line.startswith(name)]
    assert line.split()[-4:] == ["1", "2", "3", "5"]
    verify = llmfleet(env, "usage", "verify", "--tenant", name)
    assert (verify.returncode, verify.stdout.strip()) == (0, "OK"), verify.stderr
    exported = llmfleet(env, "usage", "export-heads")
    assert exported.returncode == 0, exported.stderr
    with db.begin() as conn:
        conn.exec_driver_sql(
            "UPDATE usagerecord SET output_tokens = 0 WHERE tenant_id = ?", (tenant_id,)
        )
    verify = llmfleet(env, "usage", "verify", "--tenant", name)
    assert verify.returncode == 1 and "seq 1: edited" in verify.stdout


def test_tenant_commands_set_the_retention_policy(db, env):
    name = f"retention-cli-{uuid.uuid4().hex[:6]}"
    assert llmfleet(env, "tenant", "create", name, "--retention-days", "7").returncode == 0
    assert llmfleet(env, "tenant", "update", name, "--retention-days", "0").returncode == 0
    with session_scope(db) as session:
        tenant = session.exec(select(Tenant).where(Tenant.name == name)).one()
        assert tenant.content_retention_days is None
    assert llmfleet(env, "tenant", "update", name, "--retention-days", "30").returncode == 0
    with session_scope(db) as session:
        assert session.get(Tenant, tenant.id).content_retention_days == 30
