"""The tenant streams as queues: an entry leaves its stream when its request has ended.

A served entry is acknowledged (out of the `workers` group's pending list) and deleted
together, in one transaction: the stream is a queue, and its entries hold prompt tokens.
"""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis

from shared import keys


def ack_in(pipe: Any, stream: str, entry_id: str) -> None:
    """Add the acknowledgement and the deletion of an entry to `pipe` (a Redis pipeline)."""
    pipe.xack(stream, keys.WORKER_GROUP, entry_id)
    pipe.xdel(stream, entry_id)


async def ack(redis: aioredis.Redis, stream: str, entry_id: str) -> None:
    """Acknowledge and delete an entry, in one transaction."""
    async with redis.pipeline(transaction=True) as pipe:
        ack_in(pipe, stream, entry_id)
        await pipe.execute()
