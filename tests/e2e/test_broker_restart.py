"""The broker restarts (kill -9, then start again on its append-only file): accepted requests
survive, and the API and the worker reconnect with backoff and carry on. A Redis, API and
worker of this test's own, so the session's servers are not disturbed."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import redis

from cli.redis_server import EmbeddedRedis, free_port
from shared import keys
from tests.conftest import _spawn, _stop
from tests.helpers import auth

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
        # every request its 16 tokens: sampled from the random-weight model, an end-of-sequence
        # token could end one early whatever the broker did (a CI run on an AVX2-only host
        # saw a request end short once, not again in 4 runs alone)
        body = {
            "model": tiny_deployment.model_id,
            "prompt": "go",
            "max_tokens": 16,
            "ignore_eos": True,
        }
        with ThreadPoolExecutor(NUM_REQUESTS) as pool:
            answers = [
                pool.submit(
                    httpx.post, f"{url}/v1/completions", json=body, headers=auth(key), timeout=120
                )
                for _ in range(NUM_REQUESTS)
            ]
            client = redis.Redis.from_url(server.url)
            stream = keys.tenant_stream(tiny_deployment.name, tenant_id)
            deadline = time.monotonic() + 30
            # Every write is fsynced before Redis answers it: nothing acknowledged is lost
            # however soon the kill comes, so it comes straight after the last write.
            assert client.config_get("appendonly") == {"appendonly": "yes"}
            assert client.config_get("appendfsync") == {"appendfsync": "always"}
            while client.xlen(stream) < NUM_REQUESTS:  # accepted and queued: no worker yet
                assert time.monotonic() < deadline
                time.sleep(0.01)
            server._process.kill()  # kill -9
            client.close()
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
