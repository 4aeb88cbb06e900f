"""Tenant and key administration: the `/admin/v1` API, the CLI, and revocation seen at once by
every API replica (authentication reads SQL on every request, with no cache)."""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator

import httpx
import pytest
from typer.testing import CliRunner

from cli.main import app as cli_app
from shared import tenants
from tests.conftest import _stop, spawn_api
from tests.helpers import assert_error, auth


def _name(prefix: str = "adm") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def admin(api_url, settings) -> Iterator[httpx.Client]:
    """An HTTP client of the admin API, holding the admin key."""
    with httpx.Client(
        base_url=f"{api_url}/admin/v1", headers=auth(settings.admin_secret), timeout=30
    ) as client:
        yield client


@pytest.fixture(scope="module")
def second_api_url(env, home, db) -> Iterator[str]:
    """Another API process on the same Redis and SQL: a second replica."""
    api = spawn_api(env, home)
    yield api.url
    _stop(api.process)


def _create(admin: httpx.Client, **fields) -> dict:
    response = admin.post("/tenants", json={"name": _name(), **fields})
    assert response.status_code == 201, response.text
    return response.json()


def _models_status(url: str, key: str) -> int:
    """The cheapest authenticated call: 200 for a live key, 401 otherwise."""
    return httpx.get(f"{url}/v1/models", headers=auth(key), timeout=30).status_code


# --- authentication of the admin API ---


@pytest.mark.parametrize(
    "headers",
    [{}, auth("not-the-admin-key-at-all"), {"Authorization": "Basic dGVzdA=="}],
    ids=["missing", "wrong", "wrong-scheme"],
)
def test_admin_api_refuses_without_the_admin_key(api_url, headers):
    for method, path in [
        ("GET", "/tenants"),
        ("POST", "/tenants"),
        ("GET", "/tenants/anyone"),
        ("DELETE", "/keys/1"),
    ]:
        response = httpx.request(method, f"{api_url}/admin/v1{path}", headers=headers, json={})
        assert_error(response, 401, "invalid_api_key")


def test_a_tenant_key_is_not_an_admin_key_and_vice_versa(api_url, make_tenant, settings):
    _, tenant_key = make_tenant("notadmin")
    assert_error(httpx.get(f"{api_url}/admin/v1/tenants", headers=auth(tenant_key)), 401)
    assert _models_status(api_url, settings.admin_secret) == 401


# --- tenants ---


def test_create_tenant_returns_it_with_a_first_key_shown_once(admin, api_url, settings):
    created = _create(admin, tier=2, weight=3, tokens_per_minute=1000)
    assert created["object"] == "tenant" and created["id"].startswith("ten_")
    assert (created["tier"], created["weight"], created["tokens_per_minute"]) == (2, 3, 1000)
    # a limit not given takes its default
    assert created["max_requests_in_flight"] == settings.default_max_requests_in_flight
    assert created["is_disabled"] is False
    key = created["api_key"]["key"]
    assert key.startswith("lf-") and created["api_key"]["prefix"] == key[:8]
    assert _models_status(api_url, key) == 200

    listing = admin.get(f"/tenants/{created['name']}/keys")
    assert listing.status_code == 200
    [shown] = listing.json()["data"]
    assert set(shown) == {"object", "id", "tenant_id", "prefix", "created_at", "revoked_at"}
    assert shown["id"] == created["api_key"]["id"] and shown["revoked_at"] is None
    assert key not in listing.text and key[8:] not in listing.text


def test_create_tenant_without_a_key(admin):
    created = _create(admin, create_key=False)
    assert created["api_key"] is None
    assert admin.get(f"/tenants/{created['name']}/keys").json()["data"] == []


def test_get_and_list_tenants(admin):
    created = _create(admin, max_tokens_per_request=64)
    del created["api_key"]
    assert admin.get(f"/tenants/{created['name']}").json() == created
    listing = admin.get("/tenants").json()
    assert listing["object"] == "list"
    assert created in listing["data"]


def test_update_changes_only_the_given_fields_and_null_clears_a_limit(admin, db, settings):
    created = _create(admin, requests_per_minute=10, max_requests_queued=5)
    name, key = created["name"], created["api_key"]["key"]

    changed = admin.patch(
        f"/tenants/{name}", json={"tier": 0, "weight": 4, "tokens_per_minute": 99}
    )
    assert changed.status_code == 200, changed.text
    cleared = admin.patch(f"/tenants/{name}", json={"requests_per_minute": None}).json()

    assert (cleared["tier"], cleared["weight"], cleared["tokens_per_minute"]) == (0, 4, 99)
    assert cleared["requests_per_minute"] is None and cleared["max_requests_queued"] == 5
    assert admin.get(f"/tenants/{name}").json() == cleared
    # what admission will see on the tenant's next request
    principal = tenants.authenticate(db, key, settings.pepper)
    assert (principal.tier, principal.weight) == (0, 4)
    assert principal.limits == tenants.TenantLimits(
        max_requests_in_flight=settings.default_max_requests_in_flight,
        max_requests_queued=5,
        tokens_per_minute=99,
    )


