"""Continuous batching is exact: with greedy decoding every request gets the tokens
`model.generate` gives it alone, whatever the batch composition, arrival order, tenants,
tiers and weights, prefill chunking and preemptions (property-based on the tiny model, a
spot check on the real one). The engine runs the default policies: weighted fair queuing,
tenant-aware preemption and prefix caching. The tiny model here is `attentive` (its tokens
depend on attention and positions), so a wrong attention or RoPE cannot pass."""

from __future__ import annotations

from functools import cache

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from shared import model_source
from tests.factories import CharDecoder, make_request, make_sequence_for
from tests.reference import greedy_alone
from worker.engine import ContinuousBatchingEngine
from worker.fair_queue import FairQueue
from worker.kv_cache import KVCacheManager
from worker.preemption import TenantAwarePreemption
from worker.runner import loader
from worker.runner.model_runner import ModelRunner, decode_group_bounds
from worker.scheduler import Scheduler, SchedulerConfig

MAX_NEW_TOKENS = 12


def _engine(
    loaded,
    num_blocks: int,
    block_size: int,
    max_num_seqs: int,
    budget: int,
    pad_attention: bool | None = None,
):
    kv = KVCacheManager(num_blocks, block_size, prefix_caching=True)
    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs, budget),
        kv,
        FairQueue(quantum_tokens=8),
        TenantAwarePreemption(),
    )
    runner = ModelRunner(loaded, num_blocks, block_size, pad_attention=pad_attention)
    return ContinuousBatchingEngine(scheduler, runner)


# Three tenants: (tenant id, tier, weight).
TENANTS = [("a", 1, 1), ("b", 1, 3), ("c", 2, 1)]


def _run(engine, arrivals: list[tuple[int, list[int], int]]) -> dict[str, list[int]]:
    """arrivals: (step at which it arrives, prompt ids, max_tokens); request i belongs to
    tenant i mod 3. Returns outputs by id."""
    seqs = {}
    pending = sorted(enumerate(arrivals), key=lambda item: item[1][0])
    step = 0
    while pending or engine.has_work():
        while pending and pending[0][1][0] <= step:
            i, (_, prompt, max_tokens) = pending.pop(0)
            tenant_id, tier, weight = TENANTS[i % len(TENANTS)]
            request = make_request(
                i, prompt, max_tokens, tenant_id=tenant_id, tier=tier, weight=weight
            )
            seq = make_sequence_for(request, CharDecoder())
            assert engine.add(seq) is None
            seqs[seq.request_id] = seq
        engine.step()
        step += 1
        assert step < 10_000
    assert engine.scheduler.kv_cache.num_free_blocks == engine.scheduler.kv_cache.num_blocks
    return {rid: seq.output_token_ids for rid, seq in seqs.items()}


