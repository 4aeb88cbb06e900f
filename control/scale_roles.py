"""Which workers of a model version serve and which stand by, for the number the policy
wants serving: plain, synchronous code without I/O (`control/scaler.py` writes the result to
`keys.AUTOSCALE_ROLES`, where each worker follows its own entry).

A worker's role is `active` or `standby`; one without an entry keeps the role it started
with (`llmfleet worker --standby` or not), which its state shows once it has loaded. Workers
draining (stopping) count for neither. To serve more, standby workers are woken first
(loaded: about a second), then loading ones are told to come up serving; to serve fewer, the
ready workers with the fewest running requests are parked first (a parked worker hands back
what it has not started and finishes the rest before it drops its KV pool), so a scale-down
cuts the least work short.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.scale_decisions import ROLE_ACTIVE, ROLE_STANDBY

ACTIVE = ROLE_ACTIVE
STANDBY = ROLE_STANDBY


@dataclass(frozen=True, slots=True)
class RoleHolder:
    worker_id: str
    state: str  # from its heartbeat: loading, standby, ready, draining...
    role: str | None  # its entry in the roles hash, if any
    num_running: int = 0

    @property
    def is_active(self) -> bool:
        """Serving, or on its way to: told so, or ready and not told otherwise."""
        if self.state == "draining":
            return False
        if self.role is not None:
            return self.role == ACTIVE
        return self.state == "ready"


def plan_roles(holders: list[RoleHolder], num_ready: int) -> dict[str, str]:
    """The entries to write (worker id -> role) so that `num_ready` workers are active, or
    as many as there are."""
    active = [h for h in holders if h.is_active]
    changes: dict[str, str] = {}
    if len(active) < num_ready:
        idle = [h for h in holders if not h.is_active and h.state != "draining"]
        # Loaded standby workers first: they serve within about a second.
        idle.sort(key=lambda h: (h.state != STANDBY, h.worker_id))
        for holder in idle[: num_ready - len(active)]:
            changes[holder.worker_id] = ACTIVE
    elif len(active) > num_ready:
        # Loading ones first (nothing to cut short), then the least busy ready ones.
        active.sort(key=lambda h: (h.state == "ready", h.num_running, h.worker_id))
        for holder in active[: len(active) - num_ready]:
            changes[holder.worker_id] = STANDBY
    return changes
