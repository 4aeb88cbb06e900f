"""The CPU's fused layer ops (worker/runner/cpu_layer_ops.py) against the torch ops they stand
in for, and the forward built on them against the torch forward."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from tests import tiny_model
from tests.factories import serve_together
from worker.runner import cpu_kernels, llama
from worker.runner.cpu_layer_ops import LayerOps
from worker.runner.model_runner import ModelRunner

pytestmark = pytest.mark.skipif(
    cpu_kernels.load() is None, reason="no C compiler here: the kernels cannot be built"
)
CPU = torch.device("cpu")


def _ops(dtype) -> LayerOps:
    ops = LayerOps.for_model(CPU, dtype, (64, 128), 32)
    assert ops is not None
    return ops


def _assert_as_torch(got: torch.Tensor, expected: torch.Tensor) -> None:
    """bf16: equal but for a rounding step in a few elements (a sum in another order, an
    exp's last bit); fp32: within a few units in the last place."""
    assert got.shape == expected.shape and got.dtype == expected.dtype
    if expected.dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=4e-6, atol=1e-6)
        return
    differ = got != expected
    assert differ.float().mean().item() <= 0.01
    step = expected.float().abs().clamp_min(1e-30) * 2**-7
    assert ((got.float() - expected.float()).abs() <= step).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 5, 40])
def test_the_norms_and_the_residual_are_torchs(dtype, rows):
    generator = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 576, generator=generator) * 3).to(dtype)
    delta = torch.randn(rows, 576, generator=generator).to(dtype)
    weight = (torch.rand(576, generator=generator) + 0.5).to(dtype)
    ops = LayerOps.for_model(CPU, dtype, (576,), 64)
    assert ops is not None
    _assert_as_torch(ops.rms_norm(x, weight, 1e-5), llama._rms_norm(x, weight, 1e-5))
    hidden = x.clone()
    normed = ops.add_rms_norm(hidden, delta, weight, 1e-5)
    assert torch.equal(hidden, x + delta)  # the residual, in place, rounded as torch rounds
    _assert_as_torch(normed, llama._rms_norm(x + delta, weight, 1e-5))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_silu_times_up_is_torchs(dtype):
    generator = torch.Generator().manual_seed(0)
    # Large gates too: exp's range ends (silu of -100 is -0, of 100 is 100).
    gate_up = (torch.randn(7, 2 * 1536, generator=generator) * 8).to(dtype)
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])
    gate, up = gate_up.chunk(2, dim=-1)
    _assert_as_torch(_ops(dtype).silu_mul(gate_up), F.silu(gate) * up)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (4, 4, 128), (2, 1, 32)])
def test_rope_and_the_pool_writes_are_torchs(dtype, heads, kv_heads, head_dim):
    generator = torch.Generator().manual_seed(heads)
    tokens, num_blocks, block_size = 11, 8, 4
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=generator).to(dtype)
    angles = torch.rand(tokens, head_dim // 2, generator=generator) * 100
    angles = torch.cat([angles, angles], dim=-1)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=generator)[:tokens]
    k_pool = torch.zeros(kv_heads, num_blocks, block_size, head_dim, dtype=dtype)
    v_pool = torch.zeros_like(k_pool)
    # What the torch forward does (llama.LlamaForward.__call__).
    qk = qkv[:, : (heads + kv_heads) * head_dim].view(tokens, heads + kv_heads, head_dim)
    rotated = qk * cos[:, None] + llama._rotate_half(qk) * sin[:, None]
    values = qkv[:, (heads + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim)
    expected_k, expected_v = torch.zeros_like(k_pool), torch.zeros_like(v_pool)
    llama._write(expected_k, rotated[:, heads:], slots)
    llama._write(expected_v, values, slots)
    expected_qk = rotated.clone()

    ops = LayerOps.for_model(CPU, dtype, (64,), head_dim)
    assert ops is not None
    ops.rope_write(qkv, cos, sin, heads, k_pool, v_pool, slots)
    _assert_as_torch(qkv[:, : (heads + kv_heads) * head_dim].view_as(qk), expected_qk)
    _assert_as_torch(k_pool, expected_k)
    assert torch.equal(v_pool, expected_v)  # copied as they are
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots] = False
    assert (k_pool.flatten(1, 2)[:, untouched] == 0).all()


def test_only_shapes_and_devices_the_kernels_have_get_the_fused_ops():
    assert LayerOps.for_model(CPU, torch.bfloat16, (576, 1536), 64) is not None
    assert LayerOps.for_model(CPU, torch.float16, (576, 1536), 64) is None
    assert LayerOps.for_model(CPU, torch.float32, (576, 1000), 64) is None
    assert LayerOps.for_model(CPU, torch.float32, (576, 1536), 16) is None
    assert LayerOps.for_model(torch.device("meta"), torch.float32, (576, 1536), 64) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_forward_serves_the_torch_forwards_tokens(dtype):
    """Prompts and decodes of four requests together (chunked prefill, preemption), fused
    and not, on a model whose tokens depend on attention and positions."""
    loaded = tiny_model.attentive("llama", num_heads=2, num_kv_heads=1)
    loaded.model.to(dtype)
    prompts = [list(range(1000, 1030)), [7, 7, 7, 7, 7, 7], list(range(2000, 2045, 3)), [42]]

    def serve(fused: bool) -> list[list[int]]:
        runner = ModelRunner(loaded, 14, 4, "own")
        assert runner._forward is not None and (runner._forward.ops is not None)
        if not fused:  # a copy: the model's one forward is shared by its runners
            runner._forward = copy.copy(runner._forward)
            runner._forward.ops = None
        tokens, num_preemptions = serve_together(runner, prompts, 14)
        assert num_preemptions > 0
        return tokens

    assert serve(fused=True) == serve(fused=False)
