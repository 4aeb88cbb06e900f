"""`llmfleet tenant ...` and `llmfleet key ...`: tenants, their limits and their API keys."""

from __future__ import annotations

from typing import Annotated

import typer

from cli.common import db, print_table, tenant_id_of, when
from shared.settings import get_settings

tenant_app = typer.Typer(help="Tenants and their API keys.", no_args_is_help=True)
key_app = typer.Typer(help="API keys of tenants.", no_args_is_help=True)


# Limit options, shared by `tenant create` and `tenant update`. 0 means unlimited.
MaxInFlight = Annotated[
    int | None,
    typer.Option("--max-in-flight", min=0, help="Requests admitted, not finished; 0 = unlimited."),
]
MaxQueued = Annotated[
    int | None,
    typer.Option("--max-queued", min=0, help="Requests waiting for a worker; 0 = unlimited."),
]
TokensPerMinute = Annotated[
    int | None,
    typer.Option("--tpm", min=0, help="Tokens per minute (prompt + max_tokens); 0 = unlimited."),
]
RequestsPerMinute = Annotated[
    int | None, typer.Option("--rpm", min=0, help="Requests per minute; 0 = unlimited.")
]
MaxTokensPerRequest = Annotated[
    int | None,
    typer.Option("--max-tokens-per-request", min=0, help="Cap on max_tokens; 0 = unlimited."),
]

RetentionDays = Annotated[
    int | None,
    typer.Option(
        "--retention-days",
        min=0,
        help="Days prompts and outputs are kept (at most 36500); 0 = not stored.",
    ),
]


def _limit_changes(
    max_in_flight: int | None,
    max_queued: int | None,
    tpm: int | None,
    rpm: int | None,
    max_tokens_per_request: int | None,
) -> dict[str, int | None]:
    """The limits given on the command line, by field; 0 becomes None (unlimited)."""
    given = {
        "max_requests_in_flight": max_in_flight,
        "max_requests_queued": max_queued,
        "tokens_per_minute": tpm,
        "requests_per_minute": rpm,
        "max_tokens_per_request": max_tokens_per_request,
    }
    return {field: value or None for field, value in given.items() if value is not None}


@tenant_app.command("create")
def tenant_create(
    name: str,
    tier: Annotated[int, typer.Option(min=0, help="Priority tier (higher wins).")] = 1,
    weight: Annotated[int, typer.Option(min=1, help="Fair-share weight.")] = 1,
    max_in_flight: MaxInFlight = None,
    max_queued: MaxQueued = None,
    tpm: TokensPerMinute = None,
    rpm: RequestsPerMinute = None,
    max_tokens_per_request: MaxTokensPerRequest = None,
    retention_days: RetentionDays = None,
) -> None:
    """Create a tenant and print its API key (shown this once). A limit not given takes its
    default (LLMFLEET_DEFAULT_MAX_REQUESTS_IN_FLIGHT, _QUEUED; the others unlimited)."""
    from shared import tenants

    given = _limit_changes(max_in_flight, max_queued, tpm, rpm, max_tokens_per_request)
    engine = db()
    try:
        tenant = tenants.create_tenant(
            engine,
            name,
            tier=tier,
            weight=weight,
            limits=tenants.limits_with_defaults(given, get_settings()),
            content_retention_days=retention_days or None,
        )
    except tenants.TenantNameTaken:
        raise typer.BadParameter(f"tenant {name!r} already exists") from None
    except tenants.InvalidTenantField as exc:
        raise typer.BadParameter(str(exc)) from None
    key = tenants.create_key(engine, tenant.id, get_settings().pepper)
    typer.echo(f"tenant {tenant.name} ({tenant.id}) created")
    typer.echo(f"api key (shown once): {key}")


