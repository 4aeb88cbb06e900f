"""Bearer key -> tenant (or the admin), with failed attempts throttled per client address.

A verified key's principal is cached in the process (`api/context.py` `PrincipalCache`),
valid while the principals' epoch in Redis has not moved (`shared/principals_epoch.py`):
every change to a tenant or key moves it, so a revoked key is refused by every replica on
its next request, and an unchanged one costs a Redis read instead of an SQL lookup on a
thread.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from api import auth_throttle
from api.context import ApiContext
from api.errors import unauthorized
from shared import principals_epoch, tenants
from shared.tenants import Principal

T = TypeVar("T")


def bearer_key(request: Request) -> str | None:
    """The key of `Authorization: Bearer <key>`; None when no key is presented."""
    scheme, _, key = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        return None
    return key.strip()


async def verify_key(
    request: Request,
    ctx: ApiContext,
    verify: Callable[[str], Awaitable[T | None]],
    *,
    missing: str,
    invalid: str,
) -> T:
    """What `verify` makes of the request's bearer key: 401 with `missing` without one; 401
    with `invalid` when `verify` says None (counted against the client's address), or 429
    once the address has used up its failures (`api/auth_throttle.py`). A valid key passes
    whatever its address did."""
    key = bearer_key(request)
    if key is None:
        raise unauthorized(missing)
    verified = await verify(key)
    if verified is None:
        address = auth_throttle.client_address(request)
        await auth_throttle.refuse_if_throttled(ctx.redis, ctx.settings, address)
        await auth_throttle.count_failure(ctx.redis, ctx.settings, address)
        raise unauthorized(invalid)
    return verified


async def authenticate(request: Request, ctx: ApiContext) -> Principal:
    async def lookup(key: str) -> Principal | None:
        key_hash = tenants.hash_key(key, ctx.settings.pepper)
        epoch, now_s = await principals_epoch.current(ctx.redis), time.monotonic()
        if (principal := ctx.principals.get(key_hash, epoch, now_s)) is not None:
            return principal
        principal = await run_in_threadpool(
            tenants.authenticate, ctx.engine, key, ctx.settings.pepper
        )
        if principal is not None:
            ctx.principals.put(key_hash, principal, epoch, now_s)
        return principal

    return await verify_key(
        request,
        ctx,
        lookup,
        missing="Missing API key: send `Authorization: Bearer <key>`.",
        invalid="Invalid or missing API key.",
    )
