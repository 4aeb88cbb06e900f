"""`GET /metrics`: the API's counters (summed over its uvicorn workers) and the fleet's queues
and workers as Redis holds them at scrape time, in Prometheus' text format.

It always needs `Authorization: Bearer <metrics token>` (`LLMFLEET_METRICS_TOKEN`, or the
token generated into `<home>/secrets/metrics_token`): the series name tenants by id and show
each one's load. A token rather than a second, localhost-only listener: the API may run
several uvicorn workers on one port and several replicas behind a load balancer, and
Prometheus sends a bearer token from a file (`authorization.credentials_file`) to any of them
with no extra port to open or keep private.
"""

from __future__ import annotations

import hmac

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from api.context import ApiContext
from api.errors import unauthorized
from shared import fleet
from shared.metrics import ApiMetrics


async def metrics(request: Request) -> Response:
    ctx: ApiContext = request.state.ctx
    _check_token(request, ctx.settings.metrics_secret)
    api_metrics: ApiMetrics = request.state.metrics
    snapshot = await fleet.snapshot(ctx.redis, ctx.engine)
    return Response(api_metrics.exposition(snapshot), media_type=CONTENT_TYPE_LATEST)


def _check_token(request: Request, token: str) -> None:
    scheme, _, presented = request.headers.get("authorization", "").partition(" ")
    presented_bytes = presented.strip().encode() if scheme.lower() == "bearer" else b""
    if not hmac.compare_digest(presented_bytes, token.encode()):
        raise unauthorized("Invalid or missing metrics token.")


routes = [Route("/metrics", metrics, methods=["GET"])]
