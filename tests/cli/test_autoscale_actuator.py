"""The local actuator's choice of workers to start and stop (`cli/autoscale_actuator.py`)."""

from __future__ import annotations

from cli.autoscale_actuator import plan_changes


def test_more_wanted_starts_the_difference_within_the_maximum():
    assert plan_changes(["worker-0"], [], 3, 1, 4).num_to_start == 2
    assert plan_changes(["worker-0"], [], 9, 1, 4).num_to_start == 3
    assert plan_changes([], [], 0, 1, 4).num_to_start == 1  # the minimum holds


def test_fewer_wanted_stops_only_parked_workers_the_newest_first():
    running = ["worker-0", "worker-1", "worker-2", "worker-3"]
    changes = plan_changes(running, ["worker-1", "worker-3"], 1, 1, 4)
    assert changes.num_to_start == 0
    # Three too many, two parked: those two go; the serving ones wait to be parked first.
    assert changes.to_stop == ["worker-3", "worker-1"]
    assert plan_changes(running, [], 1, 1, 4).to_stop == []
    assert plan_changes(running, running, 0, 2, 4).to_stop == ["worker-3", "worker-2"]
