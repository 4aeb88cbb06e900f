"""The worker's hardening: one request's bad sampling values end that request alone, never a
step carrying other tenants' work (engine level, on the tiny model). What a real worker
keeps of a tenant's content: tests/e2e/test_hardening_worker.py."""

from __future__ import annotations

import pytest

from shared import model_source
from shared.protocol import QueuedRequest, SamplingParams
from tests.factories import CharDecoder, make_request, make_sequence_for
from tests.reference import greedy_alone
from worker.engine import ContinuousBatchingEngine
from worker.fair_queue import FairQueue
from worker.kv_cache import KVCacheManager
from worker.model_engine import StaticBatchEngine
from worker.preemption import TenantAwarePreemption
from worker.runner import loader
from worker.runner.model_runner import ModelRunner
from worker.scheduler import Scheduler, SchedulerConfig

# Values the API used to admit, each of which failed the worker's step twice (the seeds in
# `manual_seed`, the temperatures in `multinomial` after softmax turned them into NaN).
BAD_SAMPLING = [
    {"temperature": 1.0, "seed": 2**64},
    {"temperature": 1.0, "seed": 10**30},
    {"temperature": 1e-40},
    {"temperature": 5e-324},
]
MAX_TOKENS = 6


def _continuous_engine(loaded) -> ContinuousBatchingEngine:
    num_blocks, block_size = 64, 4
    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64),
        KVCacheManager(num_blocks, block_size),
        FairQueue(quantum_tokens=8),
        TenantAwarePreemption(),
    )
    return ContinuousBatchingEngine(scheduler, ModelRunner(loaded, num_blocks, block_size))


def _bad_request(i: int, prompt: list[int], sampling: dict) -> QueuedRequest:
    """A request with sampling values the API schema would refuse: built without validation,
    as if it had reached the worker's stream some other way."""
    request = make_request(i, prompt, MAX_TOKENS, tenant_id="bad")
    bad = SamplingParams.model_construct(max_tokens=MAX_TOKENS, **sampling)
    return request.model_copy(update={"sampling": bad})


def _run_to_end(engine) -> list:
    outputs = []
    for _ in range(1000):
        if not engine.has_work():
            return outputs
        outputs += engine.step()
    raise AssertionError("the engine never finished")


@pytest.mark.parametrize("sampling", BAD_SAMPLING, ids=lambda s: repr(s))
def test_bad_sampling_values_fail_their_sequence_alone(tiny_loaded, sampling):
    # Three tenants' greedy requests and one seeded sampled request share every step with a
    # request whose sampling cannot work; it is put past the engine's door (`add` refuses it
    # now), straight into the scheduler, so the step itself must cope.
    good = {
        0: make_request(0, list(range(1000, 1012)), MAX_TOKENS, tenant_id="a"),
        1: make_request(1, list(range(2000, 2005)), MAX_TOKENS, tenant_id="b"),
        2: make_request(2, list(range(3000, 3009)), MAX_TOKENS, tenant_id="c"),
        3: make_request(3, [10, 20, 30], MAX_TOKENS, tenant_id="a", temperature=0.8, seed=3),
    }
    engine = _continuous_engine(tiny_loaded)
    seqs = {i: make_sequence_for(r, CharDecoder()) for i, r in good.items()}
    for seq in seqs.values():
        assert engine.add(seq) is None
    bad = make_sequence_for(_bad_request(9, [1500, 1501, 1502], sampling), CharDecoder())
    assert engine.scheduler.add(bad) is None
    outputs = _run_to_end(engine)

    (error,) = [o for o in outputs if o.error is not None]
    assert error.request_id == "r9" and error.error.code == "sampling_error"
    assert bad.num_failures == 0 and bad.num_output_tokens == 0
    assert engine.scheduler.num_preemptions == 0
    for i in (0, 1, 2):
        assert seqs[i].output_token_ids == greedy_alone(tiny_loaded, good[i].prompt_token_ids, 6)
    alone = _continuous_engine(tiny_loaded)
    seeded_alone = make_sequence_for(good[3], CharDecoder())
    alone.add(seeded_alone)
    _run_to_end(alone)
    assert seqs[3].output_token_ids == seeded_alone.output_token_ids
    for i, seq in seqs.items():
        assert seq.num_output_tokens == MAX_TOKENS and seq.finish_reason == "length"
        # Computed once: the prompt and a decode per token after the first, no recompute.
        assert seq.num_computed_total == len(good[i].prompt_token_ids) + MAX_TOKENS - 1
    kv = engine.scheduler.kv_cache
    assert kv.num_free_blocks == kv.num_blocks


@pytest.fixture(scope="module")
def padded_loaded(tiny_model_dir):
    # Its own copy: the continuous engine switches a model to paged attention, under which
    # the padded batch's 2D attention mask would be ignored (as in test_engine.py).
    return loader.load(model_source.resolve(str(tiny_model_dir)), "cpu", "float32")


@pytest.mark.parametrize("sampling", BAD_SAMPLING, ids=lambda s: repr(s))
def test_the_static_batch_ends_a_bad_sequence_and_finishes_the_rest(padded_loaded, sampling):
    good = [make_request(i, [100 + i, 200, 300], MAX_TOKENS) for i in range(3)]
    engine = StaticBatchEngine(padded_loaded, max_batch_size=4)
    seqs = [make_sequence_for(r, CharDecoder()) for r in good]
    for seq in seqs:
        assert engine.add(seq) is None
    bad = make_sequence_for(_bad_request(9, [1500, 1501], sampling), CharDecoder())
    engine._waiting.append(bad)  # past the door, as above
    outputs = _run_to_end(engine)
    (error,) = [o for o in outputs if o.error is not None]
    assert error.request_id == "r9" and error.error.code == "sampling_error"
    for request, seq in zip(good, seqs, strict=True):
        assert seq.output_token_ids == greedy_alone(padded_loaded, request.prompt_token_ids, 6)


@pytest.mark.parametrize("sampling", BAD_SAMPLING, ids=lambda s: repr(s))
def test_the_engines_refuse_unusable_requests_at_the_door(tiny_loaded, padded_loaded, sampling):
    bad_seed_or_temperature = _bad_request(0, [1, 2, 3], sampling)
    vocab_size = tiny_loaded.model.config.vocab_size
    out_of_vocabulary = make_request(1, [1, vocab_size, 2], MAX_TOKENS)
    for engine in (_continuous_engine(tiny_loaded), StaticBatchEngine(padded_loaded, 4)):
        refused = engine.add(make_sequence_for(bad_seed_or_temperature, CharDecoder()))
        assert refused.error.code == "invalid_sampling_params"
        assert ("seed" if "seed" in sampling else "temperature") in refused.error.message
        refused = engine.add(make_sequence_for(out_of_vocabulary, CharDecoder()))
        assert refused.error.code == "invalid_prompt"
        assert not engine.has_work()
