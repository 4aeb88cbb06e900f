"""The admin API under `/admin/v1`: tenants, their settings and their API keys; model rollouts
(`api/admin_rollouts.py`); the autoscaler's decisions, for KEDA (`api/admin_autoscale.py`).

Every call needs `Authorization: Bearer <admin key>` (`api/admin_auth.py`).
The two credentials never overlap: tenant keys start with `lf-`, which an admin key may not,
and the admin key is not in the key table, so it opens none of `/v1`.

A tenant name or key id in a path that could name no row (malformed, out of the SQL column's
range) is a 404 like an unknown one, without a query.

Changes take effect on every API replica at the tenant's next request, because
authentication reads SQL on each request (`shared.tenants.authenticate`, no cache).
"""

from __future__ import annotations

from datetime import UTC, datetime

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Mount, Route

from api import admin_autoscale, admin_rollouts
from api.admin_auth import admin_context
from api.admin_schemas import TenantCreateBody, TenantUpdateBody
from api.context import ApiContext
from api.errors import APIError, bad_request, not_found
from api.schemas import parse_body, read_body
from shared import principals_epoch, tenants
from shared.tables import Tenant
from shared.tenants import LIMIT_FIELDS, InvalidTenantField, IssuedKey, KeyInfo, TenantNameTaken


async def create_tenant(request: Request) -> Response:
    ctx = await admin_context(request)
    body = parse_body(
        TenantCreateBody, await read_body(request, ctx.settings.max_request_body_bytes)
    )
    tenant, issued = await run_in_threadpool(_create_tenant, ctx, body)
    api_key = _issued_key_json(issued) if issued is not None else None
    return JSONResponse({**_tenant_json(tenant), "api_key": api_key}, status_code=201)


def _create_tenant(ctx: ApiContext, body: TenantCreateBody) -> tuple[Tenant, IssuedKey | None]:
    try:
        tenant = tenants.create_tenant(
            ctx.engine,
            body.name,
            tier=body.tier,
            weight=body.weight,
            limits=tenants.limits_with_defaults(body.given_limits(), ctx.settings),
            content_retention_days=body.content_retention_days,
        )
    except InvalidTenantField as exc:
        raise bad_request(str(exc), param=exc.field, code="invalid_value") from None
    except TenantNameTaken:
        raise APIError(
            409,
            f"A tenant named `{body.name}` already exists (names are unique ignoring case).",
            param="name",
            code="tenant_exists",
        ) from None
    if not body.create_key:
        return tenant, None
    return tenant, tenants.issue_key(ctx.engine, tenant.id, ctx.settings.pepper)


async def list_tenants(request: Request) -> Response:
    ctx = await admin_context(request)
    rows = await run_in_threadpool(tenants.list_tenants, ctx.engine)
    return JSONResponse({"object": "list", "data": [_tenant_json(t) for t in rows]})


async def get_tenant(request: Request) -> Response:
    ctx = await admin_context(request)
    tenant = await _tenant_or_404(ctx, request.path_params["name"])
    return JSONResponse(_tenant_json(tenant))


async def update_tenant(request: Request) -> Response:
    ctx = await admin_context(request)
    changes = parse_body(
        TenantUpdateBody, await read_body(request, ctx.settings.max_request_body_bytes)
    ).changes()
    name = request.path_params["name"]
    if not tenants.is_valid_tenant_name(name):
        raise _no_tenant(name)
    try:
        tenant = await run_in_threadpool(tenants.update_tenant, ctx.engine, name, **changes)
    except InvalidTenantField as exc:
        raise bad_request(str(exc), param=exc.field, code="invalid_value") from None
    if tenant is None:
        raise _no_tenant(name)
    await principals_epoch.advance(ctx.redis)
    return JSONResponse(_tenant_json(tenant))


async def create_key(request: Request) -> Response:
    ctx = await admin_context(request)
    tenant = await _tenant_or_404(ctx, request.path_params["name"])
    issued = await run_in_threadpool(tenants.issue_key, ctx.engine, tenant.id, ctx.settings.pepper)
    return JSONResponse(_issued_key_json(issued), status_code=201)


async def list_keys(request: Request) -> Response:
    ctx = await admin_context(request)
    tenant = await _tenant_or_404(ctx, request.path_params["name"])
    rows = await run_in_threadpool(tenants.list_keys, ctx.engine, tenant.id)
    return JSONResponse({"object": "list", "data": [_key_json(k) for k in rows]})


async def revoke_key(request: Request) -> Response:
    ctx = await admin_context(request)
    text = request.path_params["key_id"]
    # Not digits: 0, which no key has. `revoke_key` answers None, without a query, for an id
    # out of the column's range (the driver would fail on it: a 500).
    key_id = int(text) if text.isascii() and text.isdigit() else 0
    info = await run_in_threadpool(tenants.revoke_key, ctx.engine, key_id)
    if info is None:
        raise not_found(f"No API key with id `{text}`.")
    await principals_epoch.advance(ctx.redis)
    return JSONResponse(_key_json(info))


async def _tenant_or_404(ctx: ApiContext, name: str) -> Tenant:
    if not tenants.is_valid_tenant_name(name):
        raise _no_tenant(name)  # no such name can be created (PostgreSQL refuses a NUL in one)
    tenant = await run_in_threadpool(tenants.get_tenant_by_name, ctx.engine, name)
    if tenant is None:
        raise _no_tenant(name)
    return tenant


def _no_tenant(name: str) -> APIError:
    return APIError(404, f"No tenant named `{name}`.", code="tenant_not_found")


def _tenant_json(tenant: Tenant) -> dict:
    return {
        "object": "tenant",
        "id": tenant.id,
        "name": tenant.name,
        "tier": tenant.tier,
        "weight": tenant.weight,
        **{field: getattr(tenant, field) for field in LIMIT_FIELDS},
        "content_retention_days": tenant.content_retention_days,
        "is_disabled": tenant.is_disabled,
        "created_at": _unix_s(tenant.created_at),
        "updated_at": _unix_s(tenant.updated_at),
    }


def _key_json(info: KeyInfo) -> dict:
    """Never the key nor its hash: those exist only in `_issued_key_json`, once."""
    return {
        "object": "api_key",
        "id": info.id,
        "tenant_id": info.tenant_id,
        "prefix": info.prefix,
        "created_at": _unix_s(info.created_at),
        "revoked_at": _unix_s(info.revoked_at) if info.revoked_at is not None else None,
    }


def _issued_key_json(issued: IssuedKey) -> dict:
    return {**_key_json(issued.info), "key": issued.key}


def _unix_s(moment: datetime) -> int:
    # SQLite gives back naive datetimes; every one stored here is UTC (`tables.utcnow`).
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return int(moment.timestamp())


routes = [
    Mount(
        "/admin/v1",
        routes=[
            Route("/tenants", create_tenant, methods=["POST"]),
            Route("/tenants", list_tenants, methods=["GET"]),
            Route("/tenants/{name}", get_tenant, methods=["GET"]),
            Route("/tenants/{name}", update_tenant, methods=["PATCH"]),
            Route("/tenants/{name}/keys", create_key, methods=["POST"]),
            Route("/tenants/{name}/keys", list_keys, methods=["GET"]),
            Route("/keys/{key_id}", revoke_key, methods=["DELETE"]),
            *admin_rollouts.routes,
            *admin_autoscale.routes,
        ],
    )
]
