"""Whole prompt steps of the real model through one runner, its attention in this build's
kernels and in another build's (`--baseline`, a .so made by a worktree of an earlier commit,
as in `bench/few_rows_stream.py`), the two taking turns on each step shape, every other round
in reverse order: what an attention change gives a step, with the matmuls, norms and the
rest of the step the same on both sides. The shapes are `bench/step_times.py`'s (one prompt,
several prompts in one step, a prompt chunk beside 31 decodes).

    git worktree add /tmp/wt-base BASE
    (cd /tmp/wt-base && LLMFLEET_KERNEL_CACHE=/tmp/base-kernels python -c \\
        "from worker.runner import cpu_kernels; cpu_kernels.load()")
    python -m bench.prompt_sides --baseline /tmp/base-kernels/*.so --json bench/results/...
"""

from __future__ import annotations

import argparse
import statistics

import torch

from bench import kernel_run, report, step_times
from bench.step_times import StepShape
from shared import model_source
from worker.runner import loader
from worker.runner.model_runner import ModelRunner

SHAPES = [
    StepShape("prompt 192", 0, 192),
    StepShape("prompt 512", 0, 512),
    StepShape("prompt 1024", 0, 1024),
    StepShape("prompt 2048", 0, 2048),
    StepShape("4 prompts of 256", 0, 256, num_chunks=4),
    StepShape("31 decodes + 161 prompt tokens", 31, 161),
]


class _AttentionOf:
    """`runner`'s steps with the attention of another build of the kernels."""

    def __init__(self, runner: ModelRunner, library) -> None:
        self._runner, self._library = runner, library

    def execute(self, batch):
        with kernel_run.attention_from(self._library):
            return self._runner.execute(batch)


def measure(runner: ModelRunner, baseline, shapes: list[StepShape], rounds: int) -> list[dict]:
    """Median seconds a step per shape and side (`step_times.measure_runners`), and the
    median of the rounds' ratios of the baseline's step time to this build's."""
    sides = {"this": runner, "baseline": _AttentionOf(runner, baseline)}
    rows = step_times.measure_runners(sides, shapes, rounds)  # type: ignore[arg-type]
    for row in rows:
        this, base = row["all_s"]["this"], row["all_s"]["baseline"]
        row["baseline_over_this"] = statistics.median(
            b / a for a, b in zip(this, base, strict=True)
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", required=True, help="another build of the kernels (a .so)")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--source", default=model_source.DEFAULT_MODEL_ID, help="the model")
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    loaded = loader.load(model_source.resolve(args.source), "auto", "bfloat16")
    runner = ModelRunner(loaded, step_times.NUM_BLOCKS, step_times.BLOCK_SIZE, "own")
    rows = measure(runner, kernel_run.with_signatures(args.baseline), SHAPES, args.rounds)
    print(
        "median ms a step: this build's attention, the baseline's; the baseline's time over this one's"
    )
    for row in rows:
        print(
            f"{row['shape']:32s} {row['median_s']['this'] * 1e3:8.1f} "
            f"{row['median_s']['baseline'] * 1e3:8.1f}  {row['baseline_over_this']:.2f}x"
        )
    if args.json:
        report.write_json(
            args.json, {**kernel_run.header(), "baseline": args.baseline, "rows": rows}
        )


if __name__ == "__main__":
    main()
