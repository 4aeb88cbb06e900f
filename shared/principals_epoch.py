"""The principals' epoch: a counter in Redis (`keys.PRINCIPALS_EPOCH`) that every change to
a tenant or a key moves (a key revoked, a tenant disabled, its tier, weight or limits
changed), through the admin API or the command line alike.

An API replica caches the principal of each key it has verified (`api/auth.py`) together
with the epoch it read before the lookup, and reads the epoch again on every request: a
cached principal of an older epoch is looked up in SQL again. So a change made through any
replica or the command line applies to every replica's next request, as with no cache,
while an unchanged key costs one Redis read instead of an SQL lookup.
"""

from __future__ import annotations

import logging

import redis
import redis.asyncio as aioredis

from shared import keys

log = logging.getLogger("llmfleet.tenants")


async def current(client: aioredis.Redis) -> int:
    return int(await client.get(keys.PRINCIPALS_EPOCH) or 0)


async def advance(client: aioredis.Redis) -> None:
    """After a change to tenants or keys is committed to SQL."""
    await client.incr(keys.PRINCIPALS_EPOCH)


def advance_sync(client: redis.Redis) -> bool:
    """`advance` for the command line; False (logged) when Redis cannot be reached: the
    replicas' caches then hold the old principals for at most their TTL."""
    try:
        client.incr(keys.PRINCIPALS_EPOCH)
    except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
        log.warning("could not tell the API replicas of the change (%s)", exc)
        return False
    return True
