"""The scheduler with tenants: preemption policies, fair admission and fair prefill order; pure."""

from __future__ import annotations

from tests.factories import make_sequence
from worker.fair_queue import FairQueue, FifoQueue
from worker.kv_cache import KVCacheManager
from worker.preemption import LatestArrivalFirst, TenantAwarePreemption
from worker.scheduler import Scheduler, SchedulerConfig
from worker.sequence import SequenceStatus


def _running(i: int, tenant: str, num_blocks: int, *, tier: int = 1, weight: int = 1):
    seq = make_sequence(i, 4, 8, tenant_id=tenant, tier=tier, weight=weight)
    seq.block_table = list(range(num_blocks))
    return seq


def test_latest_arrival_first():
    seqs = [_running(i, "t", 1) for i in range(3)]
    assert LatestArrivalFirst().pick_victim(seqs, seqs) is seqs[2]


def test_among_sequences_that_arrived_together_the_one_admitted_last_loses():
    # A burst's requests arrive at one instant; the candidates are in admission order, and
    # the first admitted has computed the most. Before, ties went to the first: the burst
    # engine-direct recomputed 30k tokens under FIFO, 34k under fair queuing.
    seqs = [_running(i, "t", 1) for i in range(3)]
    for seq in seqs:
        seq.arrival_s = 5.0
    assert LatestArrivalFirst().pick_victim(seqs, seqs) is seqs[2]
    assert TenantAwarePreemption().pick_victim(seqs, seqs) is seqs[2]


def test_lowest_tier_loses_first_even_when_under_its_share():
    gold = _running(0, "gold", 10, tier=2)
    free = _running(1, "free", 1, tier=0)
    assert TenantAwarePreemption().pick_victim([gold, free], [gold, free]) is free


def test_within_a_tier_the_tenant_most_over_its_weighted_share_loses():
    # a holds 6 of 10 blocks with weight 3 (fair share 3/4): under. b holds 4 with weight 1
    # (fair share 1/4): over, so b loses although a's sequence arrived last.
    b1 = _running(0, "b", 4, weight=1)
    a1 = _running(1, "a", 6, weight=3)
    assert TenantAwarePreemption().pick_victim([b1, a1], [b1, a1]) is b1


def test_within_the_tenant_its_latest_arrival_loses():
    old, new = _running(0, "a", 2), _running(1, "a", 2)
    other = _running(2, "b", 1)
    policy = TenantAwarePreemption()
    assert policy.pick_victim([old, new, other], [old, new, other]) is new


def test_only_candidates_are_picked_but_shares_count_every_running_sequence():
    # a's big sequence was already scheduled this step (not a candidate), yet it makes a the
    # tenant over its share, so a's candidate loses.
    a_big, a_small = _running(0, "a", 8), _running(1, "a", 1)
    b = _running(2, "b", 3)
    assert TenantAwarePreemption().pick_victim([a_small, b], [a_big, a_small, b]) is a_small


def _fair_scheduler(*, quantum: int, max_num_seqs: int, budget: int, num_blocks: int,
                    num_displacement_places: int = 0):  # fmt: skip
    """Fair queuing and tenant-aware preemption over a pool of 4-token blocks."""
    return _scheduler(FairQueue(quantum_tokens=quantum), TenantAwarePreemption(),
                      max_num_seqs=max_num_seqs, budget=budget, num_blocks=num_blocks,
                      num_displacement_places=num_displacement_places)  # fmt: skip


def _scheduler(queue, policy, *, max_num_seqs: int, budget: int, num_blocks: int,
               num_displacement_places: int = 0):  # fmt: skip
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                             num_displacement_places=num_displacement_places)  # fmt: skip
    return Scheduler(
        config,
        KVCacheManager(num_blocks, 4),
        queue,
        policy,
    )


def _step(scheduler: Scheduler) -> None:
    out = scheduler.schedule()
    scheduler.postprocess(out, [70 for chunk in out.chunks if chunk.is_sampling])


