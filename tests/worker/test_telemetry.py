"""The worker's telemetry fed as the worker loop feeds it, over a real engine on the tiny model."""

from __future__ import annotations

import time

from tests.factories import CharDecoder, make_request, make_sequence_for
from worker.engine import ContinuousBatchingEngine
from worker.fair_queue import FairQueue
from worker.kv_cache import KVCacheManager
from worker.preemption import TenantAwarePreemption
from worker.runner.model_runner import ModelRunner
from worker.scheduler import Scheduler, SchedulerConfig
from worker.telemetry import Samples, Telemetry, timed_step

MODEL = "tiny-observed"


def _value(registry, name: str, **labels) -> float:
    labels.setdefault("version", "1")  # every series names the version the worker serves
    return registry.get_sample_value(name, labels) or 0.0


def _small_engine(loaded, num_blocks: int) -> ContinuousBatchingEngine:
    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32),
        KVCacheManager(num_blocks, 4),
        FairQueue(quantum_tokens=8),
        TenantAwarePreemption(),
    )
    return ContinuousBatchingEngine(scheduler, ModelRunner(loaded, num_blocks, 4))


def _add(engine, telemetry: Telemetry, request) -> bool:
    """Give the engine a request and tell telemetry, as the worker loop does."""
    seq = make_sequence_for(request, CharDecoder())
    seq.arrival_s = time.time()
    refused = engine.add(seq)
    telemetry.added(seq, refused)
    return refused is None


def _run(engine, telemetry: Telemetry) -> None:
    while engine.has_work():
        telemetry.stepped(timed_step(engine))


def test_telemetry_measures_every_request_and_step(tiny_loaded):
    # Few blocks: four requests of 10 + 8 tokens (5 blocks each) cannot all fit: preemptions.
    engine = _small_engine(tiny_loaded, num_blocks=12)
    telemetry = Telemetry(MODEL, engine.stats().max_num_seqs)
    for i in range(4):
        request = make_request(i, list(range(3, 13)), 8, tenant_id=f"t{i % 2}", tier=1 + i % 2)
        assert _add(engine, telemetry, request)
    _run(engine, telemetry)
    r = telemetry.metrics.registry
    stats = engine.stats()
    assert stats.max_num_seqs == 4
    assert stats.num_preemptions > 0
    for tier in ("1", "2"):
        labels = {"model": MODEL, "tier": tier}
        assert _value(r, "llmfleet_time_to_first_token_seconds_count", **labels) == 2
        assert _value(r, "llmfleet_request_queue_time_seconds_count", **labels) == 2
        assert _value(r, "llmfleet_e2e_request_latency_seconds_count", **labels) == 2
        # 8 tokens each: a first token and 7 gaps
        assert _value(r, "llmfleet_inter_token_latency_seconds_count", **labels) == 2 * 7
        success = {**labels, "finished_reason": "length"}
        assert _value(r, "llmfleet_request_success_total", **success) == 2
    assert _value(r, "llmfleet_generation_tokens_total", model=MODEL) == 4 * 8
    assert _value(r, "llmfleet_prompt_tokens_total", model=MODEL) == 4 * 10
    # The heartbeat's running totals: each prompt once, however often it was recomputed.
    assert telemetry.num_served_tokens == 4 * (10 + 8)
    assert telemetry.num_finished_requests == 4
    preempted = sum(
        _value(r, "llmfleet_num_preemptions_total", model=MODEL, tenant=t) for t in ("t0", "t1")
    )
    assert preempted == stats.num_preemptions
    num_steps = _value(r, "llmfleet_engine_step_duration_seconds_count", model=MODEL)
    assert num_steps == _value(r, "llmfleet_batch_size_count", model=MODEL) > 0
    assert 1 <= _value(r, "llmfleet_batch_size_sum", model=MODEL) / num_steps <= 4
    assert _value(r, "llmfleet_num_requests_running", model=MODEL) == 0
    assert _value(r, "llmfleet_kv_cache_usage_perc", model=MODEL) == 0
    assert _value(r, "llmfleet_max_num_seqs", model=MODEL) == 4
    samples = telemetry.take_samples()
    assert len(samples.ttft) == 4 and len(samples.itl) == 4 * 7
    assert [s.value_s for s in samples.failed] == [0.0] * 4  # all ended well
    assert telemetry.take_samples() == Samples()


