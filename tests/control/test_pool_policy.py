"""The shared pool's policy: a spike draws a shared worker, hysteresis keeps it from
thrashing, a short backlog is not worth a load, and a pool of several does not herd."""

from __future__ import annotations

from control.pool_policy import Member, ModelDemand, PoolPolicy

POLICY = PoolPolicy(min_waiting_per_place=1.0, switch_margin=0.5, min_dwell_s=30.0)
NOW_S = 1_000.0


def _demands(waiting_a: int, waiting_b: int, rate_per_s: float = 1.0) -> dict[str, ModelDemand]:
    return {
        "a": ModelDemand("a", waiting_a, dedicated_places=8, start_rate_per_s=rate_per_s),
        "b": ModelDemand("b", waiting_b, dedicated_places=8, start_rate_per_s=rate_per_s),
    }


def _member(serving: str | None = "b", *, since_s: float = 0.0, **load_s: float) -> Member:
    return Member("s1", ("a", "b"), places=8, serving=serving, since_s=since_s, load_s=load_s)


def test_a_spike_on_a_moves_the_shared_worker_from_b_to_a():
    assert POLICY.assign(_demands(80, 2), [_member("b")], NOW_S) == {"s1": "a"}


def test_nothing_waiting_anywhere_keeps_the_loaded_model():
    assert POLICY.assign(_demands(0, 0), [_member("b")], NOW_S) == {"s1": "b"}
    assert POLICY.assign(_demands(3, 0), [_member("b")], NOW_S) == {"s1": "b"}  # < 1 per place


def test_a_worker_without_a_model_takes_the_most_pressed_one_or_its_first():
    assert POLICY.assign(_demands(0, 40), [_member(None)], NOW_S) == {"s1": "b"}
    assert POLICY.assign(_demands(0, 0), [_member(None)], NOW_S) == {"s1": "a"}


def test_it_stays_its_dwell_time_before_switching_again():
    just_moved = _member("b", since_s=NOW_S - 10)
    assert POLICY.assign(_demands(80, 0), [just_moved], NOW_S) == {"s1": "b"}
    settled = _member("b", since_s=NOW_S - 31)
    assert POLICY.assign(_demands(80, 0), [settled], NOW_S) == {"s1": "a"}


def test_it_switches_only_when_the_other_is_pressed_by_the_margin_more():
    # Without the shared worker: a 40/8 = 5.0 against b 30/8 = 3.75 (not 1.5x): it stays.
    assert POLICY.assign(_demands(40, 30), [_member("b")], NOW_S) == {"s1": "b"}
    # b 20/8 = 2.5; 1.5 x 2.5 = 3.75 < 5.0: it goes.
    assert POLICY.assign(_demands(40, 20), [_member("b")], NOW_S) == {"s1": "a"}


def test_a_backlog_that_drains_before_the_model_loads_is_not_worth_a_switch():
    # 16 waiting, starting 4 a second: drained in 4 s, before a 10 s load ends.
    slow_load = _member("b", a=10.0)
    assert POLICY.assign(_demands(16, 0, rate_per_s=4.0), [slow_load], NOW_S) == {"s1": "b"}
    # The same backlog, and a model that loads in 2 s: worth it.
    fast_load = _member("b", a=2.0)
    assert POLICY.assign(_demands(16, 0, rate_per_s=4.0), [fast_load], NOW_S) == {"s1": "a"}
    # Nothing starts on a (no dedicated worker alive): any load is worth it.
    assert POLICY.assign(_demands(16, 0, rate_per_s=0.0), [slow_load], NOW_S) == {"s1": "a"}


def test_a_pool_of_shared_workers_splits_by_need_rather_than_herding():
    members = [Member(f"s{i}", ("a", "b"), places=8, serving="b") for i in range(3)]
    # a: 20 waiting on 8 places. After the first shared worker moves, a has 20/16 = 1.25
    # waiting per place, still worth a second; after that 20/24 = 0.83: the third stays.
    assigned = POLICY.assign(_demands(20, 4), members, NOW_S)
    assert sorted(assigned.values()) == ["a", "a", "b"]


def test_a_worker_serves_only_the_models_it_may():
    only_b = Member("s1", ("b",), places=8, serving="b")
    assert POLICY.assign(_demands(80, 0), [only_b], NOW_S) == {"s1": "b"}
    unknown = Member("s1", ("c",), places=8, serving=None)
    assert POLICY.assign(_demands(80, 0), [unknown], NOW_S) == {}


def test_a_model_this_worker_never_loaded_is_weighed_by_others_loads_of_it():
    # 16 waiting, starting 4 a second (4 s of backlog); no load of a measured here.
    never_loaded = _member("b")
    slow = {"a": ModelDemand("a", 16, 8, 4.0, load_s=10.0), "b": ModelDemand("b", 0, 8, 1.0)}
    assert POLICY.assign(slow, [never_loaded], NOW_S) == {"s1": "b"}
    fast = {"a": ModelDemand("a", 16, 8, 4.0, load_s=1.0), "b": ModelDemand("b", 0, 8, 1.0)}
    assert POLICY.assign(fast, [never_loaded], NOW_S) == {"s1": "a"}
