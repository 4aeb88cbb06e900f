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
    max_num_batched_tokens: int = 384  # continuous batching: tokens per step (chunked prefill)
    # continuous batching: the step's budget while more than one tenant has work in the
    # batch or its queue, or had in the last 10 s (None: no cap): another tenant's next token and first token then
    # wait on at most this much of a neighbour's prompt work (token_budget.py)
    shared_batched_tokens: int | None = 192
    # continuous batching: the budget of a step with no decodes in it, and of one beside
    # decodes while a backlog of prompt work waits (None: max_num_batched_tokens), and the ITL
    # target that guards the prompt work beside decodes (None: none): 150 ms, well inside the
    # gap at which a stream reads as stalling (200 ms, 5 tokens a second: the default up to
    # session 34, until prompt steps got 20-25% cheaper); it cuts a backlog's steps on a CPU
    # and never binds on a GPU (token_budget.py, docs/benchmarks.md, session 35)
    max_num_prefill_tokens: int | None = 2048
    itl_target_ms: float | None = 150.0
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
    # continuous batching: "auto" (our own Llama-family forward where the model is one,
    # `worker/runner/llama.py`), "own", or "hf" (the HF forward with our paged attention)
    forward: str = "auto"
    # continuous batching: reuse the KV of a tenant's earlier full blocks of equal tokens
    # (`worker/kv_cache.py`; never across tenants)
    prefix_caching: bool = True
    # "model": the deployment's weights; "echo": no model, each step a fixed period that
    # gives every sequence its prompt's next token (`worker/echo_engine.py`), to measure
    # the platform's own cost
    engine: str = "model"
    echo_tokens_per_s: float = 10.0  # echo: tokens a second per sequence
    # echo: how often the worker hands out tokens, each step to the sequences whose turn it
    # is (None: once a period, every sequence at once, as a model step does)
    echo_step_ms: float | None = None
    # echo: a file to which each handed-out token's request id and time (`perf_counter`,
    # the machine's monotonic clock) are appended, for `llmfleet bench --platform-load`
    echo_emissions_path: str | None = None
    # continuous batching on a GPU: decode-only steps replay CUDA graphs captured per batch
    # size and context (`worker/runner/decode_graphs.py`); ignored on the CPU
    cuda_graphs: bool = True

    @property
    def max_num_seqs_in_batch(self) -> int:
        """Places in the batch, as the engine built from this reports them
        (`EngineStats.max_num_seqs`), known before it is built."""
        if self.batching == "one":
            return 1
        if self.batching == "static":
            return self.max_batch_size
        return self.max_num_seqs


DEFAULT_ENGINE = EngineConfig()  # the defaults, for the command lines' options
