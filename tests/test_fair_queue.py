"""Weighted deficit round-robin over tenants, charged in tokens: pure and deterministic."""

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
    queue.charge(seq, seq.num_tokens)
    queue.served(seq, seq.num_tokens)
    return seq


def _fill(queue: FairQueue, tenant: str, n: int, **kwargs) -> None:
    for _ in range(n):
        queue.push(_seq(tenant, **kwargs))


def _serve(queue: FairQueue, num_pops: int, cost_of=lambda seq: 100) -> Counter[str]:
    """Pop and charge each popped sequence its cost at once; tokens served per tenant."""
    served: Counter[str] = Counter()
    for _ in range(num_pops):
        seq = queue.pop()
        queue.charge(seq, cost_of(seq))
        served[seq.tenant_id] += cost_of(seq)
    return served


def test_equal_tenants_alternate_request_by_request():
    q = FairQueue(quantum_tokens=100)
    _fill(q, "a", 5)
    _fill(q, "b", 5)
    order = []
    for _ in range(6):
        seq = q.pop()
        q.charge(seq, 10)  # small charges: several picks per round, still interleaved
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
    q.charge(first, 1000)  # its first request turns out long: 1000 tokens of decode
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
    q.charge(_seq("high", tier=2), 10_000)  # deep in debt, still first: tiers are strict
    assert [q.pop().tenant_id for _ in range(5)] == ["high", "high", "low", "low", "low"]


def test_work_conserving_whatever_the_debt():
    q = FairQueue(quantum_tokens=1)
    seq = _seq("a")
    q.charge(seq, 10**9)
    q.push(seq)
    assert q.peek() is seq
    assert q.pop() is seq
    assert q.peek() is None and len(q) == 0


def test_no_credit_accrues_while_idle():
    q = FairQueue(quantum_tokens=100)
    _fill(q, "a", 500)
    _serve(q, 300)  # b is idle all this time
    _fill(q, "b", 50)
    picks = [seq.tenant_id for seq in (q.pop() for _ in range(10))]
    assert 4 <= picks.count("b") <= 6  # b shares from now on; it does not get a long run


def test_using_idle_capacity_is_not_punished():
    q = FairQueue(quantum_tokens=100)
    _fill(q, "a", 10)
    _serve(q, 10)  # a alone: its queue empties
    running = _seq("a")
    q.charge(running, 50_000)  # a's running sequences use the idle machine heavily
    _fill(q, "b", 20)  # b arrives first: it takes the level of a, the last to leave
    _fill(q, "a", 20)
    picks = [seq.tenant_id for seq in (q.pop() for _ in range(10))]
    assert 4 <= picks.count("a") <= 6


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
    q.charge(seq, 7)
    q.charge(seq, 3)
    assert q.num_tokens_charged == {"a": 10}


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
    q.charge(b_running, 300)  # its prompt, charged in full at admission
    for _ in range(20):
        a = q.pop()
        q.charge(a, 100)
        q.served(a, 100)
        q.charge(b_running, 10)  # a decode step's worth of b's tokens
        q.served(b_running, 10)
    q.push(b_next := _seq("b"))
    assert q.pop() is b_next


def test_a_tenant_served_beyond_its_competition_waits_its_turn_on_return():
    q = FairQueue(quantum_tokens=100)
    _fill(q, "a", 50)
    q.push(_seq("b"))
    b_running = q.pop()
    q.served(b_running, 1_000)  # 10 quanta more than a has had
    q.push(_seq("b"))
    picks = []
    for _ in range(12):
        seq = q.pop()
        q.charge(seq, 100)  # a quantum each, computed at once
        q.served(seq, 100)
        picks.append(seq.tenant_id)
    assert picks == ["a"] * 10 + ["b", "a"]  # b sits out the 10 quanta it is ahead by


def test_prefill_order_follows_computed_service_per_weight():
    q = FairQueue(quantum_tokens=100)
    light, heavy = _seq("light", weight=2), _seq("heavy", weight=1)
    q.push(light)
    q.push(heavy)
    q.served(light, 300)  # 150 per unit of weight
    q.served(heavy, 100)
    assert q.priority(heavy) < q.priority(light)
    q.served(heavy, 100)  # 200 per unit of weight: more, though fewer tokens than light's
    assert q.priority(light) < q.priority(heavy)


def test_a_returning_tenant_leads_the_least_served_waiting_tenant_by_its_burst_at_most():
    q = FairQueue(quantum_tokens=100, burst_tokens=300)
    _fill(q, "a", 5)
    a = q.peek()
    q.served(a, 10_000)  # b was idle all this time: that earns it no more than a burst
    q.push(b := _seq("b"))
    assert q.priority(b) < q.priority(a)  # its next prompts go first...
    q.served(b, 299)
    assert q.priority(b) < q.priority(a)
    q.served(b, 2)
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


def test_a_tenant_a_quantum_behind_in_service_goes_before_the_round_robins_turn():
    # b's second prompt waits while its first runs. b's deficit is spent (charged for more
    # than it has had computed), yet b has had more than a quantum less computed than a, so
    # the second prompt goes before a's next one instead of waiting for b's next DRR turn.
    q = FairQueue(quantum_tokens=100, burst_tokens=300)
    _fill(q, "a", 10, prompt=100)
    for _ in range(3):
        _pop_charged(q, "a")  # a: 300 tokens of service
    q.push(_seq("b", prompt=100))
    q.push(_seq("b", prompt=100))
    first = _pop_charged(q, "b")  # b: lifted to 0, then 100 of service
    q.charge(first, 1_000)  # its deficit spent
    assert q.tenants["b"].deficit <= 0
    assert q.peek().tenant_id == "b"
    _pop_charged(q, "b")  # b: 200, within a quantum of a's 300: the round-robin again
    assert q.peek().tenant_id == "a"
