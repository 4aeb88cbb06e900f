"""Per-tenant admission limits, enforced atomically in Redis.

A tenant's `TenantLimits` (None = unlimited) bound:

- requests in flight: admitted and not yet finished (queued or generating);
- requests queued: admitted and not yet pulled by a worker;
- requests and tokens per minute: token buckets whose capacity is the limit, refilled at
  limit/60 per second. Admission takes one request and reserves prompt + `max_tokens`
  tokens; when the request finishes, the worker settles: the unused part of the reservation
  (reserved - prompt - output tokens) goes back, never above the capacity.

State (key names in `shared/keys.py`): the in-flight and queued request ids are sorted sets
scored by an expiry, admission time + `request_max_lifetime_s`, so an API or worker that
crashed holds a slot for at most that long. Both sets are kept whether or not the tenant
has a limit, so a limit set later counts what already runs. The buckets live in one hash
(`rpm:*`, `tpm:*`: level, time of the last update, capacity) with a 60 s TTL: a bucket
refills completely within a minute, so a missing hash means full buckets.

One Lua script admits: it drops expired members, checks every limit (in flight, queued,
requests per minute, tokens per minute) and, only if all pass, takes from all of them. So
a refused request consumes nothing, and no two API replicas can both take the last slot;
time comes from Redis `TIME`, one clock for every replica. A refusal names the first
limit that failed and when to retry: for a bucket, when it will hold enough; for a slot,
`MIN_RETRY_AFTER_S` (a slot frees when some request finishes, which no clock predicts).

Life cycle: `admit` (API) -> `mark_started` (a worker pulled it: it leaves the queued set)
-> `settle` (a worker finished it, for any reason: it leaves both sets, unused tokens go
back). If the enqueue fails after admission, the API calls `release`: a settle with
nothing used that also gives the request back. Only the call that removes the request
from the in-flight set refunds, so a repeat (a redelivered entry, a release racing a
worker that did get the entry) gives nothing back twice.

The API admits in two steps (`api/admission.py`): `admit_request` checks the limits that
need no tokens (in flight, queued, requests per minute) before the prompt is tokenized, so
an over-limit tenant costs no tokenizing; `admit_tokens` takes the tokens once they are
known. A request refused in between (a 400, or tokens per minute) gets its slots back by
`free_slots` but still counts against requests per minute: it cost admission its work.

Why not the `limits` library (limits.readthedocs.io): its strategies offer `hit`, `test`,
`get_window_stats` and `clear`, one limit at a time. Checking several limits means
`test` each then `hit` each: another replica can take the last unit in between, and
hitting one by one charges the limits that passed when a later one fails. Nothing gives
back part of a hit (settle) or undoes one (release), and it has no concurrency limits
(in flight, queued are counts of live requests, not rates). So: two short scripts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import redis.asyncio as aioredis

from shared import keys
from shared.lua import LuaScript
from shared.protocol import QueuedRequest
from shared.redis_conn import text
from shared.tenants import TenantLimits

MIN_RETRY_AFTER_S = 1

_LUA_COMMON = """
local function now_s()
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end

-- A bucket refills capacity/60 per second up to its capacity; one never written is full.
local function bucket_level(key, name, capacity, now)
  local state = redis.call('HMGET', key, name .. ':level', name .. ':at_s')
  if not state[1] then return capacity end
  local refill = math.max(now - tonumber(state[2]), 0) * capacity / 60
  return math.min(capacity, tonumber(state[1]) + refill)
end

local function set_bucket(key, name, capacity, level, now)
  redis.call('HSET', key, name .. ':level', level, name .. ':at_s', now,
             name .. ':capacity', capacity)
end
"""

# KEYS: in-flight set, queued set, buckets hash.
# ARGV: request id, lifetime (s), max in flight, max queued, requests per minute,
#       tokens per minute (each -1 when unlimited), tokens to reserve.
# Returns {'ok', 0} or {first limit that failed, ms until a bucket could pass (0: a slot)}.
_ADMIT_LUA = (
    _LUA_COMMON
    + """
