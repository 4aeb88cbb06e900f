"""Attention over the paged KV cache on the CPU: small C kernels that follow the block tables.

Decode: the torch path (`paged_attention._decode`) gathers every decode's blocks out of the
pool into a contiguous copy, layer by layer, and two batched matmuls then read that copy:
three passes over the bytes, in many small ops. On this CPU a decode step's attention was 44%
of the worker's CPU on the 64-request workload (docs/benchmarks.md, session 18). For each
sequence and KV head this kernel computes the scores of the head's query group (fp32, one
read of each key, a block's keys being contiguous in the pool), their softmax, and the
weighted sum of the values (one read of each value). vLLM's CPU backend has its own C++
paged attention for the same reason; no well-kept package offers one for torch's CPU build.

Prompt chunks (`paged_prefill`), on CPUs with AVX512-BF16 dot products and bf16 models:
torch 2.13's CPU SDPA runs at 20-90 GFLOP/s on a chunk's shapes, a quarter of a 384-token
step. The kernel packs the sequence's keys and values out of the pool into the layout of the
bf16 dot-product instruction, then computes 16 query positions at a time (scores, causal
softmax in fp32, weights times values), 2-3x faster than SDPA on this machine. On CPUs with
AMX the same kernel computes the scores and the weights times values in AMX tiles (the packed
keys and values are already the tiles' layout) and leaves the weights unnormalised, scaling
the sums once: 1.3-2.3x faster than SDPA there, which multiplies in AMX tiles too and was
2.5-3.8x faster than the dot products on chunks of 256 tokens or more (`has_amx`; session 31,
docs/benchmarks.md). A step's chunks go in one call a layer (`paged_prefill_spans`), which
packs and computes them all in one parallel region: a call a chunk cost ~50 us (session 35).
Elsewhere (no AVX512-BF16, fp32 models, a GPU, or AMX turned off with `LLMFLEET_CPU_AMX=0`
on a CPU with AMX) chunks take SDPA.

Both are C (`csrc/paged_attention.c`: GCC's vector extensions and, for the prompt kernel,
AVX-512 intrinsics), built and loaded with the runner's other kernels (`cpu_kernels.py`),
their work shared out with OpenMP over torch's own threads.

Where no compiler is found, the build fails, `LLMFLEET_CPU_ATTENTION_KERNEL=0` is set, or
the shapes are not the kernels' (a head dimension not a multiple of 16, or 32 for prompts,
or over 256), the torch paths run. Decode: the two agree within a rounding step of the
model's dtype. On CPUs with AVX512-BF16 a bf16 pool's decodes take the dot-product
instruction (exact bf16 products, fp32 sums: nothing widened first; half the time of the
widening kernel at 4-64 sequences, docs/benchmarks.md, session 23): scores and sums in fp32,
the softmax weights rounded to bf16 before the values, as the torch path and the prompt
kernel do. Elsewhere the decode kernel keeps the weights in fp32 too. Prompts: both round
the weights to bf16 before the values.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from worker.runner.cpu_kernels import amx_matmuls_available, cpu_flags, load

MAX_HEAD_DIM = 256
MAX_QUERIES_PER_KV_HEAD = 16
_DTYPES = {torch.bfloat16: 1, torch.float32: 0}


def supports(q: torch.Tensor, key_pool: torch.Tensor) -> bool:
    """Whether the kernel takes a layer's decodes: q [heads, tokens, head_dim] and its pool
    [kv_heads, blocks, block_size, head_dim] on the CPU, in bf16 or fp32, of shapes it has
    (a head dimension a multiple of 16 up to 256, at most 16 query heads a KV head)."""
    heads, kv_heads, head_dim = q.shape[0], key_pool.shape[0], q.shape[-1]
    return (
        q.device.type == "cpu"
        and q.dtype in _DTYPES
        and key_pool.dtype == q.dtype
        and head_dim % 16 == 0
        and head_dim <= MAX_HEAD_DIM
        and heads % kv_heads == 0
        and heads // kv_heads <= MAX_QUERIES_PER_KV_HEAD
        and load() is not None
    )


def paged_decode(
    q: torch.Tensor,  # [rows, heads, head_dim]
    key_pool: torch.Tensor,  # one layer's [kv_heads, blocks, block_size, head_dim], contiguous
    value_pool: torch.Tensor,
    tables: torch.Tensor,  # [rows, max_blocks] int32, contiguous
    lengths: torch.Tensor,  # [rows] int32: the keys each row attends to, at least 1
    scale: float,
) -> torch.Tensor:
    """Each row's attention over its first `lengths[row]` keys: [rows, heads, head_dim]. Only
    where `supports` said so."""
    library = load()
    if library is None:
        raise RuntimeError("the CPU attention kernel is not available")
    q = q.contiguous()
    if not (key_pool.is_contiguous() and value_pool.is_contiguous() and tables.is_contiguous()):
        raise ValueError("paged_decode: the pools and tables must be contiguous")
    if tables.dtype != torch.int32 or lengths.dtype != torch.int32:
        raise ValueError("paged_decode: tables and lengths are int32")
    lengths = lengths.contiguous()  # held here: the kernel reads its memory
    rows, heads, head_dim = q.shape
    kv_heads, num_blocks, block_size, _ = key_pool.shape
    out = torch.empty_like(q)
    status = library.paged_decode(
        q.data_ptr(),
        key_pool.data_ptr(),
        value_pool.data_ptr(),
        tables.data_ptr(),
        lengths.data_ptr(),
        out.data_ptr(),
        rows,
        heads,
        kv_heads,
        num_blocks,
        block_size,
        head_dim,
        tables.shape[1],
        _DTYPES[q.dtype],
        scale,
    )
    if status != 0:
        raise RuntimeError(f"paged_decode failed ({status})")
    return out


def has_prefill_kernel() -> bool:
    """Whether the prompt kernel is built here (a CPU with AVX512-BF16 dot products)."""
    library = load()
    return library is not None and bool(library.prefill_available())


def supports_prefill(q: torch.Tensor, key_pool: torch.Tensor) -> bool:
    """Whether a layer's prompt chunks take the kernel: as `supports`, but bf16 only, a head
    dimension a multiple of 32, the kernel built here, and on a CPU with AMX (`has_amx`) the
    kernel's AMX tiles allowed (`amx_matmuls_available`)."""
    return (
        q.dtype == torch.bfloat16
        and q.shape[-1] % 32 == 0
        and (not has_amx() or amx_matmuls_available())
        and has_prefill_kernel()
        and supports(q, key_pool)
    )


