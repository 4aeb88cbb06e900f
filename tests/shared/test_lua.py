"""Lua scripts made once per process (shared/lua.py): called by SHA1, loaded again when
Redis has lost them (a restart, a flush)."""

from __future__ import annotations

import uuid

from shared.lua import LuaScript

_INCR_BY = LuaScript("return redis.call('INCRBY', KEYS[1], ARGV[1])")


async def test_a_script_runs_by_its_sha_and_is_loaded_again_after_a_flush(aredis):
    key = f"lua-{uuid.uuid4().hex}"
    assert await _INCR_BY(aredis, [key], [2]) == 2
    await aredis.script_flush()
    assert await aredis.script_exists(_INCR_BY.sha) == [False]
    assert await _INCR_BY(aredis, [key], [3]) == 5  # NOSCRIPT: loaded, then run once
    assert await aredis.script_exists(_INCR_BY.sha) == [True]
