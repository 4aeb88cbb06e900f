"""Attention over the paged KV cache, plugged into the unmodified Hugging Face forward.

The step's tokens are packed into one row ([1, num_tokens]) so the projections and MLPs run
on exactly the tokens scheduled, with no padding. Each attention layer calls
`cache.update(...)` (our `PagedKVCache` writes the new keys and values into their slots)
and then the registered attention function, which attends per sequence:

- decodes (one query token each) in one batched SDPA call, over keys gathered from their
  block tables and padded to the longest context, with a padding mask;
- each prefill chunk in its own SDPA call, causal with the chunk's offset.

The gather indices are built once per step (`StepMetadata`) and shared by all layers.
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
class PrefillSpan:
    query_start: int  # first query row in the packed batch
    query_end: int
    kv_slots: torch.Tensor  # [context] slot of every key the chunk attends to
    mask: torch.Tensor | None  # [1, 1, chunk, context] bool, or None for a plain causal chunk


@dataclass(slots=True)
class StepMetadata:
    slot_mapping: torch.Tensor  # [num_tokens]: where each new token's K/V is written
    num_decodes: int
    decode_kv_slots: torch.Tensor | None  # [num_decodes, max_context]
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_context] bool
    prefills: list[PrefillSpan]


class PagedKVCache:
    """What the model sees as its cache: it writes new K/V into the pool and returns the pool."""

    def __init__(self, k_pool: torch.Tensor, v_pool: torch.Tensor, slot_mapping: torch.Tensor):
        self._k_pool = k_pool  # [layers, slots, kv_heads, head_dim]
        self._v_pool = v_pool
        self._slot_mapping = slot_mapping

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        # [1, kv_heads, num_tokens, head_dim] -> [num_tokens, kv_heads, head_dim]
        self._k_pool[layer_idx].index_copy_(0, self._slot_mapping, key_states[0].transpose(0, 1))
        self._v_pool[layer_idx].index_copy_(0, self._slot_mapping, value_states[0].transpose(0, 1))
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
    if step.num_decodes:
        out[: step.num_decodes] = _decode(
            q[:, : step.num_decodes], key_pool, value_pool, step, scaling
        )
    for span in step.prefills:
        out[span.query_start : span.query_end] = _prefill(q, key_pool, value_pool, span, scaling)
    return out.unsqueeze(0), None


def _decode(q, key_pool, value_pool, step: StepMetadata, scaling) -> torch.Tensor:
    # q: [heads, num_decodes, head_dim] -> [num_decodes, heads, 1, head_dim]
    q = q.transpose(0, 1).unsqueeze(2)
    k = key_pool[step.decode_kv_slots].transpose(1, 2)  # [num_decodes, kv_heads, context, dim]
    v = value_pool[step.decode_kv_slots].transpose(1, 2)
    o = F.scaled_dot_product_attention(
        q, k, v, attn_mask=step.decode_mask, scale=scaling, enable_gqa=True
    )
    return o[:, :, 0, :]  # [num_decodes, heads, head_dim]


def _prefill(q, key_pool, value_pool, span: PrefillSpan, scaling) -> torch.Tensor:
    q = q[:, span.query_start : span.query_end].unsqueeze(0)  # [1, heads, chunk, dim]
    k = key_pool[span.kv_slots].transpose(0, 1).unsqueeze(0)  # [1, kv_heads, context, dim]
    v = value_pool[span.kv_slots].transpose(0, 1).unsqueeze(0)
    o = F.scaled_dot_product_attention(
        q, k, v, attn_mask=span.mask, is_causal=span.mask is None, scale=scaling, enable_gqa=True
    )
    return o[0].transpose(0, 1)  # [chunk, heads, dim]


AttentionInterface.register(ATTENTION_NAME, paged_attention)
