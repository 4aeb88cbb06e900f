"""Which waiting sequence enters the batch next: weighted deficit round-robin over tenants in
tokens, strict priority between tiers, on one service counter per tenant (VTC's) that every
worker of the pool shares (`worker/pool_service.py`). Plain Python, no torch, no I/O.

- Admission (`peek`/`pop`): the highest tier waiting; within it, round-robin over the tenants
  whose counter (service per unit of weight, plus what is charged ahead) is below the round's
  line. A tenant that starts waiting is lifted to at most a burst below its competition.
- A full batch: `neediest` may displace a lower tier's work, or another tenant's a quantum
  beyond it in service (`may_displace`); `starting_soon` tells the intake whom to read.
- Within a step (`step_priority`): the least served tenant first, decodes before prefill.

The rules and the measurements behind each: docs/architecture.md, "Tenancy".
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Protocol, TypeAlias

from worker.sequence import Sequence, SequenceStatus

DEFAULT_QUANTUM_TOKENS = 256
BURST_QUANTA = 4  # the default burst allowance, in quanta (docs/benchmarks.md)

# A sort key of waiting and running work, smaller first: tiers, service, flags and times.
SortKey: TypeAlias = tuple[float, ...]


class WaitingQueue(Protocol):
    """What the scheduler needs of its waiting queue; `FairQueue` and `FifoQueue` provide it."""

    def push(self, seq: Sequence) -> None: ...
    def push_front(self, seq: Sequence) -> None: ...
    def peek(self) -> Sequence | None: ...
    def pop(self) -> Sequence: ...
    def remove(self, seq: Sequence) -> None: ...
    def charge(self, seq: Sequence, num_tokens: int) -> None:
        """Tokens of `seq` to compute (at admission: its prompt, or everything again after a
        preemption), charged before they are computed; negative: a refund of tokens
        charged that will not be computed (the sequence was preempted or ended)."""
        ...

    def served(self, seq: Sequence, num_tokens: int) -> None:
        """Tokens computed for `seq` (a prompt chunk, recompute or decode)."""
        ...

    def priority(self, seq: Sequence) -> SortKey:
        """Sort key of waiting sequences: smaller goes first."""
        ...

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

    def take_service_updates(self) -> ServiceUpdates:
        """The service computed (and the lifts made) since the last call, for the pool."""
        ...

    def apply_pool_service(self, counters: Mapping[str, float]) -> None:
        """The pool's service counters (`worker/pool_service.py`), as of the last sync."""
        ...

    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[Sequence]: ...


@dataclass(frozen=True, slots=True)
class ServiceUpdates:
    """What a worker's fair queue changed in its tenants' service counters since it last
    synced with the pool (`worker/pool_service.py`): tokens computed per unit of weight,
    to add, and lifts, counters to raise to at least a value."""

    served: dict[str, float] = field(default_factory=dict)
    floors: dict[str, float] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.served or self.floors)


