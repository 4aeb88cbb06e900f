"""The engines over a loaded model: the continuous engine on the model runner, or the
static-batch baseline it is measured against.

`StaticBatchEngine` forms a batch of up to `max_batch_size` waiting sequences, runs it until
every one of them has finished, and only then admits more; with `max_batch_size=1` it is
the one-request-at-a-time engine.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable, Mapping

from shared.protocol import ErrorCode
from worker.config import EngineConfig
from worker.engine import ContinuousBatchingEngine, Engine, EngineStats, build_scheduler
from worker.runner import guard, model_runner
from worker.runner.loader import LoadedModel
from worker.runner.model_runner import ModelRunner
from worker.runner.padded_batch import PaddedBatch
from worker.sequence import Sequence, SequenceOutput, SequenceStatus
from worker.step_batch import SamplingFailure
from worker.tenant_counters import ServiceUpdates


def build_engine(loaded: LoadedModel, config: EngineConfig) -> Engine:
    if config.batching == "one":
        return StaticBatchEngine(loaded, max_batch_size=1)
    if config.batching == "static":
        return StaticBatchEngine(loaded, max_batch_size=config.max_batch_size)
    if config.batching != "continuous":
        raise ValueError(f"unknown batching mode {config.batching!r}")
    num_blocks = config.num_kv_blocks
    if num_blocks is None:
        kv_bytes = model_runner.kv_cache_budget_bytes(
            loaded, config.kv_cache_gb, config.gpu_memory_fraction
        )
        num_blocks = model_runner.num_blocks_for_budget(loaded, kv_bytes, config.block_size)
    runner = ModelRunner(
        loaded,
        num_blocks,
        config.block_size,
        config.forward,
        graphs="auto" if config.cuda_graphs else "off",
        max_num_seqs=config.max_num_seqs,
    )
    runner.fault_token_id = config.fault_token_id
    if loaded.device.type == "cuda":  # kernels load at first use: before requests, not in them
        runner.warm_up(config.max_num_batched_tokens, config.max_num_seqs)
    return ContinuousBatchingEngine(build_scheduler(config, num_blocks), runner)


class StaticBatchEngine:
    def __init__(self, loaded: LoadedModel, max_batch_size: int) -> None:
        self._loaded = loaded
        self.max_batch_size = max_batch_size
        self._waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []
        self._batch: PaddedBatch | None = None
        self._last_token_ids: list[int] = []

    def add(self, seq: Sequence) -> SequenceOutput | None:
        vocab_size = self._loaded.vocab_size
        if (refusal := guard.refusal(seq.prompt_token_ids, seq.sampling, vocab_size)) is not None:
            return seq.refuse(*refusal)
        self._waiting.append(seq)
        return None

    def abort(self, request_ids: set[str]) -> list[SequenceOutput]:
        outputs = []
        for seq in [*self._waiting, *self._running]:
            if seq.request_id in request_ids and not seq.is_finished:
                outputs.append(seq.cancel())
        self._waiting = deque(s for s in self._waiting if not s.is_finished)
        self._end_batch_if_done()
        return outputs

    def expire(self, now_s: float) -> list[SequenceOutput]:
        outputs = [o for seq in self._waiting if (o := seq.expire(now_s)) is not None]
        self._waiting = deque(s for s in self._waiting if not s.is_finished)
        outputs += [o for seq in self._running if not seq.is_finished and (o := seq.expire(now_s))]
        self._end_batch_if_done()
        return outputs

    def num_free_slots(self) -> int:
        return max(0, self.max_batch_size - len(self._waiting) - len(self._running))

    def num_waiting_by_tenant(self) -> Counter[str]:
        return Counter(seq.tenant_id for seq in self._waiting)

    def starting_soon(self, tenant_ids: Iterable[str]) -> set[str]:
        return set()  # a static batch runs to its end

    def take_service_updates(self) -> ServiceUpdates:
        return ServiceUpdates()

    def apply_pool_service(self, counters: Mapping[str, float]) -> None:
        pass  # arrival order

    def unstarted_request_ids(self) -> list[str]:
        return [seq.request_id for seq in self._waiting]

    def has_work(self) -> bool:
        return bool(self._waiting or self._running)

    def stats(self, *, with_kv_waste: bool = True) -> EngineStats:
        return EngineStats(len(self._running), len(self._waiting), self.max_batch_size)

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

    def _collect(self, sampled: list[int | SamplingFailure]) -> list[SequenceOutput]:
        outputs = []
        token_ids = []
        for seq, token in zip(self._running, sampled, strict=True):
            if isinstance(token, SamplingFailure):
                if not seq.is_finished:
                    outputs.append(seq.refuse(ErrorCode.SAMPLING_ERROR, token.message))
                token = self._loaded.pad_token_id  # the row keeps its slot till the batch ends
            elif not seq.is_finished:
                outputs.append(seq.append_token(token))
            token_ids.append(token)
        self._last_token_ids = token_ids
        self._end_batch_if_done()
        return outputs

    def _end_batch_if_done(self) -> None:
        if self._running and all(seq.is_finished for seq in self._running):
            self._running = []
            self._batch = None
