"""Failed authentications, throttled per client address in Redis (one count for every replica).

A fixed window per address: its first failure (a wrong tenant or admin key) opens a window of
`Settings.auth_failure_window_s`; once `max_num_auth_failures` have failed in it, every further
failure from the address is answered 429 with `Retry-After` until the window ends, instead of
401. Successful requests are never throttled, from any address (the issue's rule: a guesser
must not lock out the tenants behind the same NAT or proxy). So the throttle does not slow a
guesser's oracle, which the keys' entropy makes hopeless anyway (`shared/tenants.py`: 32
random bytes); it tells a client that keeps failing to stop, says so once per window in the
log, and gives operators a signal (`too_many_failed_authentications`). A request with no key
at all is not a guess: it gets its 401 and counts for nothing.

The address is the connection's peer as uvicorn gives it, which believes `X-Forwarded-For`
only from `Settings.forwarded_allow_ips` (none by default). An IPv6 address counts as its
/64, since one host commonly holds a whole /64.

Why two short scripts rather than the `limits` library: its fixed window is this same INCR
and expiry, but it opens its own Redis pool from a URI of its own schemes and names its keys
outside `shared/keys.py`; here the API's client (its retries, the embedded server's socket)
serves, and a check or a count is one atomic round trip.
"""

from __future__ import annotations

import ipaddress
import logging
import math

import redis.asyncio as aioredis
from starlette.requests import Request

from api.errors import rate_limited
from shared import keys
from shared.lua import LuaScript
from shared.settings import Settings

log = logging.getLogger("llmfleet.api")

# KEYS: the address's counter. ARGV: max failures. Returns ms until the window ends while
# the address is over its budget, else 0.
_CHECK_LUA = """
local num_failures = tonumber(redis.call('GET', KEYS[1]) or '0')
if num_failures < tonumber(ARGV[1]) then return 0 end
return math.max(redis.call('PTTL', KEYS[1]), 1)
"""
_CHECK = LuaScript(_CHECK_LUA)

# KEYS: the address's counter. ARGV: window (ms). Returns the failures in the window, this
# one included. The expiry is set whenever the key has none: the first failure of a window.
_COUNT_LUA = """
local num_failures = redis.call('INCR', KEYS[1])
if redis.call('PTTL', KEYS[1]) < 0 then redis.call('PEXPIRE', KEYS[1], ARGV[1]) end
return num_failures
"""
_COUNT = LuaScript(_COUNT_LUA)


def client_address(request: Request) -> str:
    """What failures are counted under: the peer's address, an IPv6 one as its /64."""
    host = request.client.host if request.client is not None else ""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host or "unknown"  # not an IP (a unix socket): one count for all such peers
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return str(address)


async def refuse_if_throttled(redis: aioredis.Redis, settings: Settings, address: str) -> None:
    """429 while `address` has used up its failed authentications for the window."""
    if settings.max_num_auth_failures == 0:
        return
    wait_ms = await _CHECK(
        redis, keys=[keys.auth_failures(address)], args=[settings.max_num_auth_failures]
    )
    if int(wait_ms) > 0:
        retry_after_s = math.ceil(int(wait_ms) / 1000)
        raise rate_limited(
            "too_many_failed_authentications",
            f"Too many failed authentications from this address; retry after {retry_after_s} s.",
            retry_after_s,
        )


async def count_failure(redis: aioredis.Redis, settings: Settings, address: str) -> None:
    """One more failed authentication from `address` in its window."""
    if settings.max_num_auth_failures == 0:
        return
    num_failures = await _COUNT(
        redis, keys=[keys.auth_failures(address)], args=[settings.auth_failure_window_s * 1000]
    )
    if int(num_failures) == settings.max_num_auth_failures:
        log.warning(
            "client %s throttled: %d failed authentications within %d s",
            address,
            num_failures,
            settings.auth_failure_window_s,
        )
