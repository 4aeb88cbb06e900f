"""Which waiting sequence enters the batch next: weighted deficit round-robin over tenants,
charged in tokens, with strict priority between tiers.

Plain Python, no torch, no I/O. The scheduler asks `peek()` whenever it has room, takes the
sequence with `pop()`, and charges every token it computes to the sequence's tenant.

The algorithm (DRR, Shreedhar & Varghese 1995, charged after the fact in tokens as in VTC,
Sheng et al., OSDI'24):

- Each tenant has a FIFO of waiting sequences (a preempted sequence goes back to the front of
  its own tenant's queue) and a *deficit*: the tokens it may still start work against.
- Only the highest tier that has anything waiting is served: higher tiers win contested
  admission. Within that tier, tenants whose deficit is positive are eligible, visited
  round-robin; after each pick the pointer moves on, so tenants interleave request by request.
- When no waiting tenant of the tier has a positive deficit, a round begins: each of them
  gains `quantum_tokens * weight` (as many rounds at once as it takes for one to become
  eligible). Tenants with nothing waiting gain nothing: credit never accrues while idle.
- Charges: a sequence's tokens to (re)compute when it is started (its prompt, or its prompt
  and output so far after a preemption: recompute is charged) and one token per decode step.
  Charges apply whether or not the tenant is waiting, so a tenant with many running
  sequences falls behind one that waits.
- Each tenant also has VTC's virtual counter: the tokens it has had *computed* (`served`),
  per unit of weight. Counters only grow.
- A tenant that starts waiting is placed against its competition (the tenants waiting in
  its tier or, none waiting, the tenant that last stopped waiting), VTC's lift: its counter
  is lifted to at most `burst_tokens` (default four quanta) below the least-served
  competitor's, and its deficit is set to the competition's highest level (deficit per unit
  of weight) plus how far its counter is below that competitor's (credit, at most the burst
  allowance) or less how far it is beyond it (debt). So staying away earns at most a burst
  of service ahead of the others (a light tenant's few prompts in a row go first, as they
  would on an idle machine), using idle capacity is not punished, and it keeps no debt that
  its service does not show. Backlogged tenants never start waiting, so the allowance does
  not touch their shares. Deficits alone would keep such debt: a light tenant whose requests
  all run is charged for each decode with no quantum to set against it (nothing of it
  waits), while a flooding tenant, always waiting, is refilled every round, so the light
  tenant's next request would queue behind the flood (docs/benchmarks.md). It is visited
  next, ahead of the backlogged tenants' next turn: a light tenant's request does not queue
  behind a heavy tenant's round.

One exception to the round-robin: a waiting tenant a quantum or more below the next
tenant's counter goes first, whatever its deficit (the rule `may_displace` applies to running
work). Tenants within a quantum of each other, as backlogged tenants are, take their DRR
turns, so the rounds set their shares; a light tenant whose second prompt arrives while its
first waits, its deficit spent on the first, no longer waits for the round-robin's next turn
behind a flood's new prompts (docs/benchmarks.md).

It is work-conserving: whenever any sequence waits, `peek()` returns one.

When the batch is full, `neediest()` (the head of the waiting tenant with the highest tier
and the least service) may displace running work that `may_displace` allows: a lower tier's,
or another tenant's at least a quantum beyond it in service (the scheduler preempts it).

The order of work *within* a step (`step_priority`: decodes, the next chunk of an admitted
prompt, and the admission of the next waiting sequence) follows the counters: the least
served tenant first, and within a tenant decodes before prefill work. A light tenant's
prompts, up to its burst allowance, thus go before a flood's decodes and chunks. The
deficit cannot order this work: it is charged a whole prompt at admission, and it measures credit against
rounds rather than service received. One exception: the running work of a tenant whose
prompt is part-way through its prefill counts one quantum less service, so a started prompt
finishes before the new prompts of tenants within a quantum of its own, as in VTC, where a
prompt admitted is prefilled at once. Without it, two light tenants leapfrog: each chunk
computed lifts its tenant's counter above the other's, whose next prompt then goes first,
and the first prompt's last tokens wait a step or two (docs/benchmarks.md). A tenant a
quantum or more below still goes first (a light tenant's prompt before a flood's chunks).
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

from worker.sequence import Sequence, SequenceStatus

DEFAULT_QUANTUM_TOKENS = 256
BURST_QUANTA = 4  # the default burst allowance, in quanta (docs/benchmarks.md)


class WaitingQueue(Protocol):
    """What the scheduler needs of its waiting queue; `FairQueue` and `FifoQueue` provide it."""

    def push(self, seq: Sequence) -> None: ...
    def push_front(self, seq: Sequence) -> None: ...
    def peek(self) -> Sequence | None: ...
    def pop(self) -> Sequence: ...
    def remove(self, seq: Sequence) -> None: ...
    def charge(self, seq: Sequence, num_tokens: int) -> None: ...
    def served(self, seq: Sequence, num_tokens: int) -> None: ...
    def priority(self, seq: Sequence) -> tuple:
        """Sort key of waiting sequences: smaller goes first."""
        ...

    def step_priority(self, running: list[Sequence]) -> Callable[[Sequence], tuple]:
        """Sort key of one step's work, running and waiting, given what is running."""
        ...

    def neediest(self) -> Sequence | None:
        """The waiting sequence that may displace running work when the batch is full."""
        ...

    def may_displace(self, seq: Sequence, victim: Sequence) -> bool:
        """Whether waiting `seq` may preempt running `victim` to be admitted."""
        ...

    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[Sequence]: ...


