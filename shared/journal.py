"""The request journal: every event of a request, in order, kept in Redis for a while.

Pub/sub carries events live but at most once: a subscriber that is slow, reconnecting or on
another API replica misses what was published meanwhile. So every event is also appended
to the request's journal, a stream whose entry ids are `0-{seq + 1}`, in the same script
that publishes it. With the journal:

- a reader that sees a gap in `seq`, or no end, reads what it missed from the journal;
- a client that reconnects with `Last-Event-ID` (to any API replica) replays from it;
- every script is idempotent for its caller: the Redis client retries a command whose
  connection broke, possibly after it ran, and the retry must not look like a refusal;
- a request has exactly one end: whoever ends it (its worker, a worker reclaiming a dead
  worker's entries, an API replica that finds its worker dead) first claims
  `llmfleet:done:{id}` with SET NX, then records the usage, then appends the terminal
  event; token events are refused once the end is claimed. A zombie worker, a second
  delivery of the same entry, or a reaper racing the worker cannot add to a request that
  is ending, nor write the same `seq` twice (`XADD` refuses an id not above the last).

The journal and the done marker expire `journal_ttl_s` after their last write, with one
exception: for a tenant that keeps no content (`content_retention_days` None) the journal
holds output text the platform promised not to store, so once the terminal event is
appended the journal and the request's meta hash expire after `resume_grace_s` instead (a
client that lost its connection just before the end can still resume within it; after it,
`GET /v1/requests/{id}/events` answers 404). We shorten the TTL rather than blank the
texts: a resume inside the grace gets the whole answer, and expiry is Redis's own
bookkeeping, with no sweeper to run. The done marker holds no content and keeps
`journal_ttl_s`, so a late second delivery of the request is still refused.
"""

from __future__ import annotations

import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline

from shared import keys
from shared.protocol import ErrorEvent, Event, FinalEvent, TokenEvent, decode_event, encode_event

# KEYS: journal stream, done marker. ARGV: channel, seq, event JSON, ttl s.
# Returns 1 if appended (and published), 0 if the request is ending or `seq` was taken; an
# OOM error (`OutOfMemoryError`) if Redis is out of memory.
_APPEND_LUA = """
if redis.call('EXISTS', KEYS[2]) == 1 then return 0 end
local id = '0-' .. (tonumber(ARGV[2]) + 1)
local added = redis.pcall('XADD', KEYS[1], id, 'e', ARGV[3])
if type(added) == 'table' and added.err then
  -- Out of memory is not a taken `seq`: the caller waits and tries again.
  local oom = string.find(added.err, 'OOM', 1, true)
  if oom then return redis.error_reply(string.sub(added.err, oom)) end
  -- The very same event is there: this call is a client's retry of one that ran.
  local existing = redis.call('XRANGE', KEYS[1], id, id)
  if #existing == 1 and existing[1][2][2] == ARGV[3] then return 1 end
  return 0
end
redis.call('EXPIRE', KEYS[1], ARGV[4])
redis.call('PUBLISH', ARGV[1], ARGV[3])
return 1
"""

# KEYS: journal stream, done marker, meta hash. ARGV: channel, claimer, event JSON (its seq
# is replaced by the next one), ttl s, then the journal's and meta hash's ttl s after the end
# ('' : the journal keeps ttl s, the meta hash is left as it is). Returns 1 if appended, 0 if
# someone else claimed the end.
_APPEND_END_LUA = """
if redis.call('GET', KEYS[2]) ~= ARGV[2] then return 0 end
local last = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
local seq = 0
if #last > 0 then
  -- Already ended by this claimer: this call is a client's retry of one that ran.
  if cjson.decode(last[1][2][2])['type'] ~= 'token' then return 1 end
  seq = tonumber(string.match(last[1][1], '%-(%d+)$'))
end
local event = cjson.decode(ARGV[3])
event['seq'] = seq
local data = cjson.encode(event)
redis.call('XADD', KEYS[1], '0-' .. (seq + 1), 'e', data)
if ARGV[5] == '' then
  redis.call('EXPIRE', KEYS[1], ARGV[4])
else
  redis.call('EXPIRE', KEYS[1], ARGV[5])
  redis.call('EXPIRE', KEYS[3], ARGV[5])
end
redis.call('EXPIRE', KEYS[2], ARGV[4])
redis.call('PUBLISH', ARGV[1], data)
return 1
"""


