"""During an HTTP run against llmfleet, sample the workers' KV-cache usage and waste from their
heartbeats in Redis (a peer such as vLLM has none: then pass no Redis URL)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import redis

from shared import keys


@dataclass
class KVSampler:
    redis_url: str
    model: str
    interval_s: float = 0.5
    samples: list[float] = field(default_factory=list)  # usage, the workers' mean
    waste_samples: list[float] = field(default_factory=list)  # of the slots in use, empty
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> KVSampler:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        client = redis.Redis.from_url(self.redis_url, decode_responses=True)
        try:
            while not self._stop.wait(self.interval_s):
                usages, wastes = [], []
                for key in client.scan_iter(keys.worker_heartbeat_pattern()):
                    info: dict[str, str] = client.hgetall(key)  # type: ignore[assignment]  # redis-py: sync commands typed Awaitable[T] | T (redis-py#2399)
                    if info.get("model") == self.model and "kv_cache_usage" in info:
                        usages.append(float(info["kv_cache_usage"]))
                    if info.get("model") == self.model and "kv_cache_waste" in info:
                        wastes.append(float(info["kv_cache_waste"]))
                if usages:
                    self.samples.append(sum(usages) / len(usages))
                if wastes:
                    self.waste_samples.append(sum(wastes) / len(wastes))
        finally:
            client.close()
