"""The routing rule: a request's point, the canary's share, sticky keys, readiness."""

from __future__ import annotations

import random
import uuid

from shared import routing
from shared.keys import deployment_name, split_deployment_name
from shared.routing import RoutingTable
from shared.tables import ModelDeployment

STABLE = ModelDeployment(id=1, model_id="m", version="1", source="x", max_context_tokens=8)
CANARY = ModelDeployment(id=2, model_id="m", version="2", source="x", max_context_tokens=8)
READY = {STABLE.id, CANARY.id}


def _table(percent: float, sticky: routing.Sticky = "none") -> RoutingTable:
    return RoutingTable("m", STABLE, CANARY, percent, sticky)


def test_names_pin_a_version():
    assert deployment_name("m", "2") == "m@2" == CANARY.name
    assert split_deployment_name("m@2") == ("m", "2")
    assert split_deployment_name("m") == ("m", None)
    assert split_deployment_name("m@") == ("m", "")  # a version nobody has: a 404


def test_a_ten_percent_canary_gets_ten_percent_of_a_thousand_requests():
    rng = random.Random(7)
    table = _table(10)
    picks = [routing.pick(table, rng.random(), READY) for _ in range(1000)]
    assert 70 <= sum(p is CANARY for p in picks) <= 130
    # Sticky: a thousand tenants, hashed instead of drawn.
    sticky = _table(10, "tenant")
    tenants = [f"ten_{uuid.UUID(int=rng.getrandbits(128)).hex[:16]}" for _ in range(1000)]
    points = [routing.point_of(sticky, sticky.sticky_key(t, None) or "") for t in tenants]
    assert 70 <= sum(routing.pick(sticky, p, READY) is CANARY for p in points) <= 130


def test_a_canary_without_a_ready_worker_gets_nothing():
    table = _table(100)
    assert routing.pick(table, 0.0, READY) is CANARY
    assert routing.pick(table, 0.0, {STABLE.id}) is STABLE
    assert routing.pick(RoutingTable("m", STABLE), 0.0, READY) is STABLE


def test_sticky_points_are_stable_and_a_growing_share_only_takes_from_stable():
    table = _table(5, "user")
    key = table.sticky_key("ten_a", "user-42")
    assert key == "ten_a/user-42"
    assert table.sticky_key("ten_b", "user-42") != key  # tenants' users are distinct
    assert table.sticky_key("ten_a", None) == "ten_a"  # no user: the tenant
    assert _table(5, "tenant").sticky_key("ten_a", "user-42") == "ten_a"
    assert _table(5).sticky_key("ten_a", "user-42") is None  # drawn at random
    points = [routing.point_of(table, f"ten_a/u{i}") for i in range(500)]
    assert points == [routing.point_of(table, f"ten_a/u{i}") for i in range(500)]
    on_canary = set()
    for percent in (5, 25, 50, 100):
        grown = _table(percent, "user")
        now = {i for i, p in enumerate(points) if routing.pick(grown, p, READY) is CANARY}
        assert on_canary <= now  # nobody who met the canary goes back
        on_canary = now
    assert len(on_canary) == 500