def test_flooding_tenant_does_not_starve_a_late_one():
    scheduler = _fair_scheduler(quantum=8, max_num_seqs=2, budget=64, num_blocks=100)
    flood = [make_sequence(i, 4, 3, tenant_id="a") for i in range(10)]
    for seq in flood:
        scheduler.add(seq)
    _step(scheduler)
    late = make_sequence(99, 4, 3, tenant_id="b")
    scheduler.add(late)
    while not late.is_finished:
        _step(scheduler)
    # b started at the first free slot: at most the two sequences running when it arrived
    # and one more of a's (the round-robin turn) finished before it.
    assert sum(seq.is_finished for seq in flood) <= 4


def test_preempted_sequence_is_recomputed_charged_and_counted_for_its_tenant():
    scheduler = _fair_scheduler(
        quantum=8, max_num_seqs=4, budget=64, num_blocks=5
    )  # 20 tokens: two sequences needing 11 each cannot both fit
    queue = scheduler.waiting
    a = make_sequence(0, 8, 4, tenant_id="a")
    b = make_sequence(1, 8, 4, tenant_id="b", weight=2)
    scheduler.add(a)
    scheduler.add(b)
    while scheduler.has_work():
        _step(scheduler)
    assert scheduler.num_preemptions >= 1
    assert sum(scheduler.num_preemptions_by_tenant.values()) == scheduler.num_preemptions
    for seq in (a, b):
        assert seq.num_output_tokens == 4
        # Computed: the prompt, then each decode but the last sampled token, plus recompute.
        num_computed_once = seq.num_prompt_tokens + seq.num_output_tokens - 1
        assert seq.num_computed_total >= num_computed_once
        assert queue.counters.num_tokens_charged[seq.tenant_id] == seq.num_computed_total
    victim = a if scheduler.num_preemptions_by_tenant["a"] else b
    assert victim.num_computed_total > victim.num_prompt_tokens + victim.num_output_tokens - 1


def test_a_newcomers_prompt_step_carries_no_other_tenants_prompt_work():
    # heavy decodes one sequence and is part-way through another's prompt when light, with
    # nothing running, arrives. Light's prompt goes first, in a step that keeps heavy's
    # decode but not heavy's prompt chunk, which on a CPU would make light's first step as
    # long as a full budget's (before: [("light", 8), ("heavy", 8)] in one step).
    scheduler = _fair_scheduler(quantum=8, max_num_seqs=4, budget=16, num_blocks=100)
    decoding = make_sequence(0, 4, 8, tenant_id="heavy")
    scheduler.add(decoding)
    _step(scheduler)  # decoding's prompt; it decodes from now on
    heavy = make_sequence(1, 64, 4, tenant_id="heavy")
    scheduler.add(heavy)
    _step(scheduler)  # a decode and heavy's first 15-token chunk: heavy is in debt
    light = make_sequence(2, 8, 4, tenant_id="light")
    scheduler.add(light)
    out = scheduler.schedule()
    assert [(c.seq.tenant_id, c.num_new_tokens) for c in out.prefills] == [("light", 8)]
    assert [c.seq for c in out.decodes] == [decoding]
    scheduler.postprocess(out, [70 for chunk in out.chunks if chunk.is_sampling])
    assert light.num_output_tokens == 1
    out = scheduler.schedule()  # light is running now: heavy's prompt goes on
    assert heavy in [c.seq for c in out.prefills]


def test_fifo_fills_a_newcomers_step_with_the_others_prompt_work():
    scheduler = _scheduler(FifoQueue(), LatestArrivalFirst(), max_num_seqs=4, budget=16,
                           num_blocks=100)  # fmt: skip
    scheduler.add(make_sequence(0, 20, 4, tenant_id="heavy"))
    _step(scheduler)  # heavy's first 16 tokens
    scheduler.add(make_sequence(1, 8, 4, tenant_id="light"))
    out = scheduler.schedule()
    assert [(c.seq.tenant_id, c.num_new_tokens) for c in out.prefills] == [
        ("heavy", 4),
        ("light", 8),
    ]


