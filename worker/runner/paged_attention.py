"""Attention over the paged KV cache, plugged into the unmodified Hugging Face forward.

The step's tokens are packed into one row ([1, num_tokens]) so the projections and MLPs run
on exactly the tokens scheduled, with no padding. Each attention layer calls
`cache.update(...)` (our `PagedKVCache` writes the new keys and values into their slots)
and then the registered attention function, which attends per sequence:

- decodes (one query token each) in batched calls, one per group of similar context
  length (padding to the group's longest context wastes at most 2x; one long sequence among
  short ones would otherwise make every decode pay for its length), over keys gathered from
  their block tables, with a padding mask. Written as two matmuls and a softmax, not SDPA:
  on the CPU, torch 2.13's SDPA kernel takes 3.1 ms for one layer of 32 single-token
  queries over 272 keys where these ops take 0.24 ms (it was 70% of a batch-32 step;
  docs/benchmarks.md). Scores and probabilities are computed in the model's dtype and the
  softmax in fp32: within one bf16 rounding step of SDPA. On the CPU, a kernel of ours takes
  the decodes instead wherever it could be built (`cpu_attention.py`): it follows the block
  tables itself and reads each key and value once, where this path copies them first;
- each prefill chunk in its own SDPA call, causal with the chunk's offset. On a CPU with
  AVX512-BF16 dot products, the kernel takes bf16 chunks instead (`cpu_attention.py`): torch
  2.13's CPU SDPA runs at 20-90 GFLOP/s on these shapes, a quarter of the step's time on a
  chunk of 384 tokens, where the kernel, on one thread, is 2-5x faster. It takes all of a
  step's chunks in one call a layer (`StepMetadata.prompt_spans`, built once a step). On a
  GPU a step's chunks are padded into one batch and attended in one SDPA call instead
  (`PrefillBatch`): there an eager step's time is its launches, ~8 for each chunk in each
  layer, not the padding's arithmetic (the first GPU check: docs/benchmarks.md).

The pool is laid out by KV head, then block ([layers, kv_heads, blocks, block_size,
head_dim]), so keys are gathered a whole block at a time (one contiguous copy per block, not
per token) straight into [kv_heads, sequences, context, head_dim]: the layout the batched
matmuls read without another copy (a [blocks, block_size, kv_heads, head_dim] pool needed a
transposing copy after the gather, 15 ms of a 56 ms batch-32 step). The indices are built
once per step (`StepMetadata`) and shared by all layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from worker.runner import cpu_attention

ATTENTION_NAME = "llmfleet_paged"
STEP_KWARG = "llmfleet_step"


@dataclass(slots=True)
class DecodeGroup:
    """Decodes of similar context length, attended in one batched call."""

    query_start: int  # first query row in the packed batch
    query_end: int
    tables: torch.Tensor  # [rows, max_blocks]: block tables padded with block 0; int32 on the CPU
    lengths: torch.Tensor  # [rows]: the keys each row attends to; int32 on the CPU
    # The torch path's inputs (`torch_inputs`), made on its first use: the CPU's kernel reads
    # the tables themselves, and a step there does not pay for these.
    _pool_rows: torch.Tensor | None = None
    _bias: torch.Tensor | None = None

    def torch_inputs(self, pool: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`pool_rows` of the tables and the padding mask ([rows, 1, max_blocks * block_size]
        fp32: 0 for real keys, else -inf) over one layer's pool [kv_heads, blocks,
        block_size, head_dim]; built with tensor ops alone (no host reads), so a captured
        decode graph (`decode_graphs.py`) replays them."""
        if self._pool_rows is None or self._bias is None:
            num_kv_heads, num_blocks, block_size, _ = pool.shape
            positions = torch.arange(self.tables.shape[1] * block_size, device=pool.device)
            is_padding = (positions[None, :] >= self.lengths[:, None])[:, None, :]
            self._bias = torch.zeros(is_padding.shape, device=pool.device).masked_fill_(
                is_padding, float("-inf")
            )
            self._pool_rows = pool_rows(self.tables.flatten(), num_kv_heads, num_blocks)
        return self._pool_rows, self._bias


