"""Engines turn admitted sequences into tokens, one `step()` at a time.

`Engine` is what the worker loop asks of one. `ContinuousBatchingEngine` is the default:
every step the scheduler picks decodes and prefill chunks within a token budget, sequences
join as soon as there is room and leave the moment they finish; a `StepRunner` computes the
step's tokens. Plain Python, no torch: the runner over a loaded model and the static-batch
baseline are built in `worker/model_engine.py`, the model-free echo engine in
`worker/echo_engine.py`.
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Protocol

from shared.protocol import ErrorCode
from worker.config import EngineConfig
from worker.fair_queue import FairQueue, FifoQueue
from worker.kv_cache import KVCacheManager
from worker.preemption import LatestArrivalFirst, TenantAwarePreemption
from worker.runner import guard
from worker.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from worker.sequence import Sequence, SequenceOutput
from worker.step_batch import SamplingFailure, StepBatch
from worker.tenant_counters import ServiceUpdates

log = logging.getLogger("llmfleet.worker")

NO_TOKEN = -1  # in place of a failed sample: `postprocess` skips a finished sequence


def build_scheduler(config: EngineConfig, num_blocks: int) -> Scheduler:
    """The continuous-batching scheduler of `config` over a pool of `num_blocks` KV blocks:
    fair queuing with tenant-aware preemption, or FIFO with latest-arrival-first."""
    kv_cache = KVCacheManager(num_blocks, config.block_size, prefix_caching=config.prefix_caching)
    scheduler_config = SchedulerConfig(
        config.max_num_seqs,
        config.max_num_batched_tokens,
        config.max_num_prefill_tokens,
        None if config.itl_target_ms is None else config.itl_target_ms / 1e3,
        shared_batched_tokens=config.shared_batched_tokens,
    )
    if config.queueing == "fair":
        queue = FairQueue(config.quantum_tokens, config.burst_tokens)
        return Scheduler(scheduler_config, kv_cache, queue, TenantAwarePreemption())
    if config.queueing == "fifo":
        return Scheduler(scheduler_config, kv_cache, FifoQueue(), LatestArrivalFirst())
    raise ValueError(f"unknown queueing {config.queueing!r}")


@dataclass(frozen=True, slots=True)
class EngineStats:
    """An engine's state between steps: the heartbeat carries it (`heartbeat_fields`) and
    the worker's telemetry reads it after every step."""

    num_running: int
    num_waiting: int
    max_num_seqs: int  # places in the batch
    max_num_tokens_per_sequence: int | None = None  # the KV cache's bound, if it has one
    kv_cache_usage: float | None = None  # fraction of KV blocks in use (continuous only)
    kv_cache_waste: float | None = None  # of the slots in use, the fraction holding no token
    kv_cache_blocks: int | None = None
    num_preemptions: int = 0
    num_preemptions_by_tenant: dict[str, int] = field(default_factory=dict)
    prefix_cache_queried_tokens: int = 0  # since the start (continuous only)
    prefix_cache_hit_tokens: int = 0

    def heartbeat_fields(self) -> dict[str, int | float | str]:
        """As Redis hash fields (read back by `shared.fleet.WorkerState`); None left out."""
        fields: dict[str, int | float | str] = {}
        for name, value in asdict(self).items():
            if isinstance(value, dict):
                fields[name] = json.dumps(value)
            elif value is not None:
                fields[name] = value
        return fields


class Engine(Protocol):
    def add(self, seq: Sequence) -> SequenceOutput | None:
        """Take a sequence; an output at once if it is refused."""
        ...

    def abort(self, request_ids: set[str]) -> list[SequenceOutput]: ...
    def expire(self, now_s: float) -> list[SequenceOutput]:
        """End the sequences whose deadlines passed."""
        ...

    def num_free_slots(self) -> int: ...
    def num_waiting_by_tenant(self) -> Counter[str]: ...
    def starting_soon(self, tenant_ids: Iterable[str]) -> set[str]:
        """Which of these tenants' new requests would start at once or at the next free
        place though the batch is full (`FairQueue.starting_soon`)."""
        ...

    def take_service_updates(self) -> ServiceUpdates:
        """Tenants' service since the last call, for the pool's counters."""
        ...

    def apply_pool_service(self, counters: Mapping[str, float]) -> None: ...
    def unstarted_request_ids(self) -> list[str]:
        """Waiting requests that have produced nothing yet: safe to hand to another worker."""
        ...

    def has_work(self) -> bool: ...
    def step(self) -> list[SequenceOutput]: ...
    def stats(self, *, with_kv_waste: bool = True) -> EngineStats:
        """Without `with_kv_waste`, `kv_cache_waste` is None (it is a pass over every
        running sequence)."""
        ...


