"""The Starlette application: routes, error handlers and the lifespan that builds `ApiContext`."""

from __future__ import annotations

import asyncio
import logging
import os
from contextlib import asynccontextmanager

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError
from redis.exceptions import TimeoutError as RedisTimeoutError
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from api import admin, dashboard, metrics
from api.broker import Broker, StreamTiming
from api.context import ApiContext, KVCapacity, TokenizerCache
from api.errors import APIError, shutting_down
from api.routes import routes
from api.security_headers import SecurityHeadersMiddleware
from api.shutdown import Shutdown
from api.subscriber import Subscriber, SubscriberClosed
from shared import deployments, heap
from shared.db import create_schema, make_engine
from shared.journal import Journal
from shared.metrics import ApiMetrics
from shared.redis_conn import async_client
from shared.settings import Settings, get_settings

log = logging.getLogger("llmfleet.api")

# The Redis client name of the API's command connections, followed by `-<pid>` (`CLIENT LIST`
# tells them and their process apart; the pub/sub ones: `api/subscriber.py`).
COMMAND_CLIENT_NAME = "llmfleet-api"


def create_app(settings: Settings | None = None) -> Starlette:
    settings = settings or get_settings()

    @asynccontextmanager
    async def lifespan(_app: Starlette):
        engine = make_engine(settings)
        create_schema(engine)
        redis = async_client(
            settings.redis_url,
            max_connections=settings.api_max_num_command_connections,
            client_name=f"{COMMAND_CLIENT_NAME}-{os.getpid()}",
            auto_pipeline=True,
        )
        journal = Journal(redis, settings.journal_ttl_s, settings.resume_grace_s)
        subscriber = Subscriber(
            redis,
            settings.api_num_subscriber_connections,
            settings.max_num_buffered_events_per_stream,
        )
        broker = Broker(redis, journal, subscriber, StreamTiming.of(settings))
        shutdown = Shutdown(settings.shutdown_grace_s, subscriber)
        ctx = ApiContext(
            settings,
            engine,
            redis,
            TokenizerCache(settings),
            KVCapacity(redis),
            journal,
            broker,
            shutdown,
        )
        heap.freeze_long_lived()  # the modules and the app: out of every collection
        subscriber.start()
        give_back_signals = shutdown.install()
        # In the background: the API serves at once; a request that comes first waits for
        # its tokenizer as it would have without this.
        active = await run_in_threadpool(deployments.list_active, engine)
        warming = asyncio.create_task(ctx.tokenizers.warm(active))
        try:
            yield {"ctx": ctx, "metrics": ApiMetrics()}
        finally:
            give_back_signals()
            warming.cancel()
            await subscriber.aclose()
            await redis.aclose()
            engine.dispose()

    return Starlette(
        routes=[*routes, *admin.routes, *metrics.routes, *dashboard.routes],
        middleware=[Middleware(SecurityHeadersMiddleware)],
        lifespan=lifespan,
        exception_handlers={
            APIError: _api_error,
            HTTPException: _http_error,
            RedisConnectionError: _broker_unavailable,
            RedisTimeoutError: _broker_unavailable,
            OutOfMemoryError: _broker_out_of_memory,
            SubscriberClosed: _shutting_down,
            ClientDisconnect: _client_left,
            Exception: _crash,
        },
    )


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    if (api_metrics := getattr(request.state, "metrics", None)) is not None:
        api_metrics.count_rejection(exc.status_code, exc.code, exc.type)
    return exc.response()


async def _http_error(_request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    kind = "not_found" if exc.status_code == 404 else "invalid_request_error"
    return APIError(exc.status_code, str(exc.detail), type=kind, headers=exc.headers).response()


async def _broker_unavailable(request: Request, exc: Exception) -> Response:
    # Redis is restarting (its clients gave up retrying): nothing was enqueued; try again.
    log.warning("broker unavailable on %s %s: %s", request.method, request.url.path, exc)
    return APIError(
        503,
        "The request broker is unavailable; nothing was queued. Retry shortly.",
        type="server_error",
        code="broker_unavailable",
        headers={"Retry-After": "1"},
    ).response()


async def _broker_out_of_memory(request: Request, exc: Exception) -> Response:
    """Redis refused a write for want of memory (`maxmemory` reached, `noeviction`): nothing
    was queued, and admission gave back what it took (`api/routes.py` `_submit`)."""
    log.warning("broker out of memory on %s %s: %s", request.method, request.url.path, exc)
    return APIError(
        503,
        "The request broker is out of memory; nothing was queued. Retry shortly.",
        type="server_error",
        code="broker_out_of_memory",
        headers={"Retry-After": "5"},
    ).response()


async def _shutting_down(_request: Request, _exc: Exception) -> Response:
    return shutting_down().response()


# What nginx logs for "client closed request"; no client reads it.
CLIENT_CLOSED_REQUEST = 499


async def _client_left(request: Request, _exc: Exception) -> Response:
    """A client that leaves before its answer (while its body is read, on any route) is
    routine, not an error: one INFO line, no traceback. Whatever it started is undone on
    the way here: an admission whose enqueue was interrupted is released
    (`api/routes.py` `_submit`), a request it left is cancelled
    (`api/streaming.py` `collect_while_connected`, `SubscriptionStream`)."""
    log.info("client left before its answer: %s %s", request.method, request.url.path)
    return Response(status_code=CLIENT_CLOSED_REQUEST)


async def _crash(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return APIError(500, "Internal server error.", type="server_error").response()
