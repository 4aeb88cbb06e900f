"""Model deployments: which model ids the platform serves, at which versions, from which weights.

Each row is one version of a model (`ModelDeployment`). A model's first version is its stable
one; a later version takes traffic only through a rollout (`shared/rollouts.py`), or when a
client pins it (`model@version`).
"""

from __future__ import annotations

from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from shared import model_source
from shared.db import session_scope
from shared.keys import VERSION_SEPARATOR
from shared.tables import ModelDeployment


class InvalidName(ValueError):
    """A model id or version that cannot name a deployment."""


def register(engine: Engine, model_id: str, source: str, version: str = "1") -> ModelDeployment:
    """Add a deployment (or return the existing one for this model id and version). The
    model's first version becomes its stable version."""
    _check_name(model_id, "model id")
    _check_name(version, "version")
    existing = get_version(engine, model_id, version)
    if existing is not None:
        return existing
    resolved = model_source.resolve(source)
    with session_scope(engine) as session:
        deployment = ModelDeployment(
            model_id=model_id,
            version=version,
            source=source,
            max_context_tokens=model_source.max_context_tokens(resolved),
            is_stable=not _has_stable(session, model_id),
        )
        session.add(deployment)
        session.commit()
        return deployment


def _check_name(value: str, what: str) -> None:
    # `@` separates a model from its version (`model@version`); `:` separates the parts of
    # a Redis key.
    if not value or VERSION_SEPARATOR in value or ":" in value or not value.isprintable():
        raise InvalidName(f"a {what} must be non-empty, printable, without `@` or `:`")


def ensure_default(engine: Engine) -> ModelDeployment:
    return register(engine, model_source.DEFAULT_MODEL_ID, model_source.DEFAULT_MODEL_ID)


def get_version(engine: Engine, model_id: str, version: str) -> ModelDeployment | None:
    with session_scope(engine) as session:
        return session.exec(
            select(ModelDeployment).where(
                ModelDeployment.model_id == model_id, ModelDeployment.version == version
            )
        ).first()


def get_by_id(engine: Engine, deployment_id: int) -> ModelDeployment | None:
    with session_scope(engine) as session:
        return session.get(ModelDeployment, deployment_id)


def get_stable(engine: Engine, model_id: str) -> ModelDeployment | None:
    """The version that serves `model_id` outside a rollout."""
    versions = list_versions(engine, model_id)
    return stable_among(versions) if versions else None


def stable_among(versions: list[ModelDeployment]) -> ModelDeployment:
    """Of a model's active versions, the one marked stable; failing that (it was
    deactivated), the newest, as before versions had roles."""
    return max(versions, key=lambda d: (d.is_stable, d.id or 0))


def _has_stable(session: Session, model_id: str) -> bool:
    return (
        session.exec(
            select(ModelDeployment.id).where(
                ModelDeployment.model_id == model_id, col(ModelDeployment.is_stable)
            )
        ).first()
        is not None
    )


def list_versions(engine: Engine, model_id: str) -> list[ModelDeployment]:
    """Every active version of `model_id`, oldest first."""
    with session_scope(engine) as session:
        return list(
            session.exec(
                select(ModelDeployment)
                .where(ModelDeployment.model_id == model_id, ModelDeployment.is_active)
                .order_by(col(ModelDeployment.id))
            )
        )


def list_active(engine: Engine) -> list[ModelDeployment]:
    with session_scope(engine) as session:
        return list(
            session.exec(
                select(ModelDeployment)
                .where(ModelDeployment.is_active)
                .order_by(ModelDeployment.model_id, col(ModelDeployment.id))
            )
        )
