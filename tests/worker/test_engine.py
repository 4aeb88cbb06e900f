"""The baseline engines produce, for every request, what `model.generate` produces for it alone."""

from __future__ import annotations

import pytest

from shared import model_source
from tests.factories import make_request
from tests.reference import greedy_alone
from worker.model_engine import StaticBatchEngine
from worker.runner import loader
from worker.sequence import Sequence


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    # Its own copy: the continuous engine switches a model to paged attention, under which
    # the padded batch's 2D attention mask would be ignored.
    return loader.load(model_source.resolve(str(tiny_model_dir)), "cpu", "float32")


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return model_source.load_tokenizer(model_source.resolve(str(tiny_model_dir)))


def _run(engine, requests, tokenizer, loaded) -> dict[str, list[int]]:
    seqs = {r.request_id: Sequence.from_request(r, tokenizer, frozenset()) for r in requests}
    for seq in seqs.values():
        engine.add(seq)
    while engine.has_work():
        engine.step()
    return {rid: seq.output_token_ids for rid, seq in seqs.items()}


@pytest.mark.parametrize("max_batch_size", [1, 3])
def test_greedy_matches_generate_alone(loaded, tokenizer, max_batch_size):
    prompts = [[1, 2, 3, 4, 5], [100, 200], [7] * 11, [42, 43, 44]]
    lengths = [6, 9, 4, 7]
    requests = [
        make_request(i, p, n, temperature=0)
        for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))
    ]
    outputs = _run(StaticBatchEngine(loaded, max_batch_size), requests, tokenizer, loaded)
    for request, n in zip(requests, lengths, strict=True):
        assert outputs[request.request_id] == greedy_alone(loaded, request.prompt_token_ids, n)


def test_seeded_sampling_does_not_depend_on_batch(loaded, tokenizer):
    prompt = [10, 20, 30]
    alone = _run(
        StaticBatchEngine(loaded, 1),
        [make_request(0, prompt, 8, temperature=1.0, seed=3)],
        tokenizer,
        loaded,
    )
    mixed = _run(
        StaticBatchEngine(loaded, 4),
        [
            make_request(0, prompt, 8, temperature=1.0, seed=3),
            make_request(1, [5, 6], 5, temperature=0.7),
        ],
        tokenizer,
        loaded,
    )
    assert alone["r0"] == mixed["r0"]


def test_abort_frees_the_batch(loaded, tokenizer):
    engine = StaticBatchEngine(loaded, 2)
    requests = [
        make_request(0, [1, 2], 50, temperature=0),
        make_request(1, [3, 4], 50, temperature=0),
    ]
    seqs = [Sequence.from_request(r, tokenizer, frozenset()) for r in requests]
    for seq in seqs:
        engine.add(seq)
    engine.step()
    outputs = engine.abort({"r0", "r1"})
    assert {o.finish_reason for o in outputs} == {"cancelled"}
    assert not engine.has_work() and engine.num_free_slots() == 2
