"""`llmfleet up`'s supervisor: a child process that exits is started again, with backoff.

A child that exits while `up` runs (a crash, an out-of-memory kill, a kill -9 by hand) is
started again after a delay that doubles with each exit that came soon after its start
(1 s, 2 s, 4 s, ... at most 30 s) and falls back to 1 s once a run has lasted
`stable_after_s`: a child that fails at once does not spin, one that fails once a day comes
back at once. Each exit and each start is reported with the exit code or signal, and
`states()` says where every child stands (`shared/supervised.py` publishes it).

Only `stop()` ends the children: SIGTERM to each, SIGKILL to what is left after the grace
period. `tick()` is driven by the caller's loop (`cli/up.py`), so the policy is plain,
synchronous code with an injectable clock (tests/cli/test_supervisor.py).
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from shared.supervised import ProcessState

INITIAL_BACKOFF_S = 1.0
MAX_BACKOFF_S = 30.0
STABLE_AFTER_S = 60.0


class Process(Protocol):
    """What the supervisor uses of a child (`subprocess.Popen` provides it)."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...
    def send_signal(self, sig: int) -> None: ...
    def kill(self) -> None: ...
    def wait(self, timeout: float | None = None) -> int: ...


@dataclass(slots=True)
class Backoff:
    """Delays between restarts: doubling while runs stay short, reset by a long one."""

    initial_s: float = INITIAL_BACKOFF_S
    max_s: float = MAX_BACKOFF_S
    stable_after_s: float = STABLE_AFTER_S
    num_quick_exits: int = 0  # exits in a row that came within `stable_after_s` of the start

    def delay_s(self, uptime_s: float) -> float:
        """How long to wait before starting again a child that exited after `uptime_s`."""
        if uptime_s >= self.stable_after_s:
            self.num_quick_exits = 0
        delay_s = min(self.initial_s * 2 ** min(self.num_quick_exits, 32), self.max_s)
        self.num_quick_exits += 1
        return delay_s


@dataclass(slots=True)
class Child:
    """One supervised process: how to start it, and what happened to it so far."""

    name: str
    start: Callable[[], Process]
    metrics_port: int | None = None
    backoff: Backoff = field(default_factory=Backoff)
    process: Process | None = None
    num_restarts: int = 0
    last_exit: str | None = None
    started_at_s: float = 0.0  # the supervisor's clock
    up_since_ts: float | None = None  # wall clock, for the record
    restart_at_s: float | None = None  # set while waiting out the backoff

    def state(self) -> ProcessState:
        is_running = self.restart_at_s is None and self.process is not None
        return ProcessState(
            name=self.name,
            state="running" if is_running else "restarting",
            pid=self.process.pid if is_running and self.process is not None else None,
            num_restarts=self.num_restarts,
            last_exit=self.last_exit,
            up_since_ts=self.up_since_ts if is_running else None,
            metrics_port=self.metrics_port,
        )


def describe_exit(returncode: int) -> str:
    """`exit 1`, or `signal SIGKILL` for a child killed by a signal (a negative code)."""
    if returncode >= 0:
        return f"exit {returncode}"
    try:
        return f"signal {signal.Signals(-returncode).name}"
    except ValueError:
        return f"signal {-returncode}"


class Supervisor:
    def __init__(
        self,
        report: Callable[[str], None],
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.children: list[Child] = []
        # Stopped on purpose (a scale-down): SIGTERM sent, not restarted, killed at the deadline.
        self.retiring: list[tuple[Child, float]] = []
        self._report = report
        self._clock = clock
        self._wall_clock = wall_clock

    def add(self, child: Child) -> Child:
        """Supervise `child`, starting it now (a failed first start raises: `up` stops)."""
        self._launch(child)
        self.children.append(child)
        return child

    def tick(self) -> None:
        """Notice the children that exited and start those whose backoff is over."""
        now_s = self._clock()
        self._reap_retiring(now_s)
        for child in self.children:
            if child.restart_at_s is None and child.process is not None:
                if (returncode := child.process.poll()) is not None:
                    uptime_s = now_s - child.started_at_s
                    self._on_exit(child, describe_exit(returncode), uptime_s, now_s)
            elif child.restart_at_s is not None and now_s >= child.restart_at_s:
                self._restart(child, now_s)

    def retire(self, child: Child, grace_s: float) -> None:
        """Stop `child` for good without waiting: SIGTERM now (a worker drains), SIGKILL if
        it still runs after `grace_s`; it is no longer restarted or listed."""
        self.children.remove(child)
        if child.process is not None and child.process.poll() is None:
            child.process.send_signal(signal.SIGTERM)
            self.retiring.append((child, self._clock() + grace_s))

    def _reap_retiring(self, now_s: float) -> None:
        still = []
        for child, deadline_s in self.retiring:
            assert child.process is not None
            if child.process.poll() is not None:
                self._report(f"{child.name} (pid {child.process.pid}) stopped: scaled down")
            elif now_s >= deadline_s:
                child.process.kill()
                child.process.wait()
                self._report(f"{child.name} (pid {child.process.pid}) killed: past its drain")
            else:
                still.append((child, deadline_s))
        self.retiring = still

    def states(self) -> list[ProcessState]:
        return [child.state() for child in self.children]

    def _on_exit(self, child: Child, how: str, uptime_s: float, now_s: float) -> None:
        delay_s = child.backoff.delay_s(uptime_s)
        child.last_exit, child.restart_at_s = how, now_s + delay_s
        pid = f" (pid {child.process.pid})" if child.process is not None else ""
        self._report(
            f"{child.name}{pid} exited: {how} after {uptime_s:.1f} s; "
            f"starting it again in {delay_s:g} s"
        )

    def _restart(self, child: Child, now_s: float) -> None:
        child.restart_at_s = None
        child.num_restarts += 1
        try:
            self._launch(child)
        except Exception as exc:  # whatever failed, `up` keeps supervising the others
            child.process = None
            self._on_exit(child, f"start failed ({exc})", 0.0, now_s)
            return
        assert child.process is not None
        self._report(f"{child.name} started again (pid {child.process.pid}), "
                     f"restart {child.num_restarts}")  # fmt: skip

    def _launch(self, child: Child) -> None:
        child.process = child.start()
        child.started_at_s = self._clock()
        child.up_since_ts = self._wall_clock()

    def stop(self, grace_s: float, last: Child | None = None) -> None:
        """SIGTERM every running child, SIGKILL what is left after `grace_s`; `last` (the
        broker, which the others write to while they stop) only once they are gone."""
        first = [c for c in self.children if c is not last] + [c for c, _ in self.retiring]
        _terminate([c.process for c in first if c.process is not None], grace_s)
        if last is not None and last.process is not None:
            _terminate([last.process], grace_s)


def _terminate(processes: list[Process], grace_s: float) -> None:
    running = [p for p in processes if p.poll() is None]
    for process in running:
        process.send_signal(signal.SIGTERM)
    deadline_s = time.monotonic() + grace_s
    while any(p.poll() is None for p in running) and time.monotonic() < deadline_s:
        time.sleep(0.1)
    for process in running:
        if process.poll() is None:
            process.kill()
            process.wait()
