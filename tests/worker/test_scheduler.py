"""The continuous-batching scheduler, pure: token budget, chunked prefill, admission, preemption."""

from __future__ import annotations

from tests.factories import make_sequence
from worker.fair_queue import FifoQueue
from worker.kv_cache import KVCacheManager
from worker.preemption import LatestArrivalFirst
from worker.scheduler import Scheduler, SchedulerConfig
from worker.sequence import SequenceStatus


def _scheduler(num_blocks=100, block_size=4, max_num_seqs=8, budget=32) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget),
        KVCacheManager(num_blocks, block_size),
        FifoQueue(),
        LatestArrivalFirst(),
    )


def _run_step(scheduler: Scheduler, token_id: int = 90):
    out = scheduler.schedule()
    sampled = [token_id for chunk in out.chunks if chunk.is_sampling]
    return out, scheduler.postprocess(out, sampled)


def test_long_prompt_is_chunked_within_the_budget_and_decodes_go_first():
    s = _scheduler(budget=16)
    short, long = make_sequence(0, 4, 5), make_sequence(1, 40, 5)
    s.add(short)
    s.add(long)
    out, _ = _run_step(s)
    assert [(c.seq.request_id, c.num_new_tokens) for c in out.chunks] == [("r0", 4), ("r1", 12)]
    out, _ = _run_step(s)
    # r0 now decodes (1 token, first), r1 continues its prompt with the rest of the budget
    assert [(c.seq.request_id, c.num_new_tokens) for c in out.decodes] == [("r0", 1)]
    assert [(c.seq.request_id, c.start, c.num_new_tokens) for c in out.prefills] == [("r1", 12, 15)]
    assert out.num_batched_tokens <= 16


def test_late_chunks_of_a_long_prompt_shrink_with_their_context():
    # Budget 256, attention cap 256 x 512: chunks deep into a 2,048-token prompt get shorter,
    # so no step's prefill attention (chunk x context) exceeds the cap.
    s = Scheduler(
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256),
        KVCacheManager(200, 16),
        FifoQueue(),
        LatestArrivalFirst(),
    )
    s.add(make_sequence(0, 2048, 2))
    chunks = []
    while not chunks or chunks[-1].end < 2048:
        out, _ = _run_step(s)
        chunks += out.prefills
    sizes = [c.num_new_tokens for c in chunks]
    assert sizes[:2] == [256, 256]  # early chunks: the budget is the limit
    assert all(c.num_new_tokens * c.end <= 256 * 512 for c in chunks)
    assert sorted(sizes, reverse=True) == sizes
    assert max(c.num_new_tokens for c in chunks if c.end > 1024) <= 128
    assert [c.start for c in chunks[1:]] == [c.end for c in chunks[:-1]]  # contiguous, whole


def test_new_request_joins_while_others_decode_and_finished_leave_at_once():
    s = _scheduler()
    a = make_sequence(0, 4, 3)
    s.add(a)
    _run_step(s)
    b = make_sequence(1, 4, 3)
    s.add(b)
    out, _ = _run_step(s)
    assert {c.seq.request_id for c in out.chunks} == {"r0", "r1"}
    _, outputs = _run_step(s)  # r0 reaches max_tokens=3 here
    assert [o.request_id for o in outputs if o.is_finished] == ["r0"]
    assert a.block_table == [] and s.running == [b]


def test_preemption_takes_the_latest_arrival_and_requeues_it_first():
    # 5 blocks of 2 tokens; a and b (3 prompt tokens) take 2 blocks each at prefill.
    s = _scheduler(num_blocks=5, block_size=2, budget=64)
    a, b = make_sequence(0, 3, 5), make_sequence(1, 3, 5)
    late = make_sequence(2, 3, 2)
    assert s.add(a) is None and s.add(b) is None
    _run_step(s)
    assert s.add(late) is None
    _run_step(s)  # the decodes fit their second blocks; `late` needs 2 blocks, 1 is free
    assert late.status is SequenceStatus.WAITING
    out, _ = _run_step(s)  # a takes the last block; b needs a 3rd and none is free
    assert out.preempted == [b]
    assert list(s.waiting) == [b, late]  # ahead of new work
    assert b.num_computed_tokens == 0 and b.block_table == [] and b.num_preemptions == 1
    assert [c.seq for c in out.chunks] == [a]


