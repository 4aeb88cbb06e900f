"""The processes `llmfleet up` supervises, as it reports them: what `llmfleet status` and
`/dashboard` show about restarts.

`up` rewrites the hash `keys.SUPERVISED_PROCESSES` (process name -> JSON) about once a second
with a TTL of a few seconds, so the record of an `up` that was killed goes away by itself.
One fixed key, not one per `up`: the readers (`/metrics` among them, on every scrape) then
need no SCAN of the keyspace. (Two `up`s sharing one Redis would overwrite each other's
record; each `up` normally runs its own.) While Redis itself is down (the embedded one being
restarted) nothing is written; the next write after it is back holds everything.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields

import redis
import redis.asyncio as aioredis

from shared import keys

STATE_TTL_S = 10


@dataclass(frozen=True, slots=True)
class ProcessState:
    name: str  # `api`, `control`, `worker-0`, ..., `redis`
    state: str  # `running` | `restarting` (waiting out its backoff)
    pid: int | None
    num_restarts: int
    last_exit: str | None  # `exit 1`, `signal SIGKILL`; None: never exited
    up_since_ts: float | None  # unix s the running process started; None while restarting
    metrics_port: int | None = None  # a worker's Prometheus port; None: none

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, value: bytes | str) -> ProcessState:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in json.loads(value).items() if k in known})


def write(client: redis.Redis, states: list[ProcessState], ttl_s: int = STATE_TTL_S) -> None:
    """Write the record whole (blocking: `up` is not asynchronous): a process stopped on
    purpose (a scale-down) leaves it."""
    if not states:
        return
    with client.pipeline(transaction=True) as pipe:
        pipe.delete(keys.SUPERVISED_PROCESSES)
        pipe.hset(keys.SUPERVISED_PROCESSES, mapping={s.name: s.to_json() for s in states})
        pipe.expire(keys.SUPERVISED_PROCESSES, ttl_s)
        pipe.execute()


def forget(client: redis.Redis) -> None:
    client.delete(keys.SUPERVISED_PROCESSES)


async def read(redis_client: aioredis.Redis) -> list[ProcessState]:
    """The supervised processes, by name; none when no `up` runs."""
    values = await redis_client.hgetall(keys.SUPERVISED_PROCESSES)  # type: ignore[misc]  # redis-py: async commands typed Awaitable[T] | T (redis-py#2399)
    return sorted((ProcessState.from_json(v) for v in values.values()), key=lambda s: s.name)