local id, lifetime_s = ARGV[1], tonumber(ARGV[2])
local max_in_flight, max_queued = tonumber(ARGV[3]), tonumber(ARGV[4])
local rpm, tpm, num_tokens = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local now = now_s()

-- Members past their expiry were leaked by a crashed API or worker: drop them, then count.
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
if max_in_flight >= 0 and redis.call('ZCARD', KEYS[1]) >= max_in_flight then
  return {'requests_in_flight', 0}
end
if max_queued >= 0 and redis.call('ZCARD', KEYS[2]) >= max_queued then
  return {'requests_queued', 0}
end

local function wait_ms(missing, capacity)
  if capacity <= 0 then return 60000 end  -- a zero limit never refills
  return math.ceil(missing * 60000 / capacity)
end
local num_requests_left, num_tokens_left
if rpm >= 0 then
  num_requests_left = bucket_level(KEYS[3], 'rpm', rpm, now)
  if num_requests_left < 1 then
    return {'requests_per_minute', wait_ms(1 - num_requests_left, rpm)}
  end
end
if tpm >= 0 then
  num_tokens_left = bucket_level(KEYS[3], 'tpm', tpm, now)
  if num_tokens_left < num_tokens then
    return {'tokens_per_minute', wait_ms(num_tokens - num_tokens_left, tpm)}
  end
end

-- Every limit passed: take from all of them.
for _, key in ipairs({KEYS[1], KEYS[2]}) do
  redis.call('ZADD', key, now + lifetime_s, id)
  local last = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
  redis.call('PEXPIREAT', key, math.ceil(tonumber(last[2]) * 1000))
end
if num_requests_left then set_bucket(KEYS[3], 'rpm', rpm, num_requests_left - 1, now) end
if num_tokens_left then set_bucket(KEYS[3], 'tpm', tpm, num_tokens_left - num_tokens, now) end
if num_requests_left or num_tokens_left then redis.call('EXPIRE', KEYS[3], 60) end
return {'ok', 0}
"""
)
_ADMIT = LuaScript(_ADMIT_LUA)

# KEYS: in-flight set, queued set, buckets hash.
# ARGV: request id, tokens to give back, requests to give back.
# Returns 1 if this call ended the request's admission, 0 if it had ended already.
_SETTLE_LUA = (
    _LUA_COMMON
    + """
local function refund(key, name, amount, now)
  if amount <= 0 then return end
  local capacity = tonumber(redis.call('HGET', key, name .. ':capacity'))
  if not capacity then return end  -- no bucket: unlimited, or full again since its TTL
  local level = math.min(capacity, bucket_level(key, name, capacity, now) + amount)
  set_bucket(key, name, capacity, level, now)
end

redis.call('ZREM', KEYS[2], ARGV[1])
if redis.call('ZREM', KEYS[1], ARGV[1]) == 0 then return 0 end
local now = now_s()
refund(KEYS[3], 'tpm', tonumber(ARGV[2]), now)
refund(KEYS[3], 'rpm', tonumber(ARGV[3]), now)
return 1
"""
)
_SETTLE = LuaScript(_SETTLE_LUA)


@dataclass(frozen=True, slots=True)
class Refusal:
    """The first limit a request would exceed, and how long to wait before retrying."""

    limit: str  # "requests_in_flight" | "requests_queued" | "requests_per_minute" | "tokens_per_minute"
    allowed: int  # the tenant's value of that limit
    retry_after_s: int

    @property
    def code(self) -> str:
        return f"{self.limit}_exceeded"


def num_reserved_tokens(request: QueuedRequest) -> int:
    """What admission takes from the tokens-per-minute bucket: the most the request can use."""
    return len(request.prompt_token_ids) + request.sampling.max_tokens


async def admit(
    redis: aioredis.Redis, limits: TenantLimits, request: QueuedRequest, max_lifetime_s: float
) -> Refusal | None:
    """Check every limit and, only if all pass, take a slot and the request's reservation."""
    return await _admit(
        redis,
        limits,
        request.tenant_id,
        request.request_id,
        num_reserved_tokens(request),
        max_lifetime_s,
    )