def test_duplicate_tenant_name_is_409(admin):
    created = _create(admin)
    response = admin.post("/tenants", json={"name": created["name"], "tier": 5})
    assert assert_error(response, 409, "tenant_exists")["param"] == "name"
    assert admin.get(f"/tenants/{created['name']}").json()["tier"] == 1


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tier": -1}, "tier"),
        ({"weight": 0}, "weight"),
        ({"weight": None}, "weight"),
        ({"tokens_per_minute": 0}, "tokens_per_minute"),
        ({"max_requests_in_flight": -2}, "max_requests_in_flight"),
        ({"max_tokens_per_request": 2**31}, "max_tokens_per_request"),
        ({"tier": "2"}, "tier"),
        ({"tier": 1.5}, "tier"),
        ({"tokens_per_min": 10}, "tokens_per_min"),
        ({"name": ""}, "name"),
        ({"name": "a/b"}, "name"),
        ({"name": "-leading"}, "name"),
        ({"create_key": "yes"}, "create_key"),
    ],
)
def test_invalid_create_is_400_and_creates_nothing(admin, fields, param):
    body = {"name": _name(), **fields}
    error = assert_error(admin.post("/tenants", json=body), 400, "invalid_value")
    assert error["param"] == param
    if "name" not in fields:
        assert admin.get(f"/tenants/{body['name']}").status_code == 404


def test_malformed_json_is_400(admin):
    response = admin.post("/tenants", content=b"{not json")
    assert_error(response, 400, "invalid_json")


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"weight": 0}, "weight"),
        ({"tier": None}, "tier"),
        ({"is_disabled": None}, "is_disabled"),
        ({"is_disabled": "true"}, "is_disabled"),
        ({"requests_per_minute": 0}, "requests_per_minute"),
        ({"name": "renamed"}, "name"),
    ],
)
def test_invalid_update_is_400_and_changes_nothing(admin, fields, param):
    created = _create(admin, requests_per_minute=7)
    name = created["name"]
    error = assert_error(admin.patch(f"/tenants/{name}", json=fields), 400)
    assert error["param"] == param
    after = admin.get(f"/tenants/{name}").json()
    assert (after["weight"], after["tier"], after["requests_per_minute"]) == (1, 1, 7)
    assert after["is_disabled"] is False


def test_unknown_tenant_or_key_is_404(admin):
    missing = _name("missing")
    assert_error(admin.get(f"/tenants/{missing}"), 404, "tenant_not_found")
    assert_error(admin.patch(f"/tenants/{missing}", json={"tier": 2}), 404, "tenant_not_found")
    assert_error(admin.post(f"/tenants/{missing}/keys"), 404, "tenant_not_found")
    assert_error(admin.get(f"/tenants/{missing}/keys"), 404, "tenant_not_found")
    assert_error(admin.delete("/keys/999999999"), 404, "not_found")
    assert_error(admin.delete("/keys/not-a-number"), 404)


# --- keys ---


def test_new_keys_are_shown_once_and_a_revoked_key_is_refused(admin, api_url):
    name = _create(admin, create_key=False)["name"]
    first, second = (admin.post(f"/tenants/{name}/keys") for _ in range(2))
    assert first.status_code == second.status_code == 201
    first, second = first.json(), second.json()
    assert _models_status(api_url, first["key"]) == _models_status(api_url, second["key"]) == 200

    revoked = admin.delete(f"/keys/{first['id']}")
    assert revoked.status_code == 200 and revoked.json()["revoked_at"] is not None
    assert _models_status(api_url, first["key"]) == 401
    assert _models_status(api_url, second["key"]) == 200
    # revoking again changes nothing
    assert admin.delete(f"/keys/{first['id']}").json() == revoked.json()

    listing = admin.get(f"/tenants/{name}/keys")
    assert [(k["id"], k["revoked_at"] is not None) for k in listing.json()["data"]] == [
        (first["id"], True),
        (second["id"], False),
    ]
    assert first["key"] not in listing.text and second["key"] not in listing.text


# --- every replica sees a change on the very next request ---


def test_a_key_revoked_on_one_replica_is_refused_by_another_at_once(admin, second_api_url):
    created = _create(admin)
    key = created["api_key"]["key"]
    assert _models_status(second_api_url, key) == 200
    assert admin.delete(f"/keys/{created['api_key']['id']}").status_code == 200
    assert _models_status(second_api_url, key) == 401


