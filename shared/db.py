"""The SQL engine: SQLite under the home directory by default, PostgreSQL (psycopg) via
DATABASE_URL; the schema comes from the alembic migrations in `shared/migrations/`."""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import event
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.exc import DBAPIError
from sqlmodel import Session, create_engine

from shared import tables  # noqa: F401  (registers the tables on SQLModel.metadata)
from shared.private_files import make_private_dir, touch_private
from shared.settings import Settings


def make_engine(settings: Settings) -> Engine:
    url = settings.database_url
    if url.startswith("sqlite"):
        make_private_dir(settings.home)
        if (path := make_url(url).database) and path != ":memory:":
            # SQLite creates the file 0644; its -wal and -shm files take the file's mode.
            touch_private(Path(path))
        timeout_s = settings.db_busy_timeout_s
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": timeout_s})
        event.listen(engine, "connect", functools.partial(_sqlite_pragmas, timeout_s=timeout_s))
        return engine
    return create_engine(url, pool_pre_ping=True)


def _sqlite_pragmas(dbapi_connection, _record, *, timeout_s: float) -> None:
    # WAL lets the API read while a worker writes usage; busy_timeout makes writers queue.
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute(f"PRAGMA busy_timeout={int(timeout_s * 1000)}")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()


MIGRATIONS_DIR = Path(__file__).parent / "migrations"


def alembic_config(engine: Engine) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    # configparser reads `%` as interpolation: a password may hold one.
    url = engine.url.render_as_string(hide_password=False).replace("%", "%%")
    config.set_main_option("sqlalchemy.url", url)
    return config


def create_schema(engine: Engine) -> None:
    """Upgrade the schema to the newest migration (`shared/migrations/versions`). Processes
    that start together may race here (both see an old version, one loses on a table or
    version row the other created); the loser retries and finds nothing left to do."""
    for attempt in range(5):
        try:
            with engine.begin() as connection:
                config = alembic_config(engine)
                config.attributes["connection"] = connection
                command.upgrade(config, "head")
            return
        except DBAPIError:
            if attempt == 4:
                raise
            time.sleep(0.2 * (attempt + 1))


@contextmanager
def session_scope(engine: Engine) -> Iterator[Session]:
    with Session(engine, expire_on_commit=False) as session:
        yield session
