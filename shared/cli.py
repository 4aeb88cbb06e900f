"""The `llmfleet` command: run the processes and administer tenants and models."""

from __future__ import annotations

import asyncio
import logging
import signal
from typing import Annotated

import typer

from bench.command import bench as bench_command
from shared.settings import get_settings

app = typer.Typer(help="llmfleet: multi-tenant LLM serving.", no_args_is_help=True)
tenant_app = typer.Typer(help="Tenants and their API keys.", no_args_is_help=True)
model_app = typer.Typer(help="Model deployments.", no_args_is_help=True)
app.add_typer(tenant_app, name="tenant")
app.add_typer(model_app, name="model")
app.command("bench")(bench_command)


def _setup_logging(level: str = "INFO") -> None:
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


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

    settings = get_settings()
    uvicorn.run(
        "api.app:create_app",
        factory=True,
        host=host or settings.api_host,
        port=port or settings.api_port,
        workers=workers,
        log_level="info",
        timeout_graceful_shutdown=10,
    )


@app.command()
def worker(
    model: Annotated[str, typer.Option(help="Model id of the deployment to serve.")],
    batching: Annotated[str, typer.Option(help="continuous | static | one")] = "continuous",
    max_batch_size: Annotated[int, typer.Option(help="static: sequences per batch.")] = 8,
    max_num_seqs: Annotated[int, typer.Option(help="continuous: sequences in the batch.")] = 64,
    max_num_batched_tokens: Annotated[
        int, typer.Option(help="continuous: tokens per step (prefill chunk budget).")
    ] = 256,
    block_size: Annotated[int, typer.Option(help="continuous: tokens per KV block.")] = 16,
    kv_cache_gb: Annotated[
        float | None,
        typer.Option(help="continuous: KV pool size (default 2 on CPU, 85% of free GPU memory)."),
    ] = None,
    device: Annotated[str, typer.Option(help="auto | cpu | cuda | cuda:N")] = "auto",
    dtype: Annotated[
        str, typer.Option(help="auto (bf16 on GPUs and AMX CPUs, else fp32) | float32 | bfloat16")
    ] = "auto",
) -> None:
    """Run a worker that serves one model deployment."""
    from shared import deployments
    from shared.model_source import DEFAULT_MODEL_ID
    from worker.engine import EngineConfig
    from worker.service import Worker, WorkerConfig

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
    )
    service = Worker(get_settings(), engine, deployment, WorkerConfig(engine_config, device, dtype))

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, service.stop)
        await service.run()

    asyncio.run(main())


@app.command()
def redis() -> None:
    """Run the embedded redis-server in the foreground (on the unix socket under the home dir)."""
    from shared.redis_server import EmbeddedRedis

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


@tenant_app.command("create")
def tenant_create(
    name: str,
    tier: Annotated[int, typer.Option(help="Priority tier (higher wins).")] = 1,
    weight: Annotated[int, typer.Option(help="Fair-share weight.")] = 1,
) -> None:
    """Create a tenant and print its API key (shown this once)."""
    from shared import tenants

    engine = _db()
    if tenants.get_tenant_by_name(engine, name) is not None:
        raise typer.BadParameter(f"tenant {name!r} already exists")
    tenant = tenants.create_tenant(engine, name, tier=tier, weight=weight)
    key = tenants.create_key(engine, tenant.id, get_settings().pepper)
    typer.echo(f"tenant {tenant.name} ({tenant.id}) created")
    typer.echo(f"api key (shown once): {key}")


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


if __name__ == "__main__":
    app()
