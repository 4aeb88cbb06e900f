"""When a missing heartbeat means a dead worker.

A worker's heartbeat key (`keys.worker_heartbeat`) expires when it stops beating; a request
whose owner's key is gone is then ended as lost (`shared/ending.py`), by a worker reclaiming
its entry (`worker/recovery.py`) or by the API replica streaming it (`api/broker.py`). So is
a request whose end was claimed by a process that stopped before completing it
(`is_claim_abandoned`).
"""

from __future__ import annotations

import redis.asyncio as aioredis

from shared import keys


async def is_broker_settled(redis: aioredis.Redis, heartbeat_timeout_s: float) -> bool:
    """Whether Redis has been up long enough for a missing heartbeat to mean a dead worker.
    Just after a broker restart every heartbeat key may be gone (they expired while it was
    down, or were lost with the last second of its append-only file) while the workers are
    still reconnecting: ending their requests as lost then would end live streams."""
    info = await redis.info("server")
    return float(info.get("uptime_in_seconds", 0)) > 2 * heartbeat_timeout_s


async def is_claim_abandoned(
    redis: aioredis.Redis, holder: str, claim_age_s: float, heartbeat_timeout_s: float
) -> bool:
    """Whether the end that `holder` claimed `claim_age_s` ago, and has not completed, was
    abandoned: the claim is older than a heartbeat timeout (a live claimer completes an end
    in milliseconds unless the broker is away) and `holder` does not heartbeat (a worker
    that died between claiming and completing, or an API process, which has no heartbeat
    and is gone if its end is that old)."""
    if claim_age_s < heartbeat_timeout_s:
        return False
    if await redis.exists(keys.worker_heartbeat(holder)):
        return False
    return await is_broker_settled(redis, heartbeat_timeout_s)
