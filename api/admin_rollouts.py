"""The admin API's rollouts, under `/admin/v1` like the rest (`api/admin.py`, the same key):

- `POST /models/{model}/rollout` starts one (201): body `version`, `percent`, and optionally
  `step_percent`, `interval_s`, `sticky` (`none`, `tenant`, `user`), `min_num_samples`;
- `GET /models/{model}/rollout` the model's latest rollout, with the canary's health against
  stable while it runs; `GET /rollouts` each model's latest;
- `POST /models/{model}/rollout/promote` and `.../abort` end the running one.

An unknown model or version is a 404 (`model_not_found`; a model with no rollout yet,
`rollout_not_found`), a rollout already running or none to end a 409 (`rollout_conflict`),
a bad value a 400. Changes reach every API replica's routing within `routing_cache_s`
(`api/router.py`). `llmfleet rollout` does the same from the command line.
"""

from __future__ import annotations

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from api.admin_auth import admin_context
from api.admin_schemas import RolloutStartBody
from api.context import ApiContext
from api.errors import APIError
from api.schemas import parse_body, read_body
from shared import canary_health, rollouts
from shared.canary_health import Margins
from shared.rollouts import RolloutError, RolloutState
from shared.tables import Rollout


async def start_rollout(request: Request) -> Response:
    ctx = await admin_context(request)
    body = parse_body(
        RolloutStartBody, await read_body(request, ctx.settings.max_request_body_bytes)
    )
    rollout = await _run(
        rollouts.start,
        ctx.engine,
        request.path_params["model"],
        body.version,
        body.percent,
        step_percent=body.step_percent,
        interval_s=body.interval_s,
        sticky=body.sticky,
        min_num_samples=body.min_num_samples,
    )
    return JSONResponse(await rollout_json(ctx, rollout), status_code=201)


async def get_rollout(request: Request) -> Response:
    ctx = await admin_context(request)
    model_id = request.path_params["model"]
    rollout = await run_in_threadpool(rollouts.latest, ctx.engine, model_id)
    if rollout is None:
        raise APIError(404, f"No rollout of `{model_id}`.", code="rollout_not_found")
    return JSONResponse(await rollout_json(ctx, rollout))


async def list_rollouts(request: Request) -> Response:
    ctx = await admin_context(request)
    rows = await run_in_threadpool(rollouts.latest_per_model, ctx.engine)
    return JSONResponse({"object": "list", "data": [await rollout_json(ctx, r) for r in rows]})


async def promote_rollout(request: Request) -> Response:
    ctx = await admin_context(request)
    rollout = await _run(rollouts.promote, ctx.engine, request.path_params["model"])
    return JSONResponse(await rollout_json(ctx, rollout))


async def abort_rollout(request: Request) -> Response:
    ctx = await admin_context(request)
    rollout = await _run(rollouts.abort, ctx.engine, request.path_params["model"])
    return JSONResponse(await rollout_json(ctx, rollout))


async def _run(fn, *args, **kwargs) -> Rollout:
    try:
        return await run_in_threadpool(fn, *args, **kwargs)
    except RolloutError as exc:
        raise APIError(exc.status_code, str(exc), param=exc.param, code=exc.code) from None


async def rollout_json(ctx: ApiContext, rollout: Rollout) -> dict:
    canary, stable = await run_in_threadpool(rollouts.deployments_of, ctx.engine, rollout)
    body: dict[str, object] = {
        "object": "rollout",
        "id": rollout.id,
        "model": rollout.model_id,
        "stable_version": stable.version,
        "canary_version": canary.version,
        "state": rollout.state,
        "percent": rollout.percent,
        "step_percent": rollout.step_percent,
        "interval_s": rollout.interval_s,
        "sticky": rollout.sticky,
        "min_num_samples": rollout.min_num_samples,
        "cause": rollout.cause,
        "reason": rollout.reason,
        "started_at": _unix_s(rollout.started_at),
        "stepped_at": _unix_s(rollout.stepped_at),
        "finished_at": _unix_s(rollout.finished_at) if rollout.finished_at else None,
        "health": None,
    }
    if rollout.state == RolloutState.RUNNING:
        margins = Margins.of(ctx.settings)
        found = await canary_health.assess(ctx.redis, margins, rollout, canary, stable)
        body["health"] = found.as_json()
    return body


def _unix_s(moment) -> int:
    return int(rollouts.aware(moment).timestamp())


routes = [
    Route("/rollouts", list_rollouts, methods=["GET"]),
    Route("/models/{model}/rollout", start_rollout, methods=["POST"]),
    Route("/models/{model}/rollout", get_rollout, methods=["GET"]),
    Route("/models/{model}/rollout/promote", promote_rollout, methods=["POST"]),
    Route("/models/{model}/rollout/abort", abort_rollout, methods=["POST"]),
]
