"""`loader.pick_device`: the dtype a deployment's weights take when its config says `auto`."""

from __future__ import annotations

import pytest
import torch

from worker.runner import cpu_kernels, loader

AVX2 = frozenset({"avx", "avx2", "fma"})


@pytest.fixture
def on_the_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.mark.parametrize(
    ("flags", "kernels", "dtype"),
    [
        (AVX2 | {"avx512f", "avx512_bf16"}, False, torch.bfloat16),  # bf16 dot products
        (AVX2 | {"amx_bf16", "avx512_bf16"}, False, torch.bfloat16),  # AMX
        (AVX2, True, torch.bfloat16),  # AVX2 alone, our kernels take every bf16 matmul
        (AVX2, False, torch.float32),  # AVX2 alone without them: oneDNN emulates bf16
    ],
)
def test_auto_takes_bf16_on_the_cpu_only_where_its_matmuls_are_fast(
    monkeypatch, on_the_cpu, flags, kernels, dtype
):
    monkeypatch.setattr(loader, "cpu_flags", lambda: flags)
    monkeypatch.setattr(cpu_kernels, "pair_matmuls_for_prompts", lambda: kernels)
    assert loader.pick_device("auto", "auto") == (torch.device("cpu"), dtype)
    assert loader.pick_device("cpu", "float32") == (torch.device("cpu"), torch.float32)
