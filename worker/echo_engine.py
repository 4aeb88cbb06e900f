"""The echo engine: the platform without a model, to measure what the platform itself costs.

`llmfleet worker --engine echo` serves a deployment with the real continuous-batching engine
(scheduler, fair queue, KV-cache accounting, sequences, detokenizer: `worker/engine.py`) over
a runner that computes nothing: the n-th output token of a sequence is its prompt's token n
again, cyclically (`prompt[n % len(prompt)]`, hence "echo"). So a sequence's output is known
in advance, and `max_tokens`, stop strings and stop token ids, cancels, deadlines,
`max_num_seqs` and the usage the publisher records (`shared/ending.py`) all take the path
they take with a model. The worker loads the deployment's tokenizer (to detokenize), never
its weights; this module imports no torch.

Time: every running sequence gets one token per period, `1 / tokens_per_s`, exactly. The
scheduler steps once a period (every running sequence's next token, as a model step gives
them); its outputs are handed out over the period in `num_slices` engine steps, `step_s`
apart, each sequence always in the same slice (round robin as they are added). With one
slice (the default: the step is the period) all of a step's tokens leave at once, as from a
model; with many, a few thousand slow streams emit as a fleet of workers does, spread over
time, and not as one synchronised burst that no relay could pass on within milliseconds.

The steps keep a fixed grid: a step waits for its slot (the previous one plus `step_s`), so
the worker's time between steps (publishing, intake) is hidden in the wait, as a GPU step
hides it. A step called late runs at once and keeps the grid, so the steps after a costly
one catch up and every sequence's tokens stay a period apart on average; one called more
than a period late (the engine was idle, or fell that far behind) starts a new grid.

With an emission log (`--echo-emissions PATH`), every token handed out is written down with
its request id and the time it left the engine (`time.perf_counter`, CLOCK_MONOTONIC: one
clock for every process of the machine), so a client on the same machine can tell what the
platform added after the worker emitted it, whether or not the worker kept its grid.

Why the real engine with a stand-in runner, not an engine of its own: a second engine would
have its own notion of a step, of finishing and of admission, so what it measured would be
a platform that does not exist. Here the only differences from a model worker are the time
a step takes, and when its outputs leave: what a client sees beyond the period
(`llmfleet bench --platform-load`) is the platform's own cost.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, TextIO

from worker.config import EngineConfig
from worker.engine import ContinuousBatchingEngine, build_scheduler
from worker.scheduler import Scheduler
from worker.sequence import Sequence, SequenceOutput
from worker.step_batch import ChunkInput, SamplingFailure, StepBatch

# The KV pool is only bookkeeping here (no tensors): large enough that thousands of
# sequences of a few hundred tokens never wait for blocks (4M tokens of 16; ~10 MB).
DEFAULT_NUM_KV_BLOCKS = 1 << 18


class Tokenizer(Protocol):
    """What the echo engine reads of the deployment's tokenizer (a Hugging Face one)."""

    eos_token_id: int | None

    def __len__(self) -> int: ...


@dataclass
class EchoRunner:
    """A `StepRunner` that computes nothing: for each sequence, its prompt's next token."""

    vocab_size: int
    _prompts: dict[str, list[int]] = field(default_factory=dict)

    def remember(self, request_id: str, prompt_token_ids: list[int]) -> None:
        self._prompts[request_id] = prompt_token_ids

    def execute(self, batch: StepBatch) -> list[int | SamplingFailure]:
        return [self._echo(chunk) for chunk in batch.chunks if chunk.is_sampling]

    def release(self, request_id: str) -> None:
        self._prompts.pop(request_id, None)

    def _echo(self, chunk: ChunkInput) -> int:
        # A sampling chunk ends at the sequence's last token: `end` counts the prompt and the
        # outputs so far, so it gives the index of the output token to sample, also when a
        # preempted sequence is recomputed.
        prompt = self._prompts[chunk.request_id]
        return prompt[(chunk.end - len(prompt)) % len(prompt)]


@dataclass
class StepGrid:
    """Slots `step_s` apart: `wait` returns at the next one (see the module docstring)."""

    step_s: float
    reset_after_s: float  # this late, a new grid starts
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep
    _next_slot_s: float | None = None

    def wait(self) -> None:
        now_s = self.clock()
        slot_s = self._next_slot_s
        if slot_s is None or now_s - slot_s > self.reset_after_s:
            slot_s = now_s
        elif slot_s > now_s:
            self.sleep(slot_s - now_s)
        self._next_slot_s = slot_s + self.step_s


