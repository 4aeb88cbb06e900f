"""Step latency of the model runner on fixed step shapes, for several forwards side by side.

One process, one loaded model, one runner per forward, and the same `StepBatch` for each;
the forwards take turns (every other round in reverse order), so a machine that drifts
weighs on each alike. This isolates the runner's cost from scheduling and workload noise:
the figure the forward, attention and kernel choices are judged by (docs/benchmarks.md).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

from shared.protocol import SamplingParams
from worker.runner.loader import LoadedModel
from worker.runner.model_runner import ModelRunner
from worker.step_batch import ChunkInput, StepBatch

BLOCK_SIZE = 16
NUM_BLOCKS = 4096
CONTEXT = 300  # tokens each decode attends to


@dataclass(frozen=True, slots=True)
class StepShape:
    name: str
    num_decodes: int
    prefill_tokens: int  # in each chunk
    num_chunks: int = 1
    context_spread: bool = False  # decodes' contexts from 1/8x to 2x CONTEXT, not all CONTEXT


SHAPES = [
    StepShape("decode 1", 1, 0),
    StepShape("decode 8", 8, 0),
    StepShape("decode 32", 32, 0),
    StepShape("decode 64", 64, 0),
    StepShape("31 decodes + 161 prompt tokens", 31, 161),
    StepShape("prompt 192", 0, 192),
    StepShape("prompt 1024", 0, 1024),
]


def make_batch(shape: StepShape) -> StepBatch:
    """Decodes (ascending contexts, as the scheduler orders them), then prompt chunks: each
    the start of its own prompt. Distinct blocks for every sequence."""
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    decodes, prefills, next_block = [], [], 0
    for i in range(shape.num_decodes):
        context = CONTEXT
        if shape.context_spread:  # CONTEXT / 8 up to 2 * CONTEXT, ascending
            context = CONTEXT // 8 + (2 * CONTEXT - CONTEXT // 8) * i // max(
                1, shape.num_decodes - 1
            )
        num_blocks = -(-(context + 1) // BLOCK_SIZE)
        blocks = list(range(next_block, next_block + num_blocks))
        decodes.append(ChunkInput(f"d{i}", [1000 + i], context, blocks, greedy))
        next_block += num_blocks
    for c in range(shape.num_chunks if shape.prefill_tokens else 0):
        blocks = list(range(next_block, next_block + -(-shape.prefill_tokens // BLOCK_SIZE)))
        next_block += len(blocks)
        prompt = [2000 + 7 * c + j for j in range(shape.prefill_tokens)]
        prefills.append(ChunkInput(f"p{c}", prompt, 0, blocks, greedy))
    return StepBatch(decodes, prefills)


def measure(loaded: LoadedModel, forwards: list[str], num_rounds: int = 8) -> list[dict]:
    """Median step seconds per shape and forward."""
    runners = {name: ModelRunner(loaded, NUM_BLOCKS, BLOCK_SIZE, name) for name in forwards}
    return measure_runners(runners, SHAPES, num_rounds)


def measure_runners(
    runners: dict[str, ModelRunner],
    shapes: list[StepShape],
    num_rounds: int = 8,
    deadline: Callable[[], bool] = lambda: False,
) -> list[dict]:
    """Median step seconds per shape and runner, the runners taking turns (the order
    reversed every other round). Shapes after `deadline()` turns true are left out."""
    names = list(runners)
    rows = []
    for shape in shapes:
        if deadline():
            break
        batch = make_batch(shape)
        times: dict[str, list[float]] = {name: [] for name in names}
        for runner in runners.values():
            runner.execute(batch)  # warm-up
        for index in range(num_rounds):
            for name in names if index % 2 == 0 else names[::-1]:
                start = time.perf_counter()
                runners[name].execute(batch)  # sampled tokens as ints: the device is done
                times[name].append(time.perf_counter() - start)
        rows.append(
            {
                "shape": shape.name,
                "num_decodes": shape.num_decodes,
                "prefill_tokens": shape.prefill_tokens,
                "num_chunks": shape.num_chunks,
                "context": CONTEXT,
                "context_spread": shape.context_spread,
                "median_s": {name: statistics.median(t) for name, t in times.items()},
                "all_s": times,
            }
        )
    return rows
