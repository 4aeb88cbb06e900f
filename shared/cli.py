"""The `llmfleet` command: run the processes and administer tenants and models."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
from pathlib import Path
from typing import Annotated

import typer

from bench.command import bench as bench_command
from shared.settings import get_settings

app = typer.Typer(help="llmfleet: multi-tenant LLM serving.", no_args_is_help=True)
tenant_app = typer.Typer(help="Tenants and their API keys.", no_args_is_help=True)
model_app = typer.Typer(help="Model deployments.", no_args_is_help=True)
key_app = typer.Typer(help="API keys of tenants.", no_args_is_help=True)
usage_app = typer.Typer(help="The usage ledger: reports and tamper checks.", no_args_is_help=True)
app.add_typer(tenant_app, name="tenant")
app.add_typer(key_app, name="key")
app.add_typer(model_app, name="model")
app.add_typer(usage_app, name="usage")
app.command("bench")(bench_command)


def _private_files() -> None:
    """What a serving process writes (metrics values, chain-head exports, the AOF) is its
    owner's alone, however it was started (`llmfleet up`, honcho, systemd):
    `shared/private_files.py`."""
    from shared.private_files import PRIVATE_UMASK

    os.umask(PRIVATE_UMASK)


def _setup_logging() -> None:
    from shared import logs

    settings = get_settings()
    logs.setup(settings.log_level, settings.log_format)


def _use_prometheus_multiprocess(home: Path, port: int) -> None:
    """Point prometheus_client's multiprocess mode at a fresh directory, so that /metrics on
    any uvicorn worker sums the counters of all of them. It must be set before
    prometheus_client is first imported (it picks its value store then), hence here."""
    if "PROMETHEUS_MULTIPROC_DIR" in os.environ:
        return  # the operator's choice; clearing it between runs is theirs too
    path = home / "metrics" / f"api-{port}"
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(path)


def _db():
    from shared.db import create_schema, make_engine

    engine = make_engine(get_settings())
    create_schema(engine)
    return engine


@app.command()
def up(
    model: Annotated[
        str, typer.Option(help="Model deployment the local worker serves.")
    ] = "smollm2-135m",
    batching: Annotated[str, typer.Option(help="continuous | static | one")] = "continuous",
) -> None:
    """Start everything locally: Redis, the API and one worker; print the URL and a dev key."""
    from shared.up import run_local

    run_local(get_settings(), model=model, batching=batching)


@app.command()
def api(
    host: Annotated[str | None, typer.Option()] = None,
    port: Annotated[int | None, typer.Option()] = None,
    workers: Annotated[int, typer.Option(help="uvicorn worker processes")] = 1,
) -> None:
    """Run the HTTP API (uvicorn)."""
    import uvicorn

    from shared import logs

    _private_files()
    settings = get_settings()
    port = port or settings.api_port
    _use_prometheus_multiprocess(settings.home, port)
    uvicorn.run(
        "api.app:create_app",
        factory=True,
        host=host or settings.api_host,
        port=port,
        workers=workers,
        log_config=logs.logging_config(settings.log_level, settings.log_format),
        log_level=settings.log_level.lower(),
        timeout_graceful_shutdown=10,
        # uvicorn believes X-Forwarded-For from 127.0.0.1 unless told otherwise; here only
        # from the proxies configured, so a client cannot pick the address it is throttled by.
        proxy_headers=settings.forwarded_allow_ips is not None,
        forwarded_allow_ips=settings.forwarded_allow_ips,
    )


@app.command()
def worker(
    model: Annotated[str, typer.Option(help="Model id of the deployment to serve.")],
    batching: Annotated[str, typer.Option(help="continuous | static | one")] = "continuous",
    max_batch_size: Annotated[int, typer.Option(help="static: sequences per batch.")] = 8,
    max_num_seqs: Annotated[int, typer.Option(help="continuous: sequences in the batch.")] = 64,
    max_num_batched_tokens: Annotated[
        int, typer.Option(help="continuous: tokens per step (prefill chunk budget).")
    ] = 192,
    block_size: Annotated[int, typer.Option(help="continuous: tokens per KV block.")] = 16,
    kv_cache_gb: Annotated[
        float | None,
        typer.Option(help="continuous: KV pool size (default 2 on CPU, 85% of free GPU memory)."),
    ] = None,
    num_kv_blocks: Annotated[
        int | None,
        typer.Option(help="continuous: the KV pool in blocks (overrides --kv-cache-gb)."),
    ] = None,
    queueing: Annotated[
        str, typer.Option(help="continuous: fair (tenants, tiers, weights) | fifo (baseline).")
    ] = "fair",
    quantum_tokens: Annotated[
        int, typer.Option(help="fair queuing: tokens a tenant may start per round per weight.")
    ] = 256,
    burst_tokens: Annotated[
        int | None,
        typer.Option(
            help="fair queuing: how far ahead of the others a tenant that starts "
            "waiting may go, in tokens of service (default: 4 quanta)."
        ),
    ] = None,
    device: Annotated[str, typer.Option(help="auto | cpu | cuda | cuda:N")] = "auto",
    dtype: Annotated[
        str, typer.Option(help="auto (bf16 on GPUs and AMX CPUs, else fp32) | float32 | bfloat16")
    ] = "auto",
    metrics_port: Annotated[
        int, typer.Option(help="Port of the worker's Prometheus /metrics; 0 = none.")
    ] = 9300,
    metrics_host: Annotated[
        str, typer.Option(help="Address /metrics listens on (0.0.0.0 in a container).")
    ] = "127.0.0.1",
    fairness_scope: Annotated[
        str,
        typer.Option(
            help="fair queuing: pool (service counters shared by the model's workers, in "
            "Redis) | worker (each worker its own)."
        ),
    ] = "pool",
    prefer_tenants: Annotated[
        str,
        typer.Option(
            help="Tenant ids (comma-separated) whose requests this worker takes first "
            "(affinity); it still serves every tenant."
        ),
    ] = "",
) -> None:
    """Run a worker that serves one model deployment."""
    from shared import deployments
    from shared.model_source import DEFAULT_MODEL_ID
    from worker.engine import EngineConfig
    from worker.service import FAIRNESS_SCOPES, Worker, WorkerConfig

    _setup_logging()
    engine = _db()
    deployment = deployments.get_active(engine, model)
    if deployment is None and model == DEFAULT_MODEL_ID:
        deployment = deployments.ensure_default(engine)
    if deployment is None:
        raise typer.BadParameter(
            f"no deployment for model {model!r}; add one with `llmfleet model add`"
        )
    engine_config = EngineConfig(
        batching=batching,
        max_batch_size=max_batch_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        block_size=block_size,
        kv_cache_gb=kv_cache_gb,
        num_kv_blocks=num_kv_blocks,
        queueing=queueing,
        quantum_tokens=quantum_tokens,
        burst_tokens=burst_tokens,
        fault_token_id=get_settings().fault_token_id,
    )
    if fairness_scope not in FAIRNESS_SCOPES:
        raise typer.BadParameter(f"one of {FAIRNESS_SCOPES}", param_hint="--fairness-scope")
    config = WorkerConfig(
        engine_config,
        device,
        dtype,
        metrics_port=metrics_port,
        metrics_host=metrics_host,
        fairness_scope=fairness_scope,
        preferred_tenants=frozenset(t.strip() for t in prefer_tenants.split(",") if t.strip()),
    )
    engine.dispose()  # the worker needs SQL only to find its deployment
    service = Worker(get_settings(), deployment, config)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, service.stop)
        await service.run()

    asyncio.run(main())


@app.command()
def control() -> None:
    """Run the control process: usage into the ledger, retention purges, chain-head exports."""
    from shared.control import make_worker

    _private_files()
    _setup_logging()
    worker = make_worker(get_settings(), _db())
    worker.run()  # arq's loop; SIGTERM and SIGINT stop it after the running jobs


@app.command()
def redis() -> None:
    """Run the embedded redis-server in the foreground (on the unix socket under the home dir)."""
    from shared.redis_server import EmbeddedRedis

    _private_files()
    settings = get_settings()
    server = EmbeddedRedis(settings.home / "redis", unix_socket=settings.redis_socket_path)
    server.start()
    typer.echo(f"redis listening on {server.url}")
    # Only raise in the handler: waiting on the child inside it would deadlock with wait().
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    try:
        server.wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()


def _raise_keyboard_interrupt(*_args) -> None:
    raise KeyboardInterrupt


@app.command()
def init() -> None:
    """Create the database schema and the default model deployment."""
    from shared import deployments

    deployment = deployments.ensure_default(_db())
    typer.echo(f"database ready; default deployment {deployment.model_id} v{deployment.version}")


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
    engine = _db()
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
        tenant = tenants.update_tenant(_db(), name, **changes)
    except tenants.InvalidTenantField as exc:
        raise typer.BadParameter(str(exc)) from None
    if tenant is None:
        raise typer.BadParameter(f"no tenant {name!r}")
    _print_tenants([tenant])


@tenant_app.command("list")
def tenant_list() -> None:
    """List the tenants with their settings ("-" is unlimited)."""
    from shared import tenants

    _print_tenants(tenants.list_tenants(_db()))


def _print_tenants(rows) -> None:
    header = ["NAME", "ID", "TIER", "WEIGHT", "IN_FLIGHT", "QUEUED", "TPM", "RPM", "MAX_TOKENS"]
    _print_table([*header, "STATUS"], [_tenant_row(t) for t in rows])


def _tenant_row(tenant) -> list:
    from shared.tenants import LIMIT_FIELDS

    limits = [getattr(tenant, field) for field in LIMIT_FIELDS]
    status = "disabled" if tenant.is_disabled else "enabled"
    return [tenant.name, tenant.id, tenant.tier, tenant.weight, *limits, status]


def _print_table(header: list[str], rows: list[list]) -> None:
    cells = [header, *[["-" if v is None else str(v) for v in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    for row in cells:
        typer.echo("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip())


@key_app.command("create")
def key_create(tenant: str) -> None:
    """Create another API key for a tenant and print it (shown this once)."""
    from shared import tenants

    engine = _db()
    issued = tenants.issue_key(engine, _tenant_id(engine, tenant), get_settings().pepper)
    typer.echo(f"key {issued.info.id} created for tenant {tenant}")
    typer.echo(f"api key (shown once): {issued.key}")


@key_app.command("list")
def key_list(tenant: str) -> None:
    """List a tenant's keys: id, prefix, when created and revoked (never the key itself)."""
    from shared import tenants

    engine = _db()
    rows = [
        [k.id, k.prefix, _when(k.created_at), _when(k.revoked_at)]
        for k in tenants.list_keys(engine, _tenant_id(engine, tenant))
    ]
    _print_table(["ID", "PREFIX", "CREATED", "REVOKED"], rows)


