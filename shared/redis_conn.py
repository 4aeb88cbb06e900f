"""Redis clients that ride out a broker restart: retries with exponential backoff.

The client's own retries cover a command whose connection broke, not every way a
reconnect can fail (redis-py takes a pooled connection and runs a new connection's
handshake outside them): a caller that must get through (`retrying`) retries the whole
call, which must then be idempotent.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import redis
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

_RETRY_ERRORS = (redis.ConnectionError, redis.TimeoutError, ConnectionError)
# What a call raises when it did not get through to the broker.
BROKER_ERRORS = (redis.ConnectionError, redis.TimeoutError, OSError)
MAX_RETRY_DELAY_S = 2.0

log = logging.getLogger("llmfleet.redis")
T = TypeVar("T")


def async_client(url: str, *, retries: int = 8) -> aioredis.Redis:
    return aioredis.Redis.from_url(
        url,
        retry=AsyncRetry(ExponentialBackoff(cap=2.0, base=0.05), retries),
        retry_on_error=list(_RETRY_ERRORS),
        health_check_interval=30,
    )


def sync_client(url: str, *, retries: int = 8) -> redis.Redis:
    return redis.Redis.from_url(
        url,
        retry=Retry(ExponentialBackoff(cap=2.0, base=0.05), retries),
        retry_on_error=list(_RETRY_ERRORS),
    )


async def retrying(call: Callable[[], Awaitable[T]], *, within_s: float, what: str) -> T:
    """`call()`, tried again with exponential backoff while the broker is unreachable, for up
    to `within_s`; then its error is raised. `call` must be idempotent: a try whose reply was
    lost may have run."""
    delay_s, deadline_s = 0.05, time.monotonic() + within_s
    while True:
        try:
            return await call()
        except BROKER_ERRORS as exc:
            if time.monotonic() + delay_s > deadline_s:
                raise
            log.warning("%s: broker unreachable (%s); retrying", what, exc)
            await asyncio.sleep(delay_s)
            delay_s = min(delay_s * 2, MAX_RETRY_DELAY_S)


def text(value: bytes | str) -> str:
    """A Redis reply as text: bytes from a client without `decode_responses`, else as is."""
    return value.decode() if isinstance(value, bytes) else value
