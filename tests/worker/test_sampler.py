"""Greedy sampling's argmax (`sampler.greedy_tokens`: on the CPU a C kernel) gives what
`torch.argmax` gives: the first largest value of each row, the first NaN where a row has one."""

from __future__ import annotations

import pytest
import torch

from worker.runner import cpu_kernels
from worker.runner.sampler import greedy_tokens


def _rows(dtype: torch.dtype, rows: int, cols: int) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(cols)).to(dtype)


def test_the_kernel_takes_the_cpus_logits():
    library = cpu_kernels.load()
    if library is None:
        pytest.skip("no C compiler here: torch's argmax runs")
    calls = []
    kernel = library.argmax_rows
    library.argmax_rows = lambda *args: calls.append(args) or kernel(*args)
    try:
        assert (
            greedy_tokens(_rows(torch.bfloat16, 2, 64))
            == _rows(torch.bfloat16, 2, 64).argmax(-1).tolist()
        )
    finally:
        library.argmax_rows = kernel
    assert len(calls) == 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("rows", "cols"), [(1, 49152), (32, 49152), (3, 37), (5, 16), (2, 1000)])
def test_greedy_tokens_are_torchs_argmax(dtype, rows, cols):
    logits = _rows(dtype, rows, cols)
    assert greedy_tokens(logits) == logits.argmax(-1).tolist()
    # ties: the first of equal largest values, also where they fall in other lanes and the tail
    tied = logits.clone()
    tied[:, [cols // 2, cols - 1, 3]] = 99.0
    assert greedy_tokens(tied) == [3] * rows == tied.argmax(-1).tolist()
    assert greedy_tokens(torch.ones(rows, cols, dtype=dtype)) == [0] * rows
    assert greedy_tokens(torch.full((rows, cols), float("-inf"), dtype=dtype)) == [0] * rows
    # NaN counts as the largest: the first NaN, past a larger value and an inf
    with_nan = logits.clone()
    with_nan[0, [cols - 1, cols // 3]] = float("nan")
    with_nan[0, 1] = float("inf")
    assert greedy_tokens(with_nan) == with_nan.argmax(-1).tolist()
    assert greedy_tokens(with_nan)[0] == cols // 3
    # a strided view (a graph's static output) reads as its values
    wide = torch.cat([logits, logits], dim=1)[:, :cols]
    assert greedy_tokens(wide) == logits.argmax(-1).tolist()
