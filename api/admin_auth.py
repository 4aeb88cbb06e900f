"""The admin API's credential: `Authorization: Bearer <admin key>` (`Settings.admin_secret`),
compared in constant time; wrong ones are throttled per client address like tenant keys
(`api/auth.py`). The admin API (`api/admin.py`, `api/admin_rollouts.py`) and the status
page's data (`api/dashboard.py`) check it."""

from __future__ import annotations

import hmac

from starlette.requests import Request

from api.auth import verify_key
from api.context import ApiContext


async def admin_context(request: Request) -> ApiContext:
    """The context, once the caller has shown the admin key; 401 otherwise (429 while the
    caller's address is throttled)."""
    ctx: ApiContext = request.state.ctx

    async def is_admin_key(key: str) -> ApiContext | None:
        is_admin = hmac.compare_digest(key.encode(), ctx.settings.admin_secret.encode())
        return ctx if is_admin else None

    message = "Invalid or missing admin key."
    return await verify_key(request, ctx, is_admin_key, missing=message, invalid=message)
