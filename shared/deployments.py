"""Model deployments: which model ids the platform serves, at which version, from which weights."""

from __future__ import annotations

from sqlalchemy.engine import Engine
from sqlmodel import col, select

from shared import model_source
from shared.db import session_scope
from shared.tables import ModelDeployment


def register(engine: Engine, model_id: str, source: str, version: str = "1") -> ModelDeployment:
    """Add a deployment (or return the existing one for this model id and version)."""
    existing = get_version(engine, model_id, version)
    if existing is not None:
        return existing
    resolved = model_source.resolve(source)
    deployment = ModelDeployment(
        model_id=model_id,
        version=version,
        source=source,
        max_context_tokens=model_source.max_context_tokens(resolved),
    )
    with session_scope(engine) as session:
        session.add(deployment)
        session.commit()
        return deployment


def ensure_default(engine: Engine) -> ModelDeployment:
    return register(engine, model_source.DEFAULT_MODEL_ID, model_source.DEFAULT_MODEL_ID)


def get_version(engine: Engine, model_id: str, version: str) -> ModelDeployment | None:
    with session_scope(engine) as session:
        return session.exec(
            select(ModelDeployment).where(
                ModelDeployment.model_id == model_id, ModelDeployment.version == version
            )
        ).first()


def get_active(engine: Engine, model_id: str) -> ModelDeployment | None:
    """The deployment that serves `model_id` (the newest active version)."""
    with session_scope(engine) as session:
        return session.exec(
            select(ModelDeployment)
            .where(ModelDeployment.model_id == model_id, ModelDeployment.is_active)
            .order_by(col(ModelDeployment.id).desc())
        ).first()


def list_active(engine: Engine) -> list[ModelDeployment]:
    with session_scope(engine) as session:
        return list(
            session.exec(
                select(ModelDeployment)
                .where(ModelDeployment.is_active)
                .order_by(ModelDeployment.model_id, col(ModelDeployment.id))
            )
        )
