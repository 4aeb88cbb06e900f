"""`llmfleet up` on embedded defaults: its own redis-server on a unix socket, SQLite, the
workers; what it does when one of its processes dies, and how it stops. (kill -9 of its only
worker under load: tests/chaos/test_up_worker_kill.py.)"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
import redis

from cli.redis_server import free_port
from shared import keys
from shared.supervised import ProcessState
from tests.helpers import UpProcess, auth, get_usage, llmfleet, stream

RESTART_TIMEOUT_S = 120.0


@pytest.fixture
def up_env(tmp_path, tiny_model_dir):
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "DATABASE_URL")}
    env.update(LLMFLEET_HOME_DIR=str(tmp_path / "home"), LLMFLEET_API_PORT=str(free_port()))
    env.pop("LLMFLEET_KEY_PEPPER", None)  # exercise the generated development pepper
    added = subprocess.run(
        [
            sys.executable,
            "-m",
            "cli",
            "model",
            "add",
            "tiny",
            "--source",
            str(tiny_model_dir),
        ],
        env=env,
        capture_output=True,
        timeout=120,
    )
    assert added.returncode == 0, added.stderr
    return env


def test_up_starts_everything_and_stops_cleanly(up_env, tmp_path):
    up = UpProcess.start(up_env, tmp_path / "up.out", "--model", "tiny")
    try:
        up.wait_until_up()
        result = stream(
            up.url, "/v1/completions", up.key, {"model": "tiny", "prompt": "hi", "max_tokens": 4}
        )
        assert result.has_done and result.chunks
        # The control process is up too: the request's usage reaches the ledger.
        request_id = result.headers["x-request-id"]
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            usage = httpx.get(f"{up.url}/v1/requests/{request_id}/usage", headers=auth(up.key))
            if usage.status_code == 200:
                break
            time.sleep(0.2)
        assert usage.status_code == 200, usage.text
        assert (tmp_path / "home" / "redis" / "appendonly.aof").exists()
    finally:
        up.stop(signal.SIGINT)
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{up.url}/healthz", timeout=2)
    assert not (tmp_path / "home" / "redis" / "redis.sock").exists()


def test_up_with_roles_runs_the_model_disaggregated(up_env, tmp_path):
    """`--roles prefill,decode`: a prefill and a decode worker; a request's first token comes
    from the one, the rest from the other, and the client sees one whole stream."""
    up = UpProcess.start(
        up_env, tmp_path / "up.out", "--model", "tiny", "--roles", "prefill,decode"
    )
    client = redis.Redis(unix_socket_path=str(tmp_path / "home" / "redis" / "redis.sock"))
    try:
        up.wait_until_up()
        deadline = time.monotonic() + 30  # the prefill worker reads the decode worker's room
        while not client.zcard(keys.decode_workers("tiny@1")):
            assert time.monotonic() < deadline, up.output
            time.sleep(0.1)
        time.sleep(1.0)
        body = {"model": "tiny", "prompt": "hello there", "max_tokens": 8, "ignore_eos": True}
        result = stream(up.url, "/v1/completions", up.key, body)
        assert result.has_done
        request_id = result.headers["x-request-id"]
        usage = get_usage(up.url, up.key, request_id)
        assert usage.status_code == 200, usage.text
        assert usage.json()["output_tokens"] == 8  # the decode worker's, whole
        record = client.hgetall(keys.handoff(request_id))
        assert record[b"state"] == b"accepted" and int(record[b"bytes"]) > 0
        roles = {client.hget(key, "role") for key in client.scan_iter(keys.worker_heartbeat("*"))}
        assert roles == {b"prefill", b"decode"}
    finally:
        client.close()
        up.stop(signal.SIGINT)


def _processes(home) -> dict[str, ProcessState]:
    """What `up` publishes about its children, from its embedded Redis (nothing while that
    is down)."""
    client = redis.Redis(unix_socket_path=str(home / "redis" / "redis.sock"))
    try:
        return {
            text.decode(): ProcessState.from_json(value)
            for text, value in client.hgetall(keys.SUPERVISED_PROCESSES).items()
        }
    except redis.ConnectionError:
        return {}
    finally:
        client.close()


def _is_restarted(state: ProcessState | None, old_pid: int) -> bool:
    return state is not None and state.state == "running" and state.pid not in (None, old_pid)


def _wait_restarted(home, names: list[str], old_pids: dict[str, int]) -> dict[str, ProcessState]:
    deadline = time.monotonic() + RESTART_TIMEOUT_S
    while True:
        states = _processes(home)
        if all(_is_restarted(states.get(name), old_pids[name]) for name in names):
            return states
        assert time.monotonic() < deadline, states
        time.sleep(0.3)


def _wait_healthy(url: str) -> None:
    deadline = time.monotonic() + RESTART_TIMEOUT_S
    while True:
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                return
        assert time.monotonic() < deadline, "the restarted API never answered"
        time.sleep(0.3)


def _wait_served(up: UpProcess, body: dict) -> None:
    """A request streams to its end (the API answers 503 while the broker is away)."""
    deadline = time.monotonic() + RESTART_TIMEOUT_S
    while True:
        result = stream(up.url, "/v1/completions", up.key, body)
        if result.has_done and result.finish_reasons[-1:] == ["length"]:
            return
        assert time.monotonic() < deadline, f"nothing was served after the restart: {result}"
        time.sleep(0.5)


def _free_ports(num_ports: int) -> int:
    """The first of `num_ports` consecutive ports that are free now."""
    while True:
        first = free_port()
        with contextlib.ExitStack() as held:
            try:
                for port in range(first, first + num_ports):
                    held.enter_context(socket.create_server(("127.0.0.1", port)))
            except OSError:
                continue
        return first


def _is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_up_restarts_what_dies_and_sigterm_stops_everything(up_env, tmp_path):
    home = tmp_path / "home"
    first_port = _free_ports(2)
    up = UpProcess.start(
        up_env, tmp_path / "up.out", "--model", "tiny", "--workers", "2",
        "--worker-metrics-port", str(first_port),
        "--", "--kv-cache-gb", "0.01", "--dtype", "float32",
    )  # fmt: skip
    try:
        up.wait_until_up()
        # Two workers, each with its own metrics port, shown.
        for i in range(2):
            assert f"worker-{i} (metrics http://127.0.0.1:{first_port + i}/metrics)" in up.output
            assert httpx.get(f"http://127.0.0.1:{first_port + i}/metrics").status_code == 200
        before = _processes(home)
        assert set(before) == {"redis", "api", "control", "worker-0", "worker-1"}
        assert all(s.state == "running" and s.num_restarts == 0 for s in before.values())
        old_pids = {name: s.pid for name, s in before.items()}
        os.kill(old_pids["worker-1"], signal.SIGKILL)
        os.kill(old_pids["api"], signal.SIGKILL)

        after = _wait_restarted(home, ["worker-1", "api"], old_pids)
        assert up.process.poll() is None, up.output  # the platform stays up
        for name in ("worker-1", "api"):
            assert (after[name].num_restarts, after[name].last_exit) == (1, "signal SIGKILL")
        for name in ("redis", "control", "worker-0"):
            assert (after[name].pid, after[name].num_restarts) == (old_pids[name], 0)
        up_log = (home / "logs" / "up.log").read_text()
        assert f"worker-1 (pid {old_pids['worker-1']}) exited: signal SIGKILL" in up_log
        assert f"api (pid {old_pids['api']}) exited: signal SIGKILL" in up_log
        assert f"worker-1 (pid {old_pids['worker-1']}) exited: signal SIGKILL" in up.output
        # The restarted API serves (the workers' restart is proven under load in the chaos
        # suite); `llmfleet status` shows the restarts.
        _wait_healthy(up.url)
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 4}
        assert stream(up.url, "/v1/completions", up.key, body).has_done
        status = llmfleet(up_env, "status")
        assert status.returncode == 0, status.stderr
        row = next(line for line in status.stdout.splitlines() if "│ worker-1 " in line)
        cells = row.replace("│", " ").split()
        assert cells[:5] == ["worker-1", "running", str(after["worker-1"].pid), "1", "signal"]
        # The embedded Redis too: started again on its append-only file; serving goes on.
        os.kill(after["redis"].pid, signal.SIGKILL)
        after = _wait_restarted(home, ["redis"], {"redis": after["redis"].pid})
        assert after["redis"].last_exit == "signal SIGKILL"
        _wait_served(up, body)
    finally:
        exit_code = up.stop(signal.SIGTERM)
    assert exit_code == 0, up.output
    latest = {**old_pids, **{n: s.pid for n, s in after.items() if s.pid is not None}}
    assert [name for name, pid in latest.items() if _is_alive(pid)] == []
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{up.url}/healthz", timeout=2)
    assert not (home / "redis" / "redis.sock").exists()
