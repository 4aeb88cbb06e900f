"""Canary rollouts in SQL: start, step, promote, roll back, abort; the one place they change.

A rollout gives a model's new version (the canary) `percent` of the model's requests, beside
its stable version. The control process's loop (`control/rollouts.py`) adds `step_percent`
every `interval_s` while the canary is healthy, promotes it when that reaches 100 (the
canary becomes the stable version; the old one stays registered), and rolls it back to 0
when it is worse than stable. An operator may promote or abort it at any time
(`llmfleet rollout`, `/admin/v1/models/{model}/rollout`).

Every change is one conditional UPDATE (`WHERE state = 'running'`, and for a step the
percent it started from), so two control processes, or the loop and an operator, cannot
both act on one rollout: the second finds nothing to update and gets a conflict. Its
state lives only here, so it survives any restart; the API reads it through
`api/router.py`.
"""

from __future__ import annotations

import math
from collections import Counter
from datetime import UTC, datetime, timedelta
from enum import StrEnum

from sqlalchemy import update
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, col, select

from shared import deployments
from shared.db import session_scope
from shared.routing import STICKY_MODES
from shared.tables import ModelDeployment, Rollout, utcnow


class RolloutState(StrEnum):
    RUNNING = "running"
    PROMOTED = "promoted"  # the canary is the stable version now
    ROLLED_BACK = "rolled_back"  # the loop found the canary worse than stable
    ABORTED = "aborted"  # an operator stopped it


class RolloutError(Exception):
    """A command that cannot be carried out, with its HTTP status and error code."""

    status_code = 400
    code = "invalid_value"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class NotFound(RolloutError):
    status_code = 404
    code = "model_not_found"


class Conflict(RolloutError):
    status_code = 409
    code = "rollout_conflict"


def start(
    engine: Engine,
    model_id: str,
    version: str,
    percent: float,
    *,
    step_percent: float = 0.0,
    interval_s: float = 60.0,
    sticky: str = "none",
    min_num_samples: int | None = None,
) -> Rollout:
    """Start rolling `version` out: `percent` of the model's requests at once, `step_percent`
    more every `interval_s` while it is healthy (0: held there until promoted); judged once
    each version has `min_num_samples` requests in the window (None: the setting)."""
    _check_numbers(percent, step_percent, interval_s)
    if min_num_samples is not None and not 1 <= min_num_samples <= 1_000_000:
        raise RolloutError("min_num_samples must be from 1 to 1000000.", param="min_num_samples")
    if sticky not in STICKY_MODES:
        raise RolloutError(f"sticky must be one of {', '.join(STICKY_MODES)}.", param="sticky")
    versions = deployments.list_versions(engine, model_id)
    with session_scope(engine) as session:
        if not versions:
            raise NotFound(f"The model `{model_id}` does not exist.", param="model")
        canary = next((d for d in versions if d.version == version), None)
        if canary is None:
            raise NotFound(f"The model `{model_id}` has no version `{version}`.", param="version")
        stable = deployments.stable_among(versions)
        if canary.id == stable.id:
            raise Conflict(f"`{canary.name}` is the stable version already.", param="version")
        if (running := _running(session, model_id)) is not None:
            raise Conflict(
                f"A rollout of `{model_id}` is running (version "
                f"{_version_of(session, running.canary_deployment_id)}); promote or abort it "
                "first."
            )
        now = utcnow()
        rollout = Rollout(
            model_id=model_id,
            stable_deployment_id=stable.id or 0,
            canary_deployment_id=canary.id or 0,
            percent=percent,
            step_percent=step_percent,
            interval_s=interval_s,
            sticky=sticky,
            min_num_samples=min_num_samples,
            state=RolloutState.RUNNING,
            started_at=now,
            stepped_at=now,
        )
        session.add(rollout)
        try:
            session.commit()
        except IntegrityError:
            # Another start got in between the check above and this insert (the index
            # allows one running rollout per model).
            message = f"A rollout of `{model_id}` is running; promote or abort it first."
            raise Conflict(message) from None
        return rollout


def _check_numbers(percent: float, step_percent: float, interval_s: float) -> None:
    if not (math.isfinite(percent) and 0 < percent <= 100):
        raise RolloutError("percent must be above 0 and at most 100.", param="percent")
    if not (math.isfinite(step_percent) and 0 <= step_percent <= 100):
        raise RolloutError("step must be from 0 to 100.", param="step_percent")
    if not (math.isfinite(interval_s) and 1 <= interval_s <= 86_400):
        raise RolloutError("interval must be from 1 to 86400 seconds.", param="interval_s")


def step(engine: Engine, rollout: Rollout, to_percent: float) -> Rollout | None:
    """Move a running rollout from its percent to `to_percent`; None if it changed meanwhile."""
    values = {"percent": to_percent, "stepped_at": utcnow()}
    return _update(engine, rollout, values, {"percent": rollout.percent})


def roll_back(engine: Engine, rollout: Rollout, cause: str, reason: str) -> Rollout | None:
    """End a running rollout at 0%, saying why; None if it had ended meanwhile."""
    return _end(engine, rollout, RolloutState.ROLLED_BACK, reason, cause=cause)


def abort(engine: Engine, model_id: str) -> Rollout:
    """An operator's stop: the canary gets no more requests; stable is unchanged."""
    rollout = _running_or_conflict(engine, model_id, "abort")
    ended = _end(engine, rollout, RolloutState.ABORTED, "aborted by an operator")
    if ended is None:
        raise Conflict(f"The rollout of `{model_id}` ended meanwhile.")
    return ended