def test_a_started_prompt_finishes_before_a_new_prompt_of_a_tenant_within_a_quantum():
    # b's prompt is part-way through its prefill when c's prompt arrives. c has had less
    # computed, but within a quantum of b: b's last 16 tokens go first, so b's first token
    # comes this step instead of b and c leapfrogging (each chunk lifting its tenant's
    # counter above the other's).
    scheduler = _fair_scheduler(quantum=64, max_num_seqs=4, budget=32, num_blocks=100)
    b = make_sequence(0, 48, 4, tenant_id="b")
    scheduler.add(b)
    _step(scheduler)  # b's first 32 tokens
    scheduler.add(make_sequence(1, 24, 4, tenant_id="c"))
    out = scheduler.schedule()
    assert [(c.seq.tenant_id, c.num_new_tokens) for c in out.prefills] == [("b", 16), ("c", 16)]
    scheduler.postprocess(out, [70 for chunk in out.chunks if chunk.is_sampling])
    assert b.num_output_tokens == 1


def test_a_light_tenants_decodes_do_not_put_its_next_prompt_behind_a_flood():
    # light decodes a long answer while heavy floods. Charged for every decode token with
    # nothing waiting, light must not sink into debt behind heavy, whose waiting requests
    # earn it a quantum every round: light has had far less computed than heavy, so its
    # next prompt takes the first free slot and each of its chunks goes first.
    scheduler = _fair_scheduler(quantum=64, max_num_seqs=4, budget=32, num_blocks=1000)
    scheduler.add(make_sequence(0, 4, 400, tenant_id="light"))
    for i in range(1, 200):
        scheduler.add(make_sequence(i, 64, 16, tenant_id="heavy"))
    for _ in range(150):
        _step(scheduler)
    prompt = make_sequence(1000, 60, 4, tenant_id="light")
    scheduler.add(prompt)
    running_at_arrival = {seq.request_id for seq in scheduler.running}
    started_before = set()
    while prompt.status is SequenceStatus.WAITING:
        _step(scheduler)
        started_before |= {seq.request_id for seq in scheduler.running}
    assert started_before - running_at_arrival == {prompt.request_id}
    while prompt.num_output_tokens == 0:
        out = scheduler.schedule()
        assert out.prefills[0].seq is prompt
        scheduler.postprocess(out, [70 for chunk in out.chunks if chunk.is_sampling])


def _full_of_free_tier(*, num_blocks: int, prompt: int, num_displacement_places: int = 0):
    """A batch of two places, both held by a free-tier tenant's running sequences."""
    scheduler = _fair_scheduler(quantum=8, max_num_seqs=2, budget=64, num_blocks=num_blocks,
                                num_displacement_places=num_displacement_places)  # fmt: skip
    low = [make_sequence(i, prompt, 8, tenant_id="free", tier=0) for i in range(2)]
    for seq in low:
        scheduler.add(seq)
    _step(scheduler)
    return scheduler, low


def test_a_higher_tier_displaces_lower_tier_work_from_a_full_batch():
    scheduler, low = _full_of_free_tier(num_blocks=100, prompt=4)
    gold = make_sequence(9, 4, 3, tenant_id="gold", tier=2)
    scheduler.add(gold)
    out = scheduler.schedule()
    assert out.preempted == [low[1]]  # the lower tier's latest arrival
    assert gold.status is SequenceStatus.RUNNING and out.prefills[0].seq is gold
    assert low[1].status is SequenceStatus.WAITING and not low[1].block_table
    assert dict(scheduler.num_preemptions_by_tenant) == {"free": 1}


