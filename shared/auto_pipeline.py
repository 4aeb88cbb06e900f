"""A Redis client that pipelines by itself: the commands that concurrent tasks issue in the
same turn of the event loop go to Redis together, as one pipeline, on one connection.

Under load an API process has hundreds of requests in flight, each making a few short
commands (the admission script, the enqueue script, the principals' epoch). One at a time,
every command costs a pooled connection's checkout and release, a write, a wait for its
own answer and a wake-up; pipelined, a turn's commands share one write, one read and one
wake-up, and Redis serves them with one read and one write too. What each caller sees is
unchanged: its command's reply, or its error (a script's `NOSCRIPT` too, which redis-py's
`Script` answers by loading it, exactly as without pipelining). A batch whose connection
breaks is retried as a whole under the client's retry policy, as a single command is: so
what must not run twice is idempotent here as it must be anyway (`shared/redis_conn.py`).

Blocking commands (`BLPOP`, `XREADGROUP ... BLOCK`, ...) and connection state (`WATCH`,
`SELECT`) are never pipelined: they go out alone, as with the plain client. A stream read
without `BLOCK` answers at once and is pipelined like any other command (a busy worker reads
its tenants' streams beside the tenant set, `worker/intake.py`). Pipelines of
this client (`pipeline()`, transactions) are redis-py's own and go out alone as well.

The idea is ioredis's `enableAutoPipelining` and Lettuce's command batching; redis-py has
no such option.
"""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import redis.asyncio as aioredis

# Commands that hold their connection (they block, or change its state): sent alone.
_ALONE = frozenset(
    {
        "BLPOP",
        "BRPOP",
        "BRPOPLPUSH",
        "BLMOVE",
        "BLMPOP",
        "BZPOPMIN",
        "BZPOPMAX",
        "BZMPOP",
        "WAIT",
        "WATCH",
        "UNWATCH",
        "MULTI",
        "EXEC",
        "DISCARD",
        "SELECT",
        "SUBSCRIBE",
        "PSUBSCRIBE",
        "MONITOR",
    }
)
# The most commands one pipeline carries; more in one turn go out as several.
MAX_BATCH = 256
# Stream reads: alone only where they block (`_is_alone`).
_STREAM_READS = frozenset({"XREAD", "XREADGROUP"})


def _is_alone(args: tuple[Any, ...]) -> bool:
    """Whether a command goes out alone: one that holds its connection (`_ALONE`), or a
    stream read that blocks (a BLOCK among its options, which come before STREAMS)."""
    if not isinstance(args[0], str):
        return True
    name = args[0].upper()
    if name not in _STREAM_READS:
        return name in _ALONE
    for arg in args[1:]:  # redis-py passes the keywords as bytes
        word = arg.upper() if isinstance(arg, str | bytes) else b""
        if word in ("STREAMS", b"STREAMS"):
            return False
        if word in ("BLOCK", b"BLOCK"):
            return True
    return False


_Pending = tuple[tuple[Any, ...], dict[str, Any], asyncio.Future]


class AutoPipelinedRedis(aioredis.Redis):
    """`redis.asyncio.Redis`, its commands pipelined per turn of the event loop."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._pending: list[_Pending] = []
        self._batches: set[asyncio.Task] = set()

    async def execute_command(self, *args: Any, **options: Any) -> Any:
        if _is_alone(args):
            return await super().execute_command(*args, **options)
        loop = asyncio.get_running_loop()
        reply = loop.create_future()
        if not self._pending:
            loop.call_soon(self._flush)
        self._pending.append((args, options, reply))
        return await reply

    def _flush(self) -> None:
        pending, self._pending = self._pending, []
        for start in range(0, len(pending), MAX_BATCH):
            batch = asyncio.create_task(self._run(pending[start : start + MAX_BATCH]))
            self._batches.add(batch)
            batch.add_done_callback(self._batches.discard)

    async def _run(self, batch: list[_Pending]) -> None:
        pipe = self.pipeline(transaction=False)
        pipe.command_stack = [(args, options) for args, options, _ in batch]
        try:
            replies = await pipe.execute(raise_on_error=False)
        except Exception as exc:
            for _, _, reply in batch:
                if not reply.done():
                    # A copy each: every caller raises it from its own task.
                    reply.set_exception(copy.copy(exc))
            return
        except BaseException:
            for _, _, reply in batch:
                reply.cancel()
            raise
        for (_, _, reply), value in zip(batch, replies, strict=True):
            if reply.done():  # its caller was cancelled meanwhile
                continue
            if isinstance(value, Exception):
                reply.set_exception(value)
            else:
                reply.set_result(value)
