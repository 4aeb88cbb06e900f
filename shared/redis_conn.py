"""Redis clients that ride out a broker restart: retries with exponential backoff."""

from __future__ import annotations

import redis
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

_RETRY_ERRORS = (redis.ConnectionError, redis.TimeoutError, ConnectionError)


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
