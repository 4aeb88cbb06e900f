"""kill -9 of the only worker under `llmfleet up`, with its batch full and more waiting.

The platform a new user runs: `llmfleet up` with one worker (at most 24 sequences), the
embedded Redis, SQLite. 24 streams run and 8 more wait in the queue when the worker is
killed. Every running stream must end with an error event (`worker_lost`) and `[DONE]`
within the heartbeat timeout plus 5 s, none cut; `up` must start the worker again, and the
restarted worker must serve the waiting requests (the ones still in the stream, and any the
dead worker had pulled but not started, which it reclaims). Every request ends exactly once,
its events the journal's, with one usage record, and nothing stays pending: the chaos
suite's checks (`tests/chaos/checks.py`).
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time

import pytest
import redis

from cli.redis_server import free_port
from shared import keys
from shared.supervised import ProcessState
from tests.chaos import checks
from tests.chaos.client import LoadClient, RequestSpec
from tests.chaos.harness import MODEL, TenantKey
from tests.helpers import UpProcess, llmfleet, wait_pending_drained

NUM_RUNNING = 24  # the worker's --max-num-seqs: its batch is full
NUM_QUEUED = 8
RUNNING_MAX_TOKENS = 900  # still running when the kill comes (the tiny model's context: 1,024)
HEARTBEAT_TIMEOUT_S = 2.0
END_BOUND_S = HEARTBEAT_TIMEOUT_S + 5.0  # the target
RESTART_TIMEOUT_S = 120.0
START_TIMEOUT_S = 120.0
USAGE_WAIT_TIMEOUT_S = 30.0


@pytest.fixture
def up_platform(tmp_path, chaos_model_dir):
    """`llmfleet up` in a home of its own, serving the tiny model with one worker, and a
    second tenant beside its development one, of a lower tier (the development tenant's is
    1), so its requests wait behind the full batch instead of displacing some of it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMFLEET_")}
    env.pop("REDIS_URL", None)
    env.pop("DATABASE_URL", None)
    env |= {
        "LLMFLEET_HOME_DIR": str(tmp_path / "home"),
        "LLMFLEET_API_PORT": str(free_port()),
        "LLMFLEET_WORKER_HEARTBEAT_S": "0.5",
        "LLMFLEET_WORKER_HEARTBEAT_TIMEOUT_S": str(HEARTBEAT_TIMEOUT_S),
        "LLMFLEET_WORKER_IDLE_POLL_MS": "50",
        "OMP_NUM_THREADS": "1",  # the worker leaves a core to the API and the client
    }
    added = llmfleet(env, "model", "add", MODEL, "--source", str(chaos_model_dir))
    assert added.returncode == 0, added.stderr
    created = llmfleet(env, "tenant", "create", "other", "--tier", "0")
    assert created.returncode == 0, created.stderr
    other_key = re.search(r"api key \(shown once\): (\S+)", created.stdout).group(1)  # type: ignore[union-attr]
    up = UpProcess.start(
        env, tmp_path / "up.out", "--model", MODEL, "--worker-metrics-port", "0",
        "--", "--dtype", "float32", "--max-num-seqs", str(NUM_RUNNING),
        "--max-num-batched-tokens", "256", "--kv-cache-gb", "0.05",
    )  # fmt: skip
    try:
        yield up.wait_until_up(), TenantKey("", "other", other_key)
    finally:
        up.stop(signal.SIGTERM)


def _redis(up: UpProcess) -> redis.Redis:
    home = up.out_path.parent / "home"
    return redis.Redis(unix_socket_path=str(home / "redis" / "redis.sock"))


def _worker(r: redis.Redis) -> ProcessState:
    return ProcessState.from_json(r.hget(keys.SUPERVISED_PROCESSES, "worker-0"))  # type: ignore[arg-type]


def _num_held_by(r: redis.Redis, pid: int) -> int:
    """Entries pending on the worker process `pid` (its consumer name holds the pid)."""
    num_held = 0
    for stream in r.scan_iter(keys.tenant_stream(f"{MODEL}@1", "*"), _type="stream"):
        for entry in r.xpending_range(stream, keys.WORKER_GROUP, "-", "+", 1000):
            num_held += f"-{pid}-" in entry["consumer"].decode()
    return num_held


def _started(r: redis.Redis, request_ids: list[str]) -> set[str]:
    """The requests whose journal holds events: a worker started them."""
    return {rid for rid in request_ids if r.xlen(keys.request_events(rid))}


def _is_ready(r: redis.Redis, pid: int) -> bool:
    for key in r.scan_iter(keys.worker_heartbeat_pattern()):
        if r.hget(key, "pid") == str(pid).encode() and r.hget(key, "state") == b"ready":
            return True
    return False


async def _wait_until(predicate, timeout_s: float, what: str) -> float:
    """Seconds until `predicate()` held."""
    started_s = time.monotonic()
    while not await asyncio.to_thread(predicate):
        assert time.monotonic() - started_s < timeout_s, what
        await asyncio.sleep(0.05)
    return time.monotonic() - started_s


