"""One step as the model runner sees it: plain data, no `Sequence`.

The scheduler decides a step over live sequences (`SchedulerOutput`); `SchedulerOutput.batch`
copies out what the forward pass needs: for each chunk its token ids, the position of the
first, the sequence's KV block ids and, when the chunk reaches the sequence's last token,
its sampling parameters. The runner (`worker/runner/model_runner.py`, the echo engine's
`worker.echo_engine.EchoRunner`, or the benchmark's `bench.simulate.CostRunner`) returns
one token per sampling chunk, in `StepBatch.chunks` order, which is `SchedulerOutput.chunks`
order too, or that chunk's `SamplingFailure`.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.protocol import SamplingParams


@dataclass(frozen=True, slots=True)
class ChunkInput:
    """Tokens [start, start + len(token_ids)) of one sequence."""

    request_id: str
    token_ids: list[int]
    start: int
    block_ids: list[int]  # the sequence's KV blocks: token t is in block_ids[t // block_size]
    sampling: SamplingParams | None  # the chunk's last position samples; None: it does not

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)

    @property
    def is_sampling(self) -> bool:
        return self.sampling is not None


@dataclass(frozen=True, slots=True)
class StepBatch:
    decodes: list[ChunkInput]  # one token each, by ascending context (`end`)
    prefills: list[ChunkInput]  # prompt chunks, or recompute after a preemption

    @property
    def chunks(self) -> list[ChunkInput]:
        """In the order the runner packs them: decodes first, then prefills."""
        return self.decodes + self.prefills

    @property
    def num_tokens(self) -> int:
        return sum(len(chunk.token_ids) for chunk in self.chunks)


@dataclass(frozen=True, slots=True)
class SamplingFailure:
    """A row that could not be sampled, and why; the step's other rows are unaffected."""

    message: str
