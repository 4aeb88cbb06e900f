"""The self-pipelining client (`shared/auto_pipeline.py`) against a real redis-server: one
round trip for a turn's commands, and to each caller exactly what a plain client gives."""

from __future__ import annotations

import asyncio
import uuid

import pytest
import redis.exceptions

from shared.auto_pipeline import AutoPipelinedRedis
from shared.redis_conn import async_client


class CountingClient(AutoPipelinedRedis):
    """Counts the pipelines it sends, and names their commands."""

    num_pipelines = 0

    async def _run(self, batch):
        self.num_pipelines += 1
        self.pipelined = [args[0] for args, _, _ in batch]
        await super()._run(batch)


@pytest.fixture
async def client(redis_server):
    client = CountingClient.from_url(redis_server.url)
    yield client
    await client.aclose()


async def test_a_turns_commands_go_out_in_one_pipeline_and_each_caller_gets_its_reply(client):
    prefix = uuid.uuid4().hex
    await asyncio.gather(*(client.set(f"{prefix}:{i}", i) for i in range(100)))
    replies = await asyncio.gather(*(client.get(f"{prefix}:{i}") for i in range(100)))
    assert replies == [str(i).encode() for i in range(100)]
    assert client.num_pipelines == 2


async def test_an_error_goes_to_its_own_caller_only(client):
    key = f"{uuid.uuid4().hex}:list"
    await client.rpush(key, "a")
    replies = await asyncio.gather(
        client.incr(key), client.lrange(key, 0, -1), return_exceptions=True
    )
    assert isinstance(replies[0], redis.exceptions.ResponseError)
    assert replies[1] == [b"a"]


async def test_a_script_that_redis_forgot_is_loaded_again(client):
    script = client.register_script("return tonumber(ARGV[1]) + 1")
    assert await script(args=[1]) == 2
    await client.script_flush()
    assert await asyncio.gather(script(args=[2]), script(args=[3])) == [3, 4]


async def test_a_blocking_command_goes_alone_and_holds_up_no_other(client):
    key = uuid.uuid4().hex
    # Issued in the same turn: pipelined with the BLPOP, the PING would wait its 2 s.
    blocking = asyncio.ensure_future(client.blpop([key], timeout=2))
    ping = asyncio.ensure_future(client.ping())
    assert await asyncio.wait_for(ping, timeout=0.5)
    await client.rpush(key, "x")
    assert tuple(await blocking) == (key.encode(), b"x")


async def test_a_stream_read_that_does_not_block_goes_with_the_turns_commands(client):
    stream, group = uuid.uuid4().hex, "workers"
    await client.xgroup_create(stream, group, id="0", mkstream=True)
    await client.xadd(stream, {"n": "1"})
    before = client.num_pipelines
    members, read = await asyncio.gather(
        client.smembers(f"{stream}:none"), client.xreadgroup(group, "c", {stream: ">"}, count=5)
    )
    assert client.num_pipelines == before + 1  # one round trip for both
    assert client.pipelined == ["SMEMBERS", "XREADGROUP"]
    assert members == set()
    [(name, [(_, fields)])] = read
    assert name == stream.encode() and fields == {b"n": b"1"}
    # with BLOCK it goes alone: pipelined, the PING would wait its 2 s
    blocking = asyncio.ensure_future(client.xreadgroup(group, "c", {stream: ">"}, block=2000))
    ping = asyncio.ensure_future(client.ping())
    assert await asyncio.wait_for(ping, timeout=0.5)
    await client.xadd(stream, {"n": "2"})
    [(_, [(_, fields)])] = await blocking
    assert fields == {b"n": b"2"}


async def test_a_caller_cancelled_mid_flight_leaves_the_others_their_replies(client):
    key = uuid.uuid4().hex
    await client.set(key, "v")
    gets = [asyncio.ensure_future(client.get(key)) for _ in range(10)]
    gets[3].cancel()
    done = await asyncio.gather(*gets, return_exceptions=True)
    assert isinstance(done[3], asyncio.CancelledError)
    assert [d for i, d in enumerate(done) if i != 3] == [b"v"] * 9
    assert await client.get(key) == b"v"  # the connection is still in step


async def test_a_broker_that_is_gone_fails_every_caller(own_redis):
    client = async_client(own_redis.url, retries=0, auto_pipeline=True)
    assert isinstance(client, AutoPipelinedRedis)
    assert await client.ping()
    own_redis.stop()
    replies = await asyncio.gather(*(client.get("k") for _ in range(5)), return_exceptions=True)
    assert all(isinstance(r, redis.exceptions.ConnectionError) for r in replies)
    assert len({id(r) for r in replies}) == 5  # a copy each
    await client.aclose()
