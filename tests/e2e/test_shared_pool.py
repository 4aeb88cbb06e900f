"""The shared pool: two models with a dedicated worker each and one shared worker. A spike
on model A moves the shared worker from B to A (assigned by the control process), it serves
A's backlog beside A's dedicated worker, and every request of both models ends once, with
exact usage. A Redis, API, control process and workers of this test's own (the session's
control process would assign the shared worker too).

Every worker steps at most every 100 ms (`LLMFLEET_FAULT_STEP_DELAY_MS`), two sequences in
its batch: A's 30 requests of 16 tokens take its dedicated worker alone 24 s."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import redis

from shared import deployments, keys, pool_assignments
from tests.conftest import _spawn, _stop
from tests.helpers import auth, wait_for_usage_record

NUM_SPIKE_REQUESTS = 30
MAX_TOKENS = 16
MOVE_TIMEOUT_S = 20.0


def _heartbeat_of(client: redis.Redis, process) -> dict[str, str]:
    for key in client.scan_iter(keys.worker_heartbeat_pattern()):
        fields = {k.decode(): v.decode() for k, v in client.hgetall(key).items()}
        if fields.get("pid") == str(process.pid):
            return fields | {"worker_id": key.decode().removeprefix(keys.worker_heartbeat(""))}
    return {}


def _wait_serving(client: redis.Redis, process, model: str, timeout_s: float) -> dict[str, str]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert process.poll() is None, "a worker exited"
        beat = _heartbeat_of(client, process)
        if beat.get("model") == model and beat.get("state") == "ready":
            return beat
        time.sleep(0.1)
    raise AssertionError(f"no worker ready for {model} in {timeout_s} s: {beat}")


def test_a_spike_on_one_model_moves_the_shared_worker_to_it_and_loses_nothing(
    env, home, own_redis, start_api, tiny_model_dir, make_tenant, db
):
    model_a, model_b = "pool-spike-a", "pool-spike-b"
    for model in (model_a, model_b):
        deployments.register(db, model, str(tiny_model_dir))
    own_env = env | {"REDIS_URL": own_redis.url}
    api = start_api({"REDIS_URL": own_redis.url})
    control_env = own_env | {"LLMFLEET_POOL_MIN_DWELL_S": "1", "LLMFLEET_POOL_TICK_S": "0.5"}
    worker_env = own_env | {"LLMFLEET_FAULT_STEP_DELAY_MS": "100"}
    engine_args = ["--max-num-seqs", "2", "--kv-cache-gb", "0.01", "--dtype", "float32",
                   "--metrics-port", "0"]  # fmt: skip
    processes = [_spawn(["control"], control_env, home / "control-pool.log")]
    try:
        dedicated_a, dedicated_b, shared = (
            _spawn(["worker", *args, *engine_args], worker_env, home / f"worker-{name}.log")
            for name, args in [
                ("pool-a", ["--model", model_a]),
                ("pool-b", ["--model", model_b]),
                ("pool-shared", ["--pool", "shared", "--models", f"{model_b},{model_a}"]),
            ]
        )
        processes += [dedicated_a, dedicated_b, shared]
        client = redis.Redis.from_url(own_redis.url)
        _wait_serving(client, dedicated_a, model_a, 120)
        _wait_serving(client, dedicated_b, model_b, 120)
        before = _wait_serving(client, shared, model_b, 120)  # its first model
        assert before["pool"] == "shared" and before["pool_models"] == f"{model_b},{model_a}"

        _tenant_id, key = make_tenant("pool-spike")
        body = {"prompt": "go", "max_tokens": MAX_TOKENS, "ignore_eos": True}

        def complete(model: str) -> httpx.Response:
            return httpx.post(
                f"{api.url}/v1/completions",
                json={**body, "model": model},
                headers=auth(key),
                timeout=180,
            )

        with ThreadPoolExecutor(NUM_SPIKE_REQUESTS + 2) as pool:
            spike = [pool.submit(complete, model_a) for _ in range(NUM_SPIKE_REQUESTS)]
            steady = [pool.submit(complete, model_b) for _ in range(2)]
            moved = _wait_serving(client, shared, model_a, MOVE_TIMEOUT_S)
            assignment = pool_assignments.Assignment.decode(
                client.hget(keys.POOL_ASSIGNMENTS, moved["worker_id"])
            )
            assert assignment.model == model_a
            answers = [f.result() for f in spike], [f.result() for f in steady]

        ended_by_shared = 0
        for answer in [*answers[0], *answers[1]]:
            assert answer.status_code == 200, answer.text
            request_id = answer.headers["x-request-id"]
            assert answer.json()["usage"]["completion_tokens"] == MAX_TOKENS
            assert answer.json()["choices"][0]["finish_reason"] == "length"
            record = wait_for_usage_record(db, request_id)
            assert record.output_tokens == MAX_TOKENS
            ended_by_shared += client.get(keys.request_done(request_id)) == (
                moved["worker_id"].encode()
            )
        # It served a share of A's backlog (A's dedicated worker alone would take 24 s).
        assert ended_by_shared >= 4, ended_by_shared
        for process in (dedicated_a, dedicated_b, shared, processes[0]):
            assert process.poll() is None
    finally:
        for process in processes:
            _stop(process)