@functools.cache
def has_amx() -> bool:
    """Whether the CPU multiplies bf16 matrices in AMX tiles: torch's SDPA then does (through
    oneDNN's brgemm), 2.5-3.8x faster than the prompt kernel's dot products on chunks of 256
    tokens or more (1.3x at 64) at the default model's shapes (docs/benchmarks.md, session
    25), so there the kernel computes in AMX tiles too, or prompt chunks take SDPA where those
    are off (`LLMFLEET_CPU_AMX=0`)."""
    return "amx_bf16" in cpu_flags()


def paged_prefill(
    q: torch.Tensor,  # [tokens, heads, head_dim]: one sequence's chunk
    key_pool: torch.Tensor,  # one layer's [kv_heads, blocks, block_size, head_dim], contiguous
    value_pool: torch.Tensor,
    table: torch.Tensor,  # the sequence's block table, int32, contiguous
    start: int,  # the chunk's first position: keys before it are the sequence's earlier ones
    scale: float,
) -> torch.Tensor:
    """Causal attention of a chunk at positions `start ..` over the sequence's keys up to
    each query's own: [tokens, heads, head_dim] (`paged_prefill_spans` of the one chunk).
    Only where `supports_prefill` said so."""
    q = q.contiguous()
    if not (key_pool.is_contiguous() and value_pool.is_contiguous() and table.is_contiguous()):
        raise ValueError("paged_prefill: the pools and the table must be contiguous")
    if table.dtype != torch.int32:
        raise ValueError("paged_prefill: the table is int32")
    tokens = q.shape[0]
    if table.shape[0] * key_pool.shape[2] < start + tokens:
        raise ValueError("paged_prefill: the table is shorter than the chunk's end")
    out = torch.empty_like(q)
    paged_prefill_spans(
        q, key_pool, value_pool, PromptSpans.of([(0, tokens, start, table)]), out, scale
    )
    return out


def paged_prefill_spans(
    q: torch.Tensor,  # [tokens, heads, head_dim]: the step's queries (rows may be apart)
    key_pool: torch.Tensor,  # one layer's [kv_heads, blocks, block_size, head_dim], contiguous
    value_pool: torch.Tensor,
    spans: PromptSpans,
    out: torch.Tensor,  # [tokens, heads, head_dim], contiguous: the chunks' rows written
    scale: float,
) -> None:
    """`paged_prefill` of every prompt chunk of a step in one call (one parallel region a
    layer, not one a chunk): each chunk's rows of `out` from its rows of `q`. Only where
    `supports_prefill` said so."""
    library = load()
    if library is None:
        raise RuntimeError("the CPU attention kernel is not available")
    _, heads, head_dim = q.shape
    if q.stride(2) != 1 or q.stride(1) != head_dim:  # each row's heads side by side
        q = q.contiguous()
    if not (key_pool.is_contiguous() and value_pool.is_contiguous() and out.is_contiguous()):
        raise ValueError("paged_prefill_spans: the pools and out must be contiguous")
    if out.shape != q.shape:
        raise ValueError("paged_prefill_spans: out is not q's shape")
    kv_heads, num_blocks, block_size, _ = key_pool.shape
    row = heads * head_dim  # a one-row tensor's stride(0) may be anything: its rows are `row`
    status = library.paged_prefill_spans(
        q.data_ptr(),
        q.stride(0) if len(q) > 1 else row,
        key_pool.data_ptr(),
        value_pool.data_ptr(),
        spans.spans.data_ptr(),
        spans.tables.data_ptr(),
        out.data_ptr(),
        out.stride(0) if len(out) > 1 else row,
        spans.count,
        heads,
        kv_heads,
        num_blocks,
        block_size,
        head_dim,
        int(amx_matmuls_available()),
        scale,
    )
    if status != 0:
        raise RuntimeError(f"paged_prefill_spans failed ({status})")


@dataclass(frozen=True, slots=True)
class PromptSpans:
    """A step's prompt chunks as `paged_prefill_spans` reads them, built once a step: per
    chunk its first query row, its length, its first position and where its block table
    starts in `tables` (int32 [count, 4]), and the tables one after the other (int32)."""

    spans: torch.Tensor
    tables: torch.Tensor
    count: int

    @classmethod
    def of(cls, chunks: list[tuple[int, int, int, torch.Tensor]]) -> PromptSpans:
        """From (first query row, length, first position, block table (int32)) a chunk."""
        rows, at = [], 0
        for query_start, length, start, table in chunks:
            rows.append((query_start, length, start, at))
            at += len(table)
        tables = torch.cat([table for *_, table in chunks]).to(torch.int32).contiguous()
        return cls(torch.tensor(rows, dtype=torch.int32), tables, len(chunks))