@dataclass
class EmissionLog:
    """Lines `<request id> <perf_counter s>`, one per token handed out, flushed each step."""

    file: TextIO

    def emitted(self, outputs: list[SequenceOutput], at_s: float) -> None:
        lines = [f"{o.request_id} {at_s:.6f}\n" for o in outputs if o.num_new_tokens]
        if lines:
            self.file.write("".join(lines))
            self.file.flush()


class EchoEngine(ContinuousBatchingEngine):
    """The continuous engine over an `EchoRunner`, its steps on a `StepGrid`, each scheduler
    step's outputs handed out in `num_slices` steps."""

    def __init__(
        self,
        scheduler: Scheduler,
        runner: EchoRunner,
        grid: StepGrid,
        num_slices: int = 1,
        emissions: EmissionLog | None = None,
    ) -> None:
        super().__init__(scheduler, runner)
        self.echo = runner
        self.grid = grid
        self.num_slices = num_slices
        self.emissions = emissions
        self._slice_of: dict[str, int] = {}
        self._num_added = 0
        self._pending: deque[list[SequenceOutput]] = deque()  # the slices still to hand out

    def add(self, seq: Sequence) -> SequenceOutput | None:
        self.echo.remember(seq.request_id, seq.prompt_token_ids)
        if (refused := super().add(seq)) is not None:
            self.echo.release(seq.request_id)
            return refused
        self._slice_of[seq.request_id] = self._num_added % self.num_slices
        self._num_added += 1
        return None

    def abort(self, request_ids: set[str]) -> list[SequenceOutput]:
        return self._forget(super().abort(request_ids))

    def expire(self, now_s: float) -> list[SequenceOutput]:
        return self._forget(super().expire(now_s))

    def has_work(self) -> bool:
        return bool(self._pending) or super().has_work()

    def step(self) -> list[SequenceOutput]:
        """The next slice of the last scheduler step's outputs, at its slot; a scheduler step
        (every running sequence's next token) once the slices are all out."""
        self.grid.wait()
        if not self._pending:
            self._pending = deque(self._sliced(super().step()))
        outputs = self._pending.popleft()
        if self.emissions is not None:
            self.emissions.emitted(outputs, time.perf_counter())
        return outputs

    def _sliced(self, outputs: list[SequenceOutput]) -> list[list[SequenceOutput]]:
        slices: list[list[SequenceOutput]] = [[] for _ in range(self.num_slices)]
        for output in outputs:
            slices[self._slice_of.get(output.request_id, 0)].append(output)
        self._forget(outputs)
        return slices

    def _forget(self, outputs: list[SequenceOutput]) -> list[SequenceOutput]:
        for output in outputs:
            if output.is_finished:
                self._slice_of.pop(output.request_id, None)
        return outputs


def build_echo_engine(config: EngineConfig, vocab_size: int) -> EchoEngine:
    """The echo engine with `config`'s scheduler settings (continuous batching only): each
    sequence `config.echo_tokens_per_s` tokens a second, handed out every
    `config.echo_step_ms` (None: once a period), rounded so that a period holds whole
    steps."""
    if config.batching != "continuous":
        raise ValueError("the echo engine batches continuously (--batching continuous)")
    if not config.echo_tokens_per_s > 0:
        raise ValueError("the echo engine needs a rate above 0 tokens per second")
    period_s = 1.0 / config.echo_tokens_per_s
    step_s = period_s if config.echo_step_ms is None else config.echo_step_ms / 1e3
    num_slices = max(1, round(period_s / step_s))
    grid = StepGrid(step_s=period_s / num_slices, reset_after_s=period_s)
    scheduler = build_scheduler(config, config.num_kv_blocks or DEFAULT_NUM_KV_BLOCKS)
    emissions = None
    if config.echo_emissions_path is not None:
        emissions = EmissionLog(open(config.echo_emissions_path, "a"))  # noqa: SIM115  # for the process's life
    return EchoEngine(scheduler, EchoRunner(vocab_size), grid, num_slices, emissions)


def eos_token_ids(tokenizer: Tokenizer) -> frozenset[int]:
    """The end-of-sequence ids an echoed prompt may hit: the tokenizer's (no model config is
    read; a model's generation config may name others)."""
    eos = tokenizer.eos_token_id
    return frozenset() if eos is None else frozenset({eos})
