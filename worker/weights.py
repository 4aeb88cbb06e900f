"""A worker's model apart from the engine over it: what a standby worker keeps (the weights,
the tokenizer) and what it builds when it serves and drops when it goes back to standby (the
engine and its KV pool).

Loading weights takes seconds to minutes; building the engine takes the KV pool's
allocation (and, on a GPU, the decode graphs' capture), so a standby worker serves again
within about a second. Every function here runs on the worker's engine thread
(`worker/service.py`): all torch work stays on that one thread. The echo engine has no
weights: its `Weights` hold the tokenizer alone, and no torch is imported for it.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from shared import heap, model_source
from worker import echo_engine
from worker.config import EngineConfig
from worker.detokenizer import Decoder
from worker.engine import Engine

if TYPE_CHECKING:
    from worker.runner.loader import LoadedModel


@dataclass(frozen=True, slots=True)
class Weights:
    tokenizer: Decoder
    vocab_size: int  # the tokenizer's: the echo engine's token ids stay below it
    eos_token_ids: frozenset[int]
    model: LoadedModel | None  # None: the echo engine, no model


def import_loaders(config: EngineConfig) -> None:
    """The modules `load` needs: transformers, and torch for a model (not for echo)."""
    model_source.import_loaders()
    if config.engine != "echo":
        import worker.model_engine
        import worker.runner.loader  # noqa: F401


def load_weights(
    source_spec: str, cache_dir: Path, config: EngineConfig, device: str, dtype: str
) -> Weights:
    """The tokenizer and, for a model, its weights on `device`; no engine, no KV pool."""
    source = model_source.resolve(source_spec)
    tokenizer = model_source.load_tokenizer(source, cache_dir)
    if config.engine == "echo":
        eos_token_ids = echo_engine.eos_token_ids(tokenizer)
        return Weights(tokenizer, len(tokenizer), eos_token_ids, None)
    from worker.runner import loader, model_runner

    loaded = loader.load(source, device, dtype)
    if model_runner.uses_own_forward(loaded.model, config.forward):
        model_runner.own_forward(loaded.model)  # its fused weights: not at each activation
    return Weights(tokenizer, len(tokenizer), loaded.eos_token_ids, loaded)


def build_engine(weights: Weights, config: EngineConfig) -> Engine:
    """The engine over the loaded weights: this allocates its KV pool. It is frozen out of
    every collection, as the weights are (`shared/heap.py`), without a collection first,
    which would add its walk of the whole heap to an activation."""
    engine: Engine
    if weights.model is None:
        engine = echo_engine.build_echo_engine(config, weights.vocab_size)
    else:
        from worker.model_engine import build_engine as build_model_engine

        engine = build_model_engine(weights.model, config)
    gc.freeze()
    return engine


def release_engine_memory(weights: Weights) -> None:
    """Once the engine is no longer referenced: collect it (its KV pool, the decode graphs
    and whatever cycle held them) and, on a GPU, give the memory torch's caching allocator
    keeps back to the device. The weights stay."""
    heap.freeze_long_lived()  # unfreezes and collects first: the engine was frozen with the rest
    if weights.model is not None:
        from worker.runner import loader

        loader.release_cached_memory(weights.model)
