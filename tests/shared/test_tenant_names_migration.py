"""The migration that makes tenant names one name whatever their case names the clashes it finds."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from alembic import command
from sqlalchemy import create_engine, text

from shared.db import alembic_config, create_schema


def test_the_case_index_migration_names_the_clashes_it_finds(tmp_path):
    engine = create_engine(f"sqlite:///{tmp_path / 'old.db'}")
    with engine.begin() as connection:
        config = alembic_config(engine)
        config.attributes["connection"] = connection
        command.upgrade(config, "0001")
        for i, name in enumerate(["Dup", "dup", "unique"]):
            connection.execute(
                text(
                    "INSERT INTO tenant (id, name, tier, weight, is_disabled, created_at,"
                    " updated_at) VALUES (:id, :name, 1, 1, 0, :now, :now)"
                ),
                {"id": f"ten_{i}", "name": name, "now": datetime.now(UTC)},
            )
    with pytest.raises(RuntimeError, match=r"differ only in case.*: dup$"):
        create_schema(engine)
    engine.dispose()