@dataclass(slots=True)
class TenantState:
    tier: int
    weight: int
    service: float = 0.0  # VTC counter: tokens computed per unit of weight, lifted
    num_charged_ahead: int = 0  # tokens charged, not computed yet
    waiting: deque[Sequence] = field(default_factory=deque)

    @property
    def counter(self) -> float:
        """What admission orders by: service, and what is charged ahead of it."""
        return self.service + self.num_charged_ahead / self.weight


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
        # Waiting tenants per tier, in round-robin order (ties between counters).
        self._rings: dict[int, deque[str]] = {}
        self._last_left: str | None = None
        self._num_waiting = 0
        self.num_tokens_charged: Counter[str] = Counter()
        # Pool-wide counters (module docstring): the pool's last word, and what changed here
        # since the last sync.
        self._pool_service: dict[str, float] = {}
        self._served_since_sync: dict[str, float] = {}  # tenant -> service (per unit of weight)
        self._floors_since_sync: dict[str, float] = {}

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
        """Take the sequence `peek()` returned; its tenant goes to the back of the ring."""
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
            self._last_left = tenant_id
        return seq

    def remove(self, seq: Sequence) -> None:
        """Drop a waiting sequence (cancelled before it started)."""
        tenant = self.tenants[seq.tenant_id]
        tenant.waiting.remove(seq)
        self._num_waiting -= 1
        if not tenant.waiting:
            self._rings[tenant.tier].remove(seq.tenant_id)
            self._last_left = seq.tenant_id

    def charge(self, seq: Sequence, num_tokens: int) -> None:
        tenant = self._tenant(seq)
        tenant.num_charged_ahead = max(0, tenant.num_charged_ahead + num_tokens)
        self.num_tokens_charged[seq.tenant_id] += num_tokens

    def served(self, seq: Sequence, num_tokens: int) -> None:
        tenant = self._tenant(seq)
        tenant.service += num_tokens / tenant.weight
        tenant.num_charged_ahead = max(0, tenant.num_charged_ahead - num_tokens)
        served_since_sync = self._served_since_sync.get(seq.tenant_id, 0)
        self._served_since_sync[seq.tenant_id] = served_since_sync + num_tokens / tenant.weight

    def take_service_updates(self) -> ServiceUpdates:
        updates = ServiceUpdates(dict(self._served_since_sync), self._floors_since_sync)
        self._served_since_sync = {}
        self._floors_since_sync = {}
        return updates

    def apply_pool_service(self, counters: Mapping[str, float]) -> None:
        """Take the pool's counters, plus what was computed here since they were read.
        Counters never go down; one the pool has lost (a Redis without its data) is
        sent back as a floor at the next sync."""
        self._pool_service = dict(counters)
        for tenant_id, tenant in self.tenants.items():
            if tenant_id in counters:
                pool_view = counters[tenant_id] + self._served_since_sync.get(tenant_id, 0)
                tenant.service = max(tenant.service, pool_view)
            else:
                self._raise_floor(tenant_id, tenant.service)

    def priority(self, seq: Sequence) -> tuple[int, float, bool, float]:
        """Higher tier, then the tenant with the least computed service per unit of weight;
        within a tenant, decodes before prefill work, then age."""
        return (-seq.tier, self._service(seq), _is_prefill(seq), seq.arrival_s)

    def step_priority(
        self, running: list[Sequence]
    ) -> Callable[[Sequence], tuple[int, float, bool, float]]:
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
        return self._may_displace(seq.tenant_id, seq.tier, self._service(seq), victim)

    def starting_soon(self, tenant_ids: Iterable[str], running: list[Sequence]) -> set[str]:
        """Which of `tenant_ids` would start at once or at the next free place if a request
        of theirs came in now: a tenant with nothing waiting here that, once lifted against
        its competition, could displace some of `running` (a lower tier, or another
        tenant's work a quantum beyond it), or would be the least served of the tenants
        waiting; and a tenant never seen here (its tier is not known yet). The running
        tenants and the waiting counters are summed up once, so a pull with the batch full
        costs O(running + tenants), not their product."""
        lowest_running_tier = min((seq.tier for seq in running), default=math.inf)
        most_served: dict[int, dict[str, float]] = {}  # tier -> running tenant -> service
        for seq in running:
            most_served.setdefault(seq.tier, {})[seq.tenant_id] = self._service(seq)
        top_two = {
            tier: sorted(((v, t) for t, v in served.items()), reverse=True)[:2]
            for tier, served in most_served.items()
        }
        waiting_tiers = [tier for tier, ring in self._rings.items() if ring]
        top_tier = max(waiting_tiers, default=-math.inf)
        top_ring = self._rings[max(waiting_tiers)] if waiting_tiers else ()
        least_counter = min((self.tenants[t].counter for t in top_ring), default=math.inf)
        soon = set()
        for tenant_id in tenant_ids:
            tenant = self.tenants.get(tenant_id)
            if tenant is None:
                soon.add(tenant_id)
                continue
            if tenant.waiting:
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
        return self._service(victim) - service >= self.quantum_tokens

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
            service = self._pool_service.get(seq.tenant_id, 0.0)
            tenant = TenantState(seq.tier, seq.weight, service=service)
            self.tenants[seq.tenant_id] = tenant
        elif not tenant.waiting:
            # Tier and weight may change between requests (an operator updated the tenant).
            tenant.tier, tenant.weight = seq.tier, seq.weight
        return tenant

    def _start_waiting(self, tenant_id: str, tenant: TenantState) -> None:
        """Lift the counter of a tenant that starts waiting against its competition (module
        docstring); among equal counters it goes first."""
        floor = self._lift_floor(tenant_id, tenant.tier)
        if floor > tenant.service:
            tenant.service = floor
            self._raise_floor(tenant_id, floor)
        self._rings.setdefault(tenant.tier, deque()).appendleft(tenant_id)

    def _competitors(self, tenant_id: str, tier: int) -> list[TenantState]:
        """Whom a tenant that starts waiting is placed against: the tenants waiting in its
        tier or, none waiting, the tenant that last stopped waiting."""
        competitors = [self.tenants[t] for t in self._rings.get(tier, ())]
        if not competitors and self._last_left not in (None, tenant_id):
            competitors = [self.tenants[self._last_left]]
        return competitors

    def _lift_floor(self, tenant_id: str, tier: int) -> float:
        """The least service a tenant that starts waiting now is lifted to."""
        competitors = self._competitors(tenant_id, tier)
        return min((t.service for t in competitors), default=-math.inf) - self.burst_tokens

    def _raise_floor(self, tenant_id: str, service: float) -> None:
        self._floors_since_sync[tenant_id] = max(
            service, self._floors_since_sync.get(tenant_id, -math.inf)
        )

    def _next_tenant(self) -> str | None:
        """Weighted deficit round-robin on the counters (module docstring): in the highest
        tier with anything waiting, the first tenant in ring order whose counter is below
        the round's line."""
        tier = max((tier for tier, ring in self._rings.items() if ring), default=None)
        if tier is None:
            return None
        ring = self._rings[tier]
        counters = [self.tenants[t].counter for t in ring]
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

    def step_priority(self, running: list[Sequence]) -> Callable[[Sequence], tuple[bool, float]]:
        return self.priority

    def neediest(self) -> Sequence | None:
        return None  # FIFO waits for room

    def may_displace(self, seq: Sequence, victim: Sequence) -> bool:
        return False

    def starting_soon(self, tenant_ids: Iterable[str], running: list[Sequence]) -> set[str]:
        return set()  # FIFO waits for room

    def take_service_updates(self) -> ServiceUpdates:
        return ServiceUpdates()

    def apply_pool_service(self, counters: Mapping[str, float]) -> None:
        pass  # arrival order needs no account of service


def _is_prefill(seq: Sequence) -> bool:
    """More than one token to compute: a prompt (chunk), recompute, or not started yet."""
    return seq.num_tokens - seq.num_computed_tokens > 1


def _is_part_done(seq: Sequence) -> bool:
    """A prompt (or recompute) with some of its tokens computed and more to go."""
    return seq.num_computed_tokens > 0 and _is_prefill(seq)
