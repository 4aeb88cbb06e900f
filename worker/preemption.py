"""Which running sequence gives up its KV blocks when a sequence needs one and none is free.

A policy only chooses; the scheduler frees the victim's blocks and puts it back at the head
of the waiting queue, to be recomputed ahead of new work. The tenancy issue replaces
`LatestArrivalFirst` with a tenant- and tier-aware policy behind the same interface.
"""

from __future__ import annotations

from collections.abc import Sequence as Candidates
from typing import Protocol

from worker.sequence import Sequence


class PreemptionPolicy(Protocol):
    def pick_victim(self, candidates: Candidates[Sequence]) -> Sequence:
        """One of `candidates` (never empty) to preempt."""
        ...


class LatestArrivalFirst:
    """vLLM's default: the request that arrived last has waited least, so it loses least."""

    def pick_victim(self, candidates: Candidates[Sequence]) -> Sequence:
        return max(candidates, key=lambda seq: seq.arrival_s)