@dataclass(slots=True)
class PrefillSpan:
    query_start: int
    query_end: int
    pool_rows: torch.Tensor  # `pool_rows` of the sequence's block table up to the chunk's end
    num_context: int  # keys the chunk attends to: every token up to its end
    mask: torch.Tensor | None  # [1, 1, chunk, context] bool, or None for a plain causal chunk
    # On the CPU, for its kernel (`cpu_attention.py`): the sequence's block table, int32.
    table: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class PrefillBatch:
    """A step's prompt chunks, padded to the longest chunk and the longest context, for one
    SDPA call in each layer (`prefill_batch`)."""

    query_start: int  # the chunks' rows in the packed batch: [query_start, query_end)
    query_end: int
    query_rows: torch.Tensor  # [chunks, longest chunk]: packed row of each query; padded
    pool_rows: torch.Tensor  # `pool_rows` of the chunks' tables, padded to the longest one
    bias: torch.Tensor  # [chunks, 1, longest chunk, longest context]: 0 where a query sees a key
    real_rows: torch.Tensor  # [query_end - query_start]: the real queries' flat padded rows


@dataclass(slots=True)
class StepMetadata:
    slot_mapping: torch.Tensor  # [num_tokens]: flat slot (block * block_size + offset) per token
    decode_groups: list[DecodeGroup]
    prefills: list[PrefillSpan]
    prefill_batch: PrefillBatch | None = None  # set: the prefills in one call (a GPU's way)
    # On the CPU, the prefills as the prompt kernel reads them (`prompt_spans`), made once
    _prompt_spans: cpu_attention.PromptSpans | None = None

    def prompt_spans(self) -> cpu_attention.PromptSpans:
        """The prefills as the CPU's prompt kernel takes them all in one call (`PromptSpans`):
        built once a step, read by every layer."""
        if self._prompt_spans is None:
            self._prompt_spans = cpu_attention.PromptSpans.of(
                [
                    (span.query_start, span.query_end - span.query_start,
                     span.num_context - (span.query_end - span.query_start), span.table)
                    for span in self.prefills
                    if span.table is not None
                ]
            )  # fmt: skip
        return self._prompt_spans


class PagedKVCache:
    """What the model sees as its cache: it writes new K/V into the pool and returns the pool."""

    def __init__(self, k_pool: torch.Tensor, v_pool: torch.Tensor, slot_mapping: torch.Tensor):
        self._k_pool = k_pool  # [layers, kv_heads, blocks, block_size, head_dim]
        self._v_pool = v_pool
        self._slot_mapping = slot_mapping

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        # [1, kv_heads, num_tokens, head_dim] into each head's flat slots
        for pool, states in ((self._k_pool, key_states), (self._v_pool, value_states)):
            flat = pool[layer_idx].flatten(1, 2)  # a view: [kv_heads, slots, head_dim]
            flat.index_copy_(1, self._slot_mapping, states[0])
        return self._k_pool[layer_idx], self._v_pool[layer_idx]


def paged_attention(module, query, key_pool, value_pool, attention_mask, scaling=None, **kwargs):
    """query: [1, heads, num_tokens, head_dim]; returns [1, num_tokens, heads, head_dim]."""
    step: StepMetadata | None = kwargs.get(STEP_KWARG)
    if step is None:  # an ordinary forward (e.g. `generate`) on the same model: plain SDPA
        return sdpa_attention_forward(
            module, query, key_pool, value_pool, attention_mask, scaling=scaling, **kwargs
        )
    return attend(query[0], key_pool, value_pool, step, scaling).unsqueeze(0), None


