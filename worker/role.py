"""A dedicated worker's role as the autoscaler wants it (`keys.AUTOSCALE_ROLES`: worker id ->
`active` or `standby`; `control/scaler.py` writes it).

`active`: the worker serves. `standby`: it keeps its weights and tokenizer loaded and its
heartbeat alive, but holds no engine and no KV pool and pulls nothing, so that it can serve
again within about a second (vLLM's sleep mode, level 1). A worker without an entry keeps
the role it started with (`llmfleet worker --standby`). `worker/service.py` follows it.
"""

from __future__ import annotations

import redis.asyncio as aioredis

from shared import keys
from shared.redis_conn import text
from shared.scale_decisions import ROLE_ACTIVE, ROLE_STANDBY

ACTIVE = ROLE_ACTIVE
STANDBY = ROLE_STANDBY
ROLES = (ACTIVE, STANDBY)
# How often a dedicated worker reads its role (one HGET), on standby and while serving: a
# standby worker sees `active` within this, and a serving one `standby`.
ROLE_POLL_S = 0.2


def role_of(entry: str | None, start_role: str) -> str:
    """The role an entry of `keys.AUTOSCALE_ROLES` asks for; `start_role` without an entry
    (or with one that names no role)."""
    return entry if entry in ROLES else start_role


async def read_entry(redis: aioredis.Redis, worker_id: str) -> str | None:
    """This worker's entry as written, or None."""
    raw = await redis.hget(keys.AUTOSCALE_ROLES, worker_id)  # type: ignore[misc]  # redis-py: async commands typed Awaitable[T] | T (redis-py#2399)
    return None if raw is None else text(raw)
