"""Engines turn admitted sequences into tokens, one `step()` at a time.

`StaticBatchEngine` is the baseline the continuous-batching engine is measured against:
it forms a batch of up to `max_batch_size` waiting sequences, runs it until every one of
them has finished, and only then admits more. With `max_batch_size=1` it is the
one-request-at-a-time engine.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

from worker.runner.loader import LoadedModel
from worker.runner.padded_batch import PaddedBatch
from worker.sequence import Sequence, SequenceOutput, SequenceStatus


class Engine(Protocol):
    def add(self, seq: Sequence) -> None: ...
    def abort(self, request_ids: set[str]) -> list[SequenceOutput]: ...
    def num_free_slots(self) -> int: ...
    def has_work(self) -> bool: ...
    def step(self) -> list[SequenceOutput]: ...


class StaticBatchEngine:
    def __init__(self, loaded: LoadedModel, max_batch_size: int) -> None:
        self._loaded = loaded
        self.max_batch_size = max_batch_size
        self._waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []
        self._batch: PaddedBatch | None = None
        self._last_token_ids: list[int] = []

    def add(self, seq: Sequence) -> None:
        self._waiting.append(seq)

    def abort(self, request_ids: set[str]) -> list[SequenceOutput]:
        outputs = []
        for seq in [*self._waiting, *self._running]:
            if seq.request_id in request_ids and not seq.is_finished:
                outputs.append(seq.cancel())
        self._waiting = deque(s for s in self._waiting if not s.is_finished)
        self._end_batch_if_done()
        return outputs

    def num_free_slots(self) -> int:
        return max(0, self.max_batch_size - len(self._waiting) - len(self._running))

    def has_work(self) -> bool:
        return bool(self._waiting or self._running)

    def step(self) -> list[SequenceOutput]:
        if self._batch is None:
            if not self._waiting:
                return []
            return self._start_batch()
        token_ids = self._batch.decode(self._last_token_ids)
        return self._collect(token_ids)

    def _start_batch(self) -> list[SequenceOutput]:
        count = min(self.max_batch_size, len(self._waiting))
        self._running = [self._waiting.popleft() for _ in range(count)]
        for seq in self._running:
            seq.status = SequenceStatus.RUNNING
        self._batch = PaddedBatch(
            self._loaded,
            [seq.prompt_token_ids for seq in self._running],
            [seq.sampling for seq in self._running],
        )
        return self._collect(self._batch.prefill())

    def _collect(self, token_ids: list[int]) -> list[SequenceOutput]:
        outputs = [
            seq.append_token(token_id)
            for seq, token_id in zip(self._running, token_ids, strict=True)
            if not seq.is_finished
        ]
        self._last_token_ids = token_ids
        self._end_batch_if_done()
        return outputs

    def _end_batch_if_done(self) -> None:
        if self._running and all(seq.is_finished for seq in self._running):
            self._running = []
            self._batch = None
