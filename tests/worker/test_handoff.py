"""A decode worker adopting a sequence whose prompt another worker computed (issue 22): it
joins the batch as a decode only when there is room, and with the KV it was sent it goes on
exactly as one worker serving it alone would have."""

from __future__ import annotations

import pytest

from shared.protocol import SamplingParams
from tests import tiny_model
from tests.factories import CharDecoder, make_request, make_sequence, make_sequence_for
from worker.engine import ContinuousBatchingEngine
from worker.fair_queue import FairQueue
from worker.kv_cache import KVCacheManager
from worker.preemption import TenantAwarePreemption
from worker.runner.model_runner import ModelRunner
from worker.scheduler import Scheduler, SchedulerConfig
from worker.sequence import SequenceStatus
from worker.step_batch import ChunkInput, StepBatch

BLOCK_SIZE = 4


def _scheduler(max_num_seqs: int = 4, num_blocks: int = 32) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=64)
    return Scheduler(
        config, KVCacheManager(num_blocks, BLOCK_SIZE), FairQueue(), TenantAwarePreemption()
    )


def _handed_off(i: int, num_prompt_tokens: int, max_tokens: int = 8, tenant_id: str = "t"):
    seq = make_sequence(i, num_prompt_tokens, max_tokens, tenant_id=tenant_id)
    seq.adopt_first_token(70)
    return seq


def test_an_adopted_sequence_decodes_its_first_token_next_with_blocks_for_the_rest():
    scheduler = _scheduler()
    seq = _handed_off(0, 10)
    assert scheduler.adopt(seq)
    assert seq.status is SequenceStatus.RUNNING and seq.num_computed_tokens == 10
    assert len(seq.block_table) == 3  # 10 tokens in blocks of 4
    out = scheduler.schedule(now_s=0.0)
    assert [(c.seq, c.start, c.num_new_tokens) for c in out.decodes] == [(seq, 10, 1)]
    assert not out.prefills
    (output,) = scheduler.postprocess(out, [71])
    assert seq.output_token_ids == [70, 71] and output.text == "G"  # only the new token's text


def test_a_hand_off_waits_while_the_batch_or_the_kv_cache_is_full():
    scheduler = _scheduler(max_num_seqs=1, num_blocks=8)
    assert scheduler.adopt(_handed_off(0, 6))
    full_batch = _handed_off(1, 6)
    assert not scheduler.adopt(full_batch)
    assert full_batch.status is SequenceStatus.WAITING and not full_batch.block_table
    scheduler = _scheduler(max_num_seqs=4, num_blocks=8)
    assert scheduler.adopt(_handed_off(0, 20))  # 5 of the 8 blocks
    too_big = _handed_off(1, 16)  # 4 more: only 3 free
    assert not scheduler.adopt(too_big) and not too_big.block_table
    assert scheduler.adopt(_handed_off(2, 12))
    scheduler.kv_cache.check(scheduler.running)
    with pytest.raises(RuntimeError, match="not a hand-off"):
        scheduler.adopt(make_sequence(3, 4, 4))  # no first token: not computed anywhere


def test_the_decode_worker_continues_the_sequence_as_one_worker_alone_would():
    loaded = tiny_model.attentive("llama")
    prompt = list(range(1000, 1030))

    def engine(runner: ModelRunner) -> ContinuousBatchingEngine:
        scheduler = Scheduler(
            SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16),
            KVCacheManager(32, BLOCK_SIZE),
            FairQueue(quantum_tokens=8),
            TenantAwarePreemption(),
        )
        return ContinuousBatchingEngine(scheduler, runner)

    alone = engine(ModelRunner(loaded, 32, BLOCK_SIZE, "own"))
    expected_seq = make_sequence_for(make_request(0, prompt, 12), CharDecoder())
    alone.add(expected_seq)
    while alone.has_work():
        alone.step()

    # The prefill worker: the prompt and the first token, then its blocks as bytes.
    prefill_runner = ModelRunner(loaded, 32, BLOCK_SIZE, "own")
    blocks = list(range(8))
    greedy = SamplingParams(max_tokens=12, temperature=0.0)
    first = prefill_runner.execute(StepBatch([], [ChunkInput("0", prompt, 0, blocks, greedy)]))[0]
    payload = prefill_runner.export_kv(blocks)

    decode_runner = ModelRunner(loaded, 32, BLOCK_SIZE, "own")
    decode = engine(decode_runner)
    seq = make_sequence_for(make_request(0, prompt, 12), CharDecoder())
    seq.adopt_first_token(first)
    layout = prefill_runner.kv_layout
    assert decode.adopt(seq, lambda ids: decode_runner.import_kv(ids, layout, payload))
    texts = []
    while decode.has_work():
        texts += [output.text for output in decode.step()]
    assert seq.output_token_ids == expected_seq.output_token_ids
    assert "".join(texts) == CharDecoder().decode(expected_seq.output_token_ids[1:])
    assert decode.scheduler.kv_cache.num_free_blocks == 32


def test_a_hand_off_whose_kv_cannot_be_taken_is_let_go():
    loaded = tiny_model.attentive("llama")
    runner = ModelRunner(loaded, 32, BLOCK_SIZE, "own")
    scheduler = _scheduler()
    engine = ContinuousBatchingEngine(scheduler, runner)
    seq = _handed_off(0, 10)

    def fail(block_ids: list[int]) -> None:
        raise ValueError("KV layout does not match")

    with pytest.raises(ValueError):
        engine.adopt(seq, fail)
    assert not scheduler.running and scheduler.kv_cache.num_free_blocks == 32


