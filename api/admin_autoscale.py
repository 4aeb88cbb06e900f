"""The admin API's autoscaling view, under `/admin/v1` like the rest (`api/admin.py`, the
same key): `GET /models/{model}/autoscale`, the autoscaler's latest decision for a model
version (`model@version`; a bare model id means its stable version).

It is what KEDA's `metrics-api` scaler reads to scale a version's worker Deployment from the
forecast rather than from raw queue depth (infra/keda/scaledobject.yaml): `num_workers` is
the pods to keep (serving plus standby). No decision (no autoscaler running, or it stopped
renewing its decision) is a 404 `autoscale_not_found`, on which KEDA keeps its fallback.
"""

from __future__ import annotations

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from api.admin_auth import admin_context
from api.errors import APIError
from shared import deployments, keys, scale_decisions


async def get_autoscale(request: Request) -> Response:
    ctx = await admin_context(request)
    model = request.path_params["model"]
    model_id, version = keys.split_deployment_name(model)
    if version is None:
        stable = await run_in_threadpool(deployments.get_stable, ctx.engine, model_id)
        version = stable.version if stable is not None else None
    if version is None:
        raise APIError(404, f"No model `{model_id}`.", code="model_not_found")
    name = keys.deployment_name(model_id, version)
    view = await scale_decisions.read(ctx.redis, name)
    if view is None:
        raise APIError(
            404,
            f"No autoscaling decision for `{name}`: is the control process running with "
            "LLMFLEET_AUTOSCALE_POLICY set?",
            code="autoscale_not_found",
        )
    return JSONResponse(
        {
            "object": "autoscale",
            "model": model_id,
            "version": version,
            "policy": view.policy,
            "num_workers": view.num_workers,
            "num_ready": view.num_ready,
            "num_standby": view.num_standby,
            "forecast_tokens_per_s": view.forecast_tokens_per_s,
            "arrival_rate_per_s": view.arrival_rate_per_s,
            "arrival_tokens_per_s": view.arrival_tokens_per_s,
            "worker_tokens_per_s": view.worker_tokens_per_s,
            "num_waiting": view.num_waiting,
            "updated_at": view.updated_at_s,
        }
    )


routes = [Route("/models/{model}/autoscale", get_autoscale, methods=["GET"])]
