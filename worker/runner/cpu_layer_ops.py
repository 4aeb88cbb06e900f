"""A decoder layer's element-wise work on the CPU, fused into four C calls a layer.

Between its matmuls a layer of our forward (`llama.py`) ran some 25 small torch ops: the two
RMS norms (a cast, the norm, a cast back, the scale), the residual adds, RoPE (two products,
a rotation built by slicing and concatenating, a sum), the two writes into the paged pool,
and SiLU times the up projection. At batch 1 each costs its dispatch and allocation more
than its arithmetic: some 750 ops a step of the default model, a third of a decode step on
this machine (docs/benchmarks.md, "Fused layer ops"). `csrc/layer_ops.c` does the same work
in `rms_norm`, `add_rms_norm` (residual and norm), `rope_write` (RoPE in place, then the keys
and values into the pool) and `silu_mul`, rounding where torch's ops round, so the results
are torch's but for the order of the norm's sum and the last bits of SiLU's exp
(tests/worker/test_cpu_layer_ops.py).

`LayerOps.for_model` is None (the torch ops run) off the CPU, for dtypes other than bf16 and
fp32, for dimensions not a multiple of 16 (of 32 for a head), where the kernels cannot be
built (`cpu_kernels.py`), or with `LLMFLEET_CPU_LAYER_OPS=0`.
"""

from __future__ import annotations

import ctypes
import os

import torch

from worker.runner.cpu_kernels import load

_DTYPES = {torch.bfloat16: 1, torch.float32: 0}


class LayerOps:
    def __init__(self, library: ctypes.CDLL, dtype: torch.dtype) -> None:
        self._library = library
        self._is_bf16 = _DTYPES[dtype]

    @classmethod
    def for_model(
        cls, device: torch.device, dtype: torch.dtype, dims: tuple[int, ...], head_dim: int
    ) -> LayerOps | None:
        """The fused ops for a model with these dimensions (hidden, intermediate), or None."""
        if os.environ.get("LLMFLEET_CPU_LAYER_OPS", "1") == "0":
            return None
        if device.type != "cpu" or dtype not in _DTYPES:
            return None
        if any(dim % 16 for dim in dims) or head_dim % 32:
            return None
        library = load()
        return None if library is None else cls(library, dtype)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """HF's RMS norm of each row of x [rows, dim] (contiguous)."""
        out = torch.empty_like(x)
        rows, dim = x.shape
        self._library.rms_norm(
            x.data_ptr(), weight.data_ptr(), out.data_ptr(), rows, dim, eps, self._is_bf16
        )
        return out

    def add_rms_norm(
        self, hidden: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """`hidden += delta` in place (the residual), then the RMS norm of the sum."""
        out = torch.empty_like(hidden)
        rows, dim = hidden.shape
        self._library.add_rms_norm(
            hidden.data_ptr(),
            delta.contiguous().data_ptr(),
            weight.data_ptr(),
            out.data_ptr(),
            rows,
            dim,
            eps,
            self._is_bf16,
        )
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """`F.silu(gate) * up` of a fused gate-up projection's output [rows, 2 * inter]."""
        rows, width = gate_up.shape
        out = gate_up.new_empty(rows, width // 2)
        self._library.silu_mul(gate_up.data_ptr(), out.data_ptr(), rows, width // 2, self._is_bf16)
        return out

    def rope_write(
        self,
        qkv: torch.Tensor,  # [tokens, (heads + 2 * kv_heads) * head_dim], contiguous
        cos: torch.Tensor,  # [tokens, head_dim], contiguous
        sin: torch.Tensor,
        num_heads: int,
        k_pool: torch.Tensor,  # one layer's [kv_heads, blocks, block_size, head_dim]
        v_pool: torch.Tensor,
        slot_mapping: torch.Tensor,  # [tokens] int64
    ) -> None:
        """RoPE on the queries and keys in place, then the keys and values into the pools."""
        kv_heads, num_blocks, block_size, head_dim = k_pool.shape
        self._library.rope_write(
            qkv.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            k_pool.data_ptr(),
            v_pool.data_ptr(),
            slot_mapping.data_ptr(),
            qkv.shape[0],
            num_heads,
            kv_heads,
            head_dim,
            num_blocks * block_size,
            self._is_bf16,
        )
