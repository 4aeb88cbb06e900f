"""Fair queuing over tenants by their service in tokens per unit of weight (VTC): pure and
deterministic."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

from tests.factories import make_sequence
from worker.fair_queue import FairQueue, FifoQueue

_ids = itertools.count()


def _seq(tenant: str, *, tier: int = 1, weight: int = 1, prompt: int = 4):
    return make_sequence(next(_ids), prompt, 8, tenant_id=tenant, tier=tier, weight=weight)


def _pop_charged(queue: FairQueue, tenant: str | None = None):
    """Admit the queue's next sequence, charged and served its tokens as the scheduler does."""
    seq = queue.pop()
    assert tenant is None or seq.tenant_id == tenant
    queue.counters.charge(seq, seq.num_tokens)
    queue.counters.served(seq, seq.num_tokens)
    return seq


def _fill(queue: FairQueue, tenant: str, n: int, **kwargs) -> None:
    for _ in range(n):
        queue.push(_seq(tenant, **kwargs))


def _serve(queue: FairQueue, num_pops: int, cost_of=lambda seq: 100) -> Counter[str]:
    """Pop each sequence and compute its cost at once; tokens served per tenant."""
    served: Counter[str] = Counter()
    for _ in range(num_pops):
        seq = queue.pop()
        queue.counters.charge(seq, cost_of(seq))
        queue.counters.served(seq, cost_of(seq))
        served[seq.tenant_id] += cost_of(seq)
    return served


def test_equal_tenants_alternate_request_by_request():
    q = FairQueue(quantum_tokens=100)
    _fill(q, "a", 5)
    _fill(q, "b", 5)
    order = []
    for _ in range(6):
        seq = q.pop()
        q.counters.charge(seq, 10)  # small charges: several picks per round, still interleaved
        order.append(seq.tenant_id)
    assert order == ["b", "a", "b", "a", "b", "a"]  # the last to start waiting goes first


@pytest.mark.parametrize("quantum", [16, 256, 1000])
def test_backlogged_tenants_get_service_in_proportion_to_weight(quantum):
    q = FairQueue(quantum_tokens=quantum)
    for tenant, weight in (("a", 4), ("b", 2), ("c", 1)):
        _fill(q, tenant, 2000, weight=weight)
    served = _serve(q, 1400, cost_of=lambda seq: 50 + (seq.request_id.__hash__() % 150))
    total = sum(served.values())
    for tenant, weight in (("a", 4), ("b", 2), ("c", 1)):
        assert served[tenant] / total == pytest.approx(weight / 7, rel=0.05)


def test_charges_after_the_fact_count_running_work():
    # Tenant a has long-running sequences charged every step; b's requests are short.
    q = FairQueue(quantum_tokens=50)
    _fill(q, "a", 50)
    _fill(q, "b", 50)
    first = q.pop()
    q.counters.charge(first, 1000)  # its first request turns out long: 1000 tokens of decode
    picks = [q.pop().tenant_id for _ in range(10)]
    other = "b" if first.tenant_id == "a" else "a"
    assert picks == [other] * 10  # the other catches up before it starts anything else


def test_a_tenant_that_starts_waiting_is_served_before_the_backlogged_next_turn():
    q = FairQueue(quantum_tokens=100)
    _fill(q, "heavy", 20)
    _serve(q, 5, cost_of=lambda seq: 10)
    q.push(light := _seq("light"))
    assert q.pop() is light


def test_a_higher_tier_wins_contested_admission():
    q = FairQueue(quantum_tokens=100)
    _fill(q, "low", 3, tier=0, weight=8)
    _fill(q, "high", 2, tier=2, weight=1)
    q.counters.charge(_seq("high", tier=2), 10_000)  # deep in debt, still first: tiers are strict
    assert [q.pop().tenant_id for _ in range(5)] == ["high", "high", "low", "low", "low"]


def test_work_conserving_whatever_the_debt():
    q = FairQueue(quantum_tokens=1)
    seq = _seq("a")
    q.counters.charge(seq, 10**9)
    q.push(seq)
    assert q.peek() is seq
    assert q.pop() is seq
    assert q.peek() is None and len(q) == 0


def test_no_credit_accrues_while_idle():
    q = FairQueue(quantum_tokens=100, burst_tokens=0)
    _fill(q, "a", 500)
    _serve(q, 300)  # b is idle all this time
    _fill(q, "b", 50)
    picks = list(_serve(q, 10).elements())
    assert 400 <= picks.count("b") <= 600  # b shares from now on; it does not get a long run


def test_using_idle_capacity_is_not_punished():
    q = FairQueue(quantum_tokens=100, burst_tokens=0)
    _fill(q, "a", 10)
    _serve(q, 10)  # a alone: its queue empties
    running = _seq("a")
    q.counters.served(running, 50_000)  # a's running sequences use the idle machine heavily
    _fill(q, "b", 20)  # b arrives first: it is lifted to the level of a, the last to leave
    _fill(q, "a", 20)
    served = _serve(q, 10)
    assert 400 <= served["a"] <= 600


