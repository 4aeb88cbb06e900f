"""Which workers serve and which stand by (`control/scale_roles.py`)."""

from __future__ import annotations

from control.scale_roles import ACTIVE, STANDBY, RoleHolder, plan_roles


def test_standby_workers_are_woken_before_loading_ones():
    holders = [
        RoleHolder("a", "ready", None, 10),
        RoleHolder("b", "loading", None),
        RoleHolder("c", "standby", None),
        RoleHolder("d", "draining", None),
    ]
    assert plan_roles(holders, 2) == {"c": ACTIVE}
    assert plan_roles(holders, 3) == {"c": ACTIVE, "b": ACTIVE}
    assert plan_roles(holders, 9) == {"c": ACTIVE, "b": ACTIVE}  # never a draining one


def test_fewer_wanted_parks_the_least_busy_ready_workers():
    holders = [
        RoleHolder("a", "ready", None, 30),
        RoleHolder("b", "ready", ACTIVE, 2),
        RoleHolder("c", "ready", None, 12),
    ]
    assert plan_roles(holders, 1) == {"b": STANDBY, "c": STANDBY}
    assert plan_roles(holders, 3) == {}


def test_a_worker_told_its_role_counts_as_that_role_before_it_gets_there():
    holders = [
        RoleHolder("a", "ready", STANDBY, 3),  # parking: not serving any more
        RoleHolder("b", "standby", ACTIVE),  # waking: serving in a second
        RoleHolder("c", "standby", None),
    ]
    assert plan_roles(holders, 1) == {}
    assert plan_roles(holders, 2) == {"c": ACTIVE}