def test_refuses_a_sequence_that_can_never_fit():
    s = _scheduler(num_blocks=4, block_size=4)
    output = s.add(make_sequence(0, 10, 7))  # 17 tokens > 16
    assert (
        output is not None
        and output.finish_reason == "error"
        and "KV cache" in output.error.message
    )
    assert not s.has_work()


def test_max_num_seqs_caps_the_batch():
    s = _scheduler(max_num_seqs=2)
    for i in range(3):
        s.add(make_sequence(i, 2, 5))
    out, _ = _run_step(s)
    assert len(out.chunks) == 2 and s.num_waiting == 1


def test_abort_frees_blocks_of_running_and_waiting():
    s = _scheduler(num_blocks=10)
    a, b = make_sequence(0, 8, 5), make_sequence(1, 8, 5)
    s.add(a)
    s.add(b)
    _run_step(s)
    c = make_sequence(2, 4, 5)
    s.add(c)
    outputs = s.abort({"r0", "r2"})
    assert {o.request_id: o.finish_reason for o in outputs} == {
        "r0": "cancelled",
        "r2": "cancelled",
    }
    assert s.kv_cache.num_free_blocks == 10 - len(b.block_table)
    assert s.running == [b] and not s.waiting


def test_everything_finishes_and_every_block_returns_under_pressure():
    s = _scheduler(num_blocks=12, block_size=2, max_num_seqs=6, budget=9)
    seqs = [make_sequence(i, 2 + (i * 5) % 9, 3 + (i * 7) % 11) for i in range(12)]
    for seq in seqs:
        assert s.add(seq) is None
    for _ in range(2000):
        if not s.has_work():
            break
        _run_step(s)
    assert all(seq.is_finished for seq in seqs)
    assert all(seq.num_output_tokens == seq.sampling.max_tokens for seq in seqs)
    assert s.kv_cache.num_free_blocks == 12
    assert s.num_preemptions > 0  # the pool was small enough to force some


def test_deadlines_end_waiting_and_running_sequences_and_free_their_blocks():
    s = _scheduler(max_num_seqs=1)
    running, waiting = make_sequence(0, 4, 20), make_sequence(1, 4, 20)
    running.deadline_s, waiting.queue_deadline_s = 100.0, 50.0
    s.add(running)
    s.add(waiting)
    _run_step(s)
    assert s.expire(now_s=10.0) == []
    (queue_timeout,) = s.expire(now_s=60.0)
    assert queue_timeout.request_id == "r1" and queue_timeout.error.code == "queue_timeout"
    (deadline,) = s.expire(now_s=101.0)
    assert (deadline.request_id, deadline.finish_reason) == ("r0", "deadline")
    assert deadline.num_output_tokens == 1
    assert not s.has_work()
    assert s.kv_cache.num_free_blocks == s.kv_cache.num_blocks


def test_a_started_sequence_outlives_its_queue_deadline_until_its_total_deadline():
    s = _scheduler()
    seq = make_sequence(0, 4, 20)
    seq.queue_deadline_s, seq.deadline_s = 50.0, 100.0
    s.add(seq)
    _run_step(s)  # started before its queue deadline
    assert s.expire(now_s=60.0) == []
    assert s.expire(now_s=99.0) == []
    (deadline,) = s.expire(now_s=101.0)
    assert (deadline.request_id, deadline.finish_reason) == ("r0", "deadline")


def test_the_deadlines_of_finished_sequences_are_not_kept():
    # Every request has a deadline, most far ahead: the sequences that finish before it
    # must not stay behind, held by the scheduler, until it passes.
    s = _scheduler(num_blocks=400, max_num_seqs=8)
    for index in range(2000):
        seq = make_sequence(index, 4, 1)
        seq.deadline_s = 1e9
        s.add(seq)
        if index % 8 == 7:
            while s.has_work():
                _run_step(s)
    assert len(s._deadlines) <= 2 * 8 + 64 + 1
    assert s.expire(now_s=1e9 + 1) == []