@dataclass(slots=True)
class TenantState:
    tier: int
    weight: int
    deficit: float = 0.0
    service: float = 0.0  # VTC counter: tokens computed per unit of weight, lifted
    waiting: deque[Sequence] = field(default_factory=deque)

    @property
    def level(self) -> float:
        """Deficit per unit of weight: how far ahead of its share the tenant may run."""
        return self.deficit / self.weight


class FairQueue:
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
        self.tenants: dict[str, TenantState] = {}
        # Waiting tenants per tier, in round-robin order: the head is visited next.
        self._rings: dict[int, deque[str]] = {}
        self._last_left: str | None = None
        self._num_waiting = 0
        self.num_tokens_charged: Counter[str] = Counter()

    def __len__(self) -> int:
        return self._num_waiting

    def __iter__(self) -> Iterator[Sequence]:
        for tenant in self.tenants.values():
            yield from tenant.waiting

    def push(self, seq: Sequence) -> None:
        self._enqueue(seq, at_front=False)

    def push_front(self, seq: Sequence) -> None:
        """Put back a preempted sequence ahead of its tenant's newer work."""
        self._enqueue(seq, at_front=True)

    def peek(self) -> Sequence | None:
        """The sequence to start next, or None when nothing waits. Does not change the order."""
        tenant_id = self._next_tenant()
        return None if tenant_id is None else self.tenants[tenant_id].waiting[0]

    def pop(self) -> Sequence:
        """Take the sequence `peek()` returned; the round-robin pointer moves past its tenant."""
        tenant_id = self._next_tenant()
        if tenant_id is None:
            raise IndexError("pop from an empty FairQueue")
        tenant = self.tenants[tenant_id]
        ring = self._rings[tenant.tier]
        seq = tenant.waiting.popleft()
        self._num_waiting -= 1
        ring.remove(tenant_id)
        if tenant.waiting:
            ring.append(tenant_id)
        else:
            self._stop_waiting(tenant_id)
        return seq

    def remove(self, seq: Sequence) -> None:
        """Drop a waiting sequence (cancelled before it started)."""
        tenant = self.tenants[seq.tenant_id]
        tenant.waiting.remove(seq)
        self._num_waiting -= 1
        if not tenant.waiting:
            self._rings[tenant.tier].remove(seq.tenant_id)
            self._stop_waiting(seq.tenant_id)

    def charge(self, seq: Sequence, num_tokens: int) -> None:
        """Charge tokens computed for `seq` (prefill, recompute or decode) to its tenant."""
        self._tenant(seq).deficit -= num_tokens
        self.num_tokens_charged[seq.tenant_id] += num_tokens

    def served(self, seq: Sequence, num_tokens: int) -> None:
        """Count tokens computed for `seq` (a prompt chunk, recompute or decode) in its
        tenant's virtual counter."""
        tenant = self._tenant(seq)
        tenant.service += num_tokens / tenant.weight

    def priority(self, seq: Sequence) -> tuple[int, float, bool, float]:
        """Higher tier, then the tenant with the least computed service per unit of weight;
        within a tenant, decodes before prefill work, then age."""
        return (-seq.tier, self._service(seq), _is_prefill(seq), seq.arrival_s)

    def step_priority(self, running: list[Sequence]) -> Callable[[Sequence], tuple]:
        """`priority`, except that the running work of a tenant whose prompt is part-way
        through its prefill counts one quantum less service (module docstring)."""
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
        service per unit of weight."""
        heads = [tenant.waiting[0] for tenant in self.tenants.values() if tenant.waiting]
        return min(heads, key=self.priority, default=None)

    def may_displace(self, seq: Sequence, victim: Sequence) -> bool:
        """A higher tier always; in the same tier, another tenant whose service per unit of
        weight is at least a quantum beyond `seq`'s. A tenant that starts waiting is lifted
        to a burst below its competition, so it displaces a flood at once; tenants that
        the counters keep within a quantum of each other do not preempt each other."""
        if seq.tier != victim.tier:
            return seq.tier > victim.tier
        if seq.tenant_id == victim.tenant_id:
            return False
        return self._is_a_quantum_behind(self._service(seq), self._service(victim))

    def _service(self, seq: Sequence) -> float:
        tenant = self.tenants.get(seq.tenant_id)
        return 0.0 if tenant is None else tenant.service

    def _enqueue(self, seq: Sequence, *, at_front: bool) -> None:
        tenant = self._tenant(seq)
        if not tenant.waiting:
            self._start_waiting(seq.tenant_id, tenant)
        if at_front:
            tenant.waiting.appendleft(seq)
        else:
            tenant.waiting.append(seq)
        self._num_waiting += 1

    def _tenant(self, seq: Sequence) -> TenantState:
        tenant = self.tenants.get(seq.tenant_id)
        if tenant is None:
            tenant = self.tenants[seq.tenant_id] = TenantState(seq.tier, seq.weight)
        elif not tenant.waiting:
            # Tier and weight may change between requests (an operator updated the tenant).
            tenant.tier, tenant.weight = seq.tier, seq.weight
        return tenant

    def _start_waiting(self, tenant_id: str, tenant: TenantState) -> None:
        """Lift the counter and set the deficit of a tenant that starts waiting against its
        competition (module docstring); it is visited next."""
        ring = self._rings.setdefault(tenant.tier, deque())
        competitors = [self.tenants[t] for t in ring]
        if not competitors and self._last_left not in (None, tenant_id):
            competitors = [self.tenants[self._last_left]]
        if competitors:
            floor = min(t.service for t in competitors)
            tenant.service = max(tenant.service, floor - self.burst_tokens)
            # Its service beyond the floor is debt; below it (a burst allowance), credit.
            behind = floor - tenant.service
            tenant.deficit = (max(t.level for t in competitors) + behind) * tenant.weight
        ring.appendleft(tenant_id)

    def _stop_waiting(self, tenant_id: str) -> None:
        self._last_left = tenant_id

    def _next_tenant(self) -> str | None:
        tier = max((tier for tier, ring in self._rings.items() if ring), default=None)
        if tier is None:
            return None
        ring = self._rings[tier]
        eligible = [t for t in ring if self.tenants[t].deficit > 0]
        if not eligible:
            self._start_rounds(ring)
            eligible = [t for t in ring if self.tenants[t].deficit > 0]
        head = eligible[0]  # the ring's order: the first eligible after the pointer
        neediest = self.neediest().tenant_id  # of this tier: the highest with anything waiting
        if self._is_a_quantum_behind(self.tenants[neediest].service, self.tenants[head].service):
            return neediest  # before the round's turn
        return head

    def _is_a_quantum_behind(self, service: float, other: float) -> bool:
        """The rule for going before another tenant's turn or running work: a quantum or
        more less service per unit of weight."""
        return other - service >= self.quantum_tokens

    def _start_rounds(self, ring: deque[str]) -> None:
        """Add as many rounds of quantum * weight as it takes for one waiting tenant to become
        eligible (deficit > 0), all at once."""
        states = [self.tenants[t] for t in ring]
        num_rounds = min(
            math.floor(-t.deficit / (self.quantum_tokens * t.weight)) + 1 for t in states
        )
        for t in states:
            t.deficit += num_rounds * self.quantum_tokens * t.weight


class FifoQueue:
    """Arrival order, tenants ignored: the baseline fair queuing is measured against. Entries
    pulled from several tenants' streams at once are merged by arrival time."""

    def __init__(self) -> None:
        self._waiting: deque[Sequence] = deque()
        self.num_tokens_charged: Counter[str] = Counter()

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

    def charge(self, seq: Sequence, num_tokens: int) -> None:
        self.num_tokens_charged[seq.tenant_id] += num_tokens

    def served(self, seq: Sequence, num_tokens: int) -> None:
        pass  # arrival order needs no account of service

    def priority(self, seq: Sequence) -> tuple[bool, float]:
        """Decodes before prefill work, each in arrival order."""
        return (_is_prefill(seq), seq.arrival_s)

    def step_priority(self, running: list[Sequence]) -> Callable[[Sequence], tuple]:
        return self.priority

    def neediest(self) -> Sequence | None:
        return None  # FIFO waits for room

    def may_displace(self, seq: Sequence, victim: Sequence) -> bool:
        return False


def _is_prefill(seq: Sequence) -> bool:
    """More than one token to compute: a prompt (chunk), recompute, or not started yet."""
    return seq.num_tokens - seq.num_computed_tokens > 1


def _is_part_done(seq: Sequence) -> bool:
    """A prompt (or recompute) with some of its tokens computed and more to go."""
    return seq.num_computed_tokens > 0 and _is_prefill(seq)
