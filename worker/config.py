"""The engine's settings and their defaults, in one place: the worker (`llmfleet worker`),
the benchmark (`llmfleet bench`) and the local stack read them from here.

Plain data, no torch: the command line imports it to show its defaults.
"""

from __future__ import annotations

from dataclasses import dataclass

from worker.fair_queue import DEFAULT_QUANTUM_TOKENS


@dataclass(frozen=True, slots=True)
class EngineConfig:
    batching: str = "continuous"  # "continuous" | "static" | "one"
    max_batch_size: int = 8  # static batching
    max_num_seqs: int = 64  # continuous batching: sequences in the batch
    max_num_batched_tokens: int = 192  # continuous batching: tokens per step (chunked prefill)
    block_size: int = 16  # tokens per KV block
    kv_cache_gb: float | None = (
        None  # KV pool size; None: 2 GB on CPU, a fraction of free GPU memory
    )
    num_kv_blocks: int | None = None  # the KV pool in blocks, overriding kv_cache_gb
    gpu_memory_fraction: float = 0.85
    queueing: str = "fair"  # continuous batching: "fair" (tenants, tiers) | "fifo" (baseline)
    # Fault injection for the chaos tests: a model step whose input holds this token id fails.
    fault_token_id: int | None = None
    quantum_tokens: int = DEFAULT_QUANTUM_TOKENS  # fair queuing: tokens per round per weight
    burst_tokens: int | None = None  # fair queuing: a returning tenant's lead (4 quanta)


DEFAULT_ENGINE = EngineConfig()  # the defaults, for the command lines' options
