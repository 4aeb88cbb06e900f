"""What the platform's processes hold and spend while `llmfleet bench --platform-load` runs,
sampled on a thread every `interval_s`: the API process's memory (RSS), CPU time, open file
descriptors, client connections and Redis connections; the worker's and redis-server's CPU
time; Redis's commands so far (`INFO commandstats`); and the worker's own inter-token
latencies (its latency window in Redis, `shared/latency_window.py`).

The API's Redis connections are counted twice: from its own sockets (psutil: TCP
connections to the Redis port) and as Redis sees them (`CLIENT LIST`, the entries whose
address is one of those sockets, by client name), so neither a socket Redis has already
dropped nor another process's client is counted. That needs Redis on TCP, as the bench runs
it: over a unix socket every client's address is the same.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

import psutil
import redis

from shared import keys
from shared.redis_conn import text


@dataclass(frozen=True, slots=True)
class Processes:
    api: psutil.Process
    api_port: int
    worker: psutil.Process
    redis_server: psutil.Process
    redis_port: int


@dataclass(frozen=True, slots=True)
class Sample:
    at_s: float  # time.perf_counter()
    api_rss_bytes: int
    api_cpu_s: float  # user + system since the process started
    api_fds: int
    num_client_connections: int  # established on the API's port: the streams it holds
    num_redis_connections: int  # the API's TCP connections to Redis, from its sockets
    redis_clients_by_name: dict[str, int]  # CLIENT LIST entries from those sockets
    worker_cpu_s: float
    redis_cpu_s: float
    redis_calls: dict[str, int]  # commands run since Redis started, by name


def redis_clients_from(client_list: Iterable[dict], local_ports: set[int]) -> Counter[str]:
    """The `CLIENT LIST` entries whose address (`ip:port`) has one of `local_ports`, counted
    by client name ("" for none)."""
    counts: Counter[str] = Counter()
    for client in client_list:
        port = int(str(client.get("addr", ":0")).rsplit(":", 1)[1])
        if port in local_ports:
            counts[str(client.get("name") or "")] += 1
    return counts


def redis_calls(commandstats: dict) -> dict[str, int]:
    """`INFO commandstats` (redis-py's parse: `cmdstat_get` -> {"calls": n, ...}) as calls by
    command. Commands a script runs count too, besides the script's own EVALSHA."""
    return {
        name.removeprefix("cmdstat_"): int(stats["calls"])
        for name, stats in commandstats.items()
        if name.startswith("cmdstat_")
    }


def cpu_s(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def take_sample(processes: Processes, client: redis.Redis) -> Sample:
    num_clients, redis_ports = 0, set()
    for conn in processes.api.net_connections(kind="tcp"):
        if conn.status != psutil.CONN_ESTABLISHED or not conn.raddr:
            continue
        if conn.laddr.port == processes.api_port:
            num_clients += 1
        elif conn.raddr.port == processes.redis_port:
            redis_ports.add(conn.laddr.port)
    clients: list[dict] = client.client_list()  # type: ignore[assignment]  # redis-py: sync commands typed Awaitable[T] | T (redis-py#2399)
    commandstats: dict = client.info("commandstats")  # type: ignore[assignment]  # redis-py: sync commands typed Awaitable[T] | T (redis-py#2399)
    return Sample(
        at_s=time.perf_counter(),
        api_rss_bytes=processes.api.memory_info().rss,
        api_cpu_s=cpu_s(processes.api),
        api_fds=processes.api.num_fds(),
        num_client_connections=num_clients,
        num_redis_connections=len(redis_ports),
        redis_clients_by_name=dict(redis_clients_from(clients, redis_ports)),
        worker_cpu_s=cpu_s(processes.worker),
        redis_cpu_s=cpu_s(processes.redis_server),
        redis_calls=redis_calls(commandstats),
    )


@dataclass
class Sampler:
    """Samples every `interval_s` on a thread while entered, and collects the ITL samples
    (seconds) the worker of `deployment` (`model@version`) pushes meanwhile."""

    processes: Processes
    redis_url: str
    deployment: str
    interval_s: float = 2.0
    samples: list[Sample] = field(default_factory=list)
    worker_itl_s: list[float] = field(default_factory=list)
    _stopping: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _last_itl_at_s: float = 0.0

    def __enter__(self) -> Sampler:
        self._last_itl_at_s = time.time()
        self._thread = threading.Thread(target=self._run, name="sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        client = redis.Redis.from_url(self.redis_url)
        try:
            while not self._stopping.is_set():
                self.samples.append(take_sample(self.processes, client))
                self._take_worker_itl(client)
                self._stopping.wait(self.interval_s)
        finally:
            client.close()

    def _take_worker_itl(self, client: redis.Redis) -> None:
        """The window's samples pushed since the last look (newest first, `at value`)."""
        raw: list[bytes] = client.lrange(keys.latency_samples(self.deployment, "itl"), 0, -1)  # type: ignore[assignment]  # redis-py: sync commands typed Awaitable[T] | T (redis-py#2399)
        newest_s = self._last_itl_at_s
        for item in raw:
            at_s, value_s = (float(part) for part in text(item).split())
            if at_s <= self._last_itl_at_s:
                break
            newest_s = max(newest_s, at_s)
            self.worker_itl_s.append(value_s)
        self._last_itl_at_s = newest_s
