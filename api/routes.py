"""The HTTP handlers. Each reads as the data path: authenticate, admit, enqueue, stream."""

from __future__ import annotations

import logging
import re
from datetime import date

import anyio
from sqlmodel import select
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from api import admission, broker, resume_slots
from api.auth import authenticate
from api.context import ApiContext
from api.errors import bad_request, not_found, shutting_down
from api.schemas import ChatBody, CompletionBody, GenerationBody, parse_body, read_body
from api.sse_response import SubscriptionStream
from api.streaming import chunk_format, collect_while_connected
from shared import deployments, quota, usage
from shared.db import session_scope
from shared.protocol import QueuedRequest
from shared.tables import UsageRecord

log = logging.getLogger("llmfleet.api")
# At most 18 ASCII digits: below 2**63, so the journal's entry ids (`0-{seq + 1}`) stay valid
# Redis stream ids. `str.isdigit` also accepts `²` and other digits `int` cannot parse.
_EVENT_ID = re.compile(r"[0-9]{1,18}")
_DAY = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}")


def _ctx(request: Request) -> ApiContext:
    return request.state.ctx


def _serving_ctx(request: Request) -> ApiContext:
    """The context, for a route that starts a request or a stream: refused (503) once the
    process is shutting down (`api/shutdown.py`)."""
    ctx = _ctx(request)
    if ctx.shutdown.is_draining:
        raise shutting_down()
    return ctx


async def completions(request: Request) -> Response:
    ctx = _serving_ctx(request)
    principal = await authenticate(request, ctx)
    body = parse_body(CompletionBody, await read_body(request, ctx.settings.max_request_body_bytes))
    queued = await admission.admit_completion(ctx, principal, body)
    return await _respond(request, ctx, queued, body)


async def chat_completions(request: Request) -> Response:
    ctx = _serving_ctx(request)
    principal = await authenticate(request, ctx)
    body = parse_body(ChatBody, await read_body(request, ctx.settings.max_request_body_bytes))
    queued = await admission.admit_chat(ctx, principal, body)
    return await _respond(request, ctx, queued, body)


async def _respond(
    request: Request, ctx: ApiContext, queued: QueuedRequest, body: GenerationBody
) -> Response:
    subscription = await _submit(ctx, queued)
    fmt = chunk_format(subscription, body.model, body.include_usage)
    # Which version of the model serves it: the stable one, a rollout's canary, or a pin.
    headers = {"X-Request-Id": queued.request_id, "X-Model-Version": queued.version}
    if body.stream:
        return SubscriptionStream(
            subscription,
            fmt,
            send_timeout_s=ctx.settings.stream_send_timeout_s,
            headers=headers,
            keepalive_s=ctx.settings.stream_keepalive_s,
        )
    answer = await collect_while_connected(subscription, fmt, request.receive)
    return JSONResponse(answer, headers=headers)


async def _submit(ctx: ApiContext, queued: QueuedRequest) -> broker.Subscription:
    """Enqueue an admitted request; if that fails (the broker unreachable or out of memory,
    this process shutting down), give back the slots and tokens it took."""
    try:
        return await ctx.broker.submit(queued)
    except BaseException:
        # Shielded: a handler cancelled mid-enqueue must still release its admission.
        with anyio.CancelScope(shield=True):
            try:
                await quota.release(ctx.redis, queued)
            except Exception:
                # Redis is likely down too; the slots expire after `request_max_lifetime_s`.
                log.exception("could not release the admission of %s", queued.request_id)
        raise


async def request_events(request: Request) -> Response:
    """Resume a request's stream: the events after `Last-Event-ID` (header, or the
    `last_event_id` query parameter), then the live ones, on any API replica."""
    ctx = _serving_ctx(request)
    principal = await authenticate(request, ctx)
    request_id = request.path_params["request_id"]
    if (last_event_id := request.headers.get("last-event-id")) is not None:
        next_seq = _next_seq(last_event_id, param="Last-Event-ID")
    else:
        next_seq = _next_seq(request.query_params.get("last_event_id"), param="last_event_id")
    info = await broker.request_info(ctx.journal, request_id, principal.tenant_id)
    # Another tenant's request and one that does not exist (or expired) look the same.
    if info is None:
        raise not_found(f"No stream for request `{request_id}`.")
    limits = resume_slots.ResumeLimits.of(ctx.settings)
    slot = await resume_slots.acquire(ctx.redis, limits, request_id, principal.tenant_id)
    try:
        subscription = await ctx.broker.resume(info, next_seq)
    except BaseException:
        await slot.release()
        raise
    include_usage = request.query_params.get("include_usage", "false").lower() == "true"
    fmt = chunk_format(subscription, info.model, include_usage)
    return SubscriptionStream(
        subscription,
        fmt,
        send_timeout_s=ctx.settings.stream_send_timeout_s,
        holding=slot,
        headers={"X-Request-Id": request_id},
        keepalive_s=ctx.settings.stream_keepalive_s,
    )


