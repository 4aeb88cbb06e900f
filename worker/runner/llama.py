"""Our own forward pass for Llama-family decoders (Llama, Mistral, Qwen2, SmolLM).

The weights are the Hugging Face model's, taken once it is loaded (from a GGUF file or a
model directory alike) and fused: q, k and v into one projection, gate and up into another,
so a layer is a handful of large matmuls. The step's tokens stay packed in one row
(`[num_tokens, hidden]`), RoPE's cos/sin are computed once per step for all layers, and the
new keys and values go straight into the paged pool, where `paged_attention` reads them.
Compared with the HF forward on the same packed step this drops the per-layer module calls,
mask construction and transposes, and makes 4 matmuls a layer instead of 7.

Any other architecture, or weights that are not plain `nn.Linear` (e.g. quantized), keeps
the HF forward with our attention plugged in (`LlamaForward.supports`).
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from worker.runner import host_memory
from worker.runner.cpu_decode import DecodeLayers
from worker.runner.cpu_kernels import (
    AMX_FROM_ROWS,
    amx_matmuls_available,
    load,
    pair_matmuls_available,
    pair_matmuls_for_prompts,
)
from worker.runner.cpu_layer_ops import LayerOps
from worker.runner.paged_attention import StepMetadata, attend

SUPPORTED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2"})


class _Linear:
    """`y = x @ weight.T + bias`. On the CPU the weight is packed once into oneDNN's blocked
    layout (what inductor's freezing does): the matmul then skips the per-call reorder, with
    identical results in bf16 (docs/benchmarks.md, "Our own forward"). A bf16 matmul of at
    most 8 rows (a decode step of 1-8 sequences) takes the C kernel in `csrc/few_rows.c`
    instead, which streams the weights at nearly the memory's rate where oneDNN's reached
    about half of it (docs/benchmarks.md, "Few-row matmuls").

    Where our tiled kernels run, the weight is also packed in AMX's tile layout
    (`tiled_weight`). On a CPU with AMX it replaces oneDNN's (the same memory) and every bf16
    matmul of `AMX_FROM_ROWS` rows or more takes `csrc/amx_matmul.c`, which streams the
    weights faster than either there (8 rows: 8.4 against 12.9 ms for all the layers, 32 rows:
    10.1 against oneDNN's 15.5; session 28), bit for bit oneDNN's up to 32 rows. Fewer rows
    take the few-row kernel: a tile product costs as much at 1 row as at 16 (session 42). On
    a CPU with AVX512-BF16 but no AMX, decode steps of more than 8 sequences take
    `csrc/pair_matmul.c` over it in `decode_layers.c` (the layers' shapes at 16-32 rows:
    830-980 GFLOP/s against oneDNN's 430-840; session 29), while prompts keep oneDNN, whose sums the kernel's
    differ from by a rounding step in a few elements in 10,000: the prompts' logits stay
    those of `transformers`, whose matmul is oneDNN's, bit for bit. On a CPU with AVX2 alone,
    where oneDNN emulates bf16, every matmul takes our kernels: `few_rows.c` up to 8 rows,
    `pair_matmul.c` past that, prompts too (`pair_matmuls_for_prompts`; session 38)."""

    __slots__ = (
        "_amx", "_few_rows", "_packed", "_pairs", "bias", "max_few_rows", "tiled_weight", "weight",
    )  # fmt: skip

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight, self.bias = weight, bias
        self._packed: torch.Tensor | None = None
        self.tiled_weight = _tiled(weight, bias)
        self._amx = self.tiled_weight is not None and amx_matmuls_available()
        # with AVX2 alone the pair kernel takes every matmul past the few-row kernel's rows
        self._pairs = self.tiled_weight is not None and pair_matmuls_for_prompts()
        on_the_cpu = weight.device.type == "cpu" and torch.backends.mkldnn.is_available()
        if not self._amx and not self._pairs and on_the_cpu:
            try:
                self._packed = torch.ops.mkldnn._reorder_linear_weight(weight)
            except RuntimeError:  # no oneDNN kernel for this dtype on this CPU
                self._packed = None
        self._few_rows = _few_rows_kernel(weight, bias)
        self.max_few_rows = self._few_rows.few_rows_available() if self._few_rows else 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.takes_amx(x.shape[0]):
            return self._matmul_amx(x)
        if 0 < x.shape[0] <= self.max_few_rows:
            return self._matmul_few_rows(x)
        if self._pairs and x.shape[0] > 0:
            return self.matmul_pairs(x)
        if self._packed is None:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")

    def takes_amx(self, rows: int) -> bool:
        """Whether a matmul of `rows` rows takes AMX's kernel: on a CPU with AMX, from
        `AMX_FROM_ROWS` rows, or from 1 where the few-row kernel cannot take the weight (the
        decode step's C call chooses by it too: `cpu_decode`'s `Model.tiled_from`)."""
        few = 0 < rows < AMX_FROM_ROWS and rows <= self.max_few_rows
        return self._amx and rows > 0 and not few

    def _matmul_few_rows(self, x: torch.Tensor) -> torch.Tensor:
        assert self._few_rows is not None  # max_few_rows is 0 without it
        return _call_kernel(self._few_rows.matmul_few_rows, x, self.weight, self.bias)

    def _matmul_amx(self, x: torch.Tensor) -> torch.Tensor:
        library = load()
        assert self.tiled_weight is not None and library is not None  # packed by the library
        return _call_kernel(library.amx_matmul, x, self.tiled_weight, self.bias, self.weight.shape)

    def silu_mul(self, x: torch.Tensor, ops: LayerOps) -> torch.Tensor:
        """`silu(gate) * up` of x through this fused gate-up projection ([gate | up]): on a
        CPU with AMX in the matmul's own pass (`amx_matmul_silu`, bit for bit the two steps,
        without writing the projection's output), else the matmul, then `ops.silu_mul`."""
        if self.takes_amx(len(x)) and self.bias is None and self.weight.shape[0] % 64 == 0:
            library = load()
            assert self.tiled_weight is not None and library is not None
            inter, k = self.weight.shape[0] // 2, self.weight.shape[1]
            return _call_kernel(library.amx_matmul_silu, x, self.tiled_weight, None, (inter, k))
        return ops.silu_mul(self(x))

    def matmul_pairs(self, x: torch.Tensor) -> torch.Tensor:
        """`csrc/pair_matmul.c`'s product, as the decode layers take it past 8 rows on CPUs
        without AMX (their LM head: `DecodeLayers.lm_head`), and every matmul past 8 rows on
        CPUs with AVX2 alone."""
        library = load()
        assert self.tiled_weight is not None and library is not None
        return _call_kernel(library.pair_matmul, x, self.tiled_weight, self.bias, self.weight.shape)


def _call_kernel(
    kernel: Any,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    shape: tuple[int, ...] | None = None,  # the weight's [n, k] where `weight` is packed
) -> torch.Tensor:
    n, k = shape or weight.shape
    x = x.contiguous()
    out = x.new_empty(x.shape[0], n)
    failed = kernel(
        x.data_ptr(),
        weight.data_ptr(),
        None if bias is None else bias.data_ptr(),
        out.data_ptr(),
        x.shape[0],
        n,
        k,
    )
    if failed:
        raise RuntimeError(f"{kernel.__name__} failed ({failed}) for {tuple(x.shape)}")
    return out


def _tiled(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """The weight in AMX's tile layout (`amx_pack`) where a kernel that reads it can run its
    matmuls (`csrc/amx_matmul.c`, or `csrc/pair_matmul.c` in the decode layers; on the CPU,
    bf16, both dimensions multiples of 32), else None."""
    if not _fits_kernels(weight, bias) or weight.shape[0] % 32:
        return None
    if not amx_matmuls_available() and not pair_matmuls_available():
        return None
    library = load()
    assert library is not None
    packed = torch.empty(weight.numel(), dtype=torch.bfloat16)  # `_tiled_into_one_tensor`'s
    library.amx_pack(weight.data_ptr(), packed.data_ptr(), *weight.shape)
    return packed


def _tiled_into_one_tensor(linears: list[_Linear]) -> None:
    """The linears' tiled weights copied into one tensor in huge pages, in this order, each
    becoming a view of it (as `_into_one_tensor` does for the weights themselves)."""
    packed = [linear.tiled_weight for linear in linears if linear.tiled_weight is not None]
    if not packed:
        return
    arena = host_memory.zeros((sum(p.numel() for p in packed),), torch.bfloat16)
    start = 0
    for linear in linears:
        if linear.tiled_weight is not None:
            view = arena[start : start + linear.tiled_weight.numel()]
            view.copy_(linear.tiled_weight)
            linear.tiled_weight = view
            start += view.numel()


def _few_rows_kernel(weight: torch.Tensor, bias: torch.Tensor | None) -> ctypes.CDLL | None:
    """The C kernels where `csrc/few_rows.c` can run this weight's matmuls (on the CPU, bf16,
    rows a multiple of 32 long, a CPU with AVX512-BF16; `LLMFLEET_CPU_FEW_ROWS=0` turns it
    off), else None."""
    if os.environ.get("LLMFLEET_CPU_FEW_ROWS", "1") == "0" or not _fits_kernels(weight, bias):
        return None
    library = load()
    return library if library is not None and library.few_rows_available() > 0 else None


def _fits_kernels(weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether the C matmuls take this weight: on the CPU, bf16, contiguous, rows a multiple
    of 32 long, a bf16 bias or none."""
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or weight.dim() != 2:
        return False
    if not weight.is_contiguous() or weight.shape[1] % 32:
        return False
    return bias is None or (bias.dtype == torch.bfloat16 and bias.is_contiguous())


@dataclass(frozen=True, slots=True)
class _Layer:
    input_norm: torch.Tensor
    qkv: _Linear  # hidden -> (heads + 2 * kv_heads) * head_dim
    o: _Linear
    post_norm: torch.Tensor
    gate_up: _Linear  # hidden -> 2 * intermediate
    down: _Linear


class LlamaForward:
    """`logits = forward(input_ids, positions, k_pool, v_pool, step, keep)` for one packed step."""

    def __init__(self, model: Any) -> None:  # an HF *ForCausalLM; its modules are untyped
        config = model.config
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = (
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        self.eps = config.rms_norm_eps
        self.scaling = self.head_dim**-0.5
        decoder = model.model
        if decoder.embed_tokens.weight.device.type == "cpu":
            _into_one_tensor(_decode_order(model))
        self.embed = decoder.embed_tokens.weight
        self.norm = decoder.norm.weight
        self.lm_head = _Linear(model.lm_head.weight.detach())
        self.rotary = decoder.rotary_emb  # HF's, so every RoPE scaling type is as HF has it
        self._rope_table = _rope_table(self.rotary, self.embed, config.max_position_embeddings)
        self.layers = [_fuse(layer) for layer in decoder.layers]
        linears = [self.lm_head] + [
            linear for layer in self.layers for linear in (layer.qkv, layer.o, layer.gate_up, layer.down)
        ]  # fmt: skip
        _tiled_into_one_tensor(linears[1:] + linears[:1])  # as a decode step reads them
        # On the CPU, the layers' element-wise work in four C calls a layer (cpu_layer_ops.py)
        self.ops = LayerOps.for_model(
            self.embed.device,
            self.embed.dtype,
            (config.hidden_size, config.intermediate_size),
            self.head_dim,
        )
        # On the CPU, a decode step of 1-8 sequences (with the tiled kernels, any) through
        # every layer in one C call
        self.decode_layers = DecodeLayers.for_forward(self)

    @staticmethod
    def supports(model: Any) -> bool:
        config = model.config
        if config.model_type not in SUPPORTED_MODEL_TYPES or config.hidden_act != "silu":
            return False
        if getattr(config, "mlp_bias", False) or getattr(config, "use_sliding_window", False):
            return False
        if getattr(config, "sliding_window", None) and config.model_type == "mistral":
            return False  # a window shorter than the context needs a windowed attention
        layer = model.model.layers[0]
        linears = [
            layer.self_attn.q_proj,
            layer.self_attn.k_proj,
            layer.self_attn.v_proj,
            layer.self_attn.o_proj,
            layer.mlp.gate_proj,
            layer.mlp.up_proj,
            layer.mlp.down_proj,
            model.lm_head,
        ]
        return all(type(linear) is nn.Linear for linear in linears)

    def __call__(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        k_pool: torch.Tensor,  # [layers, kv_heads, blocks, block_size, head_dim]
        v_pool: torch.Tensor,
        step: StepMetadata,
        keep: torch.Tensor,  # rows whose logits are wanted
    ) -> torch.Tensor:
        cos, sin = self._rope(positions)  # [num_tokens, head_dim]
        decode_layers = self.decode_layers
        if (
            decode_layers is not None
            and not step.prefills
            and len(input_ids) <= decode_layers.max_rows
            and len(keep) == len(input_ids)  # every row's logits (`keep` has no repeats)
        ):
            slot_mapping = step.slot_mapping.to(torch.int64).contiguous()
            return decode_layers.step(
                input_ids, cos, sin, slot_mapping, k_pool, v_pool, step.decode_groups
            )
        hidden = F.embedding(input_ids, self.embed)
        if self.ops is not None:
            return self._fused_forward(hidden, cos, sin, k_pool, v_pool, step, keep)
        cos, sin = cos[:, None], sin[:, None]  # [num_tokens, 1, head_dim]
        num_q = self.num_heads * self.head_dim
        num_kv = self.num_kv_heads * self.head_dim
        for index, layer in enumerate(self.layers):
            x = _rms_norm(hidden, layer.input_norm, self.eps)
            qkv = layer.qkv(x)
            qk = qkv[:, : num_q + num_kv].view(
                -1, self.num_heads + self.num_kv_heads, self.head_dim
            )
            qk = qk * cos + _rotate_half(qk) * sin
            q = qk[:, : self.num_heads]  # [num_tokens, heads, head_dim]
            k = qk[:, self.num_heads :]
            v = qkv[:, num_q + num_kv :].view(-1, self.num_kv_heads, self.head_dim)
            _write(k_pool[index], k, step.slot_mapping)
            _write(v_pool[index], v, step.slot_mapping)
            out = attend(q.transpose(0, 1), k_pool[index], v_pool[index], step, self.scaling)
            hidden = hidden + layer.o(out.flatten(1))
            x = _rms_norm(hidden, layer.post_norm, self.eps)
            gate, up = layer.gate_up(x).chunk(2, dim=-1)
            hidden = hidden + layer.down(F.silu(gate) * up)
        hidden = _rms_norm(hidden.index_select(0, keep), self.norm, self.eps)
        return self.lm_head(hidden)

    def decode_at(
        self,
        token_ids: list[int],
        positions: list[int],
        slots: list[int],
        block_tables: list[list[int]],
        lengths: list[int],
        group_bounds: list[tuple[int, int]],
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        greedy: bool,
    ) -> tuple[torch.Tensor, list[int]] | None:
        """A decode step (one token a row, every row's logits) from the host's lists, in one
        C call that also reads the RoPE table and, if `greedy`, takes each row's argmax
        (`DecodeLayers.step_at`): the logits and the argmaxes. None where that call cannot
        take the step (no decode layers, more rows than they take, a position past the
        table): the caller takes `__call__`."""
        decode_layers, table = self.decode_layers, self._rope_table
        if decode_layers is None or table is None or len(token_ids) > decode_layers.max_rows:
            return None
        if max(positions) >= table[0].shape[0]:
            return None
        return decode_layers.step_at(
            token_ids, positions, slots, block_tables, lengths, group_bounds, table,
            k_pool, v_pool, greedy,
        )  # fmt: skip

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin at `positions`, [num_tokens, head_dim] each: HF's rotary module's, read
        from a table of them where it has one. In a batch-1 decode step, whose weights had
        just swept the caches, the module's call and the embedding took 0.19-0.23 ms, the
        table's lookup 0.08-0.10 (session 33)."""
        table = self._rope_table
        if table is not None and len(positions) and int(positions.max()) < table[0].shape[0]:
            return table[0][positions], table[1][positions]
        cos, sin = self.rotary(self.embed, positions[None])
        return cos[0], sin[0]

    def _fused_forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,  # [num_tokens, head_dim]
        sin: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        step: StepMetadata,
        keep: torch.Tensor,
    ) -> torch.Tensor:
        """The same forward with the element-wise work in the CPU's fused ops."""
        ops = self.ops
        assert ops is not None
        cos, sin = cos.contiguous(), sin.contiguous()
        slot_mapping = step.slot_mapping.to(torch.int64).contiguous()
        num_q = self.num_heads * self.head_dim
        x = ops.rms_norm(hidden, self.layers[0].input_norm, self.eps)
        for index, layer in enumerate(self.layers):
            qkv = layer.qkv(x)
            ops.rope_write(
                qkv, cos, sin, self.num_heads, k_pool[index], v_pool[index], slot_mapping
            )
            q = qkv[:, :num_q].view(-1, self.num_heads, self.head_dim)
            out = attend(q.transpose(0, 1), k_pool[index], v_pool[index], step, self.scaling)
            x = ops.add_rms_norm(hidden, layer.o(out.flatten(1)), layer.post_norm, self.eps)
            delta = layer.down(layer.gate_up.silu_mul(x, ops))
            if index + 1 < len(self.layers):
                x = ops.add_rms_norm(hidden, delta, self.layers[index + 1].input_norm, self.eps)
            else:
                hidden += delta
        return self.lm_head(ops.rms_norm(hidden.index_select(0, keep), self.norm, self.eps))


# A RoPE table covers at most this many positions (4 MB for a head of 64 in bf16); a step
# past it calls the rotary module.
ROPE_TABLE_POSITIONS = 16384


def _rope_table(
    rotary: Any, like: torch.Tensor, max_positions: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """HF's rotary module's cos and sin at every position up to `max_positions` (capped at
    `ROPE_TABLE_POSITIONS`), computed by the module itself: per position they are its
    element-wise ops on that position alone, so a row of the table is, bit for bit, what it
    gives for that position (tests/worker/test_llama_forward.py). None for the RoPE types
    whose frequencies change with the sequence's length (`dynamic`, `longrope`), and off the
    CPU: a GPU's decode graphs capture the module's ops, where the table's bound check would
    read the positions back to the host."""
    rope_type = getattr(rotary, "rope_type", "default")
    if not isinstance(rope_type, str) or "dynamic" in rope_type or "longrope" in rope_type:
        return None
    if like.device.type != "cpu":
        return None
    num_positions = min(max_positions or 0, ROPE_TABLE_POSITIONS)
    if num_positions < 1:
        return None
    positions = torch.arange(num_positions, device=like.device)[None]
    with torch.inference_mode():
        cos, sin = rotary(like, positions)
    return cos[0].contiguous(), sin[0].contiguous()


def _fuse(layer: Any) -> _Layer:
    attn, mlp = layer.self_attn, layer.mlp
    qkv = (attn.q_proj, attn.k_proj, attn.v_proj)
    has_bias = all(p.bias is not None for p in qkv)
    return _Layer(
        input_norm=layer.input_layernorm.weight.detach(),
        qkv=_Linear(
            _concat([p.weight for p in qkv]), _concat([p.bias for p in qkv]) if has_bias else None
        ),
        o=_Linear(
            attn.o_proj.weight.detach(),
            None if attn.o_proj.bias is None else attn.o_proj.bias.detach(),
        ),
        post_norm=layer.post_attention_layernorm.weight.detach(),
        gate_up=_Linear(_concat([mlp.gate_proj.weight, mlp.up_proj.weight])),
        down=_Linear(mlp.down_proj.weight.detach()),
    )


def _decode_order(model: Any) -> list[Any]:
    """The weights as a decode step reads them: each layer's q, k, v, o, gate, up and down
    projections, then the LM head (the embedding too, where they are tied)."""
    order = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for linear in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj,
                       mlp.up_proj, mlp.down_proj):  # fmt: skip
            order.append(linear.weight)
    order.append(model.lm_head.weight)
    return order


def _into_one_tensor(params: list[Any]) -> None:
    """Copies the CPU weights into one tensor in huge pages (`host_memory`), in the order
    given, each parameter becoming a view of it: a decode step then streams one run of
    memory front to back instead of hundreds of separately allocated 4 KB-paged tensors
    (docs/benchmarks.md, "Weights in huge pages"). Parameters of another dtype keep theirs."""
    dtype = params[0].dtype
    params = [p for p in dict.fromkeys(params) if p.dtype == dtype]  # once each, in order
    arena = host_memory.zeros((sum(p.numel() for p in params),), dtype)
    start = 0
    for param in params:
        view = arena[start : start + param.numel()].view(param.shape)
        view.copy_(param.detach())
        param.data = view
        start += param.numel()


def _concat(params: list[Any]) -> torch.Tensor:
    """One tensor of `params` along the first dimension; each parameter then becomes a view
    into it, so the HF modules (still used by `generate`) share its memory. Parameters that
    already lie one after another (`_into_one_tensor`) are viewed together, not copied."""
    first = params[0].detach()
    shape = (sum(p.shape[0] for p in params), *first.shape[1:])
    if _adjacent([p.detach() for p in params]):
        return first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), shape)
    fused = torch.cat([p.detach() for p in params])
    start = 0
    for param in params:
        param.data = fused[start : start + param.shape[0]]
        start += param.shape[0]
    return fused


def _adjacent(tensors: list[torch.Tensor]) -> bool:
    """Whether contiguous `tensors` of one storage lie back to back in it, in this order."""
    first = tensors[0]
    offset = first.storage_offset()
    for tensor in tensors:
        if not tensor.is_contiguous() or tensor.storage_offset() != offset:
            return False
        if tensor.untyped_storage().data_ptr() != first.untyped_storage().data_ptr():
            return False
        offset += tensor.numel()
    return True


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """As HF's LlamaRMSNorm: normalised in fp32, cast back, then scaled."""
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _write(pool: torch.Tensor, states: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """states [num_tokens, kv_heads, head_dim] into one layer's pool at the tokens' slots."""
    pool.flatten(1, 2).index_copy_(1, slot_mapping, states.transpose(0, 1))
