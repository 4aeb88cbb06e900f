"""The broker restarts (kill -9, then start again on its append-only file): accepted requests
survive, and the API and the worker reconnect with backoff and carry on. A Redis, API and
worker of this test's own, so the session's servers are not disturbed."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import redis
import redis.asyncio as aioredis

from cli.redis_server import EmbeddedRedis, free_port
from shared import keys, recovery, redis_conn
from shared.journal import Journal
from tests.conftest import _spawn, _stop
from tests.factories import make_request
from tests.helpers import auth
from worker.intake import Intake
from worker.recovery import Reclaimer

NUM_REQUESTS = 4


def _wait_worker_ready(url: str, timeout_s: float = 120) -> None:
    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            for key in client.scan_iter(keys.worker_heartbeat_pattern()):
                if client.hget(key, "state") == b"ready":
                    return
            time.sleep(0.1)
        raise AssertionError("worker not ready")
    finally:
        client.close()


def test_queued_requests_survive_a_broker_restart(
    env, home, tmp_path, start_api, tiny_deployment, make_tenant
):
    tenant_id, key = make_tenant("restart")
    server = EmbeddedRedis(tmp_path / "redis", port=free_port()).start()
    own_env = env | {"REDIS_URL": server.url}
    worker = None
    try:
        url = start_api({"REDIS_URL": server.url}).url
        body = {"model": tiny_deployment.model_id, "prompt": "go", "max_tokens": 16}
        with ThreadPoolExecutor(NUM_REQUESTS) as pool:
            answers = [
                pool.submit(
                    httpx.post, f"{url}/v1/completions", json=body, headers=auth(key), timeout=120
                )
                for _ in range(NUM_REQUESTS)
            ]
            client = redis.Redis.from_url(server.url)
            stream = keys.tenant_stream(tiny_deployment.model_id, tenant_id)
            deadline = time.monotonic() + 30
            while client.xlen(stream) < NUM_REQUESTS:  # accepted and queued: no worker yet
                assert time.monotonic() < deadline
                time.sleep(0.05)
            client.close()
            time.sleep(1.5)  # the append-only file is fsynced every second
            server._process.kill()  # kill -9
            server._process.wait()
            server.start()  # same port, same directory: it replays the append-only file
            worker = _spawn(
                ["worker", "--model", tiny_deployment.model_id, "--dtype", "float32"],
                own_env,
                home / "worker-restart.log",
            )
            _wait_worker_ready(server.url)
            responses = [a.result(timeout=120) for a in answers]
        assert [r.status_code for r in responses] == [200] * NUM_REQUESTS, responses[0].text
        assert all(r.json()["usage"]["completion_tokens"] == 16 for r in responses)
    finally:
        if worker is not None:
            _stop(worker)
        server.stop()


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