async def admit_request(
    redis: aioredis.Redis,
    limits: TenantLimits,
    tenant_id: str,
    request_id: str,
    max_lifetime_s: float,
) -> Refusal | None:
    """The limits that need no tokens (in flight, queued, requests per minute), checked
    before the prompt is tokenized: if all pass, take a slot and one request. The API then
    either takes the tokens (`admit_tokens`) or refuses the request and `free_slots`."""
    without_tokens = replace(limits, tokens_per_minute=None)
    return await _admit(redis, without_tokens, tenant_id, request_id, 0, max_lifetime_s)


async def admit_tokens(
    redis: aioredis.Redis, limits: TenantLimits, request: QueuedRequest, max_lifetime_s: float
) -> Refusal | None:
    """After `admit_request`: take the request's reservation from its tokens per minute
    (nothing to take, and no call to Redis, for a tenant without that limit)."""
    if limits.tokens_per_minute is None:
        return None
    tokens_only = TenantLimits(tokens_per_minute=limits.tokens_per_minute)
    return await _admit(
        redis,
        tokens_only,
        request.tenant_id,
        request.request_id,
        num_reserved_tokens(request),
        max_lifetime_s,
    )


async def _admit(
    redis: aioredis.Redis,
    limits: TenantLimits,
    tenant_id: str,
    request_id: str,
    num_tokens: int,
    max_lifetime_s: float,
) -> Refusal | None:
    allowed = _limits_by_name(limits)
    reply = await _ADMIT(
        redis,
        keys=_keys(tenant_id),
        args=[
            request_id,
            max_lifetime_s,
            *(-1 if value is None else value for value in allowed.values()),
            num_tokens,
        ],
    )
    limit, wait_ms = text(reply[0]), int(reply[1])
    if limit == "ok":
        return None
    retry_after_s = max(MIN_RETRY_AFTER_S, math.ceil(wait_ms / 1000))
    return Refusal(limit, allowed[limit] or 0, retry_after_s)


async def mark_started(redis: aioredis.Redis, request: QueuedRequest) -> None:
    """A worker pulled the request: it no longer counts as queued (still in flight)."""
    await redis.zrem(keys.tenant_queued(request.tenant_id), request.request_id)


async def settle(redis: aioredis.Redis, request: QueuedRequest, num_used_tokens: int) -> bool:
    """The request finished: free its slots and give back the unused part of its reservation."""
    num_unused_tokens = max(num_reserved_tokens(request) - num_used_tokens, 0)
    return await _end(redis, request, num_unused_tokens, num_requests=0)


async def release(redis: aioredis.Redis, request: QueuedRequest) -> bool:
    """The request was admitted but never enqueued: undo its admission entirely."""
    return await _end(redis, request, num_reserved_tokens(request), num_requests=1)


async def free_slots(redis: aioredis.Redis, tenant_id: str, request_id: str) -> bool:
    """A request refused after `admit_request` (a bad prompt, too many tokens): free its
    slots but give back no request, so every request that got that far, and cost the API
    its tokenizing, counts against its tenant's requests per minute."""
    reply = await _SETTLE(redis, keys=_keys(tenant_id), args=[request_id, 0, 0])
    return reply == 1


async def _end(
    redis: aioredis.Redis, request: QueuedRequest, num_tokens: int, num_requests: int
) -> bool:
    reply = await _SETTLE(
        redis, keys=_keys(request.tenant_id), args=[request.request_id, num_tokens, num_requests]
    )
    return reply == 1


def _keys(tenant_id: str) -> list[str]:
    return [
        keys.tenant_inflight(tenant_id),
        keys.tenant_queued(tenant_id),
        keys.tenant_buckets(tenant_id),
    ]


def _limits_by_name(limits: TenantLimits) -> dict[str, int | None]:
    """The limits the admission script checks, by the names it answers with, in its ARGV order."""
    return {
        "requests_in_flight": limits.max_requests_in_flight,
        "requests_queued": limits.max_requests_queued,
        "requests_per_minute": limits.requests_per_minute,
        "tokens_per_minute": limits.tokens_per_minute,
    }
