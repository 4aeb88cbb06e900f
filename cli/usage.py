"""`llmfleet usage ...`: usage reports and the ledger's tamper checks."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from cli.common import db, print_table, tenant_id_of
from shared.settings import get_settings

usage_app = typer.Typer(help="The usage ledger: reports and tamper checks.", no_args_is_help=True)


@usage_app.command("report")
def usage_report(
    start: Annotated[str | None, typer.Option(help="First day, YYYY-MM-DD (UTC).")] = None,
    end: Annotated[str | None, typer.Option(help="Last day, included; default today.")] = None,
) -> None:
    """Usage of all tenants per model and day (by finish time, UTC); default the last 30 days."""
    from datetime import UTC, date, datetime, timedelta

    from shared import tenants, usage

    last = date.fromisoformat(end) if end else datetime.now(UTC).date()
    first = date.fromisoformat(start) if start else last - timedelta(days=29)
    engine = db()
    names = {t.id: t.name for t in tenants.list_tenants(engine)}
    rows = [_usage_row(names, total) for total in usage.totals(engine, first, last)]
    header = ["TENANT", "MODEL", "DAY", "REQUESTS", "INPUT", "OUTPUT", "COMPUTED"]
    print_table(header, rows)


def _usage_row(names: dict[str, str], total) -> list:
    tenant = names.get(total.tenant_id, total.tenant_id)
    counts = [total.num_requests, total.input_tokens, total.output_tokens, total.computed_tokens]
    return [tenant, f"{total.model_id} v{total.version}", total.day, *counts]


@usage_app.command("verify")
def usage_verify(
    tenant: Annotated[str | None, typer.Option(help="Only this tenant's chain (by name).")] = None,
    heads: Annotated[
        list[Path] | None, typer.Option(help="Exported head files to check against, too.")
    ] = None,
) -> None:
    """Check every usage chain: prints OK, or the first record edited, deleted, inserted or
    reordered in each chain (and chains rewritten since a head export); exits 1 then."""
    from control import ledger

    engine = db()
    tenant_id = tenant_id_of(engine, tenant) if tenant else None
    exports = [ledger.read_export_file(path) for path in heads or []]
    problems = ledger.verify(engine, get_settings().ledger_key, tenant_id, exports)
    for problem in problems:
        typer.echo(str(problem))
    if problems:
        raise typer.Exit(1)
    typer.echo("OK")


@usage_app.command("export-heads")
def usage_export_heads() -> None:
    """Sign and store every chain's head now (the control process does it periodically)."""
    from control import ledger

    settings = get_settings()
    export = ledger.export_heads(db(), settings.ledger_key, settings.ledger_heads_dir)
    typer.echo(f"heads exported: {settings.ledger_heads_dir / f'heads-{export.id:08d}.json'}")
