"""Matmuls in AMX tiles (`csrc/amx_matmul.c`, through `llama._Linear`) on a CPU with AMX:
torch's results, bit for bit up to 32 rows, within a rounding step past that, and torch's own
matmul wherever the kernel cannot take the weight."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests import tiny_model
from tests.reference import assert_within_rounding_of_torch, bf16_matmul_case
from worker.runner import llama

pytestmark = pytest.mark.skipif(
    not llama.amx_matmuls_available(),
    reason="the AMX matmul needs a C compiler and a CPU with AMX",
)


@pytest.mark.parametrize("rows", [9, 16, 17, 31, 32, 33, 50, 64, 100, 384])
@pytest.mark.parametrize(("n", "k"), [(96, 64), (992, 576), (64, 1536)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_amx_matmuls_are_torchs(rows, n, k, with_bias):
    x, weight, bias = bf16_matmul_case(rows, n, k, with_bias)
    linear = llama._Linear(weight, bias)
    assert linear.amx_weight is not None and linear._packed is None
    got = linear(x)
    if rows <= 32:  # the same tile products in the same order as oneDNN's
        assert torch.equal(got, F.linear(x, weight, bias))
    assert_within_rounding_of_torch(got, x, weight, bias)  # past 32, oneDNN sums otherwise


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
