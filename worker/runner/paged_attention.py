"""Attention over the paged KV cache, plugged into the unmodified Hugging Face forward.

The step's tokens are packed into one row ([1, num_tokens]) so the projections and MLPs run
on exactly the tokens scheduled, with no padding. Each attention layer calls
`cache.update(...)` (our `PagedKVCache` writes the new keys and values into their slots)
and then the registered attention function, which attends per sequence:

- decodes (one query token each) in batched SDPA calls, one per group of similar context
  length (padding to the group's longest context wastes at most 2x; one long sequence among
  short ones would otherwise make every decode pay for its length), over keys gathered from
  their block tables, with a padding mask;
- each prefill chunk in its own SDPA call, causal with the chunk's offset.

The pool is laid out by block ([layers, blocks, block_size, kv_heads, head_dim]), so keys
are gathered a whole block at a time (one contiguous copy per block, not per token); the
indices are built once per step (`StepMetadata`) and shared by all layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

ATTENTION_NAME = "llmfleet_paged"
STEP_KWARG = "llmfleet_step"


@dataclass(slots=True)
class DecodeGroup:
    """Decodes of similar context length, attended in one batched call."""

    query_start: int  # first query row in the packed batch
    query_end: int
    block_ids: torch.Tensor  # [rows * max_blocks] block tables padded to the group's longest
    mask: torch.Tensor  # [rows, 1, 1, max_blocks * block_size] bool: which keys are real


@dataclass(slots=True)
class PrefillSpan:
    query_start: int
    query_end: int
    block_ids: torch.Tensor  # [blocks] the sequence's block table, up to the chunk's end
    num_context: int  # keys the chunk attends to: every token up to its end
    mask: torch.Tensor | None  # [1, 1, chunk, context] bool, or None for a plain causal chunk


@dataclass(slots=True)
class StepMetadata:
    slot_mapping: torch.Tensor  # [num_tokens]: flat slot (block * block_size + offset) per token
    decode_groups: list[DecodeGroup]
    prefills: list[PrefillSpan]


class PagedKVCache:
    """What the model sees as its cache: it writes new K/V into the pool and returns the pool."""

    def __init__(self, k_pool: torch.Tensor, v_pool: torch.Tensor, slot_mapping: torch.Tensor):
        self._k_pool = k_pool  # [layers, blocks, block_size, kv_heads, head_dim]
        self._v_pool = v_pool
        self._slot_mapping = slot_mapping

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        # [1, kv_heads, num_tokens, head_dim] -> [num_tokens, kv_heads, head_dim] into flat slots
        for pool, states in ((self._k_pool, key_states), (self._v_pool, value_states)):
            flat = pool[layer_idx].flatten(0, 1)  # a view: [slots, kv_heads, head_dim]
            flat.index_copy_(0, self._slot_mapping, states[0].transpose(0, 1))
        return self._k_pool[layer_idx], self._v_pool[layer_idx]


def paged_attention(module, query, key_pool, value_pool, attention_mask, scaling=None, **kwargs):
    """query: [1, heads, num_tokens, head_dim]; returns [1, num_tokens, heads, head_dim]."""
    step: StepMetadata | None = kwargs.get(STEP_KWARG)
    if step is None:  # an ordinary forward (e.g. `generate`) on the same model: plain SDPA
        return sdpa_attention_forward(
            module, query, key_pool, value_pool, attention_mask, scaling=scaling, **kwargs
        )
    q = query[0]  # [heads, num_tokens, head_dim]
    out = torch.empty(q.shape[1], q.shape[0], q.shape[2], dtype=q.dtype, device=q.device)
    for group in step.decode_groups:
        rows = slice(group.query_start, group.query_end)
        out[rows] = _decode(q[:, rows], key_pool, value_pool, group, scaling)
    for span in step.prefills:
        out[span.query_start : span.query_end] = _prefill(q, key_pool, value_pool, span, scaling)
    return out.unsqueeze(0), None


def _gather(pool: torch.Tensor, block_ids: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Blocks of one layer's pool -> [num_rows, kv_heads, context, head_dim]."""
    blocks = pool.index_select(0, block_ids)  # [rows * blocks, block_size, kv_heads, dim]
    return blocks.view(num_rows, -1, *pool.shape[2:]).transpose(1, 2)


def _decode(q, key_pool, value_pool, group: DecodeGroup, scaling) -> torch.Tensor:
    q = q.transpose(0, 1).unsqueeze(2)  # [heads, rows, dim] -> [rows, heads, 1, dim]
    k = _gather(key_pool, group.block_ids, q.shape[0])
    v = _gather(value_pool, group.block_ids, q.shape[0])
    o = F.scaled_dot_product_attention(
        q, k, v, attn_mask=group.mask, scale=scaling, enable_gqa=True
    )
    return o[:, :, 0, :]  # [rows, heads, dim]


def _prefill(q, key_pool, value_pool, span: PrefillSpan, scaling) -> torch.Tensor:
    q = q[:, span.query_start : span.query_end].unsqueeze(0)  # [1, heads, chunk, dim]
    k = _gather(key_pool, span.block_ids, 1)[:, :, : span.num_context]
    v = _gather(value_pool, span.block_ids, 1)[:, :, : span.num_context]
    o = F.scaled_dot_product_attention(
        q, k, v, attn_mask=span.mask, is_causal=span.mask is None, scale=scaling, enable_gqa=True
    )
    return o[0].transpose(0, 1)  # [chunk, heads, dim]


AttentionInterface.register(ATTENTION_NAME, paged_attention)