prompts = st.lists(st.integers(1000, 20000), min_size=1, max_size=40)
arrival = st.tuples(st.integers(0, 6), prompts, st.integers(1, MAX_NEW_TOKENS))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    arrivals=st.lists(arrival, min_size=1, max_size=6),
    block_size=st.sampled_from([1, 2, 4, 16]),
    spare_blocks=st.integers(0, 40),
    max_num_seqs=st.integers(1, 6),
    budget=st.integers(1, 48),
)
# Found by this test: a displacer in the one place was scheduled twice in its first step.
@example(
    arrivals=[(0, [1000], 10), *[(0, [1000], 1)] * 3, (0, [2184, 1000], 2)],
    block_size=1,
    spare_blocks=0,
    max_num_seqs=1,
    budget=4,
)
def test_greedy_equals_generate_alone(
    attentive_loaded, arrivals, block_size, spare_blocks, max_num_seqs, budget
):
    @cache
    def reference(prompt: tuple[int, ...]) -> list[int]:
        return greedy_alone(attentive_loaded, list(prompt), MAX_NEW_TOKENS)

    # The smallest pool that fits the largest request alone, plus some: small pools preempt.
    largest = max(len(p) + n for _, p, n in arrivals)
    num_blocks = -(-largest // block_size) + spare_blocks
    engine = _engine(attentive_loaded, num_blocks, block_size, max_num_seqs, budget)
    outputs = _run(engine, arrivals)
    for i, (_, prompt, max_tokens) in enumerate(arrivals):
        assert outputs[f"r{i}"] == reference(tuple(prompt))[:max_tokens]


def test_preemption_happens_and_stays_exact(attentive_loaded):
    arrivals = [
        (0, list(range(1000, 1030)), 12),
        (0, list(range(2000, 2025)), 12),
        (1, [5000] * 9, 12),
    ]
    engine = _engine(attentive_loaded, num_blocks=12, block_size=4, max_num_seqs=3, budget=16)
    outputs = _run(engine, arrivals)
    assert engine.scheduler.num_preemptions > 0
    for i, (_, prompt, n) in enumerate(arrivals):
        assert outputs[f"r{i}"] == greedy_alone(attentive_loaded, prompt, n)


def test_decodes_share_an_attention_call_unless_padding_them_costs_more():
    # Two short sequences among twelve long ones join the long ones' call (two split off
    # made the step 5% slower); ten of 60 beside two of 900 stay apart (padded, 8x slower).
    long = [300, 320, 350, 380, 400, 420, 450, 480, 500, 520, 560, 600]
    assert decode_group_bounds([40, 50, *long], 16) == [(0, 14)]
    assert decode_group_bounds([60] * 10 + [900] * 2, 16) == [(0, 10), (10, 12)]
    assert decode_group_bounds([200] * 20 + [700] * 20, 16) == [(0, 20), (20, 40)]
    assert decode_group_bounds([], 16) == []


def test_decodes_in_separate_attention_calls_stay_exact(attentive_loaded):
    # Contexts far apart (two prompts of 600 beside ten of a few tokens): the decodes run
    # as two groups, each padded only to its own longest context.
    arrivals = [(0, list(range(1000, 1600)), 8), (0, list(range(3000, 3600)), 8)]
    arrivals += [(18, [5000 + i] * (3 + i), 8) for i in range(10)]
    engine = _engine(attentive_loaded, num_blocks=400, block_size=4, max_num_seqs=12, budget=64)
    runner = engine._runner
    num_groups = []
    decode_groups = runner._decode_groups
    runner._decode_groups = lambda decodes: num_groups.append(len(g := decode_groups(decodes))) or g
    outputs = _run(engine, arrivals)
    assert max(num_groups) == 2
    for i, (_, prompt, n) in enumerate(arrivals):
        assert outputs[f"r{i}"] == greedy_alone(attentive_loaded, prompt, n)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    arrivals=st.lists(arrival, min_size=2, max_size=6),
    block_size=st.sampled_from([1, 4, 16]),
    budget=st.integers(4, 48),
)
def test_a_gpus_padded_attention_equals_generate_alone(
    attentive_loaded, arrivals, block_size, budget
):
    """A GPU's eager step (one padded call for the prompt chunks, decodes in few groups),
    run here on the CPU."""
    largest = max(len(p) + n for _, p, n in arrivals)
    num_blocks = -(-largest // block_size) * 2
    engine = _engine(attentive_loaded, num_blocks, block_size, 4, budget, pad_attention=True)
    outputs = _run(engine, arrivals)
    for i, (_, prompt, n) in enumerate(arrivals):
        assert outputs[f"r{i}"] == greedy_alone(attentive_loaded, prompt, n)


def test_padded_attention_takes_a_steps_chunks_in_one_call(attentive_loaded, monkeypatch):
    batches = []  # (chunks, padded) of each step with prompt chunks
    make = ModelRunner._prefill_batch
    monkeypatch.setattr(
        ModelRunner,
        "_prefill_batch",
        lambda self, batch: batches.append((len(batch.prefills), b := make(self, batch))) or b,
    )
    # Four prompts of 20-35 tokens at once, then two more while they decode.
    arrivals = [(0, list(range(1000 + 50 * i, 1020 + 55 * i)), 6) for i in range(4)]
    arrivals += [(3, list(range(4000, 4030)), 6), (3, list(range(5000, 5025)), 6)]
    engine = _engine(attentive_loaded, 200, 4, 6, 64, pad_attention=True)
    outputs = _run(engine, arrivals)
    for i, (_, prompt, n) in enumerate(arrivals):
        assert outputs[f"r{i}"] == greedy_alone(attentive_loaded, prompt, n)
    assert any(chunks >= 2 and padded is not None for chunks, padded in batches)


@pytest.mark.slow
def test_real_model_spot_check():
    loaded = loader.load(model_source.resolve(model_source.DEFAULT_MODEL_ID), "cpu", "float32")
    tokenizer = model_source.load_tokenizer(model_source.resolve(model_source.DEFAULT_MODEL_ID))
    texts = [
        "The capital of France is",
        "def fibonacci(n):",
        "Water boils at a temperature of",
        "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    ]
    arrivals = [(0, tokenizer.encode(t), 10) for t in texts]
    # 8-token blocks, a 16-token budget and a pool of 8 blocks: chunking and preemptions.
    engine = _engine(loaded, num_blocks=8, block_size=8, max_num_seqs=4, budget=16)
    outputs = _run(engine, arrivals)
    assert engine.scheduler.num_preemptions > 0
    for i, (_, prompt, n) in enumerate(arrivals):
        assert outputs[f"r{i}"] == greedy_alone(loaded, prompt, n)


def test_a_request_that_breaks_the_model_is_dead_lettered_and_spares_the_batch(tiny_loaded):
    poison = 7777
    arrivals = [
        (0, list(range(1000, 1012)), 12),
        (0, [1500, poison, 1501], 12),
        (0, list(range(2000, 2009)), 12),
        (1, list(range(3000, 3005)), 12),
    ]
    engine = _engine(tiny_loaded, num_blocks=64, block_size=4, max_num_seqs=4, budget=32)
    engine._runner.fault_token_id = poison
    seqs = {}
    for i, (_, prompt, max_tokens) in enumerate(arrivals):
        seqs[i] = make_sequence_for(make_request(i, prompt, max_tokens), CharDecoder())
        assert engine.add(seqs[i]) is None
    outputs = []
    while engine.has_work():
        outputs += engine.step()
    (dead,) = [o for o in outputs if o.error is not None]
    assert dead.request_id == "r1" and dead.error.code == "model_error"
    assert seqs[1].num_failures == engine.scheduler.config.max_step_failures
    for i in (0, 2, 3):
        _, prompt, n = arrivals[i]
        assert seqs[i].output_token_ids == greedy_alone(tiny_loaded, prompt, n)
    assert engine.scheduler.kv_cache.num_free_blocks == engine.scheduler.kv_cache.num_blocks
