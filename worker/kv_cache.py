"""The KV-cache manager: a fixed pool of fixed-size blocks, handed out per sequence.

Plain Python, no torch: it only does the accounting. The model runner owns the tensors and
addresses them through each sequence's block table (token t of a sequence lives in block
`block_table[t // block_size]`, offset `t % block_size`). A sequence holds
ceil(tokens computed / block_size) blocks, so at most one block per sequence is partly empty.
"""

from __future__ import annotations

from collections import deque

from worker.sequence import Sequence


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("the KV cache needs at least one block of at least one token")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free_block_ids: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_block_ids)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    @property
    def max_num_tokens_per_sequence(self) -> int:
        return self.num_blocks * self.block_size

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
        seq.block_table.extend(self._free_block_ids.popleft() for _ in range(num_missing))

    def free(self, seq: Sequence) -> None:
        self._free_block_ids.extend(seq.block_table)
        seq.block_table = []

    def _num_missing_blocks(self, seq: Sequence, num_new_tokens: int) -> int:
        num_needed = self.num_blocks_for(seq.num_computed_tokens + num_new_tokens)
        return max(0, num_needed - len(seq.block_table))
