"""A platform of its own for one chaos scenario: an embedded Redis on a free port, SQLite in a
temporary home, two API processes and two workers for the tiny model, three tenants.

Every process is a real `llmfleet` process, so a fault is a real signal: SIGKILL, SIGTERM,
SIGSTOP/SIGCONT, a Redis killed and restarted on its append-only file, a write lock held on
the database.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import redis

from cli.redis_server import EmbeddedRedis, free_port
from shared import deployments, keys, tenants
from shared.db import create_schema, make_engine
from shared.settings import Settings
from tests.chaos.proxy import CuttingProxy
from tests.conftest import _spawn, _stop, _wait_ready, spawn_api

MODEL = "tiny-chaos"
NUM_TENANTS = 3
PEPPER = "chaos-pepper"
ADMIN_KEY = "chaos-admin-key-0123456789"
LEDGER_SECRET = "chaos-ledger-secret-0123456789"
# Workers are found dead within 2 s (the test setting).
FAST_HEARTBEAT = {"LLMFLEET_WORKER_HEARTBEAT_S": "0.5", "LLMFLEET_WORKER_HEARTBEAT_TIMEOUT_S": "2"}
# The tiny model's KV cache takes 512 bytes per token: a pool of 8,192 tokens per worker.
KV_CACHE_GB = 8192 * 512 / 2**30
WORKER_ARGS = (
    "--dtype", "float32",
    "--metrics-port", "0",
    "--max-num-seqs", "16",
    "--max-num-batched-tokens", "256",
    "--kv-cache-gb", str(KV_CACHE_GB),
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class TenantKey:
    tenant_id: str
    name: str
    key: str


@dataclass
class Stack:
    """The processes of one scenario; `start()` brings them up, `stop()` takes them down."""

    root: Path
    model_dir: Path
    extra_env: dict[str, str] = field(default_factory=dict)  # for every process
    # Workers reach Redis through a proxy that can cut their connections (`cut_workers_off`).
    workers_via_proxy: bool = False
    # The workers' roles (`llmfleet worker --role`): two `both`, or a prefill and a decode
    # worker (disaggregation); with `kv_via_proxy` prefill workers reach the decode
    # worker's KV endpoint through a proxy that can cut the link (`kv_proxy`).
    worker_roles: tuple[str, ...] = ("both", "both")
    kv_via_proxy: bool = False
    kv_proxy: CuttingProxy | None = None
    roles: dict[int, str] = field(default_factory=dict)  # worker pid -> its role
    num_subscribers_dropped: int = 0
    held_by_killed: set[str] = field(default_factory=set)  # requests the killed worker held
    in_transfer_at_kill: set[str] = field(default_factory=set)  # hand-offs offered, unanswered
    api_urls: list[str] = field(default_factory=list)
    apis: list[subprocess.Popen] = field(default_factory=list)
    control: subprocess.Popen | None = None
    workers: list[subprocess.Popen] = field(default_factory=list)
    tenants: list[TenantKey] = field(default_factory=list)
    redis_server: EmbeddedRedis | None = None
    proxy: CuttingProxy | None = None
    _db_lock: sqlite3.Connection | None = None

    @property
    def home(self) -> Path:
        return self.root / "home"

    @property
    def db_path(self) -> Path:
        return self.home / "llmfleet.db"

    @property
    def env(self) -> dict[str, str]:
        assert self.redis_server is not None
        base = {k: v for k, v in os.environ.items() if not k.startswith("LLMFLEET_")}
        base.pop("DATABASE_URL", None)
        return base | {
            "REDIS_URL": self.redis_server.url,
            "LLMFLEET_HOME_DIR": str(self.home),
            "LLMFLEET_KEY_PEPPER": PEPPER,
            "LLMFLEET_ADMIN_KEY": ADMIN_KEY,
            "LLMFLEET_LEDGER_SECRET": LEDGER_SECRET,
            "LLMFLEET_WORKER_IDLE_POLL_MS": "50",
            "LLMFLEET_LOG_LEVEL": "INFO",
            "OMP_NUM_THREADS": "1",  # two workers share two cores: no OpenMP spinning
            **FAST_HEARTBEAT,
            **self.extra_env,
        }

    def start(self) -> Stack:
        self.home.mkdir(parents=True, exist_ok=True)
        self.redis_server = EmbeddedRedis(self.root / "redis", port=free_port()).start()
        if self.workers_via_proxy:
            self.proxy = CuttingProxy(self.redis_server.port)
        settings = Settings(home_dir=self.home, key_pepper=PEPPER)
        db = make_engine(settings)
        try:
            create_schema(db)
            deployments.register(db, MODEL, str(self.model_dir))
            for i in range(NUM_TENANTS):
                tenant = tenants.create_tenant(db, f"chaos-{i}")
                key = tenants.create_key(db, tenant.id, settings.pepper)
                self.tenants.append(TenantKey(tenant.id, tenant.name, key))
        finally:
            db.dispose()
        # The control process writes usage to SQL; jobs wait in Redis until it is up.
        self.control = _spawn(["control"], self.env, self.home / "control.log")
        # Four processes at once: on two cores their imports overlap with each other.
        with ThreadPoolExecutor(4) as pool:
            apis = [pool.submit(spawn_api, self.env, self.home) for _ in range(2)]
            workers = [pool.submit(self.start_worker, role) for role in self.worker_roles]
            for api in apis:
                self.api_urls.append(api.result().url)
                self.apis.append(api.result().process)
            for worker in workers:
                worker.result()
        return self

    def start_worker(self, role: str = "both") -> subprocess.Popen:
        """Another worker process of `role`, once its heartbeat says ready."""
        log_path = self.home / f"worker-{time.monotonic_ns()}.log"
        args = ["worker", "--model", MODEL, *WORKER_ARGS, "--role", role]
        if role == "decode" and self.kv_via_proxy:
            port = free_port()
            if self.kv_proxy is not None:
                self.kv_proxy.close()
            self.kv_proxy = CuttingProxy(port)
            args += ["--kv-port", str(port), "--kv-advertise", self.kv_proxy.url_of("tcp")]
        env = self.env | ({"REDIS_URL": self.proxy.url} if self.proxy else {})
        process = _spawn(args, env, log_path)
        self.workers.append(process)
        self.roles[process.pid] = role
        _wait_ready(self.redis_server.url, process, log_path)
        return process

    def live_worker(self, role: str) -> subprocess.Popen:
        """The live worker process of `role` (the first, if several)."""
        return next(w for w in self.live_workers() if self.roles[w.pid] == role)

    def live_workers(self) -> list[subprocess.Popen]:
        return [w for w in self.workers if w.poll() is None]

    def crashed(self) -> list[str]:
        """The processes that exited with an error of their own (not killed by a signal, not
        stopped by SIGTERM)."""
        processes = [*self.apis, *self.workers, *([self.control] if self.control else [])]
        return [f"{p.args[3]} (pid {p.pid}): exit {p.returncode}"
                for p in processes if p.poll() is not None and p.returncode > 0]  # fmt: skip

    def redis(self) -> redis.Redis:
        assert self.redis_server is not None
        return redis.Redis.from_url(self.redis_server.url)

    def restart_redis(self, down_s: float) -> None:
        """kill -9 the broker, then start it again on the same port and data directory."""
        assert self.redis_server is not None and self.redis_server._process is not None
        self.redis_server._process.kill()
        self.redis_server._process.wait()
        time.sleep(down_s)
        self.redis_server.start()

    def owner_of(self, r: redis.Redis, request_ids: list[str]) -> subprocess.Popen:
        """The live worker process serving the first of `request_ids` that one serves (a
        worker id holds its process id: `{host}-{pid}-{suffix}`)."""
        by_pid = {process.pid: process for process in self.live_workers()}
        for request_id in request_ids:
            owner = r.hget(keys.request_meta(request_id), "owner")
            if owner is not None and (pid := int(owner.decode().split("-")[-2])) in by_pid:
                return by_pid[pid]
        raise AssertionError("no live worker serves these requests")

    def requests_owned_by(self, r: redis.Redis, pid: int) -> set[str]:
        """Every request whose owner is the worker process `pid` (its id holds the pid), and
        every one a decode worker `pid` accepted from a prefill worker (it records itself as
        the owner a moment after it accepts: stopped in between, it holds the request)."""
        owned = set()
        for key in r.scan_iter(keys.request_meta("*"), _type="hash"):
            owner = r.hget(key, "owner")
            if owner is not None and int(owner.decode().split("-")[-2]) == pid:
                owned.add(key.decode().removeprefix(keys.request_meta("")))
        for key in r.scan_iter(keys.handoff("*"), _type="hash"):
            receiver, state = r.hmget(key, "receiver", "state")
            if state == b"accepted" and int(receiver.decode().split("-")[-2]) == pid:
                owned.add(key.decode().removeprefix(keys.handoff("")))
        return owned

    def offered_hand_offs(self, r: redis.Redis) -> set[str]:
        """Requests whose hand-off is offered and not yet accepted or withdrawn: in transfer."""
        return {
            key.decode().removeprefix(keys.handoff(""))
            for key in r.scan_iter(keys.handoff("*"), _type="hash")
            if r.hget(key, "state") == b"offered"
        }

    def num_handed_off(self) -> int:
        """Requests a decode worker accepted from a prefill worker (`shared/handoff.py`)."""
        with self.redis() as r:
            return sum(
                r.hget(key, "state") == b"accepted"
                for key in r.scan_iter(keys.handoff("*"), _type="hash")
            )

    def lock_database(self) -> None:
        """Hold SQLite's write lock: every writer waits (busy timeout) until `unlock_database`."""
        # The lock is taken and released from different threads (the fault runs in one).
        self._db_lock = sqlite3.connect(
            self.db_path, isolation_level=None, timeout=30, check_same_thread=False
        )
        self._db_lock.execute("BEGIN EXCLUSIVE")

    def unlock_database(self) -> None:
        assert self._db_lock is not None
        self._db_lock.execute("ROLLBACK")
        self._db_lock.close()
        self._db_lock = None

    def log_lines(self, request_id: str, max_lines: int = 12) -> list[str]:
        """What the processes logged about one request (for a failure's message)."""
        lines = []
        for path in sorted(self.home.glob("*.log")):
            for line in path.read_text(errors="replace").splitlines():
                if request_id in line:
                    lines.append(f"{path.name}: {line[:300]}")
        return lines[-max_lines:]

    def log_count(self, process: str, text: str) -> int:
        """How many lines of a process's logs (`api`, `worker`, `control`) hold `text`."""
        paths = self.home.glob(f"{process}*.log")
        return sum(
            line.count(text)
            for path in paths
            for line in path.read_text(errors="replace").splitlines()
        )

    def tenant_streams(self) -> list[str]:
        return [keys.tenant_stream(f"{MODEL}@1", t.tenant_id) for t in self.tenants]

    def stop(self) -> None:
        if self._db_lock is not None:
            self.unlock_database()
        processes = [*self.apis, *self.workers, *([self.control] if self.control else [])]
        for process in processes:
            if process.poll() is None:
                process.send_signal(signal.SIGCONT)  # a paused process cannot take SIGTERM
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(_stop, processes))
        for proxy in (self.proxy, self.kv_proxy):
            if proxy is not None:
                proxy.close()
        if self.redis_server is not None:
            self.redis_server.stop()