def _specs(dev: TenantKey, other: TenantKey) -> tuple[list[RequestSpec], list[RequestSpec]]:
    """The development tenant fills the batch; both tenants queue behind it. The worker
    pulls the other tenant's head while its batch is full (it would start at the next free
    place: `worker/intake.py`), so the restarted worker has a not-started entry of the dead
    one to reclaim and serve, besides the ones still in the streams."""
    running = [
        RequestSpec(i, dev, f"request {i}: tell me a story", RUNNING_MAX_TOKENS)
        for i in range(NUM_RUNNING)
    ]
    queued = [
        RequestSpec(i, (dev, other)[i % 2], f"request {i}: a short one", 16)
        for i in range(NUM_RUNNING, NUM_RUNNING + NUM_QUEUED)
    ]
    return running, queued


async def test_kill9_of_the_only_worker_under_up(up_platform, chaos_report):
    up, other = up_platform
    running_specs, queued_specs = _specs(TenantKey("", "dev", up.key), other)
    running_client = LoadClient([up.url], NUM_RUNNING)
    queued_client = LoadClient([up.url], NUM_QUEUED)
    started_s = time.monotonic()
    running_load = asyncio.create_task(running_client.run(running_specs))
    await _wait_until(
        lambda: running_client.num_streaming(2) == NUM_RUNNING, START_TIMEOUT_S,
        "the 24 streams never all got going",
    )  # fmt: skip
    queued_load = asyncio.create_task(queued_client.run(queued_specs))
    await _wait_until(
        lambda: all(log.request_id for log in queued_client.logs), START_TIMEOUT_S,
        "the queued requests were never admitted",
    )  # fmt: skip
    await asyncio.sleep(0.5)  # the worker pulls the heads it would start next meanwhile
    with _redis(up) as r:
        killed = _worker(r)
        assert killed.pid is not None
        # Stopped first, so that what it holds at the kill can be read: which queued
        # requests had started (none should: the other tenant's tier is lower, so it cannot
        # displace the batch), and how many entries it had pulled.
        os.kill(killed.pid, signal.SIGSTOP)
        assert running_client.num_streaming(2) == NUM_RUNNING  # all still mid-generation
        started = await asyncio.to_thread(
            _started, r, [log.request_id for log in queued_client.logs]
        )
        num_held = await asyncio.to_thread(_num_held_by, r, killed.pid)
        os.kill(killed.pid, signal.SIGKILL)
        killed_s = time.monotonic()
        restarted_ready = asyncio.create_task(
            _wait_until(
                lambda: (w := _worker(r)).pid not in (None, killed.pid) and _is_ready(r, w.pid),
                RESTART_TIMEOUT_S,
                "the worker was not started again",
            )
        )
        running_logs = await asyncio.wait_for(running_load, RESTART_TIMEOUT_S)
        ready_after_s = await restarted_ready
        queued_logs = await asyncio.wait_for(queued_load, RESTART_TIMEOUT_S)
        restarted = _worker(r)
        streams = [
            k.decode() for k in r.scan_iter(keys.tenant_stream(f"{MODEL}@1", "*"), _type="stream")
        ]
        pending = await asyncio.to_thread(wait_pending_drained, r, streams)
        logs = running_logs + queued_logs
        journals = {log.request_id: checks.journal(r, log.request_id) for log in logs}
    usage = await _wait_usage(up, [log.request_id for log in logs])
    states = [checks.final_state(log, (usage.get(log.request_id) or [None])[0]) for log in logs]
    chaos_report(checks.summary("up_worker_kill9", logs, states, time.monotonic() - started_s))

    problems = [f"pending entries left: {pending}"] if any(pending.values()) else []
    for log in logs:
        problems += checks.check_request(
            log, journals[log.request_id], usage.get(log.request_id, []), {"worker_lost"}
        )
    assert not problems, "\n".join(problems[:20])
    # Every running stream ended with worker_lost and [DONE] in time, on its own connection.
    ended_after_s = [log.ended_s - killed_s for log in running_logs if log.ended_s is not None]
    assert states[:NUM_RUNNING] == ["failed:worker_lost"] * NUM_RUNNING
    assert all(not log.num_resumes and not log.http_errors for log in logs)
    assert max(ended_after_s) <= END_BOUND_S, sorted(ended_after_s)
    # The restarted worker served every queued request that had not started, one the dead
    # worker had pulled among them (else the scenario missed the reclaim it is there to
    # show); one that had started ended like the running ones.
    expected = ["failed:worker_lost" if log.request_id in started else "completed"
                for log in queued_logs]  # fmt: skip
    assert states[NUM_RUNNING:] == expected
    num_held_waiting = num_held - NUM_RUNNING - len(started)
    assert num_held_waiting > 0, "the killed worker held no waiting request"
    assert (restarted.num_restarts, restarted.last_exit) == (1, "signal SIGKILL")
    assert up.process.poll() is None, up.output
    print(f"\nstreams ended {max(ended_after_s):.2f} s after the kill at the latest "
          f"(bound {END_BOUND_S:g} s); the worker was ready again {ready_after_s:.1f} s after "
          f"(up took {up.started_in_s:.1f} s to start); the killed worker held "
          f"{num_held_waiting} of the queued requests ({len(started)} had started)")  # fmt: skip


async def _wait_usage(up: UpProcess, request_ids: list[str]) -> dict[str, list[checks.UsageRow]]:
    db_path = up.out_path.parent / "home" / "llmfleet.db"
    deadline = time.monotonic() + USAGE_WAIT_TIMEOUT_S
    while True:
        usage = await asyncio.to_thread(checks.usage_rows, db_path)
        if all(rid in usage for rid in request_ids) or time.monotonic() > deadline:
            return usage
        await asyncio.sleep(0.2)
