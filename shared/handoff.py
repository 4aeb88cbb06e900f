"""The Redis record of a prefill/decode hand-off: who holds a request that changes workers.

A prefill worker (the sender) offers a running request to a decode worker (the receiver)
(`worker/handoff.py`). Their answers to each other can be lost and either can die, so the
outcome is settled here, in `llmfleet:handoff:{request_id}`, not in their messages:

- the receiver takes the request only by turning *offered* into *accepted* (`accept`);
- the sender keeps it only by turning *offered* into *withdrawn* (`withdraw`);
- each turn is one script, so when both race exactly one wins, and the loser learns it
  from its own call: a receiver refused drops the transfer, a sender refused forgets it.

A sender whose offer was withdrawn may offer the request again, to another receiver; the
old receiver can no longer accept it. Every script is idempotent for its caller: the Redis
client retries a command whose connection broke, possibly after it ran, and the retry must
give the answer the first try got.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis.asyncio as aioredis

from shared import keys
from shared.redis_conn import text

OFFERED, ACCEPTED, WITHDRAWN = "offered", "accepted", "withdrawn"

# KEYS: hand-off hash. ARGV: sender, receiver, ttl s. 1 if this offer is recorded (now or
# already), 0 if someone else's hand-off is there or the request was accepted.
_OFFER_LUA = """
local state = redis.call('HMGET', KEYS[1], 'sender', 'receiver', 'state')
local sender, receiver = state[1], state[2]
if state[3] == 'offered' and sender == ARGV[1] and receiver == ARGV[2] then return 1 end
-- A withdrawn offer left the request with its sender, who alone may offer it again.
if state[3] == false or (state[3] == 'withdrawn' and sender == ARGV[1]) then
  redis.call('HSET', KEYS[1], 'sender', ARGV[1], 'receiver', ARGV[2], 'state', 'offered')
  redis.call('EXPIRE', KEYS[1], ARGV[3])
  return 1
end
return 0
"""

# KEYS: hand-off hash. ARGV: receiver, ttl s. 1 if the request is the receiver's (now or
# already), 0 if it was withdrawn, is offered to another, or was never offered.
_ACCEPT_LUA = """
local state = redis.call('HMGET', KEYS[1], 'receiver', 'state')
if state[1] ~= ARGV[1] then return 0 end
if state[2] == 'accepted' then return 1 end
if state[2] ~= 'offered' then return 0 end
redis.call('HSET', KEYS[1], 'state', 'accepted')
redis.call('EXPIRE', KEYS[1], ARGV[2])
return 1
"""

# KEYS: hand-off hash. ARGV: sender, ttl s. 1 if the sender keeps the request (withdrawn now
# or already), 0 if the receiver accepted it or the sender has no offer there to take back.
_WITHDRAW_LUA = """
local state = redis.call('HMGET', KEYS[1], 'sender', 'state')
if state[1] ~= ARGV[1] then return 0 end
if state[2] == 'withdrawn' then return 1 end
if state[2] ~= 'offered' then return 0 end
redis.call('HSET', KEYS[1], 'state', 'withdrawn')
redis.call('EXPIRE', KEYS[1], ARGV[2])
return 1
"""


@dataclass(frozen=True, slots=True)
class HandOffState:
    sender: str
    receiver: str
    state: str
    num_bytes: int | None = None  # of KV sent, once the receiver answered (`record_transfer`)
    transfer_s: float | None = None  # from the send to the receiver's answer


class HandOffs:
    def __init__(self, redis: aioredis.Redis, ttl_s: int) -> None:
        self._redis = redis
        self.ttl_s = ttl_s
        self._offer = redis.register_script(_OFFER_LUA)
        self._accept = redis.register_script(_ACCEPT_LUA)
        self._withdraw = redis.register_script(_WITHDRAW_LUA)

    async def offer(self, request_id: str, sender: str, receiver: str) -> bool:
        """`sender` offers the request to `receiver`. True if recorded: no hand-off of it yet,
        or the sender's last one was withdrawn (a retry to another receiver), or this very
        offer is there already. False if someone else offers it, the sender offers it to
        another receiver still (withdraw that first), or it was accepted."""
        key = keys.handoff(request_id)
        return bool(await self._offer(keys=[key], args=[sender, receiver, self.ttl_s]))

    async def accept(self, request_id: str, receiver: str) -> bool:
        """True if the request is now `receiver`'s: it was offered to it, or it accepted it
        already. False if the offer was withdrawn, is to another receiver, or never came."""
        key = keys.handoff(request_id)
        return bool(await self._accept(keys=[key], args=[receiver, self.ttl_s]))

    async def withdraw(self, request_id: str, sender: str) -> bool:
        """The sender takes its offer back (no answer came from the receiver). True if the
        sender keeps the request: its offer is withdrawn, now or already. False if the
        receiver accepted it (the sender forgets it), or the sender has no offer there."""
        key = keys.handoff(request_id)
        return bool(await self._withdraw(keys=[key], args=[sender, self.ttl_s]))

    async def state(self, request_id: str) -> HandOffState | None:
        """The hand-off as recorded, None if there is none (never offered, or forgotten)."""
        fields = await self._redis.hgetall(keys.handoff(request_id))  # type: ignore[misc]  # redis-py: async commands typed Awaitable[T] | T (redis-py#2399)
        if not fields:
            return None
        values = {text(k): text(v) for k, v in fields.items()}
        num_bytes, transfer_s = values.get("bytes"), values.get("transfer_s")
        return HandOffState(
            values["sender"],
            values["receiver"],
            values["state"],
            int(num_bytes) if num_bytes is not None else None,
            float(transfer_s) if transfer_s is not None else None,
        )

    async def record_transfer(self, request_id: str, num_bytes: int, transfer_s: float) -> None:
        """What the accepted transfer took, for operators and the benchmark: its KV bytes and
        the seconds from the send to the receiver's answer (the adoption included)."""
        await self._redis.hset(  # type: ignore[misc]  # redis-py: async commands typed Awaitable[T] | T (redis-py#2399)
            keys.handoff(request_id), mapping={"bytes": num_bytes, "transfer_s": transfer_s}
        )

    async def forget(self, request_id: str) -> None:
        """Drop the record once the request ended: its holder no longer needs it."""
        await self._redis.delete(keys.handoff(request_id))
