"""The rollout loop over real SQL and Redis: the samples workers push decide each step."""

from __future__ import annotations

import logging
import time
import uuid
from datetime import timedelta

import pytest
from sqlmodel import Session

from control.rollouts import advance, advance_all
from shared import deployments, latency_window, rollouts
from shared.canary_health import Margins
from shared.latency_window import Sample
from shared.tables import Rollout

MARGINS = Margins(
    max_ttft_p99_ratio=1.5,
    max_itl_p99_ratio=1.5,
    min_excess_s=0.025,
    max_error_rate_increase=0.02,
    min_num_samples=20,
    window_s=60.0,
)


@pytest.fixture
def model(db, tiny_model_dir):
    """A model with versions 1 (stable) and 2."""
    model_id = f"loop-{uuid.uuid4().hex[:6]}"
    for version in ("1", "2"):
        deployments.register(db, model_id, str(tiny_model_dir), version=version)
    return model_id


async def _served(aredis, name: str, ttft_s: float, *, n: int = 30, failed: int = 0) -> None:
    """`n` requests ended on version `name`, as its workers push them."""
    now = time.time()
    await latency_window.push(aredis, name, "ttft", [Sample(now, ttft_s)] * n)
    await latency_window.push(aredis, name, "itl", [Sample(now, 0.02)] * (4 * n))
    outcomes = [Sample(now, 1.0)] * failed + [Sample(now, 0.0)] * (n - failed)
    await latency_window.push(aredis, name, "failed", outcomes)


def _due_now(db, rollout: Rollout) -> Rollout:
    """Pretend its interval has passed."""
    with Session(db) as session:
        row = session.get(Rollout, rollout.id)
        row.stepped_at = row.stepped_at - timedelta(seconds=row.interval_s + 1)
        session.add(row)
        session.commit()
        session.refresh(row)
        return row


async def test_a_canary_three_times_slower_is_rolled_back_and_says_why(db, aredis, model, caplog):
    rollout = rollouts.start(db, model, "2", 10, step_percent=10)
    await _served(aredis, f"{model}@1", 0.1)
    await _served(aredis, f"{model}@2", 0.3)
    with caplog.at_level(logging.WARNING, logger="llmfleet.control"):
        await advance_all(aredis, db, MARGINS)
    ended = rollouts.latest(db, model)
    assert (ended.id, ended.state, ended.percent, ended.cause) == (
        rollout.id, "rolled_back", 0, "ttft_p99"
    )  # fmt: skip
    assert "300.0 ms vs stable 100.0 ms (3.00x" in ended.reason
    assert f"rollout of {model}@2 rolled back" in caplog.text
    assert deployments.get_stable(db, model).version == "1"


async def test_a_healthy_canary_steps_when_due_and_is_promoted_at_one_hundred(db, aredis, model):
    rollout = rollouts.start(db, model, "2", 30, step_percent=40, interval_s=60)
    await _served(aredis, f"{model}@1", 0.1)
    await _served(aredis, f"{model}@2", 0.11)
    assert await advance(aredis, db, MARGINS, rollout) is None  # healthy, not due yet
    stepped = await advance(aredis, db, MARGINS, _due_now(db, rollout))
    assert (stepped.state, stepped.percent) == ("running", 70)
    promoted = await advance(aredis, db, MARGINS, _due_now(db, stepped))
    assert (promoted.state, promoted.percent) == ("promoted", 100)
    assert deployments.get_stable(db, model).version == "2"


async def test_without_enough_samples_nothing_moves(db, aredis, model):
    rollout = _due_now(db, rollouts.start(db, model, "2", 10, step_percent=10))
    await _served(aredis, f"{model}@1", 0.1)
    await _served(aredis, f"{model}@2", 0.9, n=19)  # bad, but too few to tell
    assert await advance(aredis, db, MARGINS, rollout) is None
    assert rollouts.running(db, model).percent == 10


async def test_samples_from_before_the_rollout_do_not_count(db, aredis, model):
    # The same version was bad in an earlier rollout, rolled back a moment ago.
    await _served(aredis, f"{model}@1", 0.1)
    await _served(aredis, f"{model}@2", 0.9)
    time.sleep(1.1)
    rollout = rollouts.start(db, model, "2", 10)
    await _served(aredis, f"{model}@1", 0.1)
    await _served(aredis, f"{model}@2", 0.1)
    assert await advance(aredis, db, MARGINS, rollout) is None
    assert rollouts.running(db, model) is not None
