"""The KV-cache manager's block accounting."""

from __future__ import annotations

import pytest

from tests.factories import make_sequence
from worker.kv_cache import KVCacheManager


def test_blocks_follow_the_tokens_with_at_most_one_partial_block():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    seq = make_sequence(0, num_prompt_tokens=5, max_tokens=10)
    assert kv.can_allocate(seq, 5)
    kv.allocate(seq, 5)
    assert len(seq.block_table) == 2  # 5 tokens -> 2 blocks of 4
    seq.num_computed_tokens = 5
    for num_tokens in range(6, 14):
        kv.allocate(seq, 1)
        seq.num_computed_tokens = num_tokens
        assert len(seq.block_table) == -(-num_tokens // 4)  # never more than one partial block
    assert kv.num_free_blocks == 10 - 4
    kv.free(seq)
    assert kv.num_free_blocks == 10 and seq.block_table == []


def test_block_ids_are_distinct_across_sequences():
    kv = KVCacheManager(num_blocks=6, block_size=2)
    a, b = make_sequence(0, 4, 1), make_sequence(1, 6, 1)
    kv.allocate(a, 4)
    kv.allocate(b, 6)
    assert not set(a.block_table) & set(b.block_table)
    assert kv.num_free_blocks == 1
    assert kv.usage == pytest.approx(5 / 6)


def test_cannot_allocate_past_the_pool():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    seq = make_sequence(0, 9, 1)
    assert not kv.can_allocate(seq, 9)
    assert not kv.can_fit_alone(9) and kv.can_fit_alone(8)
    with pytest.raises(RuntimeError):
        kv.allocate(seq, 9)
