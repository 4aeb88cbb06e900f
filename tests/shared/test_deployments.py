"""Model versions in SQL: the first is stable, later ones wait for a rollout; names are checked;
the migration that introduced the stable version keeps the old routing."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import pytest
from alembic import command
from sqlalchemy import create_engine, text
from sqlmodel import Session

from shared import deployments
from shared.db import alembic_config, create_schema
from shared.tables import ModelDeployment


def test_the_first_version_is_stable_and_a_later_one_is_not(db, tiny_model_dir):
    model_id = f"versions-{uuid.uuid4().hex[:6]}"
    first = deployments.register(db, model_id, str(tiny_model_dir))
    second = deployments.register(db, model_id, str(tiny_model_dir), version="2")
    assert first.is_stable and not second.is_stable
    assert deployments.get_stable(db, model_id).id == first.id
    assert [d.version for d in deployments.list_versions(db, model_id)] == ["1", "2"]
    # Its stable version deactivated, the model falls back to its newest active one.
    with Session(db) as session:
        row = session.get(ModelDeployment, first.id)
        row.is_active = False
        session.add(row)
        session.commit()
    assert deployments.get_stable(db, model_id).id == second.id


@pytest.mark.parametrize(
    ("model_id", "version"), [("a@b", "1"), ("m", "2@x"), ("m:x", "1"), ("", "1")]
)
def test_a_name_that_cannot_name_a_deployment_is_refused(db, tiny_model_dir, model_id, version):
    with pytest.raises(deployments.InvalidName):
        deployments.register(db, model_id, str(tiny_model_dir), version=version)


def test_the_migration_makes_each_models_newest_active_version_stable(tmp_path):
    engine = create_engine(f"sqlite:///{tmp_path / 'old.db'}")
    rows = [("a", "1", 1), ("a", "2", 1), ("a", "3", 0), ("b", "1", 1)]
    with engine.begin() as connection:
        config = alembic_config(engine)
        config.attributes["connection"] = connection
        command.upgrade(config, "0002")
        for model_id, version, is_active in rows:
            connection.execute(
                text(
                    "INSERT INTO modeldeployment (model_id, version, source, max_context_tokens,"
                    " is_active, created_at) VALUES (:m, :v, 'x', 8, :a, :now)"
                ),
                {"m": model_id, "v": version, "a": is_active, "now": datetime.now(UTC)},
            )
    create_schema(engine)
    with engine.connect() as connection:
        stable = connection.execute(
            text("SELECT model_id, version FROM modeldeployment WHERE is_stable ORDER BY model_id")
        ).all()
    assert [tuple(row) for row in stable] == [("a", "2"), ("b", "1")]
    engine.dispose()
