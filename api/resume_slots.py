"""Caps on resume streams (`GET /v1/requests/{id}/events`): at most
`max_num_resume_streams_per_request` open at once on one request and
`max_num_resume_streams_per_tenant` over all of a tenant's requests; one more gets 429 with
`Retry-After`. Each open stream holds a socket and a buffer of events in the API, so without
a cap one client could exhaust the API's file descriptors and memory.

Counted in Redis, not in the API process: a tenant's streams land on any replica (and on any
of an API's uvicorn worker processes), and the cap must hold for the platform, as the
admission limits do (`shared/quota.py`). A stream's slot is a member of two sorted sets (the
request's and the tenant's, names in `shared/keys.py`) scored by its lease's expiry, taken
by one script that checks both caps first, so a refused stream takes nothing and two
replicas cannot both take the last slot. An open stream renews its lease every third of
`resume_stream_lease_s`; every exit of the stream removes the slot at once, and the slots of
an API process that died expire within one lease. Time comes from Redis `TIME`: one clock
for every replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from dataclasses import dataclass, field

import anyio
import redis.asyncio as aioredis

from api.errors import rate_limited
from shared import keys
from shared.lua import LuaScript
from shared.redis_conn import BROKER_ERRORS
from shared.settings import Settings

log = logging.getLogger("llmfleet.api")

RETRY_AFTER_S = 1  # a slot frees when some stream ends, which no clock predicts

_LUA_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
"""

# KEYS: the request's set, the tenant's set. ARGV: stream id, lease s, max per request,
# max per tenant. Returns 0 (taken), 1 (the request's cap reached) or 2 (the tenant's).
_ACQUIRE_LUA = (
    _LUA_NOW
    + """
for _, key in ipairs(KEYS) do redis.call('ZREMRANGEBYSCORE', key, '-inf', now) end
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[3]) then return 1 end
if redis.call('ZCARD', KEYS[2]) >= tonumber(ARGV[4]) then return 2 end
local ttl = math.ceil(tonumber(ARGV[2]))
for _, key in ipairs(KEYS) do
  redis.call('ZADD', key, now + tonumber(ARGV[2]), ARGV[1])
  redis.call('EXPIRE', key, ttl)
end
return 0
"""
)
_ACQUIRE = LuaScript(_ACQUIRE_LUA)

# KEYS, ARGV[1..2]: as above. Renews only a slot still held (XX): one that expired while the
# broker was unreachable is not taken back over the cap.
_RENEW_LUA = (
    _LUA_NOW
    + """
local ttl = math.ceil(tonumber(ARGV[2]))
for _, key in ipairs(KEYS) do
  redis.call('ZADD', key, 'XX', now + tonumber(ARGV[2]), ARGV[1])
  redis.call('EXPIRE', key, ttl)
end
return 0
"""
)

_REFUSALS = {
    1: ("resume_streams_per_request_exceeded", "resume streams open on this request"),
    2: ("resume_streams_per_tenant_exceeded", "resume streams open for this tenant"),
}


@dataclass(frozen=True, slots=True)
class ResumeLimits:
    max_num_per_request: int
    max_num_per_tenant: int
    lease_s: float

    @classmethod
    def of(cls, settings: Settings) -> ResumeLimits:
        return cls(
            settings.max_num_resume_streams_per_request,
            settings.max_num_resume_streams_per_tenant,
            settings.resume_stream_lease_s,
        )


@dataclass
class ResumeSlot:
    """One open resume stream's place under both caps. Use it as an async context manager
    around the stream: inside, its lease is renewed; on the way out, however the stream
    ended, it is given back."""

    redis: aioredis.Redis
    keys: list[str]
    stream_id: str
    lease_s: float
    _renewing: asyncio.Task | None = field(default=None, repr=False)

    async def __aenter__(self) -> ResumeSlot:
        self._renewing = asyncio.create_task(self._renew_until_cancelled())
        return self

    async def __aexit__(self, *_exc: object) -> None:
        if self._renewing is not None:
            self._renewing.cancel()
        await self.release()

    async def release(self) -> None:
        # Shielded: this runs while a disconnected stream is being cancelled.
        with anyio.CancelScope(shield=True):
            try:
                async with self.redis.pipeline(transaction=False) as pipe:
                    for key in self.keys:
                        pipe.zrem(key, self.stream_id)
                    await pipe.execute()
            except BROKER_ERRORS as exc:
                log.warning("resume slot not released (%s); it expires with its lease", exc)

    async def _renew_until_cancelled(self) -> None:
        renew = self.redis.register_script(_RENEW_LUA)
        while True:
            await anyio.sleep(self.lease_s / 3)
            with contextlib.suppress(*BROKER_ERRORS):
                await renew(keys=self.keys, args=[self.stream_id, self.lease_s])


async def acquire(
    redis: aioredis.Redis, limits: ResumeLimits, request_id: str, tenant_id: str
) -> ResumeSlot:
    """A slot for one more resume stream on `request_id`, or 429 naming the cap reached."""
    slot_keys = [keys.request_resume_streams(request_id), keys.tenant_resume_streams(tenant_id)]
    stream_id = uuid.uuid4().hex
    refused = await _ACQUIRE(
        redis,
        keys=slot_keys,
        args=[stream_id, limits.lease_s, limits.max_num_per_request, limits.max_num_per_tenant],
    )
    if int(refused):
        code, what = _REFUSALS[int(refused)]
        cap = limits.max_num_per_request if int(refused) == 1 else limits.max_num_per_tenant
        raise rate_limited(code, f"Too many {what} (at most {cap}).", RETRY_AFTER_S)
    return ResumeSlot(redis, slot_keys, stream_id, limits.lease_s)