def test_a_preempted_sequence_goes_back_ahead_of_its_own_tenants_newer_work():
    q = FairQueue()
    older, newer = _seq("a"), _seq("a")
    q.push(newer)
    q.push_front(older)
    assert [q.pop(), q.pop()] == [older, newer]


def test_remove_a_waiting_sequence():
    q = FairQueue()
    a, b = _seq("a"), _seq("b")
    q.push(a)
    q.push(b)
    q.remove(a)
    assert len(q) == 1 and list(q) == [b]
    assert q.pop() is b and q.peek() is None


def test_charges_are_counted_per_tenant():
    q = FairQueue()
    seq = _seq("a")
    q.counters.charge(seq, 7)
    q.counters.charge(seq, 3)
    assert q.counters.num_tokens_charged == {"a": 10}


def test_fifo_queue_keeps_arrival_order_across_tenants():
    q = FifoQueue()
    seqs = [_seq(t) for t in "aab"]
    for seq in seqs:
        q.push(seq)
    back = _seq("b")
    q.push_front(back)
    assert [q.pop() for _ in range(4)] == [back, *seqs]


def test_a_tenant_less_served_than_its_competition_starts_level_with_it_whatever_its_debt():
    # b's one request decodes while a keeps waiting. b is charged for each decode with no
    # quantum to set against it (nothing of b waits), while a's deficit is refilled every
    # round; yet b has had far less service than a, so its next request goes next.
    q = FairQueue(quantum_tokens=100)
    _fill(q, "a", 50)
    q.push(_seq("b", prompt=300))
    b_running = q.pop()
    assert b_running.tenant_id == "b"
    q.counters.charge(b_running, 300)  # its prompt, charged in full at admission
    for _ in range(20):
        a = q.pop()
        q.counters.charge(a, 100)
        q.counters.served(a, 100)
        q.counters.charge(b_running, 10)  # a decode step's worth of b's tokens
        q.counters.served(b_running, 10)
    q.push(b_next := _seq("b"))
    assert q.pop() is b_next


def test_a_tenant_served_beyond_its_competition_waits_its_turn_on_return():
    q = FairQueue(quantum_tokens=100)
    _fill(q, "a", 50)
    q.push(_seq("b"))
    b_running = q.pop()
    q.counters.served(b_running, 1_000)  # 10 quanta more than a has had
    q.push(_seq("b"))
    picks = []
    for _ in range(12):
        seq = q.pop()
        q.counters.charge(seq, 100)  # a quantum each, computed at once
        q.counters.served(seq, 100)
        picks.append(seq.tenant_id)
    assert picks == ["a"] * 10 + ["b", "a"]  # b sits out the 10 quanta it is ahead by


def test_prefill_order_follows_computed_service_per_weight():
    q = FairQueue(quantum_tokens=100)
    light, heavy = _seq("light", weight=2), _seq("heavy", weight=1)
    q.push(light)
    q.push(heavy)
    q.counters.served(light, 300)  # 150 per unit of weight
    q.counters.served(heavy, 100)
    assert q.priority(heavy) < q.priority(light)
    q.counters.served(heavy, 100)  # 200 per unit of weight: more, though fewer tokens than light's
    assert q.priority(light) < q.priority(heavy)


def test_a_returning_tenant_leads_the_least_served_waiting_tenant_by_its_burst_at_most():
    q = FairQueue(quantum_tokens=100, burst_tokens=300)
    _fill(q, "a", 5)
    a = q.peek()
    q.counters.served(a, 10_000)  # b was idle all this time: that earns it no more than a burst
    q.push(b := _seq("b"))
    assert q.priority(b) < q.priority(a)  # its next prompts go first...
    q.counters.served(b, 299)
    assert q.priority(b) < q.priority(a)
    q.counters.served(b, 2)
    assert q.priority(a) < q.priority(b)  # ...but only for a burst's worth of tokens


def test_a_returning_tenants_burst_is_admitted_before_a_backlogged_tenants_next_turn():
    q = FairQueue(quantum_tokens=100, burst_tokens=300)
    _fill(q, "a", 10, prompt=200)
    for _ in range(3):
        _pop_charged(q, "a")  # a: 600 tokens of service, b none
    for _ in range(5):
        q.push(_seq("b", prompt=100))
    order = [_pop_charged(q).tenant_id for _ in range(6)]
    # 300 tokens of credit: b's first three prompts go first, then the two share rounds.
    assert order[:3] == ["b", "b", "b"]
    assert order[3:].count("a") >= 1


