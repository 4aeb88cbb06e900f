"""Matmuls in AMX tiles (`csrc/amx_matmul.c`, through `llama._Linear`) on a CPU with AMX:
torch's results, bit for bit up to 32 rows, within a rounding step past that, and torch's own
matmul wherever the kernel cannot take the weight."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests import tiny_model
from worker.runner import llama

pytestmark = pytest.mark.skipif(
    not llama.amx_matmuls_available(),
    reason="the AMX matmul needs a C compiler and a CPU with AMX",
)


@pytest.mark.parametrize("rows", [9, 16, 17, 31, 32, 33, 50, 64, 100, 384])
@pytest.mark.parametrize(("n", "k"), [(96, 64), (992, 576), (64, 1536)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_amx_matmuls_are_torchs(rows, n, k, with_bias):
    generator = torch.Generator().manual_seed(rows * 1000 + n)
    weight = torch.randn(n, k, generator=generator).to(torch.bfloat16)
    bias = torch.randn(n, generator=generator).to(torch.bfloat16) if with_bias else None
    x = torch.randn(rows, k, generator=generator).to(torch.bfloat16)
    linear = llama._Linear(weight, bias)
    assert linear.amx_weight is not None and linear._packed is None
    got, expected = linear(x), F.linear(x, weight, bias)
    if rows <= 32:  # the same tile products in the same order as oneDNN's
        assert torch.equal(got, expected)
    # past 32 rows oneDNN orders its sums otherwise: a rounding step apart in a few elements
    assert (got != expected).float().mean().item() <= 0.01
    magnitude = x.float().abs() @ weight.float().abs().T
    bound = expected.float().abs() * 2**-7 + magnitude * 2**-14
    assert ((got.float() - expected.float()).abs() <= bound).all()


def test_weights_the_kernel_cannot_take_keep_torchs_matmul(monkeypatch):
    x = torch.randn(20, 64).to(torch.bfloat16)
    for weight in (torch.randn(48, 64).to(torch.bfloat16), torch.randn(64, 64)):  # n % 32, fp32
        linear = llama._Linear(weight)
        assert linear.amx_weight is None
        assert torch.equal(linear(x.to(weight.dtype)), F.linear(x.to(weight.dtype), weight))
    monkeypatch.setenv("LLMFLEET_CPU_AMX", "0")
    assert llama._Linear(torch.randn(64, 64).to(torch.bfloat16)).amx_weight is None


def test_a_forwards_packed_weights_lie_in_one_tensor_in_decode_order():
    loaded = tiny_model.attentive("llama", num_heads=2, num_kv_heads=1)
    loaded.model.to(torch.bfloat16)
    forward = llama.LlamaForward(loaded.model)
    linears = [
        linear for layer in forward.layers for linear in (layer.qkv, layer.o, layer.gate_up, layer.down)
    ] + [forward.lm_head]  # fmt: skip
    starts = [linear.amx_weight.data_ptr() for linear in linears]
    assert len({linear.amx_weight.untyped_storage().data_ptr() for linear in linears}) == 1
    assert starts == sorted(starts)  # a decode step streams one run of memory front to back
