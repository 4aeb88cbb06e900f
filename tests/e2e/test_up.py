"""`llmfleet up` on embedded defaults: its own redis-server on a unix socket, SQLite, a worker."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest

from cli.redis_server import free_port
from tests.helpers import auth, stream


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
    out_path = tmp_path / "up.out"
    with out_path.open("wb") as out:
        up = subprocess.Popen(
            [sys.executable, "-m", "cli", "up", "--model", "tiny"],
            env=up_env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 180
        while "llmfleet is up" not in out_path.read_text() and time.monotonic() < deadline:
            assert up.poll() is None, out_path.read_text()
            time.sleep(0.2)
        text = out_path.read_text()
        url = re.search(r"llmfleet is up at (\S+)", text).group(1)
        key = re.search(r"development API key: (lf-\S+)", text).group(1)
        result = stream(
            url, "/v1/completions", key, {"model": "tiny", "prompt": "hi", "max_tokens": 4}
        )
        assert result.has_done and result.chunks
        # The control process is up too: the request's usage reaches the ledger.
        request_id = result.headers["x-request-id"]
        while time.monotonic() < deadline:
            usage = httpx.get(f"{url}/v1/requests/{request_id}/usage", headers=auth(key))
            if usage.status_code == 200:
                break
            time.sleep(0.2)
        assert usage.status_code == 200, usage.text
        assert (tmp_path / "home" / "redis" / "appendonly.aof").exists()
    finally:
        up.send_signal(signal.SIGINT)
        up.wait(60)
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{url}/healthz", timeout=2)
    assert not (tmp_path / "home" / "redis" / "redis.sock").exists()
