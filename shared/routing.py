"""Which version of a model serves a request: the `id@version` names and the routing table.

A model id has a stable version and, during a rollout, a canary version with a traffic
percentage (`control/rollouts.py` moves it). Each request is given a point in [0, 1): a
random one, or with sticky routing a stable hash of its tenant (or of its tenant and the
client's `user` field), so one conversation sees one version; it goes to the canary when its
point is below the canary's share. A version with no ready worker gets nothing: its share
falls back to the stable version. A raised percentage only moves points from stable to
canary, so a sticky tenant that saw the canary keeps seeing it while it grows.

Pure: the API reads the table (`api/router.py`) and the readiness of each version, and asks
`pick`. A version is named `model@version` (`keys.deployment_name`) in Redis keys, metrics and
logs; clients may send that name as `model` to pin a version.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection
from dataclasses import dataclass
from typing import Literal

from shared.tables import ModelDeployment

Sticky = Literal["none", "tenant", "user"]
STICKY_MODES: tuple[Sticky, ...] = ("none", "tenant", "user")


def sticky_mode(value: str) -> Sticky:
    """A stored sticky mode as one of `STICKY_MODES` (an unknown one: none)."""
    return next((mode for mode in STICKY_MODES if mode == value), "none")


@dataclass(frozen=True, slots=True)
class RoutingTable:
    """One model's versions as the API routes them: the stable version, the canary and its
    share (percent of the requests), and how a request's point is drawn."""

    model_id: str
    stable: ModelDeployment
    canary: ModelDeployment | None = None
    canary_percent: float = 0.0
    sticky: Sticky = "none"

    def sticky_key(self, tenant_id: str, user: str | None) -> str | None:
        """What a request's point is hashed from; None: drawn at random."""
        if self.sticky == "tenant" or (self.sticky == "user" and not user):
            return tenant_id
        if self.sticky == "user":
            return f"{tenant_id}/{user}"  # one tenant's users are not another's
        return None


def point_of(table: RoutingTable, key: str) -> float:
    """A stable point in [0, 1) for `key`, salted with the canary: each rollout draws its
    own cohort, so the same tenants are not always the first to meet a new version."""
    canary_id = table.canary.id if table.canary is not None else None
    digest = hashlib.sha256(f"{table.model_id}:{canary_id}:{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def pick(table: RoutingTable, point: float, ready_ids: Collection[int]) -> ModelDeployment:
    """The version a request at `point` goes to: the canary when the point falls within its
    share and it has a ready worker (`ready_ids`: deployment ids), else the stable one."""
    canary = table.canary
    if canary is None or canary.id not in ready_ids:
        return table.stable
    return canary if point * 100 < table.canary_percent else table.stable
