"""Which running sequence gives up its KV blocks when a sequence needs one and none is free.

A policy only chooses; the scheduler frees the victim's blocks and puts it back at the head
of its tenant's waiting queue, to be recomputed ahead of that tenant's newer work. Between
sequences a policy ranks alike (a burst's requests arrive together), the one admitted last
loses: the candidates are in admission order, and it has computed the least since.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence as Candidates
from typing import Protocol

from worker.sequence import Sequence


class PreemptionPolicy(Protocol):
    def pick_victim(
        self, candidates: Candidates[Sequence], running: Candidates[Sequence]
    ) -> Sequence:
        """One of `candidates` (never empty; a subset of `running`) to preempt."""
        ...


class LatestArrivalFirst:
    """vLLM's default: the request that arrived last has waited least, so it loses least."""

    def pick_victim(
        self, candidates: Candidates[Sequence], running: Candidates[Sequence]
    ) -> Sequence:
        return max(reversed(candidates), key=lambda seq: seq.arrival_s)


class TenantAwarePreemption:
    """Lowest tier first; within it, the tenant most over its weighted share of the KV blocks
    held by running sequences; within that tenant, its latest arrival.

    A tenant's share is its blocks over all blocks held; its fair share is its weight over the
    weights of the tenants holding blocks. The tenant with the highest share / fair share ratio
    loses first, so the tenants that crowd the cache are the ones that give way.
    """

    def pick_victim(
        self, candidates: Candidates[Sequence], running: Candidates[Sequence]
    ) -> Sequence:
        over_share = self._over_share(running)
        return max(
            reversed(candidates),
            key=lambda seq: (-seq.tier, over_share.get(seq.tenant_id, 0.0), seq.arrival_s),
        )

    @staticmethod
    def _over_share(running: Candidates[Sequence]) -> dict[str, float]:
        num_blocks: Counter[str] = Counter()
        weights: dict[str, int] = {}
        for seq in running:
            num_blocks[seq.tenant_id] += len(seq.block_table)
            weights[seq.tenant_id] = seq.weight
        total_blocks = sum(num_blocks.values()) or 1
        total_weight = sum(weights.values())
        return {
            tenant: (num_blocks[tenant] / total_blocks) / (weight / total_weight)
            for tenant, weight in weights.items()
        }
