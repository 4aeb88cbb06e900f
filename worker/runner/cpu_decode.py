"""A decode step of a few sequences (1-8; where the tiled matmuls run, any number) in one C call,
from its tokens to its logits.

At one sequence a layer of the default model streams its 7 MB of weights in about a quarter
of a millisecond, and the Python between the kernels (the forward's glue, each kernel's
argument conversion, each torch op's dispatch and allocation) added close to half of that
again. `csrc/decode_layers.c` calls the same kernels in the same order as `llama.py`'s
fused forward, so its results are that forward's bit for bit
(tests/worker/test_cpu_decode.py); the weights' addresses are gathered once, here. The call
also takes the step's embedding, the norms around the layers and the LM head: from Python they
were cheap ops each, but they ran with caches the step's weights had just swept, about 0.15 ms
of a 10 ms step at one sequence (docs/benchmarks.md, session 33).

Where the weights are also packed in AMX's tile layout (`llama._Linear.tiled_weight`), the
matmuls of any number of rows have a kernel (`csrc/amx_matmul.c` on a CPU with AMX; past the
few-row kernel's 8 rows `csrc/pair_matmul.c` on one with AVX512-BF16 but no AMX), so every
decode-only step goes through here: at 32 sequences the Python between the kernels was ~270
calls a step.

`DecodeLayers.step_at` takes a decode-only step from the scheduler's lists instead of tensors
(`csrc/decode_layers.c`'s `decode_step_at`): RoPE's cos and sin read from the forward's table
in C, and, where every row is greedy, each row's argmax taken there too. In a batch-1 step
the torch ops those stood in for (the inputs' tensors, the table's lookup, slicing, the
argmax) cost about 0.5 ms with the caches the step's weights had just swept (session 34).

`DecodeLayers.for_forward` is None where it cannot run: off the CPU, for dtypes other than
bf16, without the fused layer ops or the few-row or tiled matmuls (a CPU without
AVX512-BF16), for attention shapes the decode kernel does not take, or with
`LLMFLEET_CPU_DECODE_LAYERS=0`.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

import torch

from worker.runner import cpu_attention
from worker.runner.cpu_kernels import AMX_FROM_ROWS, amx_matmuls_available, load
from worker.runner.paged_attention import DecodeGroup

_P, _I = ctypes.c_void_p, ctypes.c_int
# With the tiled matmuls a step of any number of decodes runs here: no engine runs more at once.
MAX_ROWS_TILED = 4096
_TILED_AMX, _TILED_PAIRS = 1, 2  # decode_layers.c's Model.tiled


class _Weight(ctypes.Structure):
    _fields_ = [("plain", _P), ("tiled", _P)]


class _LayerWeights(ctypes.Structure):
    _fields_ = [
        *[(name, _P) for name in ("input_norm", "qkv_bias", "post_norm")],
        *[(name, _Weight) for name in ("qkv", "o", "gate_up", "down")],
    ]


class _Group(ctypes.Structure):
    _fields_ = [("tables", _P), ("lengths", _P), ("query_start", _I), ("rows", _I),
                ("max_blocks", _I)]  # fmt: skip


class _Model(ctypes.Structure):
    _fields_ = [("layers", ctypes.POINTER(_LayerWeights)), *[(name, _I) for name in (
        "num_layers", "hidden", "inter", "heads", "kv_heads", "dim", "num_blocks", "block_size"
    )], ("eps", ctypes.c_float), ("scale", ctypes.c_float), ("tiled", _I),
        ("tiled_from", _I), ("embed", _P), ("norm", _P), ("lm_head", _Weight),
        ("embed_rows", _I), ("vocab", _I)]  # fmt: skip


class DecodeLayers:
    """`step(input_ids, ...)`: the logits of a decode step of at most `max_rows` sequences;
    `step_at(token_ids, ...)`: the same from lists. One model's runners share it (and
    `step_at`'s buffers): their steps run one at a time, as a worker's engine runs them."""

    def __init__(self, library: ctypes.CDLL, forward: Any, max_rows: int, tiled: int) -> None:
        self._library = library
        self.max_rows = max_rows
        self._weights = (_LayerWeights * len(forward.layers))()

        def matrix(linear: Any) -> _Weight:  # the weight as the C matmuls read it
            packed = linear.tiled_weight if tiled else None
            return _Weight(linear.weight.data_ptr(), None if packed is None else packed.data_ptr())

        for entry, layer in zip(self._weights, forward.layers, strict=True):
            entry.input_norm = layer.input_norm.data_ptr()
            entry.qkv = matrix(layer.qkv)
            entry.qkv_bias = None if layer.qkv.bias is None else layer.qkv.bias.data_ptr()
            entry.o = matrix(layer.o)
            entry.post_norm = layer.post_norm.data_ptr()
            entry.gate_up = matrix(layer.gate_up)
            entry.down = matrix(layer.down)
        hidden, inter = forward.embed.shape[1], forward.layers[0].down.weight.shape[1]
        self.vocab_size = forward.lm_head.weight.shape[0]
        # num_blocks and block_size are each step's pool's, set by `step`
        self._model = _Model(
            self._weights, len(forward.layers), hidden, inter, forward.num_heads,
            forward.num_kv_heads, forward.head_dim, 0, 0, forward.eps, forward.scaling, tiled,
            _tiled_from(forward, tiled),
            forward.embed.data_ptr(), forward.norm.data_ptr(), matrix(forward.lm_head),
            forward.embed.shape[0], self.vocab_size,
        )  # fmt: skip
        width = (3 * forward.num_heads + 2 * forward.num_kv_heads) * forward.head_dim
        # the layers' scratch, and the residual stream and its norm
        self._scratch_per_row = width + hidden + 3 * inter + 2 * hidden
        self._scratch: torch.Tensor | None = None  # `step_at`'s, made on its first use
        self._logits: torch.Tensor | None = None

    @classmethod
    def for_forward(cls, forward: Any) -> DecodeLayers | None:
        """For a `llama.LlamaForward` (typed Any: llama.py imports this module)."""
        if os.environ.get("LLMFLEET_CPU_DECODE_LAYERS", "1") == "0" or forward.ops is None:
            return None
        if forward.embed.device.type != "cpu" or forward.embed.dtype != torch.bfloat16:
            return None
        library = load()
        if library is None or not forward.layers:
            return None
        if not forward.norm.is_contiguous() or forward.norm.dtype != torch.bfloat16:
            return None
        linears = _linears(forward)
        tiled = 0
        if all(linear.tiled_weight is not None for linear in linears):
            tiled = _TILED_AMX if amx_matmuls_available() else _TILED_PAIRS
        max_rows = MAX_ROWS_TILED if tiled else min(linear.max_few_rows for linear in linears)
        if max_rows < 1 or any(layer.o.bias is not None for layer in forward.layers):
            return None
        group = forward.num_heads // forward.num_kv_heads  # the attention kernel's shapes
        if (
            group > cpu_attention.MAX_QUERIES_PER_KV_HEAD
            or forward.head_dim > cpu_attention.MAX_HEAD_DIM
        ):
            return None
        return cls(library, forward, max_rows, tiled)

    def step(
        self,
        input_ids: torch.Tensor,  # [rows] int64
        cos: torch.Tensor,  # [rows, head_dim], contiguous
        sin: torch.Tensor,
        slot_mapping: torch.Tensor,  # [rows] int64, contiguous
        k_pool: torch.Tensor,  # [layers, kv_heads, blocks, block_size, head_dim], contiguous
        v_pool: torch.Tensor,
        groups: list[DecodeGroup],  # each with its int32 tables and lengths (the CPU's)
    ) -> torch.Tensor:
        """The step's logits, [rows, vocab]."""
        rows, model = input_ids.shape[0], self._model
        _, _, model.num_blocks, model.block_size, _ = k_pool.shape
        entries = (_Group * len(groups))()
        for entry, group in zip(entries, groups, strict=True):
            entry.tables, entry.lengths = group.tables.data_ptr(), group.lengths.data_ptr()
            entry.query_start, entry.rows = group.query_start, group.query_end - group.query_start
            entry.max_blocks = group.tables.shape[1]
        input_ids = input_ids.to(torch.int64).contiguous()
        scratch = cos.new_empty(rows * self._scratch_per_row)
        logits = cos.new_empty(rows, self.vocab_size)
        status = self._library.decode_step(
            ctypes.byref(model), input_ids.data_ptr(), cos.data_ptr(), sin.data_ptr(),
            slot_mapping.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(), entries, len(groups),
            rows, scratch.data_ptr(), logits.data_ptr(),
        )  # fmt: skip
        _raise_for(status)
        return logits

    def step_at(
        self,
        token_ids: list[int],
        positions: list[int],
        slots: list[int],  # each token's flat slot in the pool
        block_tables: list[list[int]],  # each row's, unpadded
        lengths: list[int],  # the keys each row attends to
        group_bounds: list[tuple[int, int]],  # rows attended in one call (`decode_group_bounds`)
        rope_table: tuple[torch.Tensor, torch.Tensor],  # cos, sin [positions, head_dim]
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        greedy: bool,
    ) -> tuple[torch.Tensor, list[int]]:
        """`step` from the host's lists, with no tensor made for them and the RoPE table read
        in C: the logits [rows, vocab] (a buffer of this object's: read them before its next
        step) and, if `greedy`, each row's argmax (else []). IndexError for a token outside
        the embedding or a position outside the table."""
        rows, model = len(token_ids), self._model
        _, _, model.num_blocks, model.block_size, _ = k_pool.shape
        entries = (_Group * len(group_bounds))()
        arrays: list[ctypes.Array] = []  # alive until the call returns
        for entry, (start, end) in zip(entries, group_bounds, strict=True):
            width = max(len(table) for table in block_tables[start:end])
            padded = [b for t in block_tables[start:end] for b in (*t, *[0] * (width - len(t)))]
            tables = (ctypes.c_int32 * len(padded))(*padded)
            group_lengths = (ctypes.c_int32 * (end - start))(*lengths[start:end])
            arrays += (tables, group_lengths)
            entry.tables, entry.lengths = ctypes.addressof(tables), ctypes.addressof(group_lengths)
            entry.query_start, entry.rows, entry.max_blocks = start, end - start, width
        scratch, logits = self._buffers(rows, k_pool.dtype)
        tokens = (ctypes.c_int64 * rows)() if greedy else None
        cos, sin = rope_table
        status = self._library.decode_step_at(
            ctypes.byref(model), (ctypes.c_int64 * rows)(*token_ids),
            (ctypes.c_int64 * rows)(*positions), cos.data_ptr(), sin.data_ptr(), cos.shape[0],
            (ctypes.c_int64 * rows)(*slots), k_pool.data_ptr(), v_pool.data_ptr(), entries,
            len(group_bounds), rows, scratch.data_ptr(), logits.data_ptr(), tokens,
        )  # fmt: skip
        _raise_for(status)
        return logits, [] if tokens is None else list(tokens)

    def _buffers(self, rows: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """`step_at`'s scratch (grown, never shrunk) and logits (made again when the number of
        rows changes), kept for the next steps: slicing a larger buffer's rows was itself a
        torch op, 0.07 ms of a batch-1 step (session 34)."""
        if self._logits is None or self._logits.shape[0] != rows:
            self._logits = torch.empty(rows, self.vocab_size, dtype=dtype)
        size = rows * (self._scratch_per_row + 2 * self._model.dim)
        if self._scratch is None or self._scratch.numel() < size:
            self._scratch = torch.empty(size, dtype=dtype)
        return self._scratch, self._logits


def _linears(forward: Any) -> list[Any]:
    """The forward's matmuls: the LM head's and every layer's."""
    return [forward.lm_head] + [
        linear for layer in forward.layers for linear in (layer.qkv, layer.o, layer.gate_up, layer.down)
    ]  # fmt: skip


def _tiled_from(forward: Any, tiled: int) -> int:
    """The rows from which the decode step's matmuls take the tiled kernel (`Model.tiled_from`):
    AMX's from the fewest rows at which every linear takes it (`llama._Linear.takes_amx`), the
    pair kernel past the few-row kernel's rows."""
    if tiled != _TILED_AMX:
        return forward.lm_head.max_few_rows + 1
    linears = _linears(forward)
    fewer = (rows for rows in range(1, AMX_FROM_ROWS) if all(w.takes_amx(rows) for w in linears))
    return next(fewer, AMX_FROM_ROWS)


def _raise_for(status: int) -> None:
    if status == -4:
        raise IndexError("a token id outside the embedding")
    if status == -5:
        raise IndexError("a position outside the RoPE table")
    if status != 0:
        raise RuntimeError(f"decode_step failed ({status})")
