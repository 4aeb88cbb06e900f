"""`python -m bench.prompt_attention`: our prompt kernel against SDPA on the same chunks."""

from __future__ import annotations

import pytest

from bench import prompt_attention
from worker.runner import cpu_attention, cpu_kernels


def test_every_case_is_timed_and_the_kernel_agrees_with_sdpa_where_it_is_built():
    rows = prompt_attention.measure(repeat=1)
    assert [(row["tokens"], row["start"]) for row in rows] == prompt_attention.CASES
    assert all(row["sdpa_ms"] > 0 for row in rows)
    if cpu_attention.has_prefill_kernel():
        # outputs of a few units: within a bf16 rounding step or two
        assert all(row["kernel_ms"] > 0 and row["max_abs_difference"] <= 2**-5 for row in rows)
    else:
        assert all("kernel_ms" not in row for row in rows)


@pytest.mark.skipif(not cpu_attention.has_prefill_kernel(), reason="the prompt kernel: AVX512-BF16")
def test_a_baseline_build_is_timed_in_turns_beside_the_kernel():
    """This build as its own baseline: the same bits, both sides timed."""
    this_build = str(cpu_kernels._build(cpu_kernels._compiler()))
    rows = prompt_attention.measure(repeat=2, baseline=this_build)
    for row in rows:
        assert row["kernel_ms"] > 0 and row["baseline_ms"] > 0 and row["baseline_over_kernel"] > 0
        assert row["same_bits"]
