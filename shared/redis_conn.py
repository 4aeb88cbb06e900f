"""Redis clients that ride out a broker restart: retries with exponential backoff.

The client's own retries cover a command whose connection broke, not every way a
reconnect can fail (redis-py takes a pooled connection and runs a new connection's
handshake outside them): a caller that must get through (`retrying`) retries the whole
call, which must then be idempotent.

Commands are packed by hiredis's C packer (`_hiredis_packing`), as redis-py's synchronous
client already does when hiredis is installed; its asyncio connections pack in Python, 45 us
for an enqueue script's arguments against 3.

A broker out of memory (`maxmemory` reached, `noeviction`) refuses writes: such a command
did not run, so it is one more way of not getting through (`BROKER_ERRORS`), waited out or
reported like an unreachable broker. Redis 6.2 reports the refusal of a write inside a
script as a generic script error (`ERR Error running script ... OOM command not allowed`),
which redis-py raises as a plain `ResponseError`; the clients here parse it as the
`OutOfMemoryError` a plain command gets (`_parser_class`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import redis
import redis.asyncio as aioredis
import redis.asyncio.connection as aio_connection
import redis.connection
from redis.asyncio.connection import AbstractConnection, BlockingConnectionPool
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialBackoff
from redis.connection import HiredisRespSerializer
from redis.exceptions import OutOfMemoryError, ResponseError
from redis.retry import Retry

from shared.auto_pipeline import AutoPipelinedRedis

_RETRY_ERRORS = (redis.ConnectionError, redis.TimeoutError, ConnectionError)
# What a call raises when it did not get through to the broker (unreachable, or refusing
# writes for want of memory).
BROKER_ERRORS = (redis.ConnectionError, redis.TimeoutError, OSError, OutOfMemoryError)
MAX_RETRY_DELAY_S = 2.0
# How long a command waits for a free connection of a bounded pool before it fails.
POOL_TIMEOUT_S = 10
_OUT_OF_MEMORY = "OOM command not allowed"

log = logging.getLogger("llmfleet.redis")
T = TypeVar("T")


def _parser_class(default: Any) -> Any:
    """redis-py's parser, with a write refused for memory inside a script parsed as
    `OutOfMemoryError` (see the module docstring)."""

    class Parser(default):
        @classmethod
        def parse_error(cls, response: str) -> ResponseError:
            if _OUT_OF_MEMORY in response:
                return OutOfMemoryError(response)
            return super().parse_error(response)

    return Parser


_ASYNC_PARSER = _parser_class(aio_connection.DefaultParser)


_HIREDIS_PACKING: dict[type[AbstractConnection], type] = {}
_HIREDIS_SERIALIZER = HiredisRespSerializer()  # redis-py's own, stateless


def _hiredis_packing(connection_class: type[AbstractConnection]) -> type:
    """`connection_class` (plain, TLS or Unix socket, as the URL said) packing its commands
    with `hiredis.pack_command`, as redis-py's `HiredisRespSerializer` does, and taking a
    write on a transport that is already closed for the broken connection it is.

    Under uvloop (the API's loop under uvicorn) a write on a transport that a reset closed
    raises `RuntimeError` ("the handler is closed"), where asyncio's own loop drops the
    write and its drain raises `ConnectionResetError`. redis-py retries only connection and
    timeout errors, so the `RuntimeError` failed the call, or escaped from a reconnect's
    handshake, where a caller's retry (`retrying`) expects a connection error. It is raised
    as one here; redis-py has already closed the connection."""
    if (packing := _HIREDIS_PACKING.get(connection_class)) is not None:
        return packing

    def pack_command(self: Any, *args: Any) -> list[bytes]:
        return _HIREDIS_SERIALIZER.pack(*args)

    async def send_packed_command(self: Any, command: Any, check_health: bool = True) -> None:
        try:
            await connection_class.send_packed_command(self, command, check_health)
        except RuntimeError as exc:
            raise redis.ConnectionError(f"Error while writing to socket: {exc}") from exc

    packing = type(f"HiredisPacking{connection_class.__name__}", (connection_class,), {
        "pack_command": pack_command,
        "send_packed_command": send_packed_command,
    })  # fmt: skip
    _HIREDIS_PACKING[connection_class] = packing
    return packing


_SYNC_PARSER = _parser_class(redis.connection.DefaultParser)


def async_client(
    url: str,
    *,
    retries: int = 8,
    max_connections: int | None = None,
    client_name: str | None = None,
    auto_pipeline: bool = False,
) -> aioredis.Redis:
    """A client; with `max_connections`, its pool never opens more, and a command waits up
    to `POOL_TIMEOUT_S` for a free one (then `redis.ConnectionError`). With `auto_pipeline`,
    the commands of one turn of the event loop go out together (`shared/auto_pipeline.py`)."""
    options: dict[str, Any] = {
        "retry": AsyncRetry(ExponentialBackoff(cap=2.0, base=0.05), retries),
        "retry_on_error": list(_RETRY_ERRORS),
        "health_check_interval": 30,
        "client_name": client_name,
        "parser_class": _ASYNC_PARSER,
    }
    client_class = AutoPipelinedRedis if auto_pipeline else aioredis.Redis
    if max_connections is None:
        pool = aio_connection.ConnectionPool.from_url(url, **options)
    else:
        pool = BlockingConnectionPool.from_url(
            url, max_connections=max_connections, timeout=POOL_TIMEOUT_S, **options
        )
    pool.connection_class = _hiredis_packing(pool.connection_class)
    return client_class.from_pool(pool)


def sync_client(url: str, *, retries: int = 8) -> redis.Redis:
    return redis.Redis.from_url(
        url,
        retry=Retry(ExponentialBackoff(cap=2.0, base=0.05), retries),
        retry_on_error=list(_RETRY_ERRORS),
        parser_class=_SYNC_PARSER,
    )


async def retrying(call: Callable[[], Awaitable[T]], *, within_s: float, what: str) -> T:
    """`call()`, tried again with exponential backoff while the broker is unreachable or out
    of memory, for up to `within_s`; then its error is raised. `call` must be idempotent: a
    try whose reply was lost may have run."""
    delay_s, deadline_s = 0.05, time.monotonic() + within_s
    while True:
        try:
            return await call()
        except BROKER_ERRORS as exc:
            if time.monotonic() + delay_s > deadline_s:
                raise
            log.warning("%s: broker unreachable or out of memory (%s); retrying", what, exc)
            await asyncio.sleep(delay_s)
            delay_s = min(delay_s * 2, MAX_RETRY_DELAY_S)


def text(value: bytes | str) -> str:
    """A Redis reply as text: bytes from a client without `decode_responses`, else as is."""
    return value.decode() if isinstance(value, bytes) else value
