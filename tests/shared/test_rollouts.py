"""Rollouts in SQL: what may start, each change made once, promotion moving the stable version."""

from __future__ import annotations

import uuid

import pytest
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session

from shared import deployments, rollouts
from shared.rollouts import Conflict, NotFound, RolloutError, RolloutState
from shared.tables import Rollout


@pytest.fixture
def model(db, tiny_model_dir):
    """A model with versions 1 (stable) and 2."""
    model_id = f"rollout-{uuid.uuid4().hex[:6]}"
    for version in ("1", "2"):
        deployments.register(db, model_id, str(tiny_model_dir), version=version)
    return model_id


def test_a_rollout_starts_once_and_only_for_a_version_that_is_not_stable(db, model):
    with pytest.raises(NotFound, match="no version `9`"):
        rollouts.start(db, model, "9", 10)
    with pytest.raises(NotFound, match="does not exist"):
        rollouts.start(db, "no-such-model", "2", 10)
    with pytest.raises(Conflict, match="stable version already"):
        rollouts.start(db, model, "1", 10)
    for bad in [{"percent": 0}, {"percent": 101}, {"percent": float("nan")}]:
        with pytest.raises(RolloutError) as refused:
            rollouts.start(db, model, "2", **bad)
        assert refused.value.status_code == 400 and refused.value.param == "percent"
    with pytest.raises(RolloutError, match="sticky"):
        rollouts.start(db, model, "2", 10, sticky="cookie")
    started = rollouts.start(db, model, "2", 10, step_percent=20, interval_s=5, sticky="user")
    assert (started.state, started.percent, started.sticky) == ("running", 10, "user")
    with pytest.raises(Conflict, match="is running"):
        rollouts.start(db, model, "2", 10)
    assert rollouts.running(db, model).id == started.id


def test_each_change_applies_to_a_running_rollout_once(db, model):
    started = rollouts.start(db, model, "2", 10, step_percent=40)
    stepped = rollouts.step(db, started, 50)
    assert stepped is not None and stepped.percent == 50
    assert rollouts.step(db, started, 50) is None  # from 10: it is not at 10 any more
    rolled_back = rollouts.roll_back(db, stepped, "ttft_p99", "ttft_p99 900 ms vs 100 ms")
    assert (rolled_back.state, rolled_back.percent) == (RolloutState.ROLLED_BACK, 0)
    assert rolled_back.reason == "ttft_p99 900 ms vs 100 ms" and rolled_back.finished_at
    assert rollouts.roll_back(db, stepped, "itl_p99", "again") is None
    with pytest.raises(Conflict, match="nothing to abort"):
        rollouts.abort(db, model)
    with pytest.raises(Conflict, match="nothing to promote"):
        rollouts.promote(db, model)
    assert rollouts.rollback_counts(db)[(model, "ttft_p99")] == 1
    # The stable version never moved.
    assert deployments.get_stable(db, model).version == "1"


def test_promotion_makes_the_canary_stable_and_keeps_the_old_version(db, model):
    rollouts.start(db, model, "2", 10)
    promoted = rollouts.promote(db, model)
    assert (promoted.state, promoted.percent) == (RolloutState.PROMOTED, 100)
    assert deployments.get_stable(db, model).version == "2"
    assert [d.version for d in deployments.list_versions(db, model)] == ["1", "2"]
    # Back again: version 1 is the canary now.
    rollouts.start(db, model, "1", 5)
    aborted = rollouts.abort(db, model)
    assert (aborted.state, aborted.percent) == (RolloutState.ABORTED, 0)
    assert deployments.get_stable(db, model).version == "2"
    assert [r.state for r in rollouts.latest_per_model(db) if r.model_id == model] == ["aborted"]


def test_the_database_holds_one_running_rollout_per_model(db, model):
    # Two starts racing both passed the check; the index lets one insert.
    first = rollouts.start(db, model, "2", 10)
    with Session(db) as session:
        session.add(Rollout(**first.model_dump(exclude={"id"})))
        with pytest.raises(IntegrityError):
            session.commit()