# KEYS: done marker. ARGV: claimer, ttl s. 1 if the end is the claimer's (now or already).
_CLAIM_END_LUA = """
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'EX', ARGV[2]) then return 1 end
if redis.call('GET', KEYS[1]) == ARGV[1] then return 1 end
return 0
"""

# KEYS: meta hash, done marker. ARGV: owner, ttl s. Nothing once the end is claimed: the
# publisher marks a request started in the background, and such a late call must not
# lengthen the meta hash's life after `append_end` shortened it.
_SET_OWNER_LUA = """
if redis.call('EXISTS', KEYS[2]) == 1 then return 0 end
redis.call('HSET', KEYS[1], 'owner', ARGV[1])
redis.call('EXPIRE', KEYS[1], ARGV[2])
return 1
"""

# KEYS: done marker, the request's events. ARGV: the holder taken over, the new claimer, ttl
# s. Only while that holder still holds the end and no terminal event was appended.
_TAKE_OVER_END_LUA = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
local last = redis.call('XREVRANGE', KEYS[2], '+', '-', 'COUNT', 1)
if #last > 0 and cjson.decode(last[1][2][2])['type'] ~= 'token' then return 0 end
redis.call('SET', KEYS[1], ARGV[2], 'EX', ARGV[3])
return 1
"""

_RELEASE_END_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end
return 0
"""


DEFAULT_RESUME_GRACE_S = 60  # `Settings.resume_grace_s`