def _next_seq(last_event_id: str | None, *, param: str) -> int:
    if last_event_id is None:
        return 0
    if not _EVENT_ID.fullmatch(last_event_id):
        raise bad_request(f"`{param}` must be the `id` of an event of this stream.", param=param)
    return int(last_event_id) + 1


async def list_models(request: Request) -> Response:
    ctx = _ctx(request)
    await authenticate(request, ctx)
    rows = await run_in_threadpool(deployments.list_active, ctx.engine)
    stable_ids = {
        deployments.stable_among([r for r in rows if r.model_id == model_id]).id
        for model_id in {r.model_id for r in rows}
    }
    # A model's stable version under its id; every other version under `id@version`, the
    # name that pins it.
    data = [
        {
            "id": row.model_id if row.id in stable_ids else row.name,
            "object": "model",
            "created": int(row.created_at.timestamp()),
            "owned_by": "llmfleet",
            "version": row.version,
            "max_model_len": row.max_context_tokens,
        }
        for row in rows
    ]
    return JSONResponse({"object": "list", "data": data})


async def request_usage(request: Request) -> Response:
    ctx = _ctx(request)
    principal = await authenticate(request, ctx)
    request_id = request.path_params["request_id"]
    record = await run_in_threadpool(_usage_of, ctx, principal.tenant_id, request_id)
    # Another tenant's request and a request that does not exist look the same: 404.
    if record is None:
        raise not_found(f"No usage recorded for request `{request_id}`.")
    return JSONResponse(
        {
            "request_id": request_id,
            "input_tokens": record.input_tokens,
            "output_tokens": record.output_tokens,
        }
    )


def _usage_of(ctx: ApiContext, tenant_id: str, request_id: str) -> UsageRecord | None:
    with session_scope(ctx.engine) as session:
        return session.exec(
            select(UsageRecord).where(
                UsageRecord.request_id == request_id, UsageRecord.tenant_id == tenant_id
            )
        ).first()


async def usage_report(request: Request) -> Response:
    """The caller's usage per model and day, `start` to `end` (YYYY-MM-DD, both included)."""
    ctx = _ctx(request)
    principal = await authenticate(request, ctx)
    start, end = _day_param(request, "start"), _day_param(request, "end")
    if end < start:
        raise bad_request("`end` is before `start`.", param="end")
    max_num_days = ctx.settings.max_usage_report_days
    if (end - start).days + 1 > max_num_days:
        raise bad_request(f"The range spans more than {max_num_days} days.", param="end")
    rows = await run_in_threadpool(usage.totals, ctx.engine, start, end, principal.tenant_id)
    data = [
        {
            "model": row.model_id,
            "version": row.version,
            "day": row.day.isoformat(),
            "num_requests": row.num_requests,
            "input_tokens": row.input_tokens,
            "output_tokens": row.output_tokens,
            "computed_tokens": row.computed_tokens,
        }
        for row in rows
    ]
    return JSONResponse(
        {"object": "list", "start": start.isoformat(), "end": end.isoformat(), "data": data}
    )


def _day_param(request: Request, name: str) -> date:
    # `date.fromisoformat` alone also takes `20260310`, `2026-W10-2` and non-ASCII digits.
    value = request.query_params.get(name) or ""
    try:
        if not _DAY.fullmatch(value):
            raise ValueError(value)
        return date.fromisoformat(value)
    except ValueError:
        raise bad_request(f"`{name}` must be a date, YYYY-MM-DD.", param=name) from None


async def healthz(request: Request) -> Response:
    """Liveness (and Redis reachability): 200 while the process runs, shutting down or not."""
    await _ctx(request).redis.ping()
    return JSONResponse({"status": "ok"})


async def readyz(request: Request) -> Response:
    """Readiness: 503 from the moment the process starts shutting down, so that a load
    balancer sends it nothing more while its open streams finish."""
    ctx = _ctx(request)
    if ctx.shutdown.is_draining:
        return JSONResponse({"status": "shutting_down"}, status_code=503)
    await ctx.redis.ping()
    return JSONResponse({"status": "ready"})


routes = [
    Route("/v1/completions", completions, methods=["POST"]),
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    Route("/v1/models", list_models, methods=["GET"]),
    Route("/v1/usage", usage_report, methods=["GET"]),
    Route("/v1/requests/{request_id}/usage", request_usage, methods=["GET"]),
    Route("/v1/requests/{request_id}/events", request_events, methods=["GET"]),
    Route("/healthz", healthz, methods=["GET"]),
    Route("/readyz", readyz, methods=["GET"]),
]