def test_aborted_expired_and_refused_requests_are_counted_by_reason(tiny_loaded):
    engine = _small_engine(tiny_loaded, num_blocks=4)
    telemetry = Telemetry(MODEL, 4)
    assert not _add(engine, telemetry, make_request(0, list(range(3, 20)), 8))  # never fits
    assert _add(engine, telemetry, make_request(1, [3, 4, 5], 4))
    expiring = make_request(2, [3, 4, 5], 4).model_copy(update={"queue_deadline_ts": 1.0})
    assert _add(engine, telemetry, expiring)
    ended = engine.abort({"r1"}) + engine.expire(time.time())
    telemetry.ended(ended)
    assert [o.finish_reason for o in ended] == ["cancelled", "error"]
    r = telemetry.metrics.registry
    labels = {"model": MODEL, "tier": "1", "finished_reason": "error"}
    assert _value(r, "llmfleet_request_success_total", **labels) == 2  # refused, expired
    cancelled = {**labels, "finished_reason": "cancelled"}
    assert _value(r, "llmfleet_request_success_total", **cancelled) == 1
    assert _value(r, "llmfleet_time_to_first_token_seconds_count", model=MODEL, tier="1") == 0
    # What counts against the version's health: the refusal (it can never fit this
    # worker's KV cache) and the expiry, not the cancel.
    assert [s.value_s for s in telemetry.take_samples().failed] == [1.0, 0.0, 1.0]


def test_a_clients_invalid_request_does_not_count_against_the_version(tiny_loaded):
    engine = _small_engine(tiny_loaded, num_blocks=4)
    telemetry = Telemetry(MODEL, 4, version="2")
    out_of_vocabulary = make_request(0, [3, 10**9], 4)  # refused: `invalid_prompt`
    assert not _add(engine, telemetry, out_of_vocabulary)
    r = telemetry.metrics.registry
    labels = {"model": MODEL, "version": "2", "tier": "1", "finished_reason": "error"}
    assert _value(r, "llmfleet_request_success_total", **labels) == 1
    assert [s.value_s for s in telemetry.take_samples().failed] == [0.0]


def test_handed_back_requests_are_not_counted_as_ended(tiny_loaded):
    engine = _small_engine(tiny_loaded, num_blocks=4)
    telemetry = Telemetry(MODEL, 4)
    for i in range(2):
        assert _add(engine, telemetry, make_request(i, [3, 4, 5], 4))
    engine.abort({"r0"})
    telemetry.handed_back({"r0"})
    assert engine.unstarted_request_ids() == ["r1"]
    _run(engine, telemetry)
    r = telemetry.metrics.registry
    labels = {"model": MODEL, "tier": "1"}
    assert _value(r, "llmfleet_request_success_total", **labels, finished_reason="length") == 1
    assert _value(r, "llmfleet_request_success_total", **labels, finished_reason="cancelled") == 0
    assert _value(r, "llmfleet_time_to_first_token_seconds_count", **labels) == 1
    assert (telemetry.num_served_tokens, telemetry.num_finished_requests) == (3 + 4, 1)


def test_an_activation_from_standby_is_observed():
    telemetry = Telemetry(MODEL, 4)
    telemetry.activated(0.3)
    r = telemetry.metrics.registry
    assert _value(r, "llmfleet_worker_activation_seconds_count", model=MODEL) == 1
    assert _value(r, "llmfleet_worker_activation_seconds_sum", model=MODEL) == 0.3


def test_a_step_takes_the_kv_caches_waste_only_when_asked(tiny_loaded):
    """The waste is a pass over every running sequence: the worker asks for it once a
    second (`worker/service.py` `KV_WASTE_INTERVAL_S`), not on every step."""
    engine = _small_engine(tiny_loaded, num_blocks=12)
    telemetry = Telemetry(MODEL, engine.stats().max_num_seqs)
    assert _add(engine, telemetry, make_request(0, list(range(3, 13)), 8))  # 10 tokens, 3 blocks
    asked = timed_step(engine)
    assert asked.stats.kv_cache_waste is not None and 0 < asked.stats.kv_cache_waste < 1
    not_asked = timed_step(engine, with_kv_waste=False)
    assert not_asked.stats.kv_cache_waste is None
    assert not_asked.stats.kv_cache_usage > 0  # the rest of the stats as ever
