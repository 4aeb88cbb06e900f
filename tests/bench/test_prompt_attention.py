"""`python -m bench.prompt_attention`: our prompt kernel against SDPA on the same chunks."""

from __future__ import annotations

from bench import prompt_attention
from worker.runner import cpu_attention


def test_every_case_is_timed_and_the_kernel_agrees_with_sdpa_where_it_is_built():
    rows = prompt_attention.measure(repeat=1)
    assert [(row["tokens"], row["start"]) for row in rows] == prompt_attention.CASES
    assert all(row["sdpa_ms"] > 0 for row in rows)
    if cpu_attention.has_prefill_kernel():
        # outputs of a few units: within a bf16 rounding step or two
        assert all(row["kernel_ms"] > 0 and row["max_abs_difference"] <= 2**-5 for row in rows)
    else:
        assert all("kernel_ms" not in row for row in rows)
