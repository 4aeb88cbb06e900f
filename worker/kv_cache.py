"""The KV-cache manager: a fixed pool of fixed-size blocks, handed out per sequence, with
automatic prefix caching isolated per tenant.

Plain Python, no torch: it only does the accounting. The model runner owns the tensors and
addresses them through each sequence's block table (token t of a sequence lives in block
`block_table[t // block_size]`, offset `t % block_size`). A sequence holds
ceil(tokens computed / block_size) blocks, so at most one block per sequence is partly empty.

Prefix caching (`prefix_caching=True`): a block whose tokens are all computed is *sealed*
under a hash of its tokens chained to the hash of the block before it, the chain salted
with the tenant id (as vLLM's `cache_salt`), so a tenant can only ever find its own blocks
(a shared cache is a timing side channel: CVE-2025-46570). A sequence admitted later
whose first blocks hash the same takes those blocks (a reference each) instead of
computing them. A block nobody references stays cached until its place is needed: such
blocks count as free and are reused least recently freed first. Only full blocks are
shared, and a sequence always computes at least its last token, so no sequence ever writes
into a block another one reads.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque

from worker.sequence import Sequence


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, *, prefix_caching: bool = False) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("the KV cache needs at least one block of at least one token")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self._free_block_ids: deque[int] = deque(range(num_blocks))  # hold nothing
        self._ref_counts = [0] * num_blocks
        self._num_refs = 0  # sum of the reference counts
        self._num_referenced = 0  # blocks with a reference
        self._hash_of: dict[int, bytes] = {}  # sealed block -> its hash
        self._block_of: dict[bytes, int] = {}  # hash -> sealed block
        # Sealed blocks nobody references, least recently freed first: free, but still cached.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self.num_queried_tokens = 0  # prompt tokens looked up at admission
        self.num_hit_tokens = 0  # of them, found cached

    @property
    def num_free_blocks(self) -> int:
        """Blocks a new token may take: empty ones and cached ones nobody references."""
        return len(self._free_block_ids) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._block_of)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by sequences."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    @property
    def max_num_tokens_per_sequence(self) -> int:
        return self.num_blocks * self.block_size

    def waste(self, running: list[Sequence]) -> float | None:
        """Fraction of the slots in referenced blocks that hold no computed token (the
        partly filled last block of each sequence); None when no block is referenced."""
        if self._num_referenced == 0:
            return None
        unused = sum(len(s.block_table) * self.block_size - s.num_computed_tokens for s in running)
        return unused / (self._num_referenced * self.block_size)

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_fit_alone(self, num_tokens: int) -> bool:
        """Whether a sequence of this many tokens fits in the empty pool: else it never can."""
        return self.num_blocks_for(num_tokens) <= self.num_blocks

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self._num_missing_blocks(seq, num_new_tokens) <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow the sequence's block table to cover its next `num_new_tokens` tokens."""
        num_missing = self._num_missing_blocks(seq, num_new_tokens)
        if num_missing > self.num_free_blocks:
            raise RuntimeError("allocate without can_allocate")  # a scheduler bug, never input
        for _ in range(num_missing):
            block = self._take_free_block()
            self._reference(block)
            seq.block_table.append(block)

    def can_admit(self, seq: Sequence) -> bool:
        """Whether all of a waiting sequence's tokens fit, its cached prefix counted as held."""
        hits = self._cached_prefix(seq)
        num_evictable_hits = sum(1 for block in hits if block in self._evictable)
        num_new = self.num_blocks_for(seq.num_tokens) - len(hits)
        return num_new <= self.num_free_blocks - num_evictable_hits

    def admit(self, seq: Sequence) -> int:
        """Give a waiting sequence (holding no blocks) its cached prefix; the number of its
        tokens already computed, a whole number of blocks and always fewer than all."""
        if seq.block_table:
            raise RuntimeError("admit of a sequence that holds blocks")
        hits = self._cached_prefix(seq)
        for block in hits:
            self._evictable.pop(block, None)
            self._reference(block)
        seq.block_table.extend(hits)
        if self.prefix_caching:
            self.num_queried_tokens += seq.num_tokens
            self.num_hit_tokens += len(hits) * self.block_size
        return len(hits) * self.block_size

    def seal(self, seq: Sequence, num_computed_before: int) -> None:
        """Cache the blocks that the tokens computed since `num_computed_before` filled
        (per step only those: the blocks before them were sealed or taken from the cache)."""
        if not self.prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        first = num_computed_before // self.block_size
        if num_full == first:
            return  # no block filled in this step: most decodes
        hashes = self._block_hashes(seq, num_full)
        for index in range(first, num_full):
            block, block_hash = seq.block_table[index], hashes[index]
            if block in self._hash_of:
                continue  # sealed already (its own, or taken from the cache)
            if block_hash not in self._block_of:  # else an equal block was sealed first
                self._hash_of[block] = block_hash
                self._block_of[block_hash] = block

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references; its last blocks first, so that a cached chain is
        evicted from its tail, not its root."""
        for block in reversed(seq.block_table):
            self._ref_counts[block] -= 1
            self._num_refs -= 1
            if self._ref_counts[block] == 0:
                self._num_referenced -= 1
                if block in self._hash_of:
                    self._evictable[block] = None
                else:
                    self._free_block_ids.append(block)
        seq.block_table = []

    def num_freed_by(self, seq: Sequence) -> int:
        """Blocks that freeing `seq` would make free: those no other sequence references."""
        return sum(1 for block in seq.block_table if self._ref_counts[block] == 1)

    def check(self, running: list[Sequence]) -> None:
        """Raise if the blocks `running` hold and the free blocks do not add up (cheap: it
        runs every step)."""
        if sum(len(seq.block_table) for seq in running) != self._num_refs:
            raise RuntimeError("KV block references leaked or double-freed")
        if self._num_referenced + self.num_free_blocks != self.num_blocks:
            raise RuntimeError("KV blocks leaked or double-freed")

    def _reference(self, block: int) -> None:
        if self._ref_counts[block] == 0:
            self._num_referenced += 1
        self._ref_counts[block] += 1
        self._num_refs += 1

    def _take_free_block(self) -> int:
        if self._free_block_ids:
            return self._free_block_ids.popleft()
        block, _ = self._evictable.popitem(last=False)  # the least recently freed
        del self._block_of[self._hash_of.pop(block)]
        return block

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """The sealed blocks that hold the sequence's first tokens, leaving its last token
        to be computed (it yields the next token's logits)."""
        if not self.prefix_caching:
            return []
        num_full = (seq.num_tokens - 1) // self.block_size
        hits = []
        for block_hash in self._block_hashes(seq, num_full):
            block = self._block_of.get(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def _block_hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """Hashes of the sequence's first `num_blocks` full blocks, extended as it grows."""
        hashes = seq.block_hashes
        size = self.block_size
        while len(hashes) < num_blocks:
            index = len(hashes)
            parent = hashes[-1] if hashes else _tenant_salt(seq.tenant_id)
            tokens = array("q", seq.token_ids(index * size, (index + 1) * size)).tobytes()
            hashes.append(hashlib.sha256(parent + tokens).digest())
        return hashes[:num_blocks]

    def _num_missing_blocks(self, seq: Sequence, num_new_tokens: int) -> int:
        num_needed = self.num_blocks_for(seq.num_computed_tokens + num_new_tokens)
        return max(0, num_needed - len(seq.block_table))


def _tenant_salt(tenant_id: str) -> bytes:
    """The root of a tenant's hash chains: no two tenants' blocks ever hash alike."""
    return hashlib.sha256(b"llmfleet-prefix-cache-tenant\0" + tenant_id.encode()).digest()
