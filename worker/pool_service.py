"""The pool's tenant service counters: one per tenant and model version, in Redis, shared by
every worker serving the version, so that weighted fair queuing holds for the pool as a whole.
(Per version, not per model: each version's workers are a pool of their own, with queues of
their own; a tenant's share is kept within each.)

Each worker's fair queue counts the tokens it computes per unit of its tenants' weights
(VTC's counters, `worker/fair_queue.py`). Kept per process, as a router-level DRR keeps its
deficits (ai-dynamo/dynamo issue 15187: two routers with skewed ingress served a 4:1 split as
163:162), each worker would only be fair among the requests it happens to hold: with a
worker that takes mostly tenant A's requests and another mostly B's, both would serve
their own as if nobody else served them. Instead, once per engine step, a worker sends what
its counters gained since its last sync (tokens computed; lifts of tenants that started
waiting, as floors) and reads back the pool's counters, in one script, so one round trip;
it runs while the step computes, and its answer is applied after the step: the counters a
worker orders by are at most a step and a round trip old.

Decision: the counters live here, in Redis, beside the streams they order; the
deficits of the round-robin stay in each worker (they only break ties between tenants within
a quantum of each other, and the counters decide everything beyond that), so only counters
cross the network. `merge_service` is the script's rule, in Python, for the simulation.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter

import redis.asyncio as aioredis
from redis.typing import EncodableT

from shared import keys
from shared.redis_conn import BROKER_ERRORS, text
from worker.tenant_counters import ServiceUpdates

log = logging.getLogger("llmfleet.worker")

# Counters of a model nobody serves any more go away after a day.
COUNTERS_TTL_S = 86_400

# ARGV: number of increments, then (tenant, amount) pairs; number of floors, then (tenant,
# value) pairs; then the TTL. Increments first, then floors: a floor is a worker's view of
# a counter, which already holds that worker's increments. Returns every counter.
_SYNC_LUA = """
local key = KEYS[1]
local i = 2
for _ = 1, tonumber(ARGV[1]) do
  redis.call('HINCRBYFLOAT', key, ARGV[i], ARGV[i + 1])
  i = i + 2
end
local num_floors = tonumber(ARGV[i])
i = i + 1
for _ = 1, num_floors do
  local current = redis.call('HGET', key, ARGV[i])
  if (not current) or tonumber(ARGV[i + 1]) > tonumber(current) then
    redis.call('HSET', key, ARGV[i], ARGV[i + 1])
  end
  i = i + 2
end
redis.call('EXPIRE', key, ARGV[i])
return redis.call('HGETALL', key)
"""


def merge_service(counters: dict[str, float], updates: ServiceUpdates) -> None:
    """What the script does to the pool's counters, in Python."""
    for tenant, amount in updates.served.items():
        counters[tenant] = counters.get(tenant, 0.0) + amount
    for tenant, floor in updates.floors.items():
        counters[tenant] = max(counters.get(tenant, -math.inf), floor)


class PoolService:
    """One worker's end of the pool's counters."""

    def __init__(self, redis: aioredis.Redis, deployment: str) -> None:
        self._key = keys.tenant_service(deployment)  # the model version's pool
        self._sync = redis.register_script(_SYNC_LUA)
        self._unsent = ServiceUpdates()  # updates of syncs that did not get through
        self.last_sync_s = 0.0  # how long the last sync took (a metric)

    async def sync(self, updates: ServiceUpdates) -> dict[str, float] | None:
        """Add this worker's updates to the pool's counters and return them; None while
        the broker is unreachable: the updates then go with the next sync. (A sync whose
        reply was lost after the script ran is sent again: its tokens count twice, one
        step's worth, which the counters' hysteresis of a quantum absorbs.)"""
        updates = _merged(self._unsent, updates)
        args: list[EncodableT] = [len(updates.served)]
        for tenant, amount in updates.served.items():
            args += [tenant, repr(amount)]
        args.append(len(updates.floors))
        for tenant, floor in updates.floors.items():
            args += [tenant, repr(floor)]
        args.append(COUNTERS_TTL_S)
        started = time.perf_counter()
        try:
            reply = await self._sync(keys=[self._key], args=args)
        except BROKER_ERRORS as exc:
            log.warning("pool counters not synced (%s); sending them with the next step", exc)
            self._unsent = updates
            return None
        self.last_sync_s = time.perf_counter() - started
        self._unsent = ServiceUpdates()
        return {text(reply[i]): float(reply[i + 1]) for i in range(0, len(reply), 2)}


def _merged(first: ServiceUpdates, then: ServiceUpdates) -> ServiceUpdates:
    if not first:
        return then
    served = Counter(first.served)
    served.update(then.served)
    floors = dict(first.floors)
    for tenant, floor in then.floors.items():
        floors[tenant] = max(floor, floors.get(tenant, -math.inf))
    return ServiceUpdates(dict(served), floors)