def attend(q, key_pool, value_pool, step: StepMetadata, scaling=None) -> torch.Tensor:
    """q: [heads, num_tokens, head_dim] over one layer's pool; returns [num_tokens, heads,
    head_dim]."""
    out = torch.empty(q.shape[1], q.shape[0], q.shape[2], dtype=q.dtype, device=q.device)
    use_kernel = bool(step.decode_groups) and cpu_attention.supports(q, key_pool)
    for group in step.decode_groups:
        rows = slice(group.query_start, group.query_end)
        if use_kernel:
            scale = scaling if scaling is not None else q.shape[-1] ** -0.5
            out[rows] = cpu_attention.paged_decode(
                q[:, rows].transpose(0, 1), key_pool, value_pool, group.tables, group.lengths, scale
            )
        else:
            out[rows] = _decode(q[:, rows], key_pool, value_pool, group, scaling)
    batch = step.prefill_batch
    if batch is not None:
        out[batch.query_start : batch.query_end] = _prefill_batch(
            q, key_pool, value_pool, batch, scaling
        )
        return out
    if not step.prefills:
        return out
    if cpu_attention.supports_prefill(q, key_pool) and all(
        span.table is not None for span in step.prefills
    ):  # every chunk in one call of the CPU's kernel
        scale = scaling if scaling is not None else q.shape[-1] ** -0.5
        spans = step.prompt_spans()
        cpu_attention.paged_prefill_spans(
            q.transpose(0, 1), key_pool, value_pool, spans, out, scale
        )
        return out
    for span in step.prefills:
        out[span.query_start : span.query_end] = _prefill(q, key_pool, value_pool, span, scaling)
    return out


def pool_rows(block_ids: torch.Tensor, num_kv_heads: int, num_blocks: int) -> torch.Tensor:
    """Where blocks lie in a layer's pool seen as [kv_heads * blocks, block_size, head_dim]:
    every head's copy of each block, head by head (gathering along the first dimension is
    a plain copy per block; along the second, torch's CPU kernel is 3x slower)."""
    heads = torch.arange(num_kv_heads, device=block_ids.device)[:, None] * num_blocks
    return (heads + block_ids[None, :]).flatten()


def decode_group(
    query_start: int,
    tables: torch.Tensor,  # [rows, max_blocks]: block tables, padded
    lengths: torch.Tensor,  # [rows]: keys each row attends to
) -> DecodeGroup:
    """The group over these tables: on the CPU, int32 and contiguous, as its kernel reads
    them (`cpu_attention.py`)."""
    if tables.device.type == "cpu":
        tables = tables.to(torch.int32).contiguous()
        lengths = lengths.to(torch.int32).contiguous()
    return DecodeGroup(query_start, query_start + tables.shape[0], tables, lengths)


# A padded batch is used only while its padding costs at most this many times the chunks'
# own queries x keys, and its mask stays under MAX_PADDED_BIAS elements (16 chunks of 512
# queries over 2,048 keys): past that a call per chunk costs less than the padding.
MAX_PADDING_FACTOR = 4
MAX_PADDED_BIAS = 1 << 24


def prefill_batch(
    query_start: int,
    lengths: list[int],  # each chunk's new tokens, in packed order
    contexts: list[int],  # each chunk's keys: every token up to its end
    tables: list[list[int]],  # each chunk's block table, up to its end
    pool: torch.Tensor,  # one layer's pool [kv_heads, blocks, block_size, head_dim]
    dtype: torch.dtype,
) -> PrefillBatch | None:
    """The chunks as one padded batch, or None where the padding would cost more than the
    calls it saves (`MAX_PADDING_FACTOR`, `MAX_PADDED_BIAS`). A padding query repeats its
    chunk's last row and sees key 0 alone (a finite softmax); its output is dropped."""
    num_kv_heads, num_blocks, block_size, _ = pool.shape
    longest, max_blocks = max(lengths), max(len(table) for table in tables)
    padded = len(lengths) * longest * max_blocks * block_size
    real = sum(n * c for n, c in zip(lengths, contexts, strict=True))
    if padded > MAX_PADDING_FACTOR * real or padded > MAX_PADDED_BIAS:
        return None
    device = pool.device
    offsets = torch.arange(longest, device=device)
    lengths_t = torch.tensor(lengths, device=device)
    contexts_t = torch.tensor(contexts, device=device)
    starts = torch.cumsum(lengths_t, 0) - lengths_t + query_start
    is_real = offsets[None, :] < lengths_t[:, None]  # [chunks, longest]
    last_rows = starts + lengths_t - 1
    query_rows = torch.where(is_real, starts[:, None] + offsets, last_rows[:, None])
    positions = (contexts_t - lengths_t)[:, None] + offsets  # each query's own position
    keys = torch.arange(max_blocks * block_size, device=device)
    sees = torch.where(is_real[..., None], keys <= positions[..., None], keys == 0)
    bias = torch.zeros(sees.shape, dtype=dtype, device=device).masked_fill_(~sees, float("-inf"))
    padded_tables = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables], device=device)
    return PrefillBatch(
        query_start,
        query_start + sum(lengths),
        query_rows,
        pool_rows(padded_tables.flatten(), num_kv_heads, num_blocks),
        bias[:, None],
        torch.tensor(
            [c * longest + i for c, n in enumerate(lengths) for i in range(n)], device=device
        ),
    )


