"""Small factories for engine-level tests (vLLM's `create_requests` style)."""

from __future__ import annotations

from shared.protocol import QueuedRequest, SamplingParams
from worker.engine import ContinuousBatchingEngine
from worker.fair_queue import FairQueue
from worker.kv_cache import KVCacheManager
from worker.preemption import TenantAwarePreemption
from worker.scheduler import Scheduler, SchedulerConfig
from worker.sequence import Sequence


class CharDecoder:
    """Token id n decodes to chr(n): enough for bookkeeping tests without a tokenizer."""

    def decode(self, token_ids, skip_special_tokens=True):
        return "".join(chr(t) for t in token_ids)


def make_request(
    i: int,
    prompt_ids: list[int],
    max_tokens: int,
    *,
    tenant_id: str = "t",
    tier: int = 1,
    weight: int = 1,
    **sampling,
) -> QueuedRequest:
    sampling.setdefault("temperature", 0.0)
    return QueuedRequest(
        request_id=f"r{i}",
        tenant_id=tenant_id,
        tier=tier,
        weight=weight,
        model="m",
        deployment_id=1,
        kind="completion",
        prompt_token_ids=prompt_ids,
        sampling=SamplingParams(max_tokens=max_tokens, **sampling),
        arrival_ts=float(i),
    )


def make_sequence(
    i: int, num_prompt_tokens: int, max_tokens: int, decoder=None, **kwargs
) -> Sequence:
    """kwargs: tenant_id, tier, weight, or sampling parameters."""
    request = make_request(
        i, [65 + (j % 26) for j in range(num_prompt_tokens)], max_tokens, **kwargs
    )
    return Sequence.from_request(request, decoder or CharDecoder(), frozenset())


def make_sequence_for(request: QueuedRequest, decoder) -> Sequence:
    return Sequence.from_request(request, decoder, frozenset())


def serve_together(
    runner,
    prompts: list[list[int]],
    num_blocks: int,
    max_tokens: int = 12,
    max_num_seqs: int = 4,
    **sampling,
):
    """Each prompt a request of its own tenant, all added at once to a continuous engine over
    `runner` (its pool: `num_blocks` blocks of 4) with a 16-token budget and at most
    `max_num_seqs` running, so prompts are chunked and, with few blocks, preempted; served
    to the end; greedy unless `sampling` says otherwise. (Their output tokens, the number of
    preemptions.)"""
    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=16),
        KVCacheManager(num_blocks, 4),
        FairQueue(quantum_tokens=8),
        TenantAwarePreemption(),
    )
    engine = ContinuousBatchingEngine(scheduler, runner)
    return serve(engine, prompts, max_tokens, **sampling), scheduler.num_preemptions


def serve(engine, prompts: list[list[int]], max_tokens: int, **sampling) -> list[list[int]]:
    """Each prompt a request of its own tenant, all added at once to `engine`, served to the
    end: their output tokens."""
    seqs = []
    for i, prompt in enumerate(prompts):
        seq = make_sequence_for(
            make_request(i, prompt, max_tokens, tenant_id=f"t{i}", **sampling), CharDecoder()
        )
        assert engine.add(seq) is None
        seqs.append(seq)
    while engine.has_work():
        engine.step()
    return [seq.output_token_ids for seq in seqs]
