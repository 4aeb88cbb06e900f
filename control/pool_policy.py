"""Which model each worker of the shared pool serves: plain, synchronous code without I/O
(`control/pool.py` reads the signals from Redis and writes the assignments back).

A model's *pressure* is its requests waiting to start per place in the batch serving it.
Each shared worker, in turn, goes to the model whose pressure without it is highest, and
adds its places there before the next one chooses, so a spike draws as many shared workers
as it needs, not all of them. A worker leaves the model it serves only when all of these
hold: it has served it for `min_dwell_s`; the other model's pressure is at least
`min_waiting_per_place` and above the current one's by `switch_margin`; and the other's
backlog would last longer than loading the other model's weights takes (its waiting
requests at the rate they start now; the load as this worker measured it, else as the
other workers that loaded that model did, else `default_load_s`). A worker with nothing better to do keeps its model:
staying loaded costs nothing, switching costs a load.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class ModelDemand:
    """One model as the shared pool sees it (its stable version)."""

    model: str
    num_waiting: int  # requests not started: on its streams, or pulled and waiting
    dedicated_places: int  # places in the batch of its ready dedicated workers
    start_rate_per_s: float  # requests that started per second lately, on all its workers
    load_s: float | None = None  # the longest load of it any live worker measured


@dataclass(frozen=True, slots=True)
class Member:
    """A worker of the shared pool."""

    worker_id: str
    models: tuple[str, ...]  # those it may serve, in its preferred order
    places: int  # places in its batch
    serving: str | None = None  # the model it is assigned now
    since_s: float = 0.0  # when it was assigned that model
    load_s: dict[str, float] = field(default_factory=dict)  # measured, per model


@dataclass(frozen=True, slots=True)
class PoolPolicy:
    min_waiting_per_place: float = 1.0
    switch_margin: float = 0.5  # the other's pressure must exceed (1 + margin) x current
    min_dwell_s: float = 30.0
    default_load_s: float = 10.0  # a model this worker has not loaded yet

    def assign(
        self, demands: dict[str, ModelDemand], members: list[Member], now_s: float
    ) -> dict[str, str]:
        """Each member's model (worker id -> model id)."""
        places = {model: demand.dedicated_places for model, demand in demands.items()}
        assigned: dict[str, str] = {}
        free = []
        for member in sorted(members, key=lambda m: m.worker_id):
            serving = member.serving if member.serving in demands else None
            if serving is not None and now_s - member.since_s < self.min_dwell_s:
                assigned[member.worker_id] = serving
                places[serving] += member.places
            else:
                free.append(member)
        for member in free:
            model = self._choose(member, demands, places)
            if model is not None:
                assigned[member.worker_id] = model
                places[model] += member.places
        return assigned

    def _choose(
        self, member: Member, demands: dict[str, ModelDemand], places: dict[str, int]
    ) -> str | None:
        candidates = [model for model in member.models if model in demands]
        if not candidates:
            return None

        def pressure(model: str) -> float:
            return demands[model].num_waiting / max(1, places[model])

        best = max(candidates, key=pressure)  # the first of equals: the preferred order
        current = member.serving if member.serving in candidates else None
        if current is None:
            return best
        if best == current or not self._worth_switching(member, demands[best], pressure):
            return current
        return best

    def _worth_switching(self, member: Member, target: ModelDemand, pressure) -> bool:
        assert member.serving is not None
        target_pressure = pressure(target.model)
        if target_pressure < self.min_waiting_per_place:
            return False
        if target_pressure <= pressure(member.serving) * (1 + self.switch_margin):
            return False
        load_s = member.load_s.get(target.model, target.load_s)
        if load_s is None:
            load_s = self.default_load_s
        if target.start_rate_per_s <= 0:
            return True  # nothing starts there: its backlog outlasts any load
        return target.num_waiting / target.start_rate_per_s >= load_s
