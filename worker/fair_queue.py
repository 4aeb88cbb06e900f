"""Which waiting sequence enters the batch next: weighted deficit round-robin over tenants in
tokens, strict priority between tiers, on one service counter per tenant (VTC's, kept in
`worker/tenant_counters.py` and shared by the pool's workers). Plain Python, no I/O.

- Admission (`peek`/`pop`): in the highest tier waiting, round-robin over the tenants whose
  counter is below the round's line; a tenant that starts waiting is lifted to at most a
  burst below its competition.
- A full batch: `neediest` may displace a lower tier's work or another tenant's a quantum
  beyond it (`may_displace`); `starting_soon` tells the intake whom to read.
- Within a step (`step_priority`): the least served tenant first, decodes before prefill.
Each rule's docstring names its test; the reasoning: docs/architecture.md, "Tenancy".
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Protocol, TypeAlias

from worker.sequence import Sequence, SequenceStatus
from worker.tenant_counters import TenantCounters, TenantService

DEFAULT_QUANTUM_TOKENS = 256
BURST_QUANTA = 4  # the default burst allowance, in quanta (docs/benchmarks.md)

# A sort key of waiting and running work, smaller first: tiers, service, flags and times.
SortKey: TypeAlias = tuple[float, ...]


class WaitingQueue(Protocol):
    """A waiting queue: what the scheduler admits from, in the queue's order."""

    def push(self, seq: Sequence) -> None: ...
    def push_front(self, seq: Sequence) -> None: ...
    def peek(self) -> Sequence | None: ...
    def pop(self) -> Sequence: ...
    def remove(self, seq: Sequence) -> None: ...
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[Sequence]: ...


class QueuePolicy(WaitingQueue, Protocol):
    """A waiting queue with its rules for a full batch and for the order of a step's work:
    `FairQueue` and `FifoQueue`. Service is counted in `counters` (charged at admission,
    served as computed)."""

    counters: TenantCounters
    # Whether a step that admits a newcomer's prompt (a tenant with nothing running) takes
    # no prompt work of the running tenants (`Scheduler._is_held_back`).
    shortens_newcomer_steps: bool

    def step_priority(self, running: list[Sequence]) -> Callable[[Sequence], SortKey]:
        """Sort key of one step's work, running and waiting, given what is running."""
        ...

    def neediest(self) -> Sequence | None:
        """The waiting sequence that may displace running work when the batch is full."""
        ...

    def may_displace(self, seq: Sequence, victim: Sequence) -> bool:
        """Whether waiting `seq` may preempt running `victim` to be admitted."""
        ...

    def starting_soon(self, tenant_ids: Iterable[str], running: list[Sequence]) -> set[str]:
        """Which of these tenants, with nothing waiting, a new request would start at once
        or at the next free place: the worker's intake then takes it even with the batch
        full."""
        ...


