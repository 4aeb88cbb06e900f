"""Hardening of tenants, keys and authentication: retention values capped (and a stored
huge one still billed), failed authentications throttled per client address across
replicas, default limits for new tenants, and one rule for names and ids in the admin API
and the CLI.

The throttle tests send from their own loopback addresses (127.0.0.2 and up: all of
127.0.0.0/8 is this machine), so the failures they cause count against no other test.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import httpx
import pytest
from sqlalchemy import text
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session
from typer.testing import CliRunner

from cli.main import app as cli_app
from control import usage_writer
from shared import deployments, keys, tenants
from shared.protocol import SamplingParams, UsageEvent
from shared.tables import RequestContent, Tenant
from tests.conftest import _stop, spawn_api
from tests.helpers import (
    add_deployment,
    assert_error,
    auth,
    forget_tenant,
    stream,
    wait_for_usage_record,
)

UNSERVED_MODEL = "tiny-llama-unserved-tenants"
MAX_NUM_FAILURES = 3
WINDOW_S = 10
DEFAULT_IN_FLIGHT = 2
DEFAULT_QUEUED = 3
TRUSTED_PROXY = "127.0.0.9"
HUGE = 2**31 - 1


def _name(prefix: str = "hard") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def _cli(*args: str):
    return CliRunner().invoke(cli_app, list(args))


@pytest.fixture
def admin(api_url, settings) -> Iterator[httpx.Client]:
    with httpx.Client(
        base_url=f"{api_url}/admin/v1", headers=auth(settings.admin_secret), timeout=30
    ) as client:
        yield client


@dataclass(frozen=True)
class Replicas:
    """Two API replicas on the same Redis and SQL, with a small failure budget and small
    default limits; `a` believes X-Forwarded-For from `TRUSTED_PROXY`, `b` from nobody."""

    a: str
    b: str


@pytest.fixture(scope="module")
def replicas(env, home, db) -> Iterator[Replicas]:
    strict = {
        "LLMFLEET_MAX_NUM_AUTH_FAILURES": str(MAX_NUM_FAILURES),
        "LLMFLEET_AUTH_FAILURE_WINDOW_S": str(WINDOW_S),
        "LLMFLEET_DEFAULT_MAX_REQUESTS_IN_FLIGHT": str(DEFAULT_IN_FLIGHT),
        "LLMFLEET_DEFAULT_MAX_REQUESTS_QUEUED": str(DEFAULT_QUEUED),
    }
    a = spawn_api(env | strict | {"LLMFLEET_FORWARDED_ALLOW_IPS": TRUSTED_PROXY}, home)
    try:
        b = spawn_api(env | strict, home)
    except BaseException:
        _stop(a.process)
        raise
    yield Replicas(a.url, b.url)
    _stop(a.process)
    _stop(b.process)


def _from(address: str, **kwargs) -> httpx.Client:
    """A client whose connections come from `address` (a loopback one)."""
    return httpx.Client(transport=httpx.HTTPTransport(local_address=address), timeout=30, **kwargs)


def _models(client: httpx.Client, url: str, key: str, **headers: str) -> httpx.Response:
    return client.get(f"{url}/v1/models", headers=auth(key) | headers)


def _assert_throttled(response: httpx.Response) -> None:
    error = assert_error(response, 429, "too_many_failed_authentications")
    assert error["type"] == "rate_limit_error"
    assert 1 <= int(response.headers["retry-after"]) <= WINDOW_S


# --- 1. retention values ---


@pytest.mark.parametrize("days", [HUGE, tenants.MAX_RETENTION_DAYS + 1])
def test_a_retention_past_the_cap_is_400_on_create_and_update(admin, days):
    name = _name()
    refused = admin.post("/tenants", json={"name": name, "content_retention_days": days})
    assert assert_error(refused, 400, "invalid_value")["param"] == "content_retention_days"
    assert admin.get(f"/tenants/{name}").status_code == 404

    created = admin.post("/tenants", json={"name": name, "content_retention_days": 36_500})
    assert created.status_code == 201 and created.json()["content_retention_days"] == 36_500
    patched = admin.patch(f"/tenants/{name}", json={"content_retention_days": days})
    assert assert_error(patched, 400, "invalid_value")["param"] == "content_retention_days"
    assert admin.get(f"/tenants/{name}").json()["content_retention_days"] == 36_500


def test_the_cli_refuses_a_retention_past_the_cap(env, db):
    name = _name("cli")
    refused = _cli("tenant", "create", name, "--retention-days", str(HUGE))
    assert refused.exit_code == 2, refused.output
    assert tenants.get_tenant_by_name(db, name) is None
    assert _cli("tenant", "create", name, "--retention-days", "36500").exit_code == 0
    assert _cli("tenant", "update", name, "--retention-days", "36501").exit_code == 2
    assert tenants.get_tenant_by_name(db, name).content_retention_days == 36_500


def _set_retention_in_sql(db, tenant_id: str, days: int) -> None:
    """As a database written before the cap (or by hand) may hold it."""
    with Session(db) as session:
        session.execute(
            text("UPDATE tenant SET content_retention_days = :days WHERE id = :id"),
            {"days": days, "id": tenant_id},
        )
        session.commit()


def _assert_kept_for_the_cap(db, request_id: str, finished_at: datetime) -> None:
    with Session(db) as session:
        content = session.get(RequestContent, request_id)
    assert content is not None
    expires_at = content.expires_at.replace(tzinfo=UTC)
    expected = finished_at + timedelta(days=tenants.MAX_RETENTION_DAYS)
    assert abs(expires_at - expected) < timedelta(minutes=5)


def test_a_usage_event_with_a_huge_retention_is_recorded(db, settings):
    tenant = tenants.create_tenant(db, _name(), content_retention_days=5)
    deployment = add_deployment(db, f"m-{uuid.uuid4().hex[:6]}")
    now_s = time.time()
    event = UsageEvent(
        request_id=f"cmpl-{uuid.uuid4().hex}",
        tenant_id=tenant.id,
        deployment_id=deployment.id,
        kind="completion",
        sampling=SamplingParams(),
        input_tokens=2,
        output_tokens=3,
        computed_tokens=5,
        finish_reason="stop",
        arrival_ts=now_s - 1,
        finished_ts=now_s,
        content_retention_days=HUGE,
        prompt_token_ids=[1, 2],
        output_text="abc",
    )
    assert usage_writer.record(db, event, settings.ledger_key) is True
    _assert_kept_for_the_cap(db, event.request_id, datetime.fromtimestamp(now_s, UTC))


def test_a_huge_retention_stored_in_sql_still_gets_the_request_billed(
    api_url, tiny_worker, tiny_deployment, db, settings
):
    tenant = tenants.create_tenant(db, _name(), content_retention_days=5)
    key = tenants.create_key(db, tenant.id, settings.pepper)
    _set_retention_in_sql(db, tenant.id, HUGE)
    body = {"model": tiny_deployment.model_id, "prompt": "hello", "max_tokens": 4}
    result = stream(api_url, "/v1/completions", key, body)
    assert result.has_done, result.chunks
    request_id = result.headers["x-request-id"]

    record = wait_for_usage_record(db, request_id, timeout_s=60)
    assert record.tenant_id == tenant.id and record.output_tokens >= 1
    _assert_kept_for_the_cap(db, request_id, record.finished_at.replace(tzinfo=UTC))


# --- 2. failed authentications, throttled per client address ---


def test_failed_tenant_keys_are_throttled_per_address_across_replicas(replicas, make_tenant):
    _, key = make_tenant("throttle")
    with _from("127.0.0.2") as guesser, _from("127.0.0.3") as other:
        # the budget is one count in Redis: the failures add up over both replicas
        for url in [replicas.a, replicas.b, replicas.a][:MAX_NUM_FAILURES]:
            assert_error(_models(guesser, url, "lf-wrong"), 401, "invalid_api_key")
        for url in (replicas.a, replicas.b):
            _assert_throttled(_models(guesser, url, "lf-wrong-again"))
            # a successful request is never throttled, even from the guesser's address
            assert _models(guesser, url, key).status_code == 200
        # no key at all is not a guess: a 401 as ever
        assert_error(guesser.get(f"{replicas.a}/v1/models"), 401, "invalid_api_key")

        # another address is untouched, with a valid key or a wrong one
        assert _models(other, replicas.b, key).status_code == 200
        assert_error(_models(other, replicas.b, "lf-wrong"), 401, "invalid_api_key")


def test_failed_admin_keys_are_throttled_too(replicas, settings):
    with _from("127.0.0.4") as guesser, _from("127.0.0.5") as other:
        for _ in range(MAX_NUM_FAILURES):
            response = guesser.get(f"{replicas.b}/admin/v1/tenants", headers=auth("not-it"))
            assert_error(response, 401, "invalid_api_key")
        _assert_throttled(guesser.get(f"{replicas.a}/admin/v1/tenants", headers=auth("not-it")))
        admin_key = auth(settings.admin_secret)
        assert guesser.get(f"{replicas.a}/admin/v1/tenants", headers=admin_key).status_code == 200
        assert other.get(f"{replicas.a}/admin/v1/tenants", headers=admin_key).status_code == 200


def test_a_throttled_address_may_try_again_once_its_window_ends(replicas, make_tenant):
    _, key = make_tenant("window")
    with _from("127.0.0.6") as client:
        for _ in range(MAX_NUM_FAILURES):
            assert_error(_models(client, replicas.a, "lf-wrong"), 401)
        throttled = _models(client, replicas.a, "lf-wrong")
        _assert_throttled(throttled)
        time.sleep(int(throttled.headers["retry-after"]) + 0.5)
        assert _models(client, replicas.a, key).status_code == 200
        assert_error(_models(client, replicas.a, "lf-wrong"), 401)


@pytest.fixture
def loopback_failures(rdb) -> Iterator[str]:
    """127.0.0.1's failure counter, cleared before and after: every other test connects
    from 127.0.0.1, and this one uses up its budget."""
    key = keys.auth_failures("127.0.0.1")
    rdb.delete(key)
    yield key
    rdb.delete(key)


def test_x_forwarded_for_is_not_believed_by_default(replicas, rdb, loopback_failures):
    # uvicorn's own default believes X-Forwarded-For from 127.0.0.1: a client there could
    # pick a new address for each guess.
    with _from("127.0.0.1") as client:
        for i in range(MAX_NUM_FAILURES):
            forwarded = {"X-Forwarded-For": f"198.51.100.{i + 1}"}
            assert_error(_models(client, replicas.b, "lf-wrong", **forwarded), 401)
        _assert_throttled(_models(client, replicas.b, "lf-wrong", **{"X-Forwarded-For": "::1"}))
    assert int(rdb.get(loopback_failures)) == MAX_NUM_FAILURES
    assert not rdb.exists(keys.auth_failures("198.51.100.1"))


def test_a_configured_proxy_is_believed(replicas, make_tenant, rdb):
    _, key = make_tenant("proxied")
    first, second = ({"X-Forwarded-For": f"203.0.113.{i}"} for i in (7, 8))
    with _from(TRUSTED_PROXY) as proxy, _from("127.0.0.10") as untrusted:
        for _ in range(MAX_NUM_FAILURES):
            assert_error(_models(proxy, replicas.a, "lf-wrong", **first), 401)
        _assert_throttled(_models(proxy, replicas.a, "lf-wrong", **first))
        # the proxy's other clients keep their own budgets
        assert _models(proxy, replicas.a, key, **second).status_code == 200
        assert_error(_models(proxy, replicas.a, "lf-wrong", **second), 401)
        # from anyone else the header is ignored
        assert_error(_models(untrusted, replicas.a, "lf-wrong", **first), 401)
    assert int(rdb.get(keys.auth_failures("127.0.0.10"))) == 1
    assert int(rdb.get(keys.auth_failures("203.0.113.8"))) == 1


# --- 3. default limits for new tenants ---


@pytest.fixture(scope="module")
def unserved_deployment(db, tiny_model_dir):
    """The tiny model under a model id no worker serves: admitted requests stay queued."""
    return deployments.register(db, UNSERVED_MODEL, str(tiny_model_dir))


@pytest.fixture
def queued_tenants(rdb) -> Iterator[list[str]]:
    """Ids of tenants whose requests wait on `UNSERVED_MODEL`; their Redis state goes after."""
    made: list[str] = []
    yield made
    for tenant_id in made:
        forget_tenant(rdb, tenant_id)


def _admit_and_hang_up(url: str, key: str) -> httpx.Response:
    body = {"model": UNSERVED_MODEL, "prompt": "hi", "max_tokens": 4, "stream": True}
    with (
        httpx.Client(timeout=60) as client,
        client.stream("POST", f"{url}/v1/completions", json=body, headers=auth(key)) as r,
    ):
        if r.status_code != 200:
            r.read()  # the error body, for the caller
        return r


def test_a_tenant_created_without_limits_gets_the_defaults_and_is_held_to_them(
    replicas, settings, unserved_deployment, queued_tenants
):
    with httpx.Client(
        base_url=f"{replicas.a}/admin/v1", headers=auth(settings.admin_secret), timeout=30
    ) as admin:
        created = admin.post("/tenants", json={"name": _name("defaults")}).json()
        unlimited = admin.post(
            "/tenants", json={"name": _name("nolimit"), "max_requests_in_flight": None}
        ).json()
    assert (created["max_requests_in_flight"], created["max_requests_queued"]) == (
        DEFAULT_IN_FLIGHT,
        DEFAULT_QUEUED,
    )
    assert created["tokens_per_minute"] is None and created["requests_per_minute"] is None
    assert (unlimited["max_requests_in_flight"], unlimited["max_requests_queued"]) == (
        None,
        DEFAULT_QUEUED,
    )

    queued_tenants.append(created["id"])
    key = created["api_key"]["key"]
    for _ in range(DEFAULT_IN_FLIGHT):
        assert _admit_and_hang_up(replicas.b, key).status_code == 200
    refused = _admit_and_hang_up(replicas.b, key)
    assert_error(refused, 429, "requests_in_flight_exceeded")


def test_the_cli_gives_a_new_tenant_the_defaults_for_the_limits_it_was_not_given(env, db, settings):
    defaults = (settings.default_max_requests_in_flight, settings.default_max_requests_queued)
    plain, queued, unlimited = _name("cli"), _name("cli"), _name("cli")
    assert _cli("tenant", "create", plain).exit_code == 0
    assert _cli("tenant", "create", queued, "--max-queued", "7").exit_code == 0
    assert _cli("tenant", "create", unlimited, "--max-in-flight", "0").exit_code == 0

    def shown(name: str) -> tuple:
        tenant = tenants.get_tenant_by_name(db, name)
        return tenant.max_requests_in_flight, tenant.max_requests_queued

    assert shown(plain) == defaults
    assert shown(queued) == (defaults[0], 7)
    assert shown(unlimited) == (None, defaults[1])
    listed = _cli("tenant", "list").output.splitlines()
    [row] = [line.split() for line in listed if line.startswith(plain + " ")]
    assert row[4:6] == [str(defaults[0]), str(defaults[1])]


# --- 4. key ids and tenant names ---


@pytest.mark.parametrize(
    "key_id",
    ["9223372036854775808", "2147483648", "1" + "0" * 30, "0", "-1", "abc", "1.5", "%D9%A1"],
)
def test_an_out_of_range_or_malformed_key_id_is_404(admin, key_id):
    assert_error(admin.delete(f"/keys/{key_id}"), 404, "not_found")


@pytest.mark.parametrize("name", ["a%00b", "a%0Ab", "x" * 65, "-x", "%C3%A9"])
def test_a_malformed_tenant_name_in_a_path_is_404(admin, name):
    # (a newline matches no route at all: a 404 of the router's)
    assert_error(admin.get(f"/tenants/{name}"), 404)
    assert_error(admin.patch(f"/tenants/{name}", json={"tier": 2}), 404)
    assert_error(admin.post(f"/tenants/{name}/keys"), 404)
    assert_error(admin.get(f"/tenants/{name}/keys"), 404)


def test_the_cli_revokes_no_key_for_an_out_of_range_id(env):
    result = _cli("key", "revoke", "9223372036854775808")
    assert result.exit_code == 2, result.output  # a usage error, not a crash
    assert "no key with id" in result.output


@pytest.mark.parametrize(
    "name", ["a/b", "../../x", "a\nb", "trailing\n", "", "-x", ".x", "x" * 65, "a b", "é"]
)
def test_the_cli_and_the_admin_api_refuse_the_same_names(admin, env, db, name):
    api = admin.post("/tenants", json={"name": name})
    assert assert_error(api, 400, "invalid_value")["param"] == "name"
    cli = _cli("tenant", "create", "--", name)
    assert cli.exit_code == 2, cli.output
    with pytest.raises(tenants.InvalidTenantField):
        tenants.create_tenant(db, name)
    assert tenants.get_tenant_by_name(db, name) is None


def test_names_that_differ_only_in_case_are_one_name(admin, env, db):
    name = f"Case-{uuid.uuid4().hex[:8]}"
    assert admin.post("/tenants", json={"name": name}).status_code == 201
    other_case = name.swapcase()
    assert_error(admin.post("/tenants", json={"name": other_case}), 409, "tenant_exists")
    cli = _cli("tenant", "create", other_case.upper())
    assert cli.exit_code != 0 and "already exists" in cli.output
    with pytest.raises(tenants.TenantNameTaken):
        tenants.create_tenant(db, name.lower())
    # the database itself refuses it (the unique index on lower(name))
    with Session(db) as session, pytest.raises(IntegrityError):
        session.add(Tenant(name=name.upper()))
        session.commit()
    assert tenants.get_tenant_by_name(db, other_case) is None
