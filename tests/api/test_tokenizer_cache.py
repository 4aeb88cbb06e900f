"""The API's tokenizers: one load per model source, however many deployments share it."""

from __future__ import annotations

from api.context import TokenizerCache
from shared.tables import ModelDeployment


class _CountingCache(TokenizerCache):
    num_loads = 0

    def _load(self, deployment):
        self.num_loads += 1
        return super()._load(deployment)


def _deployment(id_: int, source: str) -> ModelDeployment:
    return ModelDeployment(
        id=id_, model_id=f"m{id_}", version="1", source=source, max_context_tokens=2048
    )


async def test_deployments_of_one_source_share_one_tokenizer(settings, tiny_model_dir):
    cache = _CountingCache(settings)
    same = [_deployment(i, str(tiny_model_dir)) for i in range(1, 6)]
    await cache.warm(same)
    assert cache.num_loads == 1
    tokenizers = {id(await cache.get(d)) for d in same}
    assert len(tokenizers) == 1 and cache.num_loads == 1