def test_a_displacer_is_scheduled_once_and_samples_one_token():
    # Admitted before the running sequences are walked, the displacer was once scheduled a
    # second time in the same step: its prompt computed twice and two tokens sampled from
    # one position (the exactness property test found it: [1000, 1000] for [1000, 46682]).
    for places in (0, 1):
        scheduler, _low = _full_of_free_tier(num_blocks=100, prompt=4,
                                             num_displacement_places=places)  # fmt: skip
        scheduler.add(gold := make_sequence(9, 4, 3, tenant_id="gold", tier=2))
        out = scheduler.schedule()
        assert [chunk.seq for chunk in out.chunks].count(gold) == 1
        scheduler.postprocess(out, [70 for chunk in out.chunks if chunk.is_sampling])
        assert gold.num_output_tokens == 1 and gold.num_computed_total == 4


def test_a_tenant_a_quantum_below_a_flood_displaces_it_from_a_full_batch():
    scheduler = _fair_scheduler(quantum=16, max_num_seqs=2, budget=64, num_blocks=100)
    flood = [make_sequence(i, 8, 50, tenant_id="a") for i in range(6)]
    for seq in flood:
        scheduler.add(seq)
    for _ in range(10):
        _step(scheduler)
    late = make_sequence(99, 8, 3, tenant_id="b")
    scheduler.add(late)
    out = scheduler.schedule()
    assert [seq.tenant_id for seq in out.preempted] == ["a"]
    assert late.status is SequenceStatus.RUNNING and out.prefills[0].seq is late


def test_a_displacer_takes_an_extra_place_while_the_kv_cache_has_room():
    # Nobody is preempted (recompute would cost the victim); the batch goes one over its
    # places, and a second displacer, the extra place taken, preempts.
    scheduler, low = _full_of_free_tier(num_blocks=100, prompt=4, num_displacement_places=1)
    scheduler.add(gold := make_sequence(9, 4, 3, tenant_id="gold", tier=2))
    out = scheduler.schedule()
    assert not out.preempted and gold.status is SequenceStatus.RUNNING
    assert scheduler.num_running == 3
    scheduler.postprocess(out, [70 for chunk in out.chunks if chunk.is_sampling])
    scheduler.add(make_sequence(10, 4, 3, tenant_id="silver", tier=1))
    assert scheduler.schedule().preempted == [low[1]]


def test_a_displacer_preempts_when_the_kv_cache_is_full():
    # 2 x 8 tokens: all 4 blocks held
    scheduler, low = _full_of_free_tier(num_blocks=4, prompt=8, num_displacement_places=1)
    scheduler.add(gold := make_sequence(9, 4, 3, tenant_id="gold", tier=2))
    out = scheduler.schedule()
    assert out.preempted == [low[1]] and gold.status is SequenceStatus.RUNNING


def test_backlogged_tenants_that_share_the_batch_do_not_displace_each_other():
    # The counters keep a and b within a quantum of each other: neither preempts the other.
    scheduler = _fair_scheduler(quantum=64, max_num_seqs=4, budget=64, num_blocks=1000)
    seqs = [make_sequence(i, 8, 12, tenant_id="ab"[i % 2]) for i in range(40)]
    for seq in seqs:
        scheduler.add(seq)
    while scheduler.has_work():
        _step(scheduler)
    assert all(seq.is_finished for seq in seqs) and scheduler.num_preemptions == 0


def test_fifo_waits_for_room():
    scheduler = _scheduler(
        FifoQueue(), LatestArrivalFirst(), max_num_seqs=2, budget=64, num_blocks=100
    )
    for i in range(2):
        scheduler.add(make_sequence(i, 4, 50, tenant_id="free", tier=0))
    _step(scheduler)
    gold = make_sequence(9, 4, 3, tenant_id="gold", tier=2)
    scheduler.add(gold)
    for _ in range(10):
        _step(scheduler)
    assert gold.status is SequenceStatus.WAITING and scheduler.num_preemptions == 0
