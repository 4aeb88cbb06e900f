"""The reclaimer (worker/recovery.py) against a Redis of its own: nothing is reclaimed until a restarted broker has settled."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis

from cli.redis_server import EmbeddedRedis, free_port
from shared import keys, recovery
from shared.journal import Journal
from shared.protocol import ErrorCode, TokenEvent
from tests.factories import make_request
from worker.intake import Intake
from worker.recovery import Reclaimer


async def test_no_entry_is_reclaimed_until_a_restarted_broker_has_settled(tmp_path):
    # Just after a restart every heartbeat key may be gone while live workers reconnect:
    # a reclaimer that believed them dead would end their streams `worker_lost`.
    server = EmbeddedRedis(tmp_path / "redis", port=free_port()).start()
    client = aioredis.Redis.from_url(server.url)
    try:
        model, tenant = "settle-model", "settle-tenant"
        stream = keys.tenant_stream(model, tenant)
        await client.sadd(keys.model_tenants(model), tenant)
        await client.xgroup_create(stream, keys.WORKER_GROUP, id="0", mkstream=True)
        await client.xadd(stream, make_request(0, [1, 2], 4, tenant_id=tenant).to_fields())
        await client.xreadgroup(keys.WORKER_GROUP, "dead-worker", {stream: ">"}, count=1)
        intake = Intake(client, model, "live-worker")
        journal = Journal(client, ttl_s=60)
        reclaimer = Reclaimer(client, intake, journal, "live-worker", 0.5, is_own=lambda _: False)
        await asyncio.sleep(0.6)  # the entry is idle past the heartbeat timeout
        assert not await recovery.is_broker_settled(client, 0.5)
        assert await reclaimer.reclaim() == []
        assert (await client.xpending(stream, keys.WORKER_GROUP))["pending"] == 1
        await asyncio.sleep(2.2)  # up for more than two heartbeat timeouts
        assert await recovery.is_broker_settled(client, 0.5)
        [served] = await reclaimer.reclaim()  # not started: served by the live worker
        assert served.request.request_id == "r0"
    finally:
        await client.aclose()
        server.stop()


async def test_an_end_its_dead_worker_claimed_and_never_completed_is_completed(tmp_path):
    # Killed between claiming the end and appending the last event: before, the entry was
    # acknowledged as ended and the stream waited for an event nobody would append.
    server = EmbeddedRedis(tmp_path / "redis", port=free_port()).start()
    client = aioredis.Redis.from_url(server.url)
    try:
        model, tenant = "claimed-model", "claimed-tenant"
        stream = keys.tenant_stream(model, tenant)
        await client.sadd(keys.model_tenants(model), tenant)
        await client.xgroup_create(stream, keys.WORKER_GROUP, id="0", mkstream=True)
        await client.xadd(stream, make_request(0, [1, 2], 4, tenant_id=tenant).to_fields())
        await client.xreadgroup(keys.WORKER_GROUP, "dead-worker", {stream: ">"}, count=1)
        journal = Journal(client, ttl_s=60)
        assert await journal.append("r0", TokenEvent(seq=0, text="a", num_tokens=1))
        assert await journal.claim_end("r0", "dead-worker")
        intake = Intake(client, model, "live-worker")
        reclaimer = Reclaimer(client, intake, journal, "live-worker", 0.5, is_own=lambda _: False)
        await asyncio.sleep(2.2)  # the broker settled, the entry and the claim idle
        assert await reclaimer.reclaim() == []
        events = await journal.read_after("r0", -1)
        assert [e.type for e in events] == ["token", "error"]
        assert events[-1].code is ErrorCode.WORKER_LOST
        assert (await client.xpending(stream, keys.WORKER_GROUP))["pending"] == 0
    finally:
        await client.aclose()
        server.stop()
