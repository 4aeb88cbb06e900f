"""Lua scripts, each made once per process and called by its SHA1.

redis-py's `register_script` makes a `Script` bound to one client, hashing its source each
time it is made; the scripts on the request path were made per call. A `LuaScript` is a
module-level constant, called with whichever client: `EVALSHA`, and on `NOSCRIPT` (a Redis
that restarted, or was flushed) `SCRIPT LOAD` and `EVALSHA` again, as redis-py's `Script`
does. Its call is one plain command, so an auto-pipelining client (`shared/auto_pipeline.py`)
sends it with the rest of its turn. For a redis-py pipeline, use `register_script` (the
pipeline loads its scripts before it runs).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import NoScriptError


class LuaScript:
    def __init__(self, source: str) -> None:
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()

    async def __call__(
        self, redis: aioredis.Redis, keys: Sequence[Any], args: Sequence[Any] = ()
    ) -> Any:
        try:
            return await redis.execute_command("EVALSHA", self.sha, len(keys), *keys, *args)
        except NoScriptError:
            await redis.execute_command("SCRIPT LOAD", self.source)
            return await redis.execute_command("EVALSHA", self.sha, len(keys), *keys, *args)
