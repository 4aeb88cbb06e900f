"""What the API's handlers share, built once in the app's lifespan (no module globals)."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import redis.asyncio as aioredis
from sqlalchemy.engine import Engine
from starlette.concurrency import run_in_threadpool

from shared import keys, model_source
from shared.journal import Journal
from shared.settings import Settings
from shared.tables import ModelDeployment

log = logging.getLogger("llmfleet.api")


@dataclass
class TokenizerCache:
    """One tokenizer per deployment, loaded off the event loop the first time it is needed."""

    settings: Settings
    _tokenizers: dict[int, object] = field(default_factory=dict)
    # One load at a time, whatever the deployment: two threads importing transformers'
    # lazily loaded modules at once fail ("cannot import name 'AutoTokenizer'"), as the
    # startup's warm-up and a first request did.
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    async def get(self, deployment: ModelDeployment):
        assert deployment.id is not None
        if (tokenizer := self._tokenizers.get(deployment.id)) is not None:
            return tokenizer
        async with self._lock:
            if deployment.id not in self._tokenizers:
                self._tokenizers[deployment.id] = await run_in_threadpool(self._load, deployment)
        return self._tokenizers[deployment.id]

    def is_loaded(self, deployment_id: int) -> bool:
        return deployment_id in self._tokenizers

    async def warm(self, deployments: list[ModelDeployment]) -> None:
        """Load these deployments' tokenizers ahead of their first request (the first load
        takes seconds, and every request for the deployment waits on it). A deployment whose
        tokenizer fails to load is left for its requests to report."""
        for deployment in deployments:
            try:
                await self.get(deployment)
            except Exception:
                log.warning("tokenizer of %s failed to load", deployment.model_id, exc_info=True)

    def _load(self, deployment: ModelDeployment):
        source = model_source.resolve(deployment.source)
        return model_source.load_tokenizer(source, self.settings.home / "cache")


@dataclass
class KVCapacity:
    """Per model, the most tokens one sequence can hold on the smallest live worker's KV cache,
    as workers publish it; re-read at most every `ttl_s`. None when no worker has said."""

    redis: aioredis.Redis
    ttl_s: float = 2.0
    _cached: dict[str, tuple[float, int | None]] = field(default_factory=dict)

    async def max_tokens(self, model: str) -> int | None:
        now = time.monotonic()
        cached = self._cached.get(model)
        if cached is not None and now - cached[0] < self.ttl_s:
            return cached[1]
        smallest = await self.redis.zrange(keys.model_capacity(model), 0, 0, withscores=True)
        value = int(smallest[0][1]) if smallest else None
        self._cached[model] = (now, value)
        return value


@dataclass
class ApiContext:
    settings: Settings
    engine: Engine
    redis: aioredis.Redis
    tokenizers: TokenizerCache
    kv_capacity: KVCapacity
    journal: Journal
