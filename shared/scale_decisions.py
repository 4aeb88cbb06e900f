"""The autoscaler's latest decision for a model version, as Redis holds it
(`keys.autoscale_decision`): written by the control process (`control/scaler.py`) every tick,
read by the actuators: `llmfleet up --autoscale` (`cli/autoscale_actuator.py`) and KEDA,
through the admin API (`api/admin_autoscale.py`). It expires when the autoscaler stops
renewing it; an actuator without a decision keeps the workers it has. Which worker serves
and which stands by is the roles hash (`keys.AUTOSCALE_ROLES`, `control/scale_roles.py`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass

import redis.asyncio as aioredis

from shared import keys
from shared.redis_conn import text

# A worker's role in `keys.AUTOSCALE_ROLES`: serving, or loaded and parked.
ROLE_ACTIVE = "active"
ROLE_STANDBY = "standby"


@dataclass(frozen=True, slots=True)
class ScaleView:
    policy: str
    num_ready: int  # workers wanted serving
    num_standby: int  # workers wanted loaded and parked
    forecast_tokens_per_s: float | None
    arrival_rate_per_s: float
    arrival_tokens_per_s: float
    worker_tokens_per_s: float
    num_waiting: int
    updated_at_s: float

    @property
    def num_workers(self) -> int:
        """The worker processes (or pods) to keep running."""
        return self.num_ready + self.num_standby

    def to_fields(self) -> dict[str, str]:
        fields = {k: ("" if v is None else str(v)) for k, v in asdict(self).items()}
        fields["num_workers"] = str(self.num_workers)  # for a reader that takes one field
        return fields

    @classmethod
    def from_fields(cls, raw: Mapping[bytes | str, bytes | str]) -> ScaleView | None:
        """From the hash as Redis returns it; None for a missing or unreadable decision."""
        fields = {text(k): text(v) for k, v in raw.items()}
        try:
            forecast = fields.get("forecast_tokens_per_s", "")
            return cls(
                policy=fields["policy"],
                num_ready=int(fields["num_ready"]),
                num_standby=int(fields["num_standby"]),
                forecast_tokens_per_s=float(forecast) if forecast else None,
                arrival_rate_per_s=float(fields["arrival_rate_per_s"]),
                arrival_tokens_per_s=float(fields["arrival_tokens_per_s"]),
                worker_tokens_per_s=float(fields["worker_tokens_per_s"]),
                num_waiting=int(fields["num_waiting"]),
                updated_at_s=float(fields["updated_at_s"]),
            )
        except (KeyError, ValueError):
            return None


async def read(redis: aioredis.Redis, deployment: str) -> ScaleView | None:
    """The latest decision for `deployment` (`model@version`); None without one."""
    raw = await redis.hgetall(keys.autoscale_decision(deployment))  # type: ignore[misc]  # redis-py: async commands typed Awaitable[T] | T (redis-py#2399)
    return ScaleView.from_fields(raw)
