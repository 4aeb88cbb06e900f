"""A sequence's KV blocks out of the paged pool and into another, as bytes: the payload of a
prefill/decode hand-off (issue 22; the transport is `worker/kv_link.py`).

The format is the engine's own paged block layout: keys then values, each [layers, kv_heads,
blocks, block_size, head_dim] in the model's dtype, the sequence's blocks in its block-table
order, C-contiguous. No framing of its own and no pickle: the receiver checks the sender's
`KVLayout` against its pool and reads the bytes back with `torch.frombuffer`. Partly filled
last blocks travel whole; the receiver's KV manager knows the token count.
"""

from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass
from typing import Any

import torch


@dataclass(frozen=True, slots=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int
    block_size: int
    head_dim: int
    dtype: str  # "bfloat16", "float32", ...

    @classmethod
    def of_pool(cls, k_pool: torch.Tensor) -> KVLayout:
        layers, kv_heads, _, block_size, head_dim = k_pool.shape
        return cls(layers, kv_heads, block_size, head_dim, str(k_pool.dtype).removeprefix("torch."))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVLayout:
        return cls(**{name: data[name] for name in cls.__dataclass_fields__})

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block, keys and values."""
        itemsize = getattr(torch, self.dtype).itemsize
        elements = self.num_layers * self.num_kv_heads * self.block_size * self.head_dim
        return 2 * elements * itemsize


def read_blocks(k_pool: torch.Tensor, v_pool: torch.Tensor, block_ids: list[int]) -> memoryview:
    """The blocks' keys and values, one contiguous copy, as bytes (on the CPU)."""
    index = torch.tensor(block_ids, dtype=torch.long, device=k_pool.device)
    layers, kv_heads, _, block_size, head_dim = k_pool.shape
    shape = (2, layers, kv_heads, len(block_ids), block_size, head_dim)
    blocks = k_pool.new_empty(shape)
    torch.index_select(k_pool, 2, index, out=blocks[0])  # one copy, straight into place
    torch.index_select(v_pool, 2, index, out=blocks[1])
    flat = blocks.cpu().view(-1).view(torch.uint8)
    return flat.numpy().data.cast("B")


def write_blocks(
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_ids: list[int],
    layout: KVLayout,
    payload: memoryview | bytes,
) -> None:
    """Put blocks read by `read_blocks` (from a pool of `layout`) at `block_ids` of this pool."""
    if layout != KVLayout.of_pool(k_pool):
        raise ValueError(
            f"KV layout {layout} does not match this pool's {KVLayout.of_pool(k_pool)}"
        )
    if len(payload) != layout.block_nbytes * len(block_ids):
        raise ValueError(
            f"{len(payload)} bytes of KV for {len(block_ids)} blocks of {layout.block_nbytes}"
        )
    if not block_ids:
        return
    shape = (
        2,
        layout.num_layers,
        layout.num_kv_heads,
        len(block_ids),
        layout.block_size,
        layout.head_dim,
    )
    with warnings.catch_warnings():  # a received frame is read-only: it is only read here
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        raw = torch.frombuffer(payload, dtype=torch.uint8)
    blocks = raw.view(k_pool.dtype).view(shape)
    index = torch.tensor(block_ids, dtype=torch.long, device=k_pool.device)
    blocks = blocks.to(k_pool.device)
    k_pool.index_copy_(2, index, blocks[0])
    v_pool.index_copy_(2, index, blocks[1])
