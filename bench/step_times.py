"""Step latency of the model runner on fixed step shapes, for several forwards side by side.

One process, one loaded model, one runner per forward, and the same `StepBatch` for each;
the forwards take turns (every other round in reverse order), so a machine that drifts
weighs on each alike. This isolates the runner's cost from scheduling and workload noise:
the figure the forward, attention and kernel choices are judged by (docs/benchmarks.md).
"""

from __future__ import annotations

import statistics
import time
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
    prefill_tokens: int


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
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    decodes, prefills, next_block = [], [], 0
    per_decode = -(-(CONTEXT + 1) // BLOCK_SIZE)
    for i in range(shape.num_decodes):
        blocks = list(range(next_block, next_block + per_decode))
        decodes.append(ChunkInput(f"d{i}", [1000 + i], CONTEXT, blocks, greedy))
        next_block += per_decode
    if shape.prefill_tokens:
        blocks = list(range(next_block, next_block + -(-shape.prefill_tokens // BLOCK_SIZE)))
        prompt = [2000 + j for j in range(shape.prefill_tokens)]
        prefills.append(ChunkInput("p", prompt, 0, blocks, greedy))
    return StepBatch(decodes, prefills)


def measure(loaded: LoadedModel, forwards: list[str], num_rounds: int = 8) -> list[dict]:
    """Median step seconds per shape and forward."""
    runners = {name: ModelRunner(loaded, NUM_BLOCKS, BLOCK_SIZE, name) for name in forwards}
    rows = []
    for shape in SHAPES:
        batch = make_batch(shape)
        times: dict[str, list[float]] = {name: [] for name in forwards}
        for runner in runners.values():
            runner.execute(batch)  # warm-up
        for index in range(num_rounds):
            order = forwards if index % 2 == 0 else forwards[::-1]
            for name in order:
                start = time.perf_counter()
                runners[name].execute(batch)
                times[name].append(time.perf_counter() - start)
        rows.append(
            {
                "shape": shape.name,
                "num_decodes": shape.num_decodes,
                "prefill_tokens": shape.prefill_tokens,
                "context": CONTEXT,
                "median_s": {name: statistics.median(t) for name, t in times.items()},
                "all_s": times,
            }
        )
    return rows
