"""Alembic's entry point: migrate the connection `shared.db.upgrade` hands over, or the URL
in the config (the `alembic` command line, for writing new revisions)."""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine
from sqlmodel import SQLModel

from shared import tables  # noqa: F401  (registers the tables on SQLModel.metadata)

config = context.config
target_metadata = SQLModel.metadata


def _migrate(connection) -> None:
    # SQLite cannot ALTER most constraints in place; batch mode rebuilds the table instead.
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
    )
    with context.begin_transaction():
        context.run_migrations()


connection = config.attributes.get("connection")
if connection is not None:
    _migrate(connection)
else:
    url = config.get_main_option("sqlalchemy.url")
    if url is None:
        raise RuntimeError("alembic: no connection handed over and no sqlalchemy.url configured")
    engine = create_engine(url)
    with engine.connect() as conn:
        _migrate(conn)
    engine.dispose()
