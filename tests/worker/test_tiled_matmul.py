"""Matmuls over weights packed in AMX's tile layout (`llama._Linear.tiled_weight`). On a CPU
with AMX every row count from `AMX_FROM_ROWS` takes `csrc/amx_matmul.c` (fewer, the few-row
kernel): torch's results bit for bit up to 32 rows, within a rounding step past that. On a
CPU with AVX512-BF16 but no AMX, the decode layers' matmuls of more than 8 rows take
`csrc/pair_matmul.c`: within a rounding step of torch's results (equal in all but a few
elements in 10,000), while the linear itself keeps oneDNN's, which are torch's bit for bit.
On a CPU with AVX2 alone the linear takes the pair kernel too, past 8 rows (oneDNN emulates
bf16 there). Torch's own matmul wherever neither can take the weight."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests import tiny_model
from tests.reference import assert_within_rounding_of_torch, bf16_matmul_case
from worker.runner import llama
from worker.runner.cpu_kernels import AMX_FROM_ROWS, load
from worker.runner.cpu_layer_ops import LayerOps

AMX = llama.amx_matmuls_available()
PAIRS = llama.pair_matmuls_available()
PROMPT_PAIRS = llama.pair_matmuls_for_prompts()
pytestmark = pytest.mark.skipif(
    not AMX and not PAIRS,
    reason="the tiled matmuls need a C compiler and a CPU with AMX, AVX512-BF16 or AVX2",
)


@pytest.mark.parametrize("rows", [9, 16, 17, 31, 32, 33, 50, 64, 100, 384])
@pytest.mark.parametrize(("n", "k"), [(96, 64), (992, 576), (64, 1536)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_tiled_matmuls_are_torchs(rows, n, k, with_bias):
    x, weight, bias = bf16_matmul_case(rows, n, k, with_bias)
    linear = llama._Linear(weight, bias)
    assert linear.tiled_weight is not None
    # no oneDNN copy where our kernels take every row count (AMX; AVX2 alone)
    assert (linear._packed is None) == (AMX or PROMPT_PAIRS)
    got = linear(x) if AMX else linear.matmul_pairs(x)
    if AMX and rows <= 32:  # the same tile products in the same order as oneDNN's
        assert torch.equal(got, F.linear(x, weight, bias))
    assert_within_rounding_of_torch(got, x, weight, bias)  # else oneDNN sums otherwise


@pytest.mark.skipif(not AMX, reason="an Intel CPU with AMX-BF16")
def test_with_amx_matmuls_of_a_few_rows_take_the_few_row_kernel(monkeypatch):
    """A tile product costs as much at 1 row as at 16: below `AMX_FROM_ROWS` rows the linear
    takes the few-row kernel, which streams the weights faster there, and so does a decode
    step of as many sequences in C (the Python forward's results, bit for bit:
    test_cpu_decode.py)."""
    calls: list[str] = []
    for name in ("_matmul_few_rows", "_matmul_amx"):
        kernel = getattr(llama._Linear, name)
        monkeypatch.setattr(
            llama._Linear, name, lambda linear, x, kernel=kernel, name=name: (
                calls.append(name) or kernel(linear, x)
            ),
        )  # fmt: skip
    for rows in range(1, 10):
        x, weight, bias = bf16_matmul_case(rows, 992, 576, True)
        calls.clear()
        got = llama._Linear(weight, bias)(x)
        assert calls == ["_matmul_few_rows" if rows <= 3 else "_matmul_amx"]
        assert_within_rounding_of_torch(got, x, weight, bias)
    loaded = tiny_model.attentive("llama", num_heads=2, num_kv_heads=1)
    loaded.model.to(torch.bfloat16)
    decode_layers = llama.LlamaForward(loaded.model).decode_layers
    assert decode_layers is not None and decode_layers._model.tiled_from == AMX_FROM_ROWS == 4


@pytest.mark.skipif(
    not PAIRS or PROMPT_PAIRS, reason="the pair kernel runs on CPUs with AVX512-BF16, no AMX"
)
@pytest.mark.parametrize("rows", [9, 32, 384])
def test_without_amx_the_linear_keeps_torchs_matmul_bit_for_bit(rows):
    x, weight, bias = bf16_matmul_case(rows, 992, 576, True)
    assert torch.equal(llama._Linear(weight, bias)(x), F.linear(x, weight, bias))


@pytest.mark.skipif(not PROMPT_PAIRS, reason="prompts take the pair kernel on AVX2-only CPUs")
@pytest.mark.parametrize("rows", [1, 8, 9, 32, 384])
def test_with_avx2_alone_every_rows_matmul_takes_our_kernels(rows):
    x, weight, bias = bf16_matmul_case(rows, 992, 576, True)
    linear = llama._Linear(weight, bias)
    got = linear(x)
    expected = linear._matmul_few_rows(x) if rows <= 8 else linear.matmul_pairs(x)
    assert torch.equal(got, expected)
    assert_within_rounding_of_torch(got, x, weight, bias)


def test_prompts_take_the_pair_kernel_only_where_the_cpu_has_no_bf16_units(monkeypatch):
    from worker.runner import cpu_kernels

    monkeypatch.setattr(cpu_kernels, "pair_matmuls_available", lambda: True)
    for flags, expected in [
        ({"avx2", "fma"}, True),
        ({"avx2", "fma", "avx512f", "avx512_bf16"}, False),
        ({"avx2", "fma", "amx_bf16", "avx512_bf16"}, False),
    ]:
        monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda flags=flags: frozenset(flags))
        assert cpu_kernels.pair_matmuls_for_prompts() is expected
    monkeypatch.setattr(cpu_kernels, "pair_matmuls_available", lambda: False)
    assert not cpu_kernels.pair_matmuls_for_prompts()


def test_weights_the_kernels_cannot_take_keep_torchs_matmul(monkeypatch):
    x = torch.randn(20, 64).to(torch.bfloat16)
    for weight in (torch.randn(48, 64).to(torch.bfloat16), torch.randn(64, 64)):  # n % 32, fp32
        linear = llama._Linear(weight)
        assert linear.tiled_weight is None
        assert torch.equal(linear(x.to(weight.dtype)), F.linear(x.to(weight.dtype), weight))
    monkeypatch.setenv("LLMFLEET_CPU_AMX", "0")  # with AMX off, AVX512-BF16's or AVX2's pairs
    assert llama.pair_matmuls_available()
    monkeypatch.setenv("LLMFLEET_CPU_PAIR_MATMUL", "0")
    assert llama._Linear(torch.randn(64, 64).to(torch.bfloat16)).tiled_weight is None


def test_a_forwards_tiled_weights_lie_in_one_tensor_in_decode_order():
    loaded = tiny_model.attentive("llama", num_heads=2, num_kv_heads=1)
    loaded.model.to(torch.bfloat16)
    forward = llama.LlamaForward(loaded.model)
    linears = [
        linear for layer in forward.layers for linear in (layer.qkv, layer.o, layer.gate_up, layer.down)
    ] + [forward.lm_head]  # fmt: skip
    starts = [linear.tiled_weight.data_ptr() for linear in linears]
    assert len({linear.tiled_weight.untyped_storage().data_ptr() for linear in linears}) == 1
    assert starts == sorted(starts)  # a decode step streams one run of memory front to back


@pytest.mark.skipif(not AMX, reason="the fused gate-up and silu runs in the AMX kernel")
@pytest.mark.parametrize("rows", [1, 9, 16, 33, 100, 384])
@pytest.mark.parametrize(("inter", "k"), [(64, 64), (1536, 576)])
def test_the_gate_up_projection_and_silu_in_one_pass_are_the_two_steps(rows, inter, k):
    x, weight, _ = bf16_matmul_case(rows, 2 * inter, k, False)
    x = x * 4  # sums from -30 to 30 and beyond: silu's every branch, the exp's clamps too
    gate_up = llama._Linear(weight)
    ops = LayerOps(load(), torch.bfloat16)
    fused = gate_up.silu_mul(x, ops)
    assert fused.shape == (rows, inter)
    assert torch.equal(fused, ops.silu_mul(gate_up(x)))
    gate, up = gate_up(x).chunk(2, dim=-1)  # and torch's ops on them, within exp's last bit
    torch.testing.assert_close(fused, F.silu(gate) * up, rtol=1e-2, atol=1e-3)


def test_a_gate_up_projection_the_kernel_cannot_take_keeps_the_two_steps(monkeypatch):
    x, weight, bias = bf16_matmul_case(20, 128, 64, True)  # a bias: never fused
    ops = LayerOps(load(), torch.bfloat16)
    assert torch.equal(
        llama._Linear(weight, bias).silu_mul(x, ops), ops.silu_mul(F.linear(x, weight, bias))
    )
    monkeypatch.setenv("LLMFLEET_CPU_AMX", "0")
    monkeypatch.setenv("LLMFLEET_CPU_PAIR_MATMUL", "0")
    x, weight, _ = bf16_matmul_case(20, 128, 64, False)
    assert torch.equal(llama._Linear(weight).silu_mul(x, ops), ops.silu_mul(F.linear(x, weight)))


@pytest.mark.skipif(not AMX, reason="the AMX kernel shares a matmul out by items")
@pytest.mark.parametrize("rows", [17, 64, 200, 1000])
@pytest.mark.parametrize(("n", "k"), [(608, 576), (96, 64), (3072, 576)])
def test_a_matmul_is_the_same_on_any_number_of_threads(rows, n, k):
    """Past 16 rows the threads take a panel's blocks times 128 rows at a time, their own
    first, then what is left of the others': every output once, summed in the same order
    however the items fell (n = 608: 19 blocks, shares of 6-10 in uneven panels)."""
    x, weight, bias = bf16_matmul_case(rows, n, k, True)
    linear = llama._Linear(weight, bias)
    threads = torch.get_num_threads()
    results = []
    try:
        for count in (1, 2, 3, 5):
            torch.set_num_threads(count)
            results.append(linear(x))
        load().amx_share(0)  # every thread its fixed share of the blocks
        results.append(linear(x))
    finally:
        load().amx_share(1)
        torch.set_num_threads(threads)
    assert all(torch.equal(result, results[0]) for result in results[1:])
    assert_within_rounding_of_torch(results[0], x, weight, bias)


@pytest.mark.skipif(not AMX, reason="the AMX kernel shares a matmul out by items")
@pytest.mark.parametrize("rows", [512, 1000])
@pytest.mark.parametrize(("n", "k"), [(608, 576), (3072, 576)])
@pytest.mark.parametrize("threads", [2, 3])
def test_a_prompts_matmul_shared_by_rows_is_the_one_shared_by_blocks(rows, n, k, threads):
    """From the kernel's row threshold (1,024) each thread's items are its contiguous rows
    over every block, not its blocks over every row: the same sums, bit for bit, in runs of
    rows that do not fall on 32 (1000 rows over 3 threads: 333, 333 and 334), for the plain
    matmul and the gate-up's silu alike."""
    x, weight, bias = bf16_matmul_case(rows, n, k, True)
    linear, gate_up = llama._Linear(weight, bias), llama._Linear(weight)
    ops = LayerOps.for_model(x.device, x.dtype, (k, n // 2), 64)
    library = load()
    was = torch.get_num_threads()
    results = []
    try:
        torch.set_num_threads(threads)
        for row_share in (1 << 30, rows):  # blocks, then rows
            assert library.amx_row_share(row_share) in (1 << 30, 1024)
            results.append((linear(x), gate_up.silu_mul(x, ops)))
    finally:
        library.amx_row_share(1024)
        torch.set_num_threads(was)
    (plain_blocks, silu_blocks), (plain_rows, silu_rows) = results
    assert torch.equal(plain_rows, plain_blocks) and torch.equal(silu_rows, silu_blocks)
    assert_within_rounding_of_torch(plain_rows, x, weight, bias)
