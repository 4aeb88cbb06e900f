"""The shared pool's assignments in Redis (`keys.POOL_ASSIGNMENTS`): which model each shared
worker serves and since when. The control process writes them (`control/pool.py`); each
shared worker reads its own (`worker/pool_member.py`)."""

from __future__ import annotations

import json
from dataclasses import dataclass

import redis.asyncio as aioredis

from shared import keys
from shared.redis_conn import text

POOL_DEDICATED = "dedicated"
POOL_SHARED = "shared"
POOLS = (POOL_DEDICATED, POOL_SHARED)


@dataclass(frozen=True, slots=True)
class Assignment:
    model: str
    at_s: float  # unix time it was assigned

    def encode(self) -> str:
        return json.dumps({"model": self.model, "at": self.at_s})

    @classmethod
    def decode(cls, raw: bytes | str) -> Assignment:
        fields = json.loads(text(raw))
        return cls(str(fields["model"]), float(fields["at"]))


async def read(redis: aioredis.Redis, worker_id: str) -> Assignment | None:
    raw = await redis.hget(keys.POOL_ASSIGNMENTS, worker_id)  # type: ignore[misc]  # redis-py: async commands typed Awaitable[T] | T (redis-py#2399)
    return None if raw is None else Assignment.decode(raw)


async def read_all(redis: aioredis.Redis) -> dict[str, Assignment]:
    raw = await redis.hgetall(keys.POOL_ASSIGNMENTS)  # type: ignore[misc]  # redis-py: async commands typed Awaitable[T] | T (redis-py#2399)
    return {text(worker_id): Assignment.decode(value) for worker_id, value in raw.items()}


async def write(redis: aioredis.Redis, changed: dict[str, Assignment], gone: set[str]) -> None:
    async with redis.pipeline(transaction=True) as pipe:
        if changed:
            pipe.hset(keys.POOL_ASSIGNMENTS, mapping={w: a.encode() for w, a in changed.items()})
        if gone:
            pipe.hdel(keys.POOL_ASSIGNMENTS, *gone)
        await pipe.execute()
