"""The tenants' service counters, as fair queuing keeps them: for each tenant, the tokens
computed for it per unit of its weight (VTC's counter, lifted when it starts waiting), the
tokens charged at admission and not computed yet, and what changed since the last sync
with the pool's counters in Redis (`worker/pool_service.py`). Plain Python, no I/O.

`worker/fair_queue.py` orders the waiting queue by these counters; the scheduler charges
and serves through them.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

from worker.sequence import Sequence


@dataclass(frozen=True, slots=True)
class ServiceUpdates:
    """What a worker changed in its tenants' counters since it last synced with the pool:
    tokens computed per unit of weight, to add, and lifts, counters to raise to at least a
    value."""

    served: dict[str, float] = field(default_factory=dict)
    floors: dict[str, float] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.served or self.floors)


@dataclass(slots=True)
class TenantService:
    tier: int
    weight: int
    service: float = 0.0  # tokens computed per unit of weight, lifted
    num_charged_ahead: int = 0  # tokens charged, not computed yet

    @property
    def counter(self) -> float:
        """What admission orders by: service, and what is charged ahead of it."""
        return self.service + self.num_charged_ahead / self.weight


class TenantCounters:
    def __init__(self) -> None:
        self.tenants: dict[str, TenantService] = {}
        self.num_tokens_charged: Counter[str] = Counter()  # every charge and refund
        self._pool_service: dict[str, float] = {}  # the pool's last word
        self._served_since_sync: dict[str, float] = {}  # per unit of weight
        self._floors_since_sync: dict[str, float] = {}

    def of(self, seq: Sequence, *, may_retier: bool = True) -> TenantService:
        """`seq`'s tenant, created at the pool's counter the first time; its tier and weight
        taken from `seq` when `may_retier` (an operator may change them between requests,
        not while the tenant has requests waiting)."""
        tenant = self.tenants.get(seq.tenant_id)
        if tenant is None:
            service = self._pool_service.get(seq.tenant_id, 0.0)
            tenant = TenantService(seq.tier, seq.weight, service=service)
            self.tenants[seq.tenant_id] = tenant
        elif may_retier:
            tenant.tier, tenant.weight = seq.tier, seq.weight
        return tenant

    def service(self, tenant_id: str) -> float:
        tenant = self.tenants.get(tenant_id)
        return 0.0 if tenant is None else tenant.service

    def charge(self, seq: Sequence, num_tokens: int) -> None:
        """Tokens of `seq` to compute (at admission: its prompt, or everything again after a
        preemption), charged before they are computed; negative: a refund of tokens charged
        that will not be computed (the sequence was preempted or ended)."""
        tenant = self.of(seq, may_retier=False)
        tenant.num_charged_ahead = max(0, tenant.num_charged_ahead + num_tokens)
        self.num_tokens_charged[seq.tenant_id] += num_tokens

    def served(self, seq: Sequence, num_tokens: int) -> None:
        """Tokens computed for `seq` (a prompt chunk, recompute or decode)."""
        tenant = self.of(seq, may_retier=False)
        tenant.service += num_tokens / tenant.weight
        tenant.num_charged_ahead = max(0, tenant.num_charged_ahead - num_tokens)
        served_since_sync = self._served_since_sync.get(seq.tenant_id, 0)
        self._served_since_sync[seq.tenant_id] = served_since_sync + num_tokens / tenant.weight

    def lift(self, tenant_id: str, floor: float) -> None:
        """Raise a tenant's counter to at least `floor`, here and, at the next sync, in the
        pool."""
        tenant = self.tenants[tenant_id]
        if floor > tenant.service:
            tenant.service = floor
            self._raise_floor(tenant_id, floor)

    def take_updates(self) -> ServiceUpdates:
        """The service computed (and the lifts made) since the last call, for the pool."""
        updates = ServiceUpdates(dict(self._served_since_sync), self._floors_since_sync)
        self._served_since_sync = {}
        self._floors_since_sync = {}
        return updates

    def apply_pool(self, counters: Mapping[str, float]) -> None:
        """Take the pool's counters, plus what was computed here since they were read.
        Counters never go down; one the pool has lost (a Redis without its data) is sent
        back as a floor at the next sync."""
        self._pool_service = dict(counters)
        for tenant_id, tenant in self.tenants.items():
            if tenant_id in counters:
                pool_view = counters[tenant_id] + self._served_since_sync.get(tenant_id, 0)
                tenant.service = max(tenant.service, pool_view)
            else:
                self._raise_floor(tenant_id, tenant.service)

    def _raise_floor(self, tenant_id: str, service: float) -> None:
        self._floors_since_sync[tenant_id] = max(
            service, self._floors_since_sync.get(tenant_id, -math.inf)
        )