def promote(engine: Engine, model_id: str, reason: str = "promoted by an operator") -> Rollout:
    """Make the canary the stable version (the rollout ends at 100%)."""
    rollout = _running_or_conflict(engine, model_id, "promote")
    promoted = promote_rollout(engine, rollout, reason)
    if promoted is None:
        raise Conflict(f"The rollout of `{model_id}` ended meanwhile.")
    return promoted


def promote_rollout(engine: Engine, rollout: Rollout, reason: str) -> Rollout | None:
    """The canary becomes the model's stable version and the old one keeps its registration,
    in one transaction with the rollout's end; None if it had ended meanwhile."""
    with session_scope(engine) as session:
        if not _ended(session, rollout, RolloutState.PROMOTED, reason, None, percent=100.0):
            session.rollback()
            return None
        session.exec(
            update(ModelDeployment)
            .where(col(ModelDeployment.model_id) == rollout.model_id)
            .values(is_stable=col(ModelDeployment.id) == rollout.canary_deployment_id)
        )
        session.commit()
        return session.get(Rollout, rollout.id)


def _running_or_conflict(engine: Engine, model_id: str, what: str) -> Rollout:
    rollout = running(engine, model_id)
    if rollout is None:
        if latest(engine, model_id) is None and not deployments.list_versions(engine, model_id):
            raise NotFound(f"The model `{model_id}` does not exist.", param="model")
        raise Conflict(f"No rollout of `{model_id}` is running: nothing to {what}.")
    return rollout


def _end(
    engine: Engine, rollout: Rollout, state: RolloutState, reason: str, cause: str | None = None
) -> Rollout | None:
    with session_scope(engine) as session:
        if not _ended(session, rollout, state, reason, cause, percent=0.0):
            return None
        session.commit()
        return session.get(Rollout, rollout.id)


def _ended(
    session: Session,
    rollout: Rollout,
    state: RolloutState,
    reason: str,
    cause: str | None,
    *,
    percent: float,
) -> bool:
    now = utcnow()
    values = {
        "state": state,
        "percent": percent,
        "reason": reason,
        "cause": cause,
        "stepped_at": now,
        "finished_at": now,
    }
    return _conditional(session, rollout, values, {})


def _update(engine: Engine, rollout: Rollout, values: dict, expected: dict) -> Rollout | None:
    with session_scope(engine) as session:
        if not _conditional(session, rollout, values, expected):
            return None
        session.commit()
        return session.get(Rollout, rollout.id)


def _conditional(session: Session, rollout: Rollout, values: dict, expected: dict) -> bool:
    """UPDATE the rollout if it is still running (and holds `expected`): whether it did."""
    query = update(Rollout).where(
        col(Rollout.id) == rollout.id, col(Rollout.state) == RolloutState.RUNNING
    )
    for name, value in expected.items():
        query = query.where(getattr(Rollout, name) == value)
    return bool(session.exec(query.values(**values)).rowcount)


def deployments_of(engine: Engine, rollout: Rollout) -> tuple[ModelDeployment, ModelDeployment]:
    """The rollout's (canary, stable) deployments."""
    with session_scope(engine) as session:
        canary = session.get(ModelDeployment, rollout.canary_deployment_id)
        stable = session.get(ModelDeployment, rollout.stable_deployment_id)
    if canary is None or stable is None:
        raise LookupError(f"a deployment of rollout {rollout.id} is gone")
    return canary, stable


def running(engine: Engine, model_id: str) -> Rollout | None:
    with session_scope(engine) as session:
        return _running(session, model_id)


def _running(session: Session, model_id: str) -> Rollout | None:
    return session.exec(
        select(Rollout).where(Rollout.model_id == model_id, Rollout.state == RolloutState.RUNNING)
    ).first()


def list_running(engine: Engine) -> list[Rollout]:
    with session_scope(engine) as session:
        return list(session.exec(select(Rollout).where(Rollout.state == RolloutState.RUNNING)))


def latest(engine: Engine, model_id: str) -> Rollout | None:
    """The model's most recent rollout, whatever its state."""
    with session_scope(engine) as session:
        return session.exec(
            select(Rollout).where(Rollout.model_id == model_id).order_by(col(Rollout.id).desc())
        ).first()


def latest_per_model(engine: Engine) -> list[Rollout]:
    """Each model's most recent rollout, by model id."""
    with session_scope(engine) as session:
        rows = session.exec(select(Rollout).order_by(col(Rollout.id)))
        by_model = {r.model_id: r for r in rows}
    return [by_model[m] for m in sorted(by_model)]


def rollback_counts(engine: Engine) -> Counter[tuple[str, str]]:
    """(model id, cause) -> rollouts rolled back, over all time: a counter that survives any
    restart (exported as `llmfleet_rollout_rollbacks_total`)."""
    with session_scope(engine) as session:
        rows = session.exec(
            select(Rollout.model_id, Rollout.cause).where(Rollout.state == RolloutState.ROLLED_BACK)
        )
        return Counter((model_id, cause or "") for model_id, cause in rows)


def due_at(rollout: Rollout) -> datetime:
    """When the rollout's next step is due."""
    return aware(rollout.stepped_at) + timedelta(seconds=rollout.interval_s)


def aware(moment: datetime) -> datetime:
    # SQLite gives back naive datetimes; every one stored here is UTC (`tables.utcnow`).
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


def _version_of(session: Session, deployment_id: int) -> str:
    deployment = session.get(ModelDeployment, deployment_id)
    return deployment.version if deployment is not None else "?"