@key_app.command("revoke")
def key_revoke(key_id: int) -> None:
    """Revoke a key by its id (see `key list`); every API replica refuses it from now on."""
    from shared import tenants

    info = tenants.revoke_key(_db(), key_id)
    if info is None:
        raise typer.BadParameter(f"no key with id {key_id}")
    typer.echo(f"key {info.id} ({info.prefix}...) revoked at {_when(info.revoked_at)}")


def _tenant_id(engine, name: str) -> str:
    from shared import tenants

    tenant = tenants.get_tenant_by_name(engine, name)
    if tenant is None:
        raise typer.BadParameter(f"no tenant {name!r}")
    return tenant.id


def _when(moment) -> str | None:
    return None if moment is None else moment.strftime("%Y-%m-%dT%H:%M:%SZ")  # stored in UTC


@app.command()
def status(
    window_s: Annotated[
        float, typer.Option(help="TTFT and ITL percentiles over the last WINDOW_S seconds.")
    ] = 60.0,
) -> None:
    """Workers, queues per tenant, KV-cache usage, batch occupancy, TTFT and ITL p50/p99."""
    from shared.status import print_status

    print_status(get_settings(), _db(), window_s)


@app.command("admin-key")
def admin_key() -> None:
    """Print the admin key of the `/admin/v1` API (LLMFLEET_ADMIN_KEY, or the generated one)."""
    typer.echo(get_settings().admin_secret)


