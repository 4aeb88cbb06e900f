"""The broker runs out of memory (`maxmemory` reached, `noeviction`): new requests get 503
`broker_out_of_memory` with `Retry-After` and give back their admission, and nothing accepted
is lost: the requests already streaming wait while Redis refuses writes (their worker
retries its writes), then complete, each ended once. A Redis, API, worker and control
process of this test's own.

Redis stays out of memory for less than the heartbeat timeout: longer, and its workers look
dead (their heartbeats are writes too); docs/operations.md says what that does."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import redis

from shared import keys
from shared.protocol import FinalEvent, TokenEvent, decode_event
from tests.conftest import _spawn, _stop
from tests.helpers import StreamRead, assert_error, auth, read_stream, wait_for_usage_record

NUM_ACCEPTED = 4
MAX_TOKENS = 400
OUT_OF_MEMORY_S = 3.0


def _wait_worker_ready(client: redis.Redis, worker, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert worker.poll() is None, "the worker exited"
        for key in client.scan_iter(keys.worker_heartbeat_pattern()):
            if client.hget(key, "state") == b"ready":
                return
        time.sleep(0.1)
    raise AssertionError("worker not ready")


def _journal(client: redis.Redis, request_id: str) -> list:
    entries = client.xrange(keys.request_events(request_id))
    return [decode_event(fields[b"e"]) for _, fields in entries]


def test_out_of_memory_refuses_new_requests_and_loses_nothing_accepted(
    env, home, own_redis, start_api, tiny_deployment, make_tenant, db
):
    tenant_id, key = make_tenant("oom")
    # Heartbeats are writes too: a timeout far above the outage, so that no worker looks dead
    # (3 s of refused writes and two beat periods of 2 s each side came to 7 s: over 6).
    own_env = env | {"REDIS_URL": own_redis.url, "LLMFLEET_WORKER_HEARTBEAT_TIMEOUT_S": "30"}
    api = start_api({"REDIS_URL": own_redis.url, "LLMFLEET_WORKER_HEARTBEAT_TIMEOUT_S": "30"})
    control = _spawn(["control"], own_env, home / "control-oom.log")
    worker_args = ["worker", "--model", tiny_deployment.model_id, "--metrics-port", "0"]
    # One torch thread: fast on a loaded machine (see tests/e2e/test_slow_reader.py).
    worker = _spawn(
        [*worker_args, "--dtype", "float32", "--kv-cache-gb", "0.01"],
        own_env | {"OMP_NUM_THREADS": "1"},
        home / "worker-oom.log",
    )
    client = redis.Redis.from_url(own_redis.url)
    body = {
        "model": tiny_deployment.model_id,
        "prompt": "go",
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "stream": True,
    }
    reads = [StreamRead(start_after=5) for _ in range(NUM_ACCEPTED)]
    try:
        _wait_worker_ready(client, worker)
        with ThreadPoolExecutor(NUM_ACCEPTED) as pool:
            reading = [pool.submit(read_stream, api.url, key, body, read) for read in reads]
            for read in reads:
                assert read.started.wait(60), "a stream never got going"
            client.config_set("maxmemory", 1)  # far below what it uses: no write that adds
            for stream in (True, False):
                refused = httpx.post(
                    f"{api.url}/v1/completions",
                    json={**body, "stream": stream},
                    headers=auth(key),
                    timeout=60,
                )
                assert_error(refused, 503, "broker_out_of_memory")
                assert int(refused.headers["retry-after"]) >= 1
            # The refused gave their admission back: only the accepted hold slots.
            assert client.zcard(keys.tenant_inflight(tenant_id)) == NUM_ACCEPTED
            time.sleep(OUT_OF_MEMORY_S)
            num_ids_out_of_memory = [len(read.ids) for read in reads]
            client.config_set("maxmemory", 0)
            for future in reading:
                future.result(timeout=120)
        served = httpx.post(
            f"{api.url}/v1/completions",
            json={**body, "stream": False},
            headers=auth(key),
            timeout=60,
        )
        assert served.status_code == 200
        assert worker.poll() is None and control.poll() is None
    finally:
        client.config_set("maxmemory", 0)
        _stop(worker)
        _stop(control)
    for read, num_ids in zip(reads, num_ids_out_of_memory, strict=True):
        assert read.has_done and not read.errors and read.finish_reason == "length"
        assert num_ids < len(read.ids)  # it had more to come once Redis took writes again
        assert read.ids == sorted(set(read.ids))
        events = _journal(client, read.request_id)
        assert [type(e) for e in events] == [TokenEvent] * (len(events) - 1) + [FinalEvent]
        assert "".join(read.texts) == "".join(e.text for e in events)
        record = wait_for_usage_record(db, read.request_id, timeout_s=60)
        assert record.finish_reason == "length" and record.output_tokens == MAX_TOKENS
    client.close()