@tenant_app.command("update")
def tenant_update(
    name: str,
    tier: Annotated[int | None, typer.Option(min=0, help="Priority tier (higher wins).")] = None,
    weight: Annotated[int | None, typer.Option(min=1, help="Fair-share weight.")] = None,
    max_in_flight: MaxInFlight = None,
    max_queued: MaxQueued = None,
    tpm: TokensPerMinute = None,
    rpm: RequestsPerMinute = None,
    max_tokens_per_request: MaxTokensPerRequest = None,
    retention_days: RetentionDays = None,
) -> None:
    """Change the given settings of a tenant; the others stay. A limit of 0 makes it unlimited."""
    changes = _limit_changes(max_in_flight, max_queued, tpm, rpm, max_tokens_per_request)
    if tier is not None:
        changes["tier"] = tier
    if weight is not None:
        changes["weight"] = weight
    if retention_days is not None:
        changes["content_retention_days"] = retention_days or None
    _change_tenant(name, **changes)


@tenant_app.command("disable")
def tenant_disable(name: str) -> None:
    """Refuse all of the tenant's keys, on every API replica, from its next request on."""
    _change_tenant(name, is_disabled=True)


@tenant_app.command("enable")
def tenant_enable(name: str) -> None:
    """Accept the tenant's (unrevoked) keys again."""
    _change_tenant(name, is_disabled=False)


def _change_tenant(name: str, **changes: object) -> None:
    from shared import tenants

    try:
        tenant = tenants.update_tenant(db(), name, **changes)
    except tenants.InvalidTenantField as exc:
        raise typer.BadParameter(str(exc)) from None
    if tenant is None:
        raise typer.BadParameter(f"no tenant {name!r}")
    _tell_the_replicas()
    _print_tenants([tenant])


@tenant_app.command("list")
def tenant_list() -> None:
    """List the tenants with their settings ("-" is unlimited)."""
    from shared import tenants

    _print_tenants(tenants.list_tenants(db()))


def _print_tenants(rows) -> None:
    header = ["NAME", "ID", "TIER", "WEIGHT", "IN_FLIGHT", "QUEUED", "TPM", "RPM", "MAX_TOKENS"]
    print_table([*header, "STATUS"], [_tenant_row(t) for t in rows])


def _tenant_row(tenant) -> list:
    from shared.tenants import LIMIT_FIELDS

    limits = [getattr(tenant, field) for field in LIMIT_FIELDS]
    status = "disabled" if tenant.is_disabled else "enabled"
    return [tenant.name, tenant.id, tenant.tier, tenant.weight, *limits, status]


@key_app.command("create")
def key_create(tenant: str) -> None:
    """Create another API key for a tenant and print it (shown this once)."""
    from shared import tenants

    engine = db()
    issued = tenants.issue_key(engine, tenant_id_of(engine, tenant), get_settings().pepper)
    typer.echo(f"key {issued.info.id} created for tenant {tenant}")
    typer.echo(f"api key (shown once): {issued.key}")


@key_app.command("list")
def key_list(tenant: str) -> None:
    """List a tenant's keys: id, prefix, when created and revoked (never the key itself)."""
    from shared import tenants

    engine = db()
    rows = [
        [k.id, k.prefix, when(k.created_at), when(k.revoked_at)]
        for k in tenants.list_keys(engine, tenant_id_of(engine, tenant))
    ]
    print_table(["ID", "PREFIX", "CREATED", "REVOKED"], rows)


@key_app.command("revoke")
def key_revoke(key_id: int) -> None:
    """Revoke a key by its id (see `key list`); every API replica refuses it from now on."""
    from shared import tenants

    info = tenants.revoke_key(db(), key_id)
    if info is None:
        raise typer.BadParameter(f"no key with id {key_id}")
    _tell_the_replicas()
    typer.echo(f"key {info.id} ({info.prefix}...) revoked at {when(info.revoked_at)}")


def _tell_the_replicas() -> None:
    """Move the principals' epoch, so every API replica looks the keys up again."""
    from contextlib import closing

    from shared import principals_epoch
    from shared.redis_conn import sync_client

    with closing(sync_client(get_settings().redis_url, retries=1)) as client:
        if not principals_epoch.advance_sync(client):
            typer.echo(
                "warning: Redis is unreachable; API replicas may accept the old key or "
                "settings for up to a minute",
                err=True,
            )
