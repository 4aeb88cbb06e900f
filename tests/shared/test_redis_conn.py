"""Calls to the broker retried while it is unreachable (shared/redis_conn.retrying)."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis
import uvloop

from shared import redis_conn


async def test_a_call_is_retried_while_the_broker_is_unreachable_then_given_up(monkeypatch):
    monkeypatch.setattr(redis_conn, "MAX_RETRY_DELAY_S", 0.05)
    attempts = []

    async def flaky():
        attempts.append(time.monotonic())
        if len(attempts) < 3:
            raise redis.ConnectionError("Connection reset by peer")
        return "through"

    assert await redis_conn.retrying(flaky, within_s=5, what="test") == "through"
    assert len(attempts) == 3

    async def unreachable():
        raise ConnectionResetError("Connection lost")

    started_s = time.monotonic()
    with pytest.raises(ConnectionResetError):
        await redis_conn.retrying(unreachable, within_s=0.3, what="test")
    assert 0.2 < time.monotonic() - started_s < 1.0

    async def refused():
        attempts.append(time.monotonic())
        raise redis.ResponseError("WRONGTYPE")  # an answer, not an outage: never retried

    attempts.clear()
    with pytest.raises(redis.ResponseError):
        await redis_conn.retrying(refused, within_s=5, what="test")
    assert len(attempts) == 1


@pytest.mark.parametrize("max_connections", [None, 4])
async def test_commands_packed_by_hiredis_reach_redis_as_redis_py_packs_them(
    redis_server, max_connections
):
    client = redis_conn.async_client(redis_server.url, max_connections=max_connections)
    try:
        assert client.connection_pool.connection_class.__name__.startswith("HiredisPacking")
        key = f"pack-{time.monotonic_ns()}"
        await client.hset(key, mapping={"f": 1.5, "n": 7, "s": "é", "b": b"\x00\xff"})
        assert await client.hgetall(key) == {
            b"f": b"1.5",
            b"n": b"7",
            b"s": "é".encode(),
            b"b": b"\x00\xff",
        }
        await client.execute_command("CLIENT SETNAME", "packed")  # a name of two words
        assert await client.client_getname() in ("packed", b"packed")
        with pytest.raises(redis.DataError):
            await client.set(key, {"not": "encodable"})
        await client.delete(key)
    finally:
        await client.aclose()


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_write_on_a_connection_a_reset_closed_is_a_connection_error(redis_server, loop):
    """Under uvloop, writing on a transport that is closed raises RuntimeError; redis-py
    retries only connection errors, so a client must see one, on either loop."""

    async def scenario() -> None:
        client = redis_conn.async_client(redis_server.url, retries=0)
        pool = client.connection_pool
        try:
            connection = await pool.get_connection()
            connection._writer.transport.abort()  # what a reset does to it
            await asyncio.sleep(0.01)
            with pytest.raises(redis.ConnectionError):
                await connection.send_command("PING")
            assert not connection.is_connected
            await pool.release(connection)
            assert await client.ping()  # on a new connection
        finally:
            await client.aclose()

    (uvloop.run if loop == "uvloop" else asyncio.run)(scenario())