class StepRunner(Protocol):
    """What the continuous engine needs of its runner: `ModelRunner`, or a stand-in such as
    the echo engine's `EchoRunner` or the benchmark's virtual-time
    `bench.simulate.CostRunner`."""

    @property
    def vocab_size(self) -> int: ...
    def execute(self, batch: StepBatch) -> list[int | SamplingFailure]:
        """One sampled token per sampling chunk, in `batch.chunks` order, or its failure."""
        ...

    def release(self, request_id: str) -> None: ...


# A prefill worker's hand-off (issue 22): called with a sequence that has just sampled its
# first token and the ids of the blocks that hold its computed tokens. True: another worker
# took it (the callback copied its KV and sampler state out of the runner first) and it
# leaves this batch; False: it goes on decoding here.
HandOff = Callable[[Sequence, list[int]], bool]


class ContinuousBatchingEngine:
    def __init__(
        self, scheduler: Scheduler, runner: StepRunner, hand_off: HandOff | None = None
    ) -> None:
        self.scheduler = scheduler
        self._runner = runner
        self._hand_off = hand_off

    @property
    def runner(self) -> StepRunner:
        return self._runner

    def set_hand_off(self, hand_off: HandOff | None) -> None:
        """Hand sequences off at their first token from now on (a prefill worker), or not."""
        self._hand_off = hand_off

    def add(self, seq: Sequence) -> SequenceOutput | None:
        vocab_size = self._runner.vocab_size
        if (refusal := guard.refusal(seq.prompt_token_ids, seq.sampling, vocab_size)) is not None:
            return seq.refuse(*refusal)
        return self.scheduler.add(seq)

    def adopt(self, seq: Sequence, fill: Callable[[list[int]], None]) -> bool:
        """A sequence handed over by the worker that computed its prompt (its first token
        adopted, `Sequence.adopt_first_token`): it joins the batch if there is room
        (`Scheduler.adopt`), and `fill(block_ids)` puts the KV it was sent into its blocks
        (`ModelRunner.import_kv`). False: no room now, nothing taken. If `fill` raises, the
        sequence is let go again and the error raised."""
        if not self.scheduler.adopt(seq):
            return False
        try:
            fill(list(seq.block_table))
        except Exception:
            self._released(self.scheduler.abort({seq.request_id}))
            raise
        return True

    def abort(self, request_ids: set[str]) -> list[SequenceOutput]:
        return self._released(self.scheduler.abort(request_ids))

    def expire(self, now_s: float) -> list[SequenceOutput]:
        return self._released(self.scheduler.expire(now_s))

    def _released(self, outputs: list[SequenceOutput]) -> list[SequenceOutput]:
        for output in outputs:
            self._runner.release(output.request_id)
        return outputs

    def num_free_slots(self) -> int:
        # Pull only what can start soon: a worker must not hoard work another could serve.
        scheduler = self.scheduler
        return max(0, scheduler.config.max_num_seqs - scheduler.num_running - scheduler.num_waiting)

    def num_waiting_by_tenant(self) -> Counter[str]:
        return Counter(seq.tenant_id for seq in self.scheduler.waiting)

    def starting_soon(self, tenant_ids: Iterable[str]) -> set[str]:
        return self.scheduler.starting_soon(tenant_ids)

    def take_service_updates(self) -> ServiceUpdates:
        return self.scheduler.waiting.counters.take_updates()

    def apply_pool_service(self, counters: Mapping[str, float]) -> None:
        self.scheduler.waiting.counters.apply_pool(counters)

    def unstarted_request_ids(self) -> list[str]:
        return [seq.request_id for seq in self.scheduler.waiting if not seq.num_output_tokens]

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def stats(self, *, with_kv_waste: bool = True) -> EngineStats:
        scheduler = self.scheduler
        waste = scheduler.kv_cache.waste(scheduler.running) if with_kv_waste else None
        return EngineStats(
            num_running=scheduler.num_running,
            num_waiting=scheduler.num_waiting,
            max_num_seqs=scheduler.config.max_num_seqs,
            max_num_tokens_per_sequence=scheduler.kv_cache.max_num_tokens_per_sequence,
            kv_cache_usage=round(scheduler.kv_cache.usage, 4),
            kv_cache_waste=_rounded(waste),
            kv_cache_blocks=scheduler.kv_cache.num_blocks,
            num_preemptions=scheduler.num_preemptions,
            num_preemptions_by_tenant=dict(scheduler.num_preemptions_by_tenant),
            prefix_cache_queried_tokens=scheduler.kv_cache.num_queried_tokens,
            prefix_cache_hit_tokens=scheduler.kv_cache.num_hit_tokens,
        )

    def step(self) -> list[SequenceOutput]:
        out = self.scheduler.schedule(time.monotonic())
        if out.is_empty:
            return []
        started_s = time.perf_counter()
        try:
            sampled = self._runner.execute(out.batch())
        except Exception as exc:  # one request may break the model: find it, spare the rest
            log.exception("model step failed for %d sequences", len(out.chunks))
            return self._released(self.scheduler.step_failed(out, f"{type(exc).__name__}"))
        seconds = time.perf_counter() - started_s
        self.scheduler.budget.observe(
            out.num_batched_tokens, out.token_budget, len(out.decodes), seconds
        )
        failed = self._take_out_failed_samples(out, sampled)
        token_ids = [NO_TOKEN if isinstance(t, SamplingFailure) else t for t in sampled]
        outputs = self.scheduler.postprocess(out, token_ids)
        # After `postprocess`, so that the step's computed tokens count in their usage.
        outputs += [
            seq.refuse(ErrorCode.SAMPLING_ERROR, failure.message) for seq, failure in failed
        ]
        for output in outputs:
            if output.is_finished:
                self._runner.release(output.request_id)
        if self._hand_off is not None:
            self._offer_first_tokens(out)
        return outputs

    def _offer_first_tokens(self, out: SchedulerOutput) -> None:
        """Hand the sequences that sampled their first token in this step to other workers."""
        assert self._hand_off is not None
        block_size = self.scheduler.kv_cache.block_size
        for chunk in out.chunks:
            seq = chunk.seq
            # (after `postprocess`: the chunk reached the token before the one it sampled)
            sampled_first = chunk.end == seq.num_tokens - 1 and seq.num_output_tokens == 1
            if seq.is_finished or not sampled_first:
                continue
            num_blocks = -(-seq.num_computed_tokens // block_size)
            if self._hand_off(seq, seq.block_table[:num_blocks]):
                self.scheduler.hand_off(seq)
                self._runner.release(seq.request_id)

    def _take_out_failed_samples(
        self, out: SchedulerOutput, sampled: list[int | SamplingFailure]
    ) -> list[tuple[Sequence, SamplingFailure]]:
        """The sequences whose sampling failed in a step whose forward pass went well, taken
        out of the batch: everyone else keeps their token and nobody is recomputed (a failed
        step would recompute them all, `Scheduler.step_failed`). `abort` is the scheduler's
        way to end a sequence from outside a step: it frees the blocks and refunds what
        was charged ahead; `postprocess` then skips the finished sequence, and the caller
        replaces the cancel with the error."""
        sampling = [chunk.seq for chunk in out.chunks if chunk.is_sampling]
        failed = [
            (seq, token)
            for seq, token in zip(sampling, sampled, strict=True)
            if isinstance(token, SamplingFailure) and not seq.is_finished
        ]
        if failed:
            log.warning("sampling failed for %d of %d sequences", len(failed), len(sampling))
            self.scheduler.abort({seq.request_id for seq, _ in failed})
        return failed


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 4)