def _gather(pool: torch.Tensor, rows: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """Blocks of one layer's pool (`rows`: from `pool_rows`) -> [kv_heads, num_seqs,
    context, head_dim], contiguous."""
    blocks = pool.flatten(0, 1).index_select(0, rows)  # [kv * seqs * blocks, block_size, dim]
    return blocks.view(pool.shape[0], num_seqs, -1, pool.shape[-1])


def _decode(q, key_pool, value_pool, group: DecodeGroup, scaling) -> torch.Tensor:
    heads, rows, dim = q.shape
    pool_rows, bias = group.torch_inputs(key_pool)
    k = _gather(key_pool, pool_rows, rows)  # [kv_heads, rows, context, dim]
    v = _gather(value_pool, pool_rows, rows)
    kv_heads = k.shape[0]
    # Query head h reads kv head h // (heads / kv_heads), as HF's repeat_kv lays them out.
    q = q.view(kv_heads, heads // kv_heads, rows, dim).transpose(1, 2)  # [kv, rows, group, dim]
    scale = scaling if scaling is not None else dim**-0.5
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale  # [kv, rows, group, ctx]
    probs = torch.softmax(scores + bias, dim=-1).to(v.dtype)
    out = torch.matmul(probs, v)  # [kv, rows, group, dim]
    return out.permute(1, 0, 2, 3).reshape(rows, heads, dim)


def _prefill(q, key_pool, value_pool, span: PrefillSpan, scaling) -> torch.Tensor:
    q = q[:, span.query_start : span.query_end].unsqueeze(0)  # [1, heads, chunk, dim]
    k = _gather(key_pool, span.pool_rows, 1).transpose(0, 1)[:, :, : span.num_context]
    v = _gather(value_pool, span.pool_rows, 1).transpose(0, 1)[:, :, : span.num_context]
    o = F.scaled_dot_product_attention(
        q, k, v, attn_mask=span.mask, is_causal=span.mask is None, scale=scaling, enable_gqa=True
    )
    return o[0].transpose(0, 1)  # [chunk, heads, dim]


def _prefill_batch(q, key_pool, value_pool, batch: PrefillBatch, scaling) -> torch.Tensor:
    heads, _, dim = q.shape
    num_chunks, longest = batch.query_rows.shape
    q = q.index_select(1, batch.query_rows.flatten()).view(heads, num_chunks, longest, dim)
    k = _gather(key_pool, batch.pool_rows, num_chunks)  # [kv_heads, chunks, context, dim]
    v = _gather(value_pool, batch.pool_rows, num_chunks)
    # Query head h reads kv head h // group (HF's repeat_kv), spelled out rather than SDPA's
    # enable_gqa: CUDA's memory-efficient kernel, the one that takes a mask, has no GQA.
    kv_heads, context = k.shape[0], k.shape[2]
    shape = (num_chunks, kv_heads, heads // kv_heads, context, dim)
    k = k.transpose(0, 1)[:, :, None].expand(shape).reshape(num_chunks, heads, context, dim)
    v = v.transpose(0, 1)[:, :, None].expand(shape).reshape(num_chunks, heads, context, dim)
    o = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=batch.bias, scale=scaling)
    return o.transpose(1, 2).flatten(0, 1).index_select(0, batch.real_rows)  # [rows, heads, dim]


AttentionInterface.register(ATTENTION_NAME, paged_attention)