@model_app.command("add")
def model_add(
    model_id: str,
    source: Annotated[str, typer.Option(help="smollm2-135m, a .gguf file or a HF model directory")],
    version: Annotated[str, typer.Option()] = "1",
) -> None:
    """Register a model deployment."""
    from shared import deployments

    deployment = deployments.register(_db(), model_id, source, version)
    typer.echo(f"deployment {deployment.model_id} v{deployment.version} from {deployment.source}")


@model_app.command("list")
def model_list() -> None:
    """List the active deployments."""
    from shared import deployments

    for d in deployments.list_active(_db()):
        typer.echo(f"{d.model_id}\tv{d.version}\t{d.max_context_tokens} ctx\t{d.source}")


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
    engine = _db()
    names = {t.id: t.name for t in tenants.list_tenants(engine)}
    rows = [_usage_row(names, total) for total in usage.totals(engine, first, last)]
    header = ["TENANT", "MODEL", "DAY", "REQUESTS", "INPUT", "OUTPUT", "COMPUTED"]
    _print_table(header, rows)


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
    from shared import ledger

    engine = _db()
    tenant_id = _tenant_id(engine, tenant) if tenant else None
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
    from shared import ledger

    settings = get_settings()
    export = ledger.export_heads(_db(), settings.ledger_key, settings.ledger_heads_dir)
    typer.echo(f"heads exported: {settings.ledger_heads_dir / f'heads-{export.id:08d}.json'}")


if __name__ == "__main__":
    app()