class FairQueue:
    shortens_newcomer_steps = True

    def __init__(
        self, quantum_tokens: int = DEFAULT_QUANTUM_TOKENS, burst_tokens: int | None = None
    ) -> None:
        if quantum_tokens < 1:
            raise ValueError("quantum_tokens must be at least 1")
        self.quantum_tokens = quantum_tokens
        # How far ahead of its competition a tenant that starts waiting may go (None: four
        # quanta): a light tenant's burst of prompts up to this many tokens of service.
        self.burst_tokens = BURST_QUANTA * quantum_tokens if burst_tokens is None else burst_tokens
        if self.burst_tokens < 0:
            raise ValueError("burst_tokens must not be negative")
        self.counters = TenantCounters()
        self._waiting: dict[str, deque[Sequence]] = {}  # by tenant, oldest first
        # Waiting tenants per tier, in round-robin order (ties between counters).
        self._rings: dict[int, deque[str]] = {}
        self._last_left: str | None = None
        self._num_waiting = 0

    def __len__(self) -> int:
        return self._num_waiting

    def __iter__(self) -> Iterator[Sequence]:
        for waiting in self._waiting.values():
            yield from waiting

    def push(self, seq: Sequence) -> None:
        self._enqueue(seq, at_front=False)

    def push_front(self, seq: Sequence) -> None:
        """Put back a preempted sequence ahead of its tenant's newer work."""
        self._enqueue(seq, at_front=True)

    def peek(self) -> Sequence | None:
        """The sequence to start next, or None when nothing waits. Does not change the order."""
        tenant_id = self._next_tenant()
        return None if tenant_id is None else self._waiting[tenant_id][0]

    def pop(self) -> Sequence:
        """Take the sequence `peek()` returned; its tenant goes to the back of the ring."""
        tenant_id = self._next_tenant()
        if tenant_id is None:
            raise IndexError("pop from an empty FairQueue")
        waiting = self._waiting[tenant_id]
        ring = self._rings[self.counters.tenants[tenant_id].tier]
        seq = waiting.popleft()
        self._num_waiting -= 1
        ring.remove(tenant_id)
        if waiting:
            ring.append(tenant_id)
        else:
            self._last_left = tenant_id
        return seq

    def remove(self, seq: Sequence) -> None:
        """Drop a waiting sequence (cancelled before it started)."""
        waiting = self._waiting[seq.tenant_id]
        waiting.remove(seq)
        self._num_waiting -= 1
        if not waiting:
            self._rings[self.counters.tenants[seq.tenant_id].tier].remove(seq.tenant_id)
            self._last_left = seq.tenant_id

    def priority(self, seq: Sequence) -> tuple[int, float, bool, float]:
        """Higher tier, then the tenant with the least computed service per unit of weight;
        within a tenant, decodes before prefill work, then age (test_tenant_scheduler:
        a light tenant's new prompt goes before a heavy tenant's prompt chunks)."""
        return (-seq.tier, self.counters.service(seq.tenant_id), _is_prefill(seq), seq.arrival_s)

    def step_priority(
        self, running: list[Sequence]
    ) -> Callable[[Sequence], tuple[int, float, bool, float]]:
        """`priority`, except that the running work of a tenant whose prompt is part-way
        through its prefill counts one quantum less service, so that a started prompt
        finishes before another tenant's new one within a quantum (test_tenant_scheduler:
        a started prompt finishes before a new prompt of a tenant within a quantum)."""
        finishing = {seq.tenant_id for seq in running if _is_part_done(seq)}
        if not finishing:
            return self.priority

        def key(seq: Sequence) -> tuple[int, float, bool, float]:
            tier, service, is_prefill, arrival_s = self.priority(seq)
            if seq.tenant_id in finishing and seq.status is SequenceStatus.RUNNING:
                service -= self.quantum_tokens
            return (tier, service, is_prefill, arrival_s)

        return key

    def neediest(self) -> Sequence | None:
        """The next sequence of the waiting tenant in the highest tier with the least
        service per unit of weight: the one a full batch makes room for."""
        heads = [waiting[0] for waiting in self._waiting.values() if waiting]
        return min(heads, key=self.priority, default=None)

    def may_displace(self, seq: Sequence, victim: Sequence) -> bool:
        """A higher tier always; in the same tier, another tenant whose service per unit of
        weight is at least a quantum beyond `seq`'s (test_tenant_scheduler: a higher tier,
        and a tenant a quantum below a flood, displace work from a full batch). A tenant
        that starts waiting is lifted to a burst below its competition, so it displaces a
        flood at once; tenants that the counters keep within a quantum of each other do
        not preempt each other (test_tenant_scheduler: backlogged tenants that share the
        batch do not displace each other)."""
        service = self.counters.service(seq.tenant_id)
        return self._may_displace(seq.tenant_id, seq.tier, service, victim)

    def starting_soon(self, tenant_ids: Iterable[str], running: list[Sequence]) -> set[str]:
        """Which of `tenant_ids` would start at once or at the next free place if a request
        of theirs came in now: a tenant with nothing waiting here that, once lifted against
        its competition, could displace some of `running` (a lower tier, or another
        tenant's work a quantum beyond it), or would be the least served of the tenants
        waiting; and a tenant never seen here (its tier is not known yet). The running
        tenants and the waiting counters are summed up once, so a pull with the batch full
        costs O(running + tenants), not their product (the burst-fill scenario, and
        test_intake: a full worker takes the head of a tenant that would start soon)."""
        tenants = self.counters.tenants
        lowest_running_tier = min((seq.tier for seq in running), default=math.inf)
        most_served: dict[int, dict[str, float]] = {}  # tier -> running tenant -> service
        for seq in running:
            most_served.setdefault(seq.tier, {})[seq.tenant_id] = self.counters.service(
                seq.tenant_id
            )
        top_two = {
            tier: sorted(((v, t) for t, v in served.items()), reverse=True)[:2]
            for tier, served in most_served.items()
        }
        waiting_tiers = [tier for tier, ring in self._rings.items() if ring]
        top_tier = max(waiting_tiers, default=-math.inf)
        top_ring = self._rings[max(waiting_tiers)] if waiting_tiers else ()
        least_counter = min((tenants[t].counter for t in top_ring), default=math.inf)
        soon = set()
        for tenant_id in tenant_ids:
            tenant = tenants.get(tenant_id)
            if tenant is None:
                soon.add(tenant_id)
                continue
            if self._waiting.get(tenant_id):
                continue
            service = max(tenant.service, self._lift_floor(tenant_id, tenant.tier))
            beyond = [v for v, t in top_two.get(tenant.tier, ()) if t != tenant_id]
            if (
                lowest_running_tier < tenant.tier
                or (beyond and beyond[0] - service >= self.quantum_tokens)
                or top_tier < tenant.tier
                or (
                    top_tier == tenant.tier
                    and service + tenant.num_charged_ahead / tenant.weight <= least_counter
                )
            ):
                soon.add(tenant_id)
        return soon

    def _may_displace(self, tenant_id: str, tier: int, service: float, victim: Sequence) -> bool:
        if tier != victim.tier:
            return tier > victim.tier
        if tenant_id == victim.tenant_id:
            return False
        return self.counters.service(victim.tenant_id) - service >= self.quantum_tokens

    def _enqueue(self, seq: Sequence, *, at_front: bool) -> None:
        waiting = self._waiting.setdefault(seq.tenant_id, deque())
        # Tier and weight may change between requests (an operator updated the tenant).
        self.counters.of(seq, may_retier=not waiting)
        if not waiting:
            self._start_waiting(seq.tenant_id)
        if at_front:
            waiting.appendleft(seq)
        else:
            waiting.append(seq)
        self._num_waiting += 1

    def _start_waiting(self, tenant_id: str) -> None:
        """Lift the counter of a tenant that starts waiting to at most a burst below its
        competition (test_fair_queue: an idle tenant earns no more than a burst); among
        equal counters it goes first."""
        tier = self.counters.tenants[tenant_id].tier
        self.counters.lift(tenant_id, self._lift_floor(tenant_id, tier))
        self._rings.setdefault(tier, deque()).appendleft(tenant_id)

    def _competitors(self, tenant_id: str, tier: int) -> list[TenantService]:
        """Whom a tenant that starts waiting is placed against: the tenants waiting in its
        tier or, none waiting, the tenant that last stopped waiting."""
        tenants = self.counters.tenants
        competitors = [tenants[t] for t in self._rings.get(tier, ())]
        if not competitors and self._last_left not in (None, tenant_id):
            competitors = [tenants[self._last_left]]
        return competitors

    def _lift_floor(self, tenant_id: str, tier: int) -> float:
        """The least service a tenant that starts waiting now is lifted to."""
        competitors = self._competitors(tenant_id, tier)
        return min((t.service for t in competitors), default=-math.inf) - self.burst_tokens

    def _next_tenant(self) -> str | None:
        """Weighted deficit round-robin on the counters (module docstring): in the highest
        tier with anything waiting, the first tenant in ring order whose counter is below
        the round's line (test_fair_queue: backlogged tenants get service in proportion to
        their weight)."""
        tier = max((tier for tier, ring in self._rings.items() if ring), default=None)
        if tier is None:
            return None
        ring = self._rings[tier]
        counters = [self.counters.tenants[t].counter for t in ring]
        line = self._round_line(min(counters))
        return next(t for t, counter in zip(ring, counters, strict=True) if counter < line)

    def _round_line(self, least_counter: float) -> float:
        """The current round's line: the next multiple of the quantum above the least
        counter of the tenants waiting. A tenant's deficit, per unit of weight, is how far
        its counter is below it; a round ends when none is below, and the next begins."""
        return (math.floor(least_counter / self.quantum_tokens) + 1) * self.quantum_tokens


