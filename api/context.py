"""What the API's handlers share, built once in the app's lifespan (no module globals)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import anyio
import anyio.to_thread
import redis.asyncio as aioredis
from sqlalchemy.engine import Engine
from starlette.concurrency import run_in_threadpool

from api.broker import Broker
from api.router import Router
from api.shutdown import Shutdown
from shared import heap, keys, model_source
from shared.journal import Journal
from shared.settings import Settings
from shared.tables import ModelDeployment
from shared.tenants import Principal

log = logging.getLogger("llmfleet.api")

T = TypeVar("T")


@dataclass
class TokenizerCache:
    """One tokenizer per model source (the deployments of one source, such as the versions
    and test deployments of the same weights, share it), loaded off the event loop the first
    time it is needed."""

    settings: Settings
    _tokenizers: dict[str, object] = field(default_factory=dict)
    # `len(tokenizer)` walks the added tokens each time: counted once per source.
    _vocab_sizes: dict[str, int] = field(default_factory=dict)
    # One load at a time, whatever the deployment: two threads importing transformers'
    # lazily loaded modules at once fail ("cannot import name 'AutoTokenizer'"), as the
    # startup's warm-up and a first request did.
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    async def get(self, deployment: ModelDeployment):
        source = deployment.source
        if (tokenizer := self._tokenizers.get(source)) is not None:
            return tokenizer
        async with self._lock:
            if source not in self._tokenizers:
                self._tokenizers[source] = await run_in_threadpool(self._load, deployment)
                heap.freeze_long_lived()  # a tokenizer is kept for life (`shared/heap.py`)
        return self._tokenizers[source]

    async def vocab_size(self, deployment: ModelDeployment) -> int:
        """How many token ids the deployment's tokenizer has (its added tokens included)."""
        if (size := self._vocab_sizes.get(deployment.source)) is None:
            size = self._vocab_sizes[deployment.source] = len(await self.get(deployment))
        return size

    def is_loaded(self, deployment: ModelDeployment) -> bool:
        return deployment.source in self._tokenizers

    async def warm(self, deployments: list[ModelDeployment]) -> None:
        """Load these deployments' tokenizers ahead of their first request (the first load
        takes seconds, and every request for the deployment waits on it), once per source: a
        load holds the GIL for much of its time, so each one slows this process's event
        loop. A deployment whose tokenizer fails to load is left for its requests to report."""
        by_source = {deployment.source: deployment for deployment in deployments}
        for deployment in by_source.values():
            try:
                await self.get(deployment)
            except Exception:
                log.warning("tokenizer of %s failed to load", deployment.model_id, exc_info=True)

    def _load(self, deployment: ModelDeployment):
        source = model_source.resolve(deployment.source)
        return model_source.load_tokenizer(source, self.settings.home / "cache")


@dataclass
class TokenizerThreads:
    """Runs tokenizing off the event loop, on at most `max_num_threads` threads at once and at
    most `max_num_per_tenant` of them for one tenant.

    900 KB of text take about 1 s to tokenize: on the event loop that held every other
    tenant's requests. The Rust tokenizer releases the GIL while it works, so a thread frees
    the loop. Its own limiter, not Starlette's `run_in_threadpool`: that one pool (40 threads)
    also runs every request's authentication and database lookups, which must not queue
    behind prompts. A tenant waits for its own slots first (FIFO), so the shared threads'
    queue holds at most `max_num_per_tenant` of any one tenant's prompts.
    """

    max_num_threads: int
    max_num_per_tenant: int
    _limiter: anyio.CapacityLimiter | None = None
    # Per tenant with prompts waiting or tokenizing: its slots and how many hold or want one.
    _tenants: dict[str, tuple[anyio.Semaphore, int]] = field(default_factory=dict)

    async def run(self, tenant_id: str, fn: Callable[..., T], *args: object) -> T:
        if self._limiter is None:  # made here: anyio needs the running event loop
            self._limiter = anyio.CapacityLimiter(self.max_num_threads)
        slots, num_users = self._tenants.get(tenant_id, (None, 0))
        slots = slots or anyio.Semaphore(self.max_num_per_tenant)
        self._tenants[tenant_id] = (slots, num_users + 1)
        try:
            async with slots:
                return await anyio.to_thread.run_sync(fn, *args, limiter=self._limiter)
        finally:
            slots, num_users = self._tenants[tenant_id]
            if num_users == 1:
                del self._tenants[tenant_id]
            else:
                self._tenants[tenant_id] = (slots, num_users - 1)


@dataclass
class KVCapacity:
    """Per model version (`model@version`), the most tokens one sequence can hold on the
    smallest live worker's KV cache, as workers publish it; re-read at most every `ttl_s`.
    None when no worker has said."""

    redis: aioredis.Redis
    ttl_s: float = 2.0
    _cached: dict[str, tuple[float, int | None]] = field(default_factory=dict)

    async def max_tokens(self, deployment: str) -> int | None:
        now = time.monotonic()
        cached = self._cached.get(deployment)
        if cached is not None and now - cached[0] < self.ttl_s:
            return cached[1]
        capacity = keys.model_capacity(deployment)
        smallest = await self.redis.zrange(capacity, 0, 0, withscores=True)
        value = int(smallest[0][1]) if smallest else None
        self._cached[deployment] = (now, value)
        return value


@dataclass
class PrincipalCache:
    """Principals of verified keys (by the key's hash), for one epoch at a time; each at
    most `ttl_s` old (a change made while Redis was unreachable moves no epoch), at most
    `max_num_entries` of them (then it starts over)."""

    ttl_s: float = 60.0
    max_num_entries: int = 10_000
    _epoch: int = -1
    _entries: dict[str, tuple[Principal, float]] = field(default_factory=dict)

    def get(self, key_hash: str, epoch: int, now_s: float) -> Principal | None:
        if epoch != self._epoch:
            self._entries.clear()
            self._epoch = epoch
            return None
        cached = self._entries.get(key_hash)
        if cached is None or now_s - cached[1] > self.ttl_s:
            return None
        return cached[0]

    def put(self, key_hash: str, principal: Principal, epoch: int, now_s: float) -> None:
        """Keep a principal looked up after reading `epoch` (not if the epoch moved since)."""
        if epoch != self._epoch:
            return
        if len(self._entries) >= self.max_num_entries:
            self._entries.clear()
        self._entries[key_hash] = (principal, now_s)


@dataclass
class ApiContext:
    settings: Settings
    engine: Engine
    redis: aioredis.Redis
    tokenizers: TokenizerCache
    kv_capacity: KVCapacity
    journal: Journal
    broker: Broker
    shutdown: Shutdown
    principals: PrincipalCache = field(default_factory=PrincipalCache)
    tokenizer_threads: TokenizerThreads = field(init=False)
    router: Router = field(init=False)

    def __post_init__(self) -> None:
        settings = self.settings
        self.tokenizer_threads = TokenizerThreads(
            settings.max_num_tokenizer_threads, settings.max_num_tokenizer_threads_per_tenant
        )
        self.router = Router(
            self.engine, self.redis, settings.routing_cache_s, settings.worker_heartbeat_timeout_s
        )
