"""Prefix caching through the engine: a tenant's repeated prefix is computed once and its
outputs stay exact; another tenant's identical prompt is computed in full, step for step as
on a cold cache, so its time to first token cannot reveal what the first tenant sent."""

from __future__ import annotations

from tests.factories import CharDecoder, make_request, make_sequence_for
from tests.reference import greedy_alone
from worker.config import EngineConfig
from worker.model_engine import build_engine

SYSTEM = list(range(3000, 3040))  # a 40-token shared prefix: two full blocks of 16


def _engine(loaded, prefix_caching: bool = True):
    config = EngineConfig(
        max_num_seqs=4,
        max_num_batched_tokens=32,
        max_num_prefill_tokens=None,  # every step 32 tokens: a 43-token prompt takes two
        num_kv_blocks=64,
        prefix_caching=prefix_caching,
    )
    return build_engine(loaded, config)


def _serve(engine, i: int, tenant_id: str, prompt: list[int]):
    """Run one request alone to its end; the sequence and the steps until its first token."""
    seq = make_sequence_for(make_request(i, prompt, 6, tenant_id=tenant_id), CharDecoder())
    assert engine.add(seq) is None
    steps_to_first = None
    num_steps = 0
    while engine.has_work():
        engine.step()
        num_steps += 1
        if steps_to_first is None and seq.output_token_ids:
            steps_to_first = num_steps
    return seq, steps_to_first


def test_a_tenants_repeated_prefix_is_computed_once_and_stays_exact(attentive_loaded):
    engine = _engine(attentive_loaded)
    first, first_steps = _serve(engine, 0, "a", [*SYSTEM, 5000, 5001])
    again, again_steps = _serve(engine, 1, "a", [*SYSTEM, 6000, 6001, 6002])
    assert first.num_computed_total == 42 + 5  # prompt and 5 decodes (the 6th ends it)
    assert again.num_computed_total == (43 - 32) + 5  # the two full system blocks reused
    assert again_steps < first_steps  # 11 prompt tokens in one step, not 43 in two
    assert again.output_token_ids == greedy_alone(attentive_loaded, [*SYSTEM, 6000, 6001, 6002], 6)
    assert first.output_token_ids == greedy_alone(attentive_loaded, [*SYSTEM, 5000, 5001], 6)


def test_another_tenants_identical_prompt_computes_as_on_a_cold_cache(attentive_loaded):
    prompt = [*SYSTEM, 7000, 7001]
    cold, cold_steps = _serve(_engine(attentive_loaded), 0, "b", prompt)
    engine = _engine(attentive_loaded)
    _serve(engine, 0, "a", prompt)
    after_a, after_a_steps = _serve(engine, 1, "b", prompt)
    assert after_a.num_computed_total == cold.num_computed_total == 42 + 5
    assert after_a_steps == cold_steps
    assert engine.scheduler.kv_cache.num_hit_tokens == 0
    assert after_a.output_token_ids == cold.output_token_ids


def test_without_prefix_caching_every_prompt_is_computed(attentive_loaded):
    engine = _engine(attentive_loaded, prefix_caching=False)
    _serve(engine, 0, "a", [*SYSTEM, 5000])
    again, _ = _serve(engine, 1, "a", [*SYSTEM, 5000])
    assert again.num_computed_total == 41 + 5
