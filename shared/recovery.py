"""When a missing heartbeat means a dead worker.

A worker's heartbeat key (`keys.worker_heartbeat`) expires when it stops beating; a request
whose owner's key is gone is then ended as lost (`shared/ending.py`), by a worker reclaiming
its entry (`worker/recovery.py`) or by the API replica streaming it (`api/broker.py`).
"""

from __future__ import annotations

import redis.asyncio as aioredis


async def is_broker_settled(redis: aioredis.Redis, heartbeat_timeout_s: float) -> bool:
    """Whether Redis has been up long enough for a missing heartbeat to mean a dead worker.
    Just after a broker restart every heartbeat key may be gone (they expired while it was
    down, or were lost with the last second of its append-only file) while the workers are
    still reconnecting: ending their requests as lost then would end live streams."""
    info = await redis.info("server")
    return float(info.get("uptime_in_seconds", 0)) > 2 * heartbeat_timeout_s