def test_a_seeded_sampler_goes_on_drawing_where_the_prefill_worker_stopped():
    """The sampling state travels with the KV: a seeded request at temperature 1 samples the
    same tokens handed off as served by one worker, and not without the state."""
    loaded = tiny_model.attentive("llama")
    prompt = list(range(1000, 1030))
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)

    def engine(runner: ModelRunner) -> ContinuousBatchingEngine:
        scheduler = Scheduler(
            SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64),
            KVCacheManager(32, BLOCK_SIZE),
            FairQueue(),
            TenantAwarePreemption(),
        )
        return ContinuousBatchingEngine(scheduler, runner)

    def seeded_sequence():
        request = make_request(0, prompt, 12)
        return make_sequence_for(request.model_copy(update={"sampling": params}), CharDecoder())

    alone = engine(ModelRunner(loaded, 32, BLOCK_SIZE, "own"))
    expected = seeded_sequence()
    alone.add(expected)
    while alone.has_work():
        alone.step()

    def handed_off(with_state: bool) -> list[int]:
        prefill_runner = ModelRunner(loaded, 32, BLOCK_SIZE, "own")
        blocks = list(range(8))
        chunk = ChunkInput("r0", prompt, 0, blocks, params)
        first = prefill_runner.execute(StepBatch([], [chunk]))[0]
        payload, state = (
            prefill_runner.export_kv(blocks),
            prefill_runner.export_sampling_state("r0"),
        )
        decode_runner = ModelRunner(loaded, 32, BLOCK_SIZE, "own")
        if with_state:
            decode_runner.import_sampling_state("r0", params, state)
        decode = engine(decode_runner)
        seq = seeded_sequence()
        seq.adopt_first_token(first)
        layout = prefill_runner.kv_layout
        assert decode.adopt(seq, lambda ids: decode_runner.import_kv(ids, layout, payload))
        while decode.has_work():
            decode.step()
        return seq.output_token_ids

    assert handed_off(with_state=True) == expected.output_token_ids
    assert handed_off(with_state=False) != expected.output_token_ids


def test_a_prefill_engine_hands_each_sequence_over_at_its_first_token():
    """Two engines in one process, a prefill worker's and a decode worker's: every request's
    first token comes from the first, the rest from the second, the same tokens as one
    worker alone; a hand-off nobody takes is decoded where it is."""
    loaded = tiny_model.attentive("llama")
    prompts = [list(range(1000, 1030)), [7, 7, 7, 7, 7, 7], list(range(2000, 2045, 3))]

    def engine(runner: ModelRunner, hand_off=None) -> ContinuousBatchingEngine:
        scheduler = Scheduler(
            SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32),
            KVCacheManager(32, BLOCK_SIZE),
            FairQueue(quantum_tokens=8),
            TenantAwarePreemption(),
        )
        return ContinuousBatchingEngine(scheduler, runner, hand_off)

    def serve(eng: ContinuousBatchingEngine, seqs) -> dict[str, list[str]]:
        texts: dict[str, list[str]] = {}
        for seq in seqs:
            assert eng.add(seq) is None
        while eng.has_work():
            for output in eng.step():
                texts.setdefault(output.request_id, []).append(output.text)
        return texts

    def requests():
        return [
            make_sequence_for(make_request(i, p, 10, tenant_id=f"t{i}"), CharDecoder())
            for i, p in enumerate(prompts)
        ]

    alone = requests()
    serve(engine(ModelRunner(loaded, 32, BLOCK_SIZE, "own")), alone)

    prefill_runner = ModelRunner(loaded, 32, BLOCK_SIZE, "own")
    decode_runner = ModelRunner(loaded, 32, BLOCK_SIZE, "own")
    decode = engine(decode_runner)
    adopted = []

    def hand_off(seq, block_ids: list[int]) -> bool:
        if seq.request_id == "r1":
            return False  # nobody takes it: the prefill worker decodes it itself
        payload, layout = prefill_runner.export_kv(block_ids), prefill_runner.kv_layout
        state = prefill_runner.export_sampling_state(seq.request_id)
        taken = make_sequence_for(make_request(int(seq.request_id[1:]), seq.prompt_token_ids, 10,
                                               tenant_id=seq.tenant_id), CharDecoder())  # fmt: skip
        taken.adopt_first_token(seq.output_token_ids[0])
        decode_runner.import_sampling_state(taken.request_id, taken.sampling, state)
        assert decode.adopt(taken, lambda ids: decode_runner.import_kv(ids, layout, payload))
        adopted.append(taken)
        return True

    prefill = engine(prefill_runner, hand_off)
    mine = requests()
    prefill_texts = serve(prefill, mine)
    assert prefill.scheduler.kv_cache.num_free_blocks == 32  # nothing held after hand-offs
    serve(decode, [])
    by_id = {seq.request_id: seq for seq in adopted}
    assert sorted(by_id) == ["r0", "r2"]
    for expected, seq in zip(alone, mine, strict=True):
        got = by_id.get(seq.request_id, seq).output_token_ids
        assert got == expected.output_token_ids
    assert len(prefill_texts["r0"]) == 1 and len(prefill_texts["r1"]) == 10  # r1 stayed