class FifoQueue:
    """Arrival order, tenants ignored: the baseline fair queuing is measured against. Entries
    pulled from several tenants' streams at once are merged by arrival time."""

    shortens_newcomer_steps = False

    def __init__(self) -> None:
        self._waiting: deque[Sequence] = deque()
        self.counters = TenantCounters()  # counted, not used for the order

    def __len__(self) -> int:
        return len(self._waiting)

    def __iter__(self) -> Iterator[Sequence]:
        return iter(self._waiting)

    def push(self, seq: Sequence) -> None:
        index = len(self._waiting)
        while index and self._waiting[index - 1].arrival_s > seq.arrival_s:
            index -= 1
        self._waiting.insert(index, seq)

    def push_front(self, seq: Sequence) -> None:
        self._waiting.appendleft(seq)

    def peek(self) -> Sequence | None:
        return self._waiting[0] if self._waiting else None

    def pop(self) -> Sequence:
        return self._waiting.popleft()

    def remove(self, seq: Sequence) -> None:
        self._waiting.remove(seq)

    def priority(self, seq: Sequence) -> tuple[bool, float]:
        """Decodes before prefill work, each in arrival order."""
        return (_is_prefill(seq), seq.arrival_s)

    def step_priority(self, running: list[Sequence]) -> Callable[[Sequence], tuple[bool, float]]:
        return self.priority

    def neediest(self) -> Sequence | None:
        return None  # FIFO waits for room

    def may_displace(self, seq: Sequence, victim: Sequence) -> bool:
        return False

    def starting_soon(self, tenant_ids: Iterable[str], running: list[Sequence]) -> set[str]:
        return set()  # FIFO waits for room


def _is_prefill(seq: Sequence) -> bool:
    """More than one token to compute: a prompt (chunk), recompute, or not started yet."""
    return seq.num_tokens - seq.num_computed_tokens > 1


def _is_part_done(seq: Sequence) -> bool:
    """A prompt (or recompute) with some of its tokens computed and more to go."""
    return seq.num_computed_tokens > 0 and _is_prefill(seq)
