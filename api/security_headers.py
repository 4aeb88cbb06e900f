"""Security headers on every HTTP answer of the API.

The API answers JSON and SSE to programs, and one HTML page (`/dashboard`), so no answer
is ever meant to be framed, sniffed into another type, or to load anything: every answer
says so, unless its route already set the header (the dashboard page sets its own
Content-Security-Policy), as the OWASP REST Security Cheat Sheet recommends for APIs.

A plain ASGI middleware rather than Starlette's `BaseHTTPMiddleware`: that one runs the
route in another task, which would cut the request's log context (`shared/logs.py`, a
contextvar) off from uvicorn's access line, and it would sit in the path of every SSE chunk.
"""

from __future__ import annotations

from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

DEFAULT_HEADERS = {
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Content-Security-Policy": "default-src 'none'; frame-ancestors 'none'",
    "Referrer-Policy": "no-referrer",
}


class SecurityHeadersMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                for name, value in DEFAULT_HEADERS.items():
                    headers.setdefault(name, value)
            await send(message)

        await self.app(scope, receive, send_with_headers)
