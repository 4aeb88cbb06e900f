"""`llmfleet up`'s supervisor: the backoff policy, and restarts driven by a fake clock and
fake processes (the real thing, with kill -9: tests/e2e/test_up.py, tests/chaos/)."""

from __future__ import annotations

import itertools
import signal
from dataclasses import dataclass, field

import pytest

from cli.supervisor import Backoff, Child, Supervisor, describe_exit


def test_backoff_doubles_while_runs_stay_short_and_is_capped():
    backoff = Backoff(initial_s=1, max_s=30, stable_after_s=60)
    assert [backoff.delay_s(uptime_s=0.5) for _ in range(8)] == [1, 2, 4, 8, 16, 30, 30, 30]


def test_backoff_starts_over_after_a_long_run():
    backoff = Backoff(initial_s=1, max_s=30, stable_after_s=60)
    assert [backoff.delay_s(uptime_s=5) for _ in range(3)] == [1, 2, 4]
    assert backoff.delay_s(uptime_s=60) == 1  # it had stayed up: a fresh failure
    assert backoff.delay_s(uptime_s=5) == 2
    assert backoff.delay_s(uptime_s=59.9) == 4  # not long enough to count as stable


def test_backoff_never_overflows():
    backoff = Backoff(initial_s=1, max_s=30)
    for _ in range(10_000):
        delay_s = backoff.delay_s(uptime_s=0)
    assert delay_s == 30


@pytest.mark.parametrize(
    ("returncode", "text"),
    [(0, "exit 0"), (1, "exit 1"), (-signal.SIGKILL, "signal SIGKILL"), (-200, "signal 200")],
)
def test_exits_are_described_by_code_or_signal(returncode, text):
    assert describe_exit(returncode) == text


@dataclass
class FakeProcess:
    pid: int
    returncode: int | None = None
    signals: list[int] = field(default_factory=list)

    def poll(self) -> int | None:
        return self.returncode

    def send_signal(self, sig: int) -> None:
        self.signals.append(sig)
        self.returncode = -sig

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        assert self.returncode is not None
        return self.returncode


class Clock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


class Starts:
    """A child's start function: each call a new fake process, or a failure."""

    def __init__(self) -> None:
        self.processes: list[FakeProcess] = []
        self.num_failures = 0

    def __call__(self) -> FakeProcess:
        if self.num_failures:
            self.num_failures -= 1
            raise RuntimeError("no such thing")
        self.processes.append(FakeProcess(pid=100 + len(self.processes)))
        return self.processes[-1]


def _supervisor() -> tuple[Supervisor, Clock, list[str]]:
    clock, reports = Clock(), []
    return Supervisor(reports.append, clock=clock, wall_clock=clock), clock, reports


def test_an_exited_child_is_started_again_after_its_backoff():
    supervisor, clock, reports = _supervisor()
    starts = Starts()
    child = supervisor.add(Child("worker-0", starts, metrics_port=9300))
    clock.now_s += 10
    starts.processes[0].returncode = -signal.SIGKILL
    supervisor.tick()
    assert len(starts.processes) == 1  # not at once: after the backoff's 1 s
    (state,) = supervisor.states()
    assert (state.state, state.pid, state.last_exit) == ("restarting", None, "signal SIGKILL")
    assert "worker-0 (pid 100) exited: signal SIGKILL after 10.0 s" in reports[-1]
    clock.now_s += 0.9
    supervisor.tick()
    assert len(starts.processes) == 1
    clock.now_s += 0.1
    supervisor.tick()
    assert len(starts.processes) == 2
    (state,) = supervisor.states()
    assert (state.state, state.pid, state.num_restarts) == ("running", 101, 1)
    assert (state.last_exit, state.up_since_ts, state.metrics_port) == (
        "signal SIGKILL", clock.now_s, 9300,
    )  # fmt: skip
    assert "worker-0 started again (pid 101), restart 1" in reports[-1]
    assert child.process is starts.processes[1]


def test_a_crash_loop_backs_off_and_a_failed_start_counts_as_an_exit():
    supervisor, clock, _ = _supervisor()
    starts = Starts()
    supervisor.add(Child("api", starts))
    restart_times_s = []
    for _ in range(4):  # the child dies at once, every time
        starts.processes[-1].returncode = 1
        supervisor.tick()
        before = len(starts.processes)
        while len(starts.processes) == before:
            clock.now_s += 0.25
            supervisor.tick()
        restart_times_s.append(clock.now_s)
    gaps = [b - a for a, b in itertools.pairwise(restart_times_s)]
    assert gaps == [2.0, 4.0, 8.0]
    starts.num_failures = 1
    starts.processes[-1].returncode = 1
    supervisor.tick()
    clock.now_s += 16
    supervisor.tick()  # the start raises: reported as an exit, backoff doubles again
    (state,) = supervisor.states()
    assert (state.state, state.num_restarts) == ("restarting", 5)
    assert state.last_exit == "start failed (no such thing)"
    clock.now_s += 30
    supervisor.tick()
    assert supervisor.states()[0].state == "running"


def test_stop_terminates_everyone_and_the_broker_last():
    supervisor, _, _ = _supervisor()
    order: list[str] = []

    def start(name: str):
        process = FakeProcess(pid=len(order) + 1)
        original = process.send_signal

        def send_signal(sig: int) -> None:
            order.append(name)
            original(sig)

        process.send_signal = send_signal  # type: ignore[method-assign]
        return lambda: process

    redis_child = supervisor.add(Child("redis", start("redis")))
    for name in ("api", "control", "worker-0"):
        supervisor.add(Child(name, start(name)))
    supervisor.stop(grace_s=1, last=redis_child)
    assert order == ["api", "control", "worker-0", "redis"]
    assert all(c.process.returncode == -signal.SIGTERM for c in supervisor.children)


@dataclass
class DrainingProcess(FakeProcess):
    """Takes SIGTERM as a request to drain: still running until told it is done, or killed."""

    def send_signal(self, sig: int) -> None:
        self.signals.append(sig)
        if sig == signal.SIGKILL:
            self.returncode = -sig


def test_a_retired_child_is_not_restarted_and_is_killed_past_its_grace():
    supervisor, clock, reports = _supervisor()
    quick, slow = DrainingProcess(pid=1), DrainingProcess(pid=2)
    first = supervisor.add(Child("worker-1", lambda: quick))
    second = supervisor.add(Child("worker-2", lambda: slow))
    supervisor.retire(first, grace_s=5)
    supervisor.retire(second, grace_s=5)
    assert quick.signals == [signal.SIGTERM] and supervisor.children == []
    quick.returncode = 0  # drained
    clock.now_s += 1
    supervisor.tick()
    assert "worker-1 (pid 1) stopped: scaled down" in reports[-1]
    assert quick.signals == [signal.SIGTERM]  # an exit on purpose: no restart, no kill
    clock.now_s += 4
    supervisor.tick()
    assert slow.signals == [signal.SIGTERM, signal.SIGKILL]
    assert "worker-2 (pid 2) killed: past its drain" in reports[-1]
    assert supervisor.retiring == [] and supervisor.states() == []
    assert second.num_restarts == 0