def test_a_tenant_disabled_on_one_replica_is_refused_by_another_at_once(admin, second_api_url):
    created = _create(admin)
    name, key = created["name"], created["api_key"]["key"]
    assert _models_status(second_api_url, key) == 200

    disabled = admin.patch(f"/tenants/{name}", json={"is_disabled": True})
    assert disabled.status_code == 200 and disabled.json()["is_disabled"] is True
    assert _models_status(second_api_url, key) == 401

    assert admin.patch(f"/tenants/{name}", json={"is_disabled": False}).status_code == 200
    assert _models_status(second_api_url, key) == 200


# --- the admin credential ---


# --- the command line ---


def _cli(*args: str):
    return CliRunner().invoke(cli_app, list(args))


def _cli_key(output: str) -> str:
    return re.search(r"api key \(shown once\): (lf-\S+)", output).group(1)


def test_cli_tenant_create_update_and_list(env, db):
    name = _name("cli")
    limits = ["--max-in-flight", "4", "--max-queued", "8", "--tpm", "500", "--rpm", "20"]
    created = _cli(
        "tenant", "create", name, "--tier", "2", "--weight", "3", *limits,
        "--max-tokens-per-request", "128",
    )  # fmt: skip
    assert created.exit_code == 0, created.output
    tenant = tenants.get_tenant_by_name(db, name)
    assert (tenant.tier, tenant.weight) == (2, 3)
    assert tenants.TenantLimits.of(tenant) == tenants.TenantLimits(4, 8, 500, 20, 128)

    updated = _cli("tenant", "update", name, "--weight", "5", "--tpm", "0", "--rpm", "30")
    assert updated.exit_code == 0, updated.output
    tenant = tenants.get_tenant_by_name(db, name)
    assert (tenant.tier, tenant.weight, tenant.tokens_per_minute) == (2, 5, None)
    assert tenants.TenantLimits.of(tenant) == tenants.TenantLimits(4, 8, None, 30, 128)

    listed = _cli("tenant", "list")
    assert listed.exit_code == 0
    assert listed.output.splitlines()[0].split() == [
        "NAME", "ID", "TIER", "WEIGHT", "IN_FLIGHT", "QUEUED", "TPM", "RPM", "MAX_TOKENS", "STATUS"
    ]  # fmt: skip
    [row] = [line.split() for line in listed.output.splitlines() if line.startswith(name + " ")]
    assert row == [name, tenant.id, "2", "5", "4", "8", "-", "30", "128", "enabled"]


@pytest.mark.parametrize(
    "args",
    [
        ["tenant", "create", "x", "--weight", "0"],
        ["tenant", "create", "x", "--tpm", "-1"],
        ["tenant", "update", "nobody-at-all", "--tier", "1"],
        ["tenant", "update", "nobody-at-all", "--max-queued", str(2**31)],
        ["tenant", "disable", "nobody-at-all"],
        ["key", "create", "nobody-at-all"],
        ["key", "revoke", "999999999"],
    ],
)
def test_cli_refuses_bad_values_and_unknown_names(env, args):
    result = _cli(*args)
    assert result.exit_code == 2, result.output  # a usage error, not a crash


def test_cli_disable_and_enable(env, api_url):
    name = _name("cli")
    key = _cli_key(_cli("tenant", "create", name).output)
    assert _models_status(api_url, key) == 200
    assert "disabled" in _cli("tenant", "disable", name).output
    assert _models_status(api_url, key) == 401
    assert "enabled" in _cli("tenant", "enable", name).output
    assert _models_status(api_url, key) == 200


def test_cli_key_create_list_and_revoke(env, api_url):
    name = _name("cli")
    first = _cli_key(_cli("tenant", "create", name).output)
    made = _cli("key", "create", name)
    assert made.exit_code == 0, made.output
    second = _cli_key(made.output)
    second_id = re.search(r"key (\d+) created", made.output).group(1)

    listed = _cli("key", "list", name)
    assert listed.exit_code == 0 and first not in listed.output and second not in listed.output
    rows = [line.split() for line in listed.output.splitlines()[1:]]
    assert [(row[1], row[3]) for row in rows] == [(first[:8], "-"), (second[:8], "-")]

    assert _models_status(api_url, second) == 200  # verified once: the replica caches it
    revoked = _cli("key", "revoke", second_id)
    assert revoked.exit_code == 0, revoked.output
    assert _models_status(api_url, second) == 401
    assert _models_status(api_url, first) == 200
    [_, revoked_row] = [line.split() for line in _cli("key", "list", name).output.splitlines()[1:]]
    assert revoked_row[0] == second_id and revoked_row[3] != "-"


def test_cli_tenant_create_refuses_a_taken_name(env):
    name = _name("cli")
    assert _cli("tenant", "create", name).exit_code == 0
    again = _cli("tenant", "create", name)
    assert again.exit_code != 0 and "already exists" in again.output


def test_cli_admin_key_prints_the_admin_key(env, settings):
    result = _cli("admin-key")
    assert result.exit_code == 0
    assert result.output.strip() == settings.admin_secret
