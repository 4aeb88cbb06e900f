"""`/dashboard`: a live status page for operators, and `/dashboard/data`, the JSON it polls.

The page (`api/static/dashboard.html`: plain `<canvas>` charts, no script from elsewhere) is a
shell without data, so anyone may load it; every figure comes from `/dashboard/data`, which
needs the admin key as `Authorization: Bearer`. The page asks for the key once per browser
tab and keeps it in sessionStorage, or takes it from the URL fragment (`/dashboard#key=...`:
browsers never send a fragment to the server, so the key stays out of access logs).

The data is the fleet snapshot (`shared/fleet.py`), the one `/metrics` and `llmfleet status`
read; under `llmfleet up` it includes the processes `up` supervises, with their restarts. The page keeps the history for its charts itself, one point per poll.

The page is served with a Content-Security-Policy that lets it run exactly its own inline
script and style (allowed by their SHA-256, computed from the file at import, so an edit of
the page cannot leave the policy behind) and fetch only from its own origin: an injected
`<script>`, a handler attribute or a request to another host is refused by the browser. No
framing (clickjacking of the admin-key form) and no MIME sniffing either.
"""

from __future__ import annotations

import base64
import hashlib
import re
from dataclasses import asdict
from pathlib import Path

from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Route

from api.admin_auth import admin_context  # the same check as the admin API
from shared import fleet
from shared.fleet import FleetSnapshot, ModelSnapshot
from shared.latency_window import DEFAULT_WINDOW_S, LatencySummary

PAGE_PATH = Path(__file__).parent / "static" / "dashboard.html"


def page_csp(html: str) -> str:
    """The page's Content-Security-Policy: its inline `<script>` and `<style>` by hash, the
    data from its own origin, nothing else (`default-src 'none'`). A regular expression is
    enough for our own, fixed page: it only has to find the two elements' bodies."""
    hashes: dict[str, list[str]] = {"script": [], "style": []}
    for tag, body in re.findall(r"<(script|style)(?:\s[^>]*)?>(.*?)</\1\s*>", html, re.DOTALL):
        digest = base64.b64encode(hashlib.sha256(body.encode()).digest()).decode()
        hashes[tag].append(f"'sha256-{digest}'")
    directives = {
        "default-src": ["'none'"],
        "script-src": hashes["script"] or ["'none'"],
        "style-src": hashes["style"] or ["'none'"],
        "connect-src": ["'self'"],  # /dashboard/data
        "base-uri": ["'none'"],
        "form-action": ["'none'"],  # the key form is handled by the script, never submitted
        "frame-ancestors": ["'none'"],
    }
    return "; ".join(f"{name} {' '.join(values)}" for name, values in directives.items())


PAGE_HEADERS = {
    "Cache-Control": "no-store",
    "Content-Security-Policy": page_csp(PAGE_PATH.read_text()),
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
}


async def page(_request: Request) -> Response:
    return FileResponse(PAGE_PATH, media_type="text/html", headers=PAGE_HEADERS)


async def data(request: Request) -> Response:
    ctx = await admin_context(request)
    snapshot = await fleet.snapshot(ctx.redis, ctx.engine, DEFAULT_WINDOW_S)
    return JSONResponse(snapshot_json(snapshot, DEFAULT_WINDOW_S))


def snapshot_json(snapshot: FleetSnapshot, window_s: float) -> dict:
    return {
        "taken_at_s": snapshot.taken_at_s,
        "window_s": window_s,
        "models": [_model_json(snapshot, snap) for snap in snapshot.models.values()],
        # Under `llmfleet up`: the processes it supervises, with their restarts.
        "processes": [
            {**asdict(p), "up_for_s": _up_for_s(snapshot, p.up_since_ts)}
            for p in snapshot.processes
        ],
    }


def _up_for_s(snapshot: FleetSnapshot, up_since_ts: float | None) -> float | None:
    return None if up_since_ts is None else max(0.0, snapshot.taken_at_s - up_since_ts)


def _model_json(snapshot: FleetSnapshot, snap: ModelSnapshot) -> dict:
    queues = [
        {
            **asdict(q),
            "tenant": snapshot.tenant_name(q.tenant_id),
            "num_undelivered": q.num_undelivered,
        }
        for q in snap.queues
    ]
    return {
        "model": snap.model,
        "version": snap.version,
        "name": snap.name,  # `model@version`
        "kv_cache_usage": snap.kv_cache_usage,
        "batch_occupancy": snap.batch_occupancy,
        "num_queued": snap.num_queued,
        "ttft_s": _latency_json(snap.ttft),
        "itl_s": _latency_json(snap.itl),
        "queues": queues,
        # Workers by state: `loading`, `standby` (loaded, not serving), `ready`, `draining`.
        "num_workers_by_state": dict(snap.num_workers_by_state()),
        "workers": [asdict(w) for w in snap.workers],
    }


def _latency_json(summary: LatencySummary) -> dict:
    return {"p50": summary.p50_s, "p99": summary.p99_s, "num_samples": summary.num_samples}


routes = [
    Route("/dashboard", page, methods=["GET"]),
    Route("/dashboard/data", data, methods=["GET"]),
]
