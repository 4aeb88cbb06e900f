"""Bearer key -> tenant."""

from __future__ import annotations

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from api.context import ApiContext
from api.errors import unauthorized
from shared import tenants
from shared.tenants import Principal


async def authenticate(request: Request, ctx: ApiContext) -> Principal:
    scheme, _, key = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise unauthorized("Missing API key: send `Authorization: Bearer <key>`.")
    principal = await run_in_threadpool(
        tenants.authenticate, ctx.engine, key.strip(), ctx.settings.pepper
    )
    if principal is None:
        raise unauthorized()
    return principal
