"""A step's prompt chunks attended as one padded batch (`paged_attention.prefill_batch`, a
GPU's way) against one call per chunk, and the guard that keeps the padding bounded."""

from __future__ import annotations

import pytest
import torch

from worker.runner import paged_attention
from worker.runner.paged_attention import PrefillSpan, StepMetadata, attend, pool_rows

BLOCK_SIZE = 4


def _pools(kv_heads: int, head_dim: int, num_blocks: int = 64, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    shape = (kv_heads, num_blocks, BLOCK_SIZE, head_dim)
    return torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)


def _chunks(lengths: list[int], starts: list[int], num_blocks: int, seed: int = 1):
    """Block tables (random, distinct blocks) of chunks of `lengths` new tokens after
    `starts` tokens already in the pool."""
    generator = torch.Generator().manual_seed(seed)
    free = torch.randperm(num_blocks, generator=generator).tolist()
    tables = []
    for length, start in zip(lengths, starts, strict=True):
        num_table_blocks = -(-(start + length) // BLOCK_SIZE)
        tables.append([free.pop() for _ in range(num_table_blocks)])
    return tables


def _step(lengths, starts, tables, k_pool, num_decodes: int, padded: bool) -> StepMetadata:
    spans, row = [], num_decodes
    for length, start, table in zip(lengths, starts, tables, strict=True):
        end = start + length
        mask = None
        if start:
            queries, keys = torch.arange(start, end), torch.arange(end)
            mask = (keys[None, :] <= queries[:, None])[None, None]
        rows = pool_rows(torch.tensor(table), k_pool.shape[0], k_pool.shape[1])
        spans.append(PrefillSpan(row, row + length, rows, end, mask))
        row += length
    step = StepMetadata(torch.zeros(0, dtype=torch.long), [], spans)
    if padded:
        contexts = [s + n for s, n in zip(starts, lengths, strict=True)]
        step.prefill_batch = paged_attention.prefill_batch(
            num_decodes, lengths, contexts, tables, k_pool, torch.float32
        )
        assert step.prefill_batch is not None
    return step


@pytest.mark.parametrize(
    ("heads", "kv_heads", "lengths", "starts"),
    [
        (6, 2, [5, 1, 13, 7], [0, 9, 3, 0]),  # chunks of a prompt's start, middle and one token
        (4, 4, [8, 8], [0, 8]),  # no GQA; equal chunks
        (8, 1, [3, 11, 2], [4, 0, 9]),  # one KV head for all queries
    ],
)
def test_one_padded_call_attends_as_one_call_per_chunk(heads, kv_heads, lengths, starts):
    head_dim, num_decodes = 16, 3  # the chunks' rows follow three decodes' rows
    k_pool, v_pool = _pools(kv_heads, head_dim)
    tables = _chunks(lengths, starts, k_pool.shape[1])
    num_rows = num_decodes + sum(lengths)
    q = torch.randn(heads, num_rows, head_dim, generator=torch.Generator().manual_seed(2))
    per_chunk = attend(
        q, k_pool, v_pool, _step(lengths, starts, tables, k_pool, num_decodes, False)
    )
    padded = attend(q, k_pool, v_pool, _step(lengths, starts, tables, k_pool, num_decodes, True))
    rows = slice(num_decodes, num_rows)
    assert torch.allclose(padded[rows], per_chunk[rows], atol=1e-5, rtol=1e-5)
    # causal and per chunk: moving the pool's keys past a query's position, or another
    # chunk's, leaves its output alone
    moved_k = k_pool.clone()
    last_table, last_end = tables[-1], starts[-1] + lengths[-1]
    block, offset = last_table[(last_end - 1) // BLOCK_SIZE], (last_end - 1) % BLOCK_SIZE
    moved_k[:, block, offset] += 10
    moved = attend(q, moved_k, v_pool, _step(lengths, starts, tables, k_pool, num_decodes, True))
    last_row = num_rows - 1
    assert torch.equal(moved[num_decodes:last_row], padded[num_decodes:last_row])
    assert not torch.allclose(moved[last_row], padded[last_row])


def test_padding_past_its_bound_keeps_a_call_per_chunk():
    k_pool, _ = _pools(2, 16, num_blocks=600)
    # one long chunk beside eight one-token ones: 9 x 256 padded queries for 264 real
    lengths, starts = [256] + [1] * 8, [0] + [40] * 8
    tables = _chunks(lengths, starts, k_pool.shape[1])
    contexts = [s + n for s, n in zip(starts, lengths, strict=True)]
    assert (
        paged_attention.prefill_batch(0, lengths, contexts, tables, k_pool, torch.float32) is None
    )
    # the long chunk with one other of about its size: padded
    lengths, starts = [256, 200], [0, 30]
    tables = _chunks(lengths, starts, k_pool.shape[1])
    contexts = [s + n for s, n in zip(starts, lengths, strict=True)]
    batch = paged_attention.prefill_batch(0, lengths, contexts, tables, k_pool, torch.float32)
    assert batch is not None and batch.query_rows.shape == (2, 256)
    assert batch.real_rows.shape == (456,)
