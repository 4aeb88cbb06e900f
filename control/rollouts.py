"""The rollout loop: every second (a cron job of the control process, `control/jobs.py`), each
running rollout's canary is judged against its stable version (`shared/canary_health.py`),
over the samples since the rollout started, at most the last `rollout_window_s`:

- unhealthy: rolled back to 0% at once, the cause and figures recorded (`rollout status`,
  the log, `llmfleet_rollout_rollbacks_total` and its alert);
- healthy, with a step due (`interval_s` after the last change) and a step size: its share
  grows by `step_percent`; reaching 100% promotes it (it becomes the stable version);
- undecided (too few samples), or nothing due: nothing changes.

Stateless: each tick derives everything from SQL (the rollout) and Redis (the samples), so a
restarted or second control process carries on where the last one was; `shared/rollouts.py`
makes each change a conditional update, so two never both act.
"""

from __future__ import annotations

import asyncio
import logging
from datetime import UTC, datetime

import redis.asyncio as aioredis
from sqlalchemy.engine import Engine

from shared import canary_health, rollouts
from shared.canary_health import Margins, Verdict
from shared.tables import ModelDeployment, Rollout

log = logging.getLogger("llmfleet.control")


async def advance_all(redis: aioredis.Redis, engine: Engine, margins: Margins) -> None:
    """One tick of the loop over every running rollout."""
    for rollout in await asyncio.to_thread(rollouts.list_running, engine):
        try:
            await advance(redis, engine, margins, rollout)
        except Exception:
            # One rollout's trouble (a version deleted under it) must not stop the others'.
            log.exception("could not advance the rollout of %s", rollout.model_id)


async def advance(
    redis: aioredis.Redis, engine: Engine, margins: Margins, rollout: Rollout
) -> Rollout | None:
    """Judge one rollout and act on the verdict; the rollout as it is now (None: unchanged)."""
    canary, stable = await asyncio.to_thread(rollouts.deployments_of, engine, rollout)
    assessment = await canary_health.assess(redis, margins, rollout, canary, stable)
    judgement = assessment.judgement
    if judgement.verdict is Verdict.UNHEALTHY:
        assert judgement.cause is not None
        ended = await asyncio.to_thread(
            rollouts.roll_back, engine, rollout, judgement.cause, judgement.reason
        )
        if ended is not None:
            log.warning(
                "rollout of %s rolled back: %s",
                canary.name,
                judgement.reason,
                extra={"model": rollout.model_id, "version": canary.version},
            )
        return ended
    now = datetime.now(UTC)
    if judgement.verdict is not Verdict.HEALTHY or rollout.step_percent <= 0:
        return None
    if now < rollouts.due_at(rollout):
        return None
    return await asyncio.to_thread(_step, engine, rollout, canary)


def _step(engine: Engine, rollout: Rollout, canary: ModelDeployment) -> Rollout | None:
    to_percent = min(100.0, rollout.percent + rollout.step_percent)
    if to_percent >= 100.0:
        promoted = rollouts.promote_rollout(engine, rollout, "promoted after its last step")
        if promoted is not None:
            log.info("rollout of %s promoted: it is the stable version now", canary.name)
        return promoted
    stepped = rollouts.step(engine, rollout, to_percent)
    if stepped is not None:
        log.info("rollout of %s stepped to %g%%", canary.name, to_percent)
    return stepped
