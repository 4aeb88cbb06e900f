"""`llmfleet up --autoscale`: the local actuator. It keeps as many worker processes of the
model running as the autoscaler wants (`keys.autoscale_decision`, written by the control
process's `control/scaler.py`), within `LLMFLEET_AUTOSCALE_MIN_WORKERS` and `_MAX_WORKERS`.

A new worker starts parked (`llmfleet worker --standby`): it loads its weights, and the
autoscaler wakes it when it wants it serving (`keys.AUTOSCALE_ROLES`), or at once if it already
does. A scale-down stops only parked workers (the autoscaler parks one first, after its
scale-down delay and quiet period): a parked worker holds no request, so stopping it cuts
nothing short; a worker still serving is never the one stopped. Without a decision (the
control process restarting) the workers stay as they are.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import redis

from cli.supervisor import Child
from shared import keys
from shared.redis_conn import text
from shared.scale_decisions import ScaleView

STANDBY = "standby"


@dataclass(frozen=True, slots=True)
class LocalChanges:
    num_to_start: int
    to_stop: list[str]  # child names


def plan_changes(
    running: list[str], parked: list[str], num_wanted: int, min_workers: int, max_workers: int
) -> LocalChanges:
    """What to start and stop so that `num_wanted` (bounded) workers run; only `parked`
    ones are stopped, the newest first."""
    num_wanted = max(min_workers, min(max_workers, num_wanted))
    if num_wanted > len(running):
        return LocalChanges(num_wanted - len(running), [])
    stoppable = [name for name in reversed(running) if name in parked]
    return LocalChanges(0, stoppable[: len(running) - num_wanted])


@dataclass
class LocalActuator:
    deployment_name: str
    min_workers: int
    max_workers: int
    spawn_worker: Callable[[int], Child]  # a worker of that index, started parked
    retire: Callable[[Child], None]
    workers: list[Child] = field(default_factory=list)

    def tick(self, client: redis.Redis) -> None:
        raw = client.hgetall(keys.autoscale_decision(self.deployment_name))
        view = ScaleView.from_fields(raw)  # type: ignore[arg-type]  # redis-py: sync commands typed Awaitable[T] | T (redis-py#2399)
        if view is None:
            return
        states = _states_by_pid(client)
        running = [c.name for c in self.workers]
        parked = [
            c.name
            for c in self.workers
            if c.process is not None and states.get(c.process.pid) == STANDBY
        ]
        changes = plan_changes(
            running, parked, view.num_workers, self.min_workers, self.max_workers
        )
        for _ in range(changes.num_to_start):
            self.workers.append(self.spawn_worker(self._free_index()))
        for child in [c for c in self.workers if c.name in changes.to_stop]:
            self.workers.remove(child)
            self.retire(child)

    def _free_index(self) -> int:
        used = {int(c.name.rsplit("-", 1)[1]) for c in self.workers}
        return next(i for i in range(len(used) + 1) if i not in used)


def _states_by_pid(client: redis.Redis) -> dict[int, str]:
    states = {}
    for key in client.scan_iter(match=keys.worker_heartbeat_pattern(), count=100):
        pid, state = client.hmget(key, ["pid", "state"])  # type: ignore[misc]  # redis-py: sync commands typed Awaitable[T] | T (redis-py#2399)
        if pid is not None and state is not None:
            states[int(text(pid))] = text(state)
    return states