class Journal:
    def __init__(
        self, redis: aioredis.Redis, ttl_s: int, resume_grace_s: int = DEFAULT_RESUME_GRACE_S
    ) -> None:
        self._redis = redis
        self.ttl_s = ttl_s
        self.resume_grace_s = resume_grace_s
        self._set_owner = redis.register_script(_SET_OWNER_LUA)
        self._append = redis.register_script(_APPEND_LUA)
        self._append_end = redis.register_script(_APPEND_END_LUA)
        self._release_end = redis.register_script(_RELEASE_END_LUA)
        self._claim_end = redis.register_script(_CLAIM_END_LUA)
        self._take_over_end = redis.register_script(_TAKE_OVER_END_LUA)

    async def append(self, request_id: str, event: TokenEvent) -> bool:
        """Append and publish a token event; False if the request is ending or `seq` was
        taken (another worker generates it)."""
        return bool(await self._append(**self._args(request_id, event)))

    def append_in(self, pipe: Pipeline, request_id: str, event: TokenEvent) -> None:
        """Queue an append on `pipe` (one pipeline per engine step); its result is the same
        0/1 as `append`'s, in the pipeline's results. Sent by the script's SHA1 alone: a
        redis-py pipeline holding a `Script` first asks Redis whether it has it (`SCRIPT
        EXISTS`, a round trip of its own on every step). A Redis that lost its scripts (it
        restarted) fails the pipeline with `NoScriptError`: `load_append_script`, then run it
        again (appends are idempotent)."""
        args = self._args(request_id, event)
        pipe.evalsha(self._append.sha, len(args["keys"]), *args["keys"], *args["args"])

    async def load_append_script(self) -> None:
        await self._redis.script_load(_APPEND_LUA)

    async def read_after(self, request_id: str, seq: int) -> list[Event]:
        """The journal's events with a sequence number above `seq` (-1: all of them)."""
        entries = await self._redis.xrange(keys.request_events(request_id), min=f"({_id(seq)}")
        return [decode_event(fields[b"e"]) for _, fields in entries]

    async def last_seq(self, request_id: str) -> int:
        """The sequence number of the last event appended, -1 if none."""
        entries = await self._redis.xrevrange(keys.request_events(request_id), count=1)
        return int(entries[0][0].split(b"-")[1]) - 1 if entries else -1

    async def is_done(self, request_id: str) -> bool:
        """Whether its end is claimed (perhaps not yet completed: see `is_ended`)."""
        return bool(await self._redis.exists(keys.request_done(request_id)))

    async def is_ended(self, request_id: str) -> bool:
        """Whether its terminal event (final or error) is appended."""
        entries = await self._redis.xrevrange(keys.request_events(request_id), count=1)
        return bool(entries) and not isinstance(decode_event(entries[0][1][b"e"]), TokenEvent)

    async def end_claim(self, request_id: str) -> tuple[str, float] | None:
        """Who holds the request's end and for how long (s), if its end is claimed."""
        done = keys.request_done(request_id)
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.get(done)
            pipe.ttl(done)
            holder, ttl_s = await pipe.execute()
        if holder is None:
            return None
        return holder.decode(), max(0.0, float(self.ttl_s - max(ttl_s, 0)))

    async def take_over_end(self, request_id: str, holder: str, claimer: str) -> bool:
        """Claim an end that `holder` claimed and never completed (`holder` is gone); False
        if it completed it meanwhile, or someone else took it."""
        return bool(
            await self._take_over_end(
                keys=[keys.request_done(request_id), keys.request_events(request_id)],
                args=[holder, claimer, self.ttl_s],
            )
        )

    async def claim_end(self, request_id: str, claimer: str) -> bool:
        """Become the one who ends the request (records its usage, appends its terminal
        event); False if someone else has. From here on, no token event is appended."""
        done = keys.request_done(request_id)
        return bool(await self._claim_end(keys=[done], args=[claimer, self.ttl_s]))

    async def release_end(self, request_id: str, claimer: str) -> None:
        """Give back a claimed end that could not be completed (its usage not recorded)."""
        await self._release_end(keys=[keys.request_done(request_id)], args=[claimer])

    async def append_end(
        self,
        request_id: str,
        claimer: str,
        event: ErrorEvent | FinalEvent,
        *,
        keeps_content: bool = False,
    ) -> bool:
        """Append and publish the terminal event, after `claim_end`; its `seq` becomes the
        one after the journal's last event. The journal then lives `ttl_s` if the tenant
        `keeps_content`, else only `resume_grace_s`, its meta hash with it (see above)."""
        grace_s = "" if keeps_content else self.resume_grace_s
        result = await self._append_end(
            keys=[
                keys.request_events(request_id),
                keys.request_done(request_id),
                keys.request_meta(request_id),
            ],
            args=[
                keys.request_channel(request_id),
                claimer,
                encode_event(event),
                self.ttl_s,
                grace_s,
            ],
        )
        return bool(result)

    async def set_owner(self, request_id: str, worker_id: str) -> None:
        """The worker that pulled the request; an API replica checks that it is alive. Does
        nothing once the request's end is claimed."""
        meta, done = keys.request_meta(request_id), keys.request_done(request_id)
        await self._set_owner(keys=[meta, done], args=[worker_id, self.ttl_s])

    async def meta(self, request_id: str) -> dict[str, str]:
        """What the API stored when it enqueued the request (tenant_id, model, kind,
        created, stream, entry_id), plus `owner` once a worker pulled it; {} if unknown."""
        fields = await self._redis.hgetall(keys.request_meta(request_id))  # type: ignore[misc]  # redis-py: async commands typed Awaitable[T] | T (redis-py#2399)
        return {k.decode(): v.decode() for k, v in fields.items()}

    def _args(self, request_id: str, event: TokenEvent) -> dict:
        return {
            "keys": [keys.request_events(request_id), keys.request_done(request_id)],
            "args": [keys.request_channel(request_id), event.seq, encode_event(event), self.ttl_s],
        }


def _id(seq: int) -> str:
    return f"0-{seq + 1}"
