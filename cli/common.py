"""What the `llmfleet` administration commands share: the database and plain tables."""

from __future__ import annotations

import typer

from shared.settings import get_settings


def db():
    from shared.db import create_schema, make_engine

    engine = make_engine(get_settings())
    create_schema(engine)
    return engine


def print_table(header: list[str], rows: list[list]) -> None:
    cells = [header, *[["-" if v is None else str(v) for v in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    for row in cells:
        typer.echo("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip())


def tenant_id_of(engine, name: str) -> str:
    from shared import tenants

    tenant = tenants.get_tenant_by_name(engine, name)
    if tenant is None:
        raise typer.BadParameter(f"no tenant {name!r}")
    return tenant.id


def when(moment) -> str | None:
    return None if moment is None else moment.strftime("%Y-%m-%dT%H:%M:%SZ")  # stored in UTC