def test_a_prompt_is_charged_from_admission_until_it_is_computed():
    # b's long prompt is admitted and not computed yet (chunked over several steps): b
    # counts as served by it already, so a's next request goes first, and b's next one
    # does not jump ahead while the first is still being prefilled.
    q = FairQueue(quantum_tokens=100, burst_tokens=0)
    _fill(q, "a", 3)
    _fill(q, "b", 3)
    first = q.pop()
    assert first.tenant_id == "b"  # the last to start waiting goes first among equals
    q.counters.charge(first, 1_000)
    assert q.counters.tenants["b"].service == 0
    assert [q.pop().tenant_id for _ in range(2)] == ["a", "a"]
    q.counters.served(first, 1_000)  # computed: the charge turns into service, not twice
    assert q.counters.tenants["b"].counter == 1_000


def test_a_refund_gives_back_what_was_charged_and_will_not_be_computed():
    q = FairQueue(quantum_tokens=100, burst_tokens=0)
    _fill(q, "a", 3)
    _fill(q, "b", 3)
    first = q.pop()
    q.counters.charge(first, 1_000)
    q.counters.charge(first, -1_000)  # preempted before any of it was computed
    assert q.counters.tenants[first.tenant_id].counter == 0
    assert q.pop().tenant_id != first.tenant_id  # round robin among equals again


def test_service_updates_carry_what_was_computed_and_the_lifts_then_start_afresh():
    q = FairQueue(quantum_tokens=100, burst_tokens=100)
    q.push(a := _seq("a", weight=2))
    q.counters.served(q.pop(), 300)
    q.push(_seq("a", weight=2))  # a waits again
    q.push(_seq("b"))  # b is lifted to a's 150 - 100
    updates = q.counters.take_updates()
    assert updates.served == {"a": 150.0}
    assert updates.floors == {"b": 50.0}
    assert not q.counters.take_updates()
    assert a.tenant_id == "a"


def test_a_worker_orders_by_the_pools_counters():
    # a and b both wait at worker 2; worker 1 serves a a lot meanwhile. Once worker 2 has
    # synced with the pool it serves b first, where counters of its own would alternate.
    from bench.scenario_driver import PoolCounters

    pool, worker_1, worker_2 = PoolCounters(), FairQueue(burst_tokens=0), FairQueue(burst_tokens=0)
    _fill(worker_2, "a", 5)
    _fill(worker_2, "b", 5)
    worker_1.push(_seq("a"))
    worker_1.counters.served(worker_1.pop(), 5_000)
    pool.sync(worker_1.counters.take_updates())
    worker_2.counters.apply_pool(pool.sync(worker_2.counters.take_updates()))
    assert list(_serve(worker_2, 5).elements()).count("b") == 500


def test_the_pools_counters_never_lower_a_tenants_own_and_lost_ones_are_sent_back():
    q = FairQueue(burst_tokens=0)
    q.push(_seq("a"))
    q.counters.served(q.pop(), 1_000)
    q.counters.take_updates()
    q.counters.apply_pool({"a": 400.0})  # a Redis that lost some of its data
    assert q.counters.tenants["a"].service == 1_000
    q.counters.apply_pool({})  # lost all of it
    assert q.counters.take_updates().floors == {"a": 1_000}


def test_a_tenant_with_nothing_waiting_starts_soon_when_it_is_needier_than_the_rest():
    q = FairQueue(quantum_tokens=100, burst_tokens=0)
    running = [_seq("flood") for _ in range(4)]
    for seq in running:
        q.push(seq)
        q.counters.served(q.pop(), 1_000)  # the flood fills the batch with 4,000 tokens of service
    assert "new" in q.starting_soon(["new"], running)  # never seen: it would be lifted and go first
    q.push(light := _seq("light"))
    q.counters.served(q.pop(), 10)
    assert light.tenant_id == "light"
    assert "light" in q.starting_soon(["light"], running)  # far below the flood: it displaces it
    q.push(_seq("light"))
    assert "light" not in q.starting_soon(["light"], running)  # has one waiting already
    _fill(q, "flood", 2)
    assert "flood" not in q.starting_soon(["flood"], running)  # has some waiting


def test_a_tenant_within_a_quantum_waits_for_a_free_place_behind_the_neediest():
    q = FairQueue(quantum_tokens=100, burst_tokens=0)
    service = {"a": 1_000, "b": 950, "c": 1_020}
    for tenant in service:
        q.push(_seq(tenant))  # all level at 0
    running = [q.pop() for _ in service]
    _fill(q, "b", 1)  # b waits
    for seq in running:
        q.counters.served(seq, service[seq.tenant_id])
    assert "a" not in q.starting_soon(["a"], running)  # 1,000: neither displaces nor goes next
    assert "c" not in q.starting_soon(["c"], running)
    q.pop()
    assert "a" in q.starting_soon(["a"], running)  # nothing waits: a would take the next place
