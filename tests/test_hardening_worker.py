"""The worker's hardening: one request's bad sampling values end that request alone, never a
step carrying other tenants' work (engine level, on the tiny model); and for a tenant that
keeps no content, neither the dead-letter stream nor the request journal keeps its prompt
or output past the stream's end and a short resume grace (a real worker, API and Redis)."""

from __future__ import annotations

import time
import uuid

import httpx
import pytest

from shared import deployments, keys, model_source, tenants
from shared.protocol import QueuedRequest, SamplingParams
from tests.factories import CharDecoder, make_request, make_sequence_for
from tests.helpers import auth, stream
from tests.reference import greedy_alone
from worker.engine import ContinuousBatchingEngine, StaticBatchEngine
from worker.fair_queue import FairQueue
from worker.kv_cache import KVCacheManager
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


# --- Content kept only as long as needed -------------------------------------------------

POISON_TOKEN_ID = 7777  # in the tiny model's vocabulary; the worker's step fails on it
RESUME_GRACE_S = 8


@pytest.fixture
def content_worker(db, tiny_model_dir, start_worker):
    """A deployment of its own, served by a worker whose model fails on the poison token and
    whose never-store journals outlive their end by `RESUME_GRACE_S`."""
    deployment = deployments.register(
        db, f"tiny-content-{uuid.uuid4().hex[:6]}", str(tiny_model_dir)
    )
    env = {
        "LLMFLEET_FAULT_TOKEN_ID": str(POISON_TOKEN_ID),
        "LLMFLEET_RESUME_GRACE_S": str(RESUME_GRACE_S),
    }
    start_worker(deployment.model_id, "--dtype", "float32", env_overrides=env)
    return deployment.model_id


def _tenant(db, settings, retention_days: int | None) -> tuple[str, str]:
    tenant = tenants.create_tenant(
        db, f"content-{uuid.uuid4().hex[:8]}", content_retention_days=retention_days
    )
    return tenant.id, tenants.create_key(db, tenant.id, settings.pepper)


def _complete(api_url: str, key: str, model: str, prompt: list[int]):
    body = {"model": model, "prompt": prompt, "max_tokens": 8, "ignore_eos": True}
    result = stream(api_url, "/v1/completions", key, body)
    assert result.status_code == 200 and result.has_done, result.chunks
    return result.headers["x-request-id"], result


def _dead_letter(rdb, model: str, request_id: str) -> dict[bytes, bytes]:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for _, fields in rdb.xrange(keys.dead_letter(model)):
            if fields[b"request_id"] == request_id.encode():
                return fields
        time.sleep(0.1)
    raise AssertionError(f"no dead letter for {request_id}")


def test_a_never_store_tenants_dead_letter_holds_no_prompt(
    api_url, content_worker, db, settings, rdb
):
    poison = [1500, POISON_TOKEN_ID, 1501]
    never_id, never_key = _tenant(db, settings, None)
    _, keep_key = _tenant(db, settings, 3)
    never_rid, never = _complete(api_url, never_key, content_worker, poison)
    keep_rid, keep = _complete(api_url, keep_key, content_worker, poison)
    for result in (never, keep):
        assert result.chunks[-1]["error"]["code"] == "model_error"

    letter = {
        k.decode(): v.decode() for k, v in _dead_letter(rdb, content_worker, never_rid).items()
    }
    assert letter["tenant_id"] == never_id and letter["code"] == "model_error"
    assert letter["num_prompt_tokens"] == "3" and letter["num_output_tokens"] == "0"
    assert "body" not in letter and not any("prompt_token_ids" in v for v in letter.values())
    # A tenant that keeps content keeps the whole request there, to replay the poison.
    kept = _dead_letter(rdb, content_worker, keep_rid)
    assert QueuedRequest.from_fields(kept).prompt_token_ids == poison
    # The failed request's journal (its error event) is on the short clock too.
    assert 0 < rdb.pttl(keys.request_events(never_rid)) <= RESUME_GRACE_S * 1000


def test_a_never_store_tenants_journal_outlives_the_end_only_by_the_grace(
    api_url, content_worker, db, settings, rdb
):
    _, never_key = _tenant(db, settings, None)
    _, keep_key = _tenant(db, settings, 3)
    prompt = [1000, 1001, 1002]
    never_rid, never = _complete(api_url, never_key, content_worker, prompt)
    keep_rid, _ = _complete(api_url, keep_key, content_worker, prompt)
    assert never.text and never.finish_reasons[-1] == "length"
    events, meta = keys.request_events(never_rid), keys.request_meta(never_rid)
    assert 0 < rdb.pttl(events) <= RESUME_GRACE_S * 1000
    assert 0 < rdb.pttl(meta) <= RESUME_GRACE_S * 1000
    # Within the grace a client that lost its connection gets the whole answer back.
    resumed = stream(api_url, f"/v1/requests/{never_rid}/events", never_key, {}, method="GET")
    assert resumed.status_code == 200 and resumed.text == never.text

    deadline = time.monotonic() + RESUME_GRACE_S + 5
    while rdb.exists(events, meta) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not rdb.exists(events, meta), "the output text outlived the grace"
    gone = httpx.get(f"{api_url}/v1/requests/{never_rid}/events", headers=auth(never_key))
    assert gone.status_code == 404
    # The done marker (no content) stays: a late second delivery is still refused.
    assert rdb.get(keys.request_done(never_rid)) is not None
    # A tenant that keeps content keeps the journal `journal_ttl_s` as before.
    assert rdb.ttl(keys.request_events(keep_rid)) > settings.journal_ttl_s - 60
