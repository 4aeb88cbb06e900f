"""`python -m bench.prompt_sides`: whole prompt steps, this build's attention against another
build's, in turns."""

from __future__ import annotations

import pytest

from bench import kernel_run, prompt_sides
from bench.step_times import BLOCK_SIZE, StepShape
from worker.runner import cpu_attention, cpu_kernels
from worker.runner.model_runner import ModelRunner

pytestmark = pytest.mark.skipif(
    cpu_kernels.load() is None, reason="another build of the kernels needs this one built (cc)"
)


class _Spy:
    """A stand-in build: counts the attention calls that reach it, and passes them on."""

    def __init__(self, library) -> None:
        self.library, self.calls = library, 0

    def __getattr__(self, name):
        self.calls += 1
        return getattr(self.library, name)


def test_the_other_builds_attention_is_called_inside_and_only_inside():
    before = cpu_attention.load
    spy = _Spy(before())
    with kernel_run.attention_from(spy):
        assert cpu_attention.load() is spy
    assert cpu_attention.load is before


def test_both_sides_are_timed_in_turns_and_the_baseline_takes_its_build(tiny_loaded):
    runner = ModelRunner(tiny_loaded, 64, BLOCK_SIZE, "own")
    library = cpu_attention.load()
    spy = _Spy(library)
    shapes = [StepShape("prompt 40", 0, 40), StepShape("2 decodes + 16 prompt tokens", 2, 16)]
    rows = prompt_sides.measure(runner, spy, shapes, rounds=3)
    assert [row["shape"] for row in rows] == [shape.name for shape in shapes]
    for row in rows:
        assert all(
            len(row["all_s"][side]) == 3 and min(row["all_s"][side]) > 0
            for side in ("this", "baseline")
        )
        assert row["baseline_over_this"] > 0
    assert spy.calls > 0  # the baseline side's attention went to its build
