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


# Prefix caching: `make_sequence` gives every sequence of a length the same tokens.


def _computed(kv: KVCacheManager, seq) -> None:
    """Admit `seq`, compute all its tokens, and seal its blocks, as a step would."""
    seq.num_computed_tokens = start = kv.admit(seq)
    kv.allocate(seq, seq.num_tokens - seq.num_computed_tokens)
    seq.num_computed_tokens = seq.num_tokens
    kv.seal(seq, start)


def test_a_tenant_reuses_its_own_full_blocks_and_computes_at_least_its_last_token():
    kv = KVCacheManager(num_blocks=20, block_size=4, prefix_caching=True)
    first = make_sequence(0, 10, 4, tenant_id="a")
    _computed(kv, first)
    again = make_sequence(1, 10, 4, tenant_id="a")
    assert kv.admit(again) == 8  # both full blocks; the last two tokens are computed
    assert again.block_table == first.block_table[:2]
    exact = make_sequence(2, 8, 4, tenant_id="a")  # exactly two full blocks
    assert kv.admit(exact) == 4  # the last token is computed: the second block is not taken
    assert kv.num_hit_tokens == 12 and kv.num_queried_tokens == 10 + 10 + 8


def test_no_block_is_shared_across_tenants():
    kv = KVCacheManager(num_blocks=20, block_size=4, prefix_caching=True)
    a = make_sequence(0, 10, 4, tenant_id="a")
    _computed(kv, a)
    b = make_sequence(1, 10, 4, tenant_id="b")  # the same tokens, another tenant
    assert kv.admit(b) == 0 and b.block_table == []
    _computed(kv, b)
    assert not set(a.block_table) & set(b.block_table)
    assert kv.num_hit_tokens == 0


def test_a_cached_block_nobody_holds_is_free_and_the_least_recently_freed_goes_first():
    kv = KVCacheManager(num_blocks=6, block_size=4, prefix_caching=True)
    old, recent = make_sequence(0, 8, 1, tenant_id="old"), make_sequence(1, 8, 1, tenant_id="new")
    _computed(kv, old)
    _computed(kv, recent)
    kv.free(old)
    kv.free(recent)
    assert kv.num_free_blocks == 6 and kv.num_cached_blocks == 4 and kv.usage == 0
    grow = make_sequence(2, 12, 1, tenant_id="other")  # 3 blocks: 2 empty, then 1 cached
    kv.allocate(grow, 12)
    assert kv.num_cached_blocks == 3
    # The evicted block is the last of `old`'s chain (freed tail first): its root stays.
    assert kv.admit(make_sequence(3, 9, 1, tenant_id="old")) == 4
    assert kv.admit(make_sequence(4, 9, 1, tenant_id="new")) == 8


def test_can_admit_counts_a_cached_prefix_as_held_not_free():
    kv = KVCacheManager(num_blocks=4, block_size=4, prefix_caching=True)
    first = make_sequence(0, 8, 1, tenant_id="a")
    _computed(kv, first)
    kv.free(first)  # its 2 blocks cached, all 4 free
    assert kv.can_admit(make_sequence(1, 16, 1, tenant_id="a"))  # 1 cached + 3 new of 4
    assert not kv.can_admit(make_sequence(2, 17, 1, tenant_id="b"))  # 5 blocks


def test_freeing_a_shared_block_only_drops_a_reference():
    kv = KVCacheManager(num_blocks=8, block_size=4, prefix_caching=True)
    a, b = make_sequence(0, 9, 1, tenant_id="a"), make_sequence(1, 9, 1, tenant_id="a")
    _computed(kv, a)
    _computed(kv, b)
    assert b.block_table[:2] == a.block_table[:2] and kv.num_free_blocks == 8 - 4
    assert kv.num_freed_by(a) == 1  # only its own last block
    kv.free(a)
    kv.check([b])
    assert kv.num_free_blocks == 8 - 3
    kv.free(b)
    kv.check([])
    assert kv.num_free_blocks == 8


def test_waste_is_the_empty_share_of_the_slots_in_use():
    kv = KVCacheManager(num_blocks=10, block_size=4, prefix_caching=True)
    assert kv.waste([]) is None
    a, b = make_sequence(0, 5, 1, tenant_id="a"), make_sequence(1, 8, 1, tenant_id="b")
    _computed(kv, a)
    _computed(kv, b)
    assert kv.waste([a, b]) == pytest.approx(3 / 16)  # a's second block holds 1 of 4
    shared = make_sequence(2, 6, 1, tenant_id="a")  # takes a's first block, adds one
    _computed(kv, shared)
    assert kv.waste([a, b, shared]) == pytest.approx((3 + 2) / 20)
