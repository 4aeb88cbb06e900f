"""The `llmfleet` command: run the processes and administer tenants and models."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
from pathlib import Path
from typing import Annotated

import typer

from cli import plugins
from cli.common import db
from cli.models import model_app
from cli.rollouts import rollout_app
from cli.tenants import key_app, tenant_app
from cli.usage import usage_app
from shared.settings import get_settings
from worker.config import DEFAULT_ENGINE, EngineConfig

DEFAULT_WORKER_METRICS_PORT = 9300
ENGINE_KINDS = ("model", "echo")
AUTOSCALE_POLICIES = ("reactive", "predictive", "predictive+warm")
# After the API's own drain: how long uvicorn waits for connections still open.
STRAGGLERS_TIMEOUT_S = 10

app = typer.Typer(help="llmfleet: multi-tenant LLM serving.", no_args_is_help=True)
app.add_typer(tenant_app, name="tenant")
app.add_typer(key_app, name="key")
app.add_typer(model_app, name="model")
app.add_typer(rollout_app, name="rollout")
app.add_typer(usage_app, name="usage")


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


@app.command(context_settings={"allow_extra_args": True})
def up(
    ctx: typer.Context,
    model: Annotated[
        str, typer.Option(help="Model deployment the local workers serve.")
    ] = "smollm2-135m",
    batching: Annotated[str, typer.Option(help="continuous | static | one")] = "continuous",
    workers: Annotated[
        int, typer.Option(min=1, help="Local worker processes, each supervised.")
    ] = 1,
    worker_metrics_port: Annotated[
        int,
        typer.Option(help="The first worker's /metrics port; worker i gets it plus i; 0 = none."),
    ] = DEFAULT_WORKER_METRICS_PORT,
    autoscale: Annotated[
        str | None,
        typer.Option(
            help="Autoscale the local workers with this policy: reactive | predictive | "
            "predictive+warm (LLMFLEET_AUTOSCALE_* settings; docs/operations.md).",
        ),
    ] = None,
    roles: Annotated[
        str | None,
        typer.Option(
            help="The workers' roles, one each (comma-separated; sets --workers): e.g. "
            "prefill,decode runs the model disaggregated (docs/operations.md).",
        ),
    ] = None,
) -> None:
    """Start everything locally: Redis, the API, the control process and the workers, each
    restarted if it exits; print the URL and a dev key. Options after `--` go to every
    worker (`llmfleet worker --help`), e.g. `llmfleet up -- --max-num-seqs 16`."""
    from cli.up import WorkerPlan, check_worker_args, run_local
    from worker.handoff import ROLES

    if autoscale is not None and autoscale not in AUTOSCALE_POLICIES:
        raise typer.BadParameter(
            f"one of {', '.join(AUTOSCALE_POLICIES)}", param_hint="--autoscale"
        )
    worker_roles = tuple(r.strip() for r in (roles or "").split(",") if r.strip())
    if any(role not in ROLES for role in worker_roles):
        raise typer.BadParameter(f"each one of {ROLES}", param_hint="--roles")
    if worker_roles and autoscale is not None:
        raise typer.BadParameter(
            "the autoscaler starts workers of one kind: no --roles with it", param_hint="--roles"
        )
    plan = WorkerPlan(
        len(worker_roles) or workers, worker_metrics_port, check_worker_args(ctx.args),
        roles=worker_roles,
    )  # fmt: skip
    run_local(get_settings(), model=model, batching=batching, workers=plan, autoscale=autoscale)


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
        access_log=settings.access_log,
        # uvicorn sees SIGTERM only once the app has drained its streams (within
        # LLMFLEET_SHUTDOWN_GRACE_S, then each ended with `api_shutdown`: `api/shutdown.py`),
        # so no stream is left for it to cut; this bounds what still writes then (a stream
        # whose client reads nothing).
        timeout_graceful_shutdown=STRAGGLERS_TIMEOUT_S,
        # uvicorn believes X-Forwarded-For from 127.0.0.1 unless told otherwise; here only
        # from the proxies configured, so a client cannot pick the address it is throttled by.
        proxy_headers=settings.forwarded_allow_ips is not None,
        forwarded_allow_ips=settings.forwarded_allow_ips,
    )


@app.command()
def worker(
    model: Annotated[
        str | None,
        typer.Option(help="Model id of the deployment to serve (a dedicated worker)."),
    ] = None,
    pool: Annotated[
        str,
        typer.Option(
            help="dedicated (serves --model) | shared (serves one of --models at a time, as "
            "the control process assigns it: the shared pool that bursts)."
        ),
    ] = "dedicated",
    models: Annotated[
        str,
        typer.Option(help="shared: the model ids it may serve (comma-separated, first preferred)."),
    ] = "",
    version: Annotated[
        str | None,
        typer.Option(help="Version of the model to serve (default: its stable version)."),
    ] = None,
    batching: Annotated[
        str, typer.Option(help="continuous | static | one")
    ] = DEFAULT_ENGINE.batching,
    max_batch_size: Annotated[
        int, typer.Option(help="static: sequences per batch.")
    ] = DEFAULT_ENGINE.max_batch_size,
    max_num_seqs: Annotated[
        int, typer.Option(help="continuous: sequences in the batch.")
    ] = DEFAULT_ENGINE.max_num_seqs,
    max_num_batched_tokens: Annotated[
        int, typer.Option(help="continuous: tokens per step (prefill chunk budget).")
    ] = DEFAULT_ENGINE.max_num_batched_tokens,
    max_num_prefill_tokens: Annotated[
        int | None,
        typer.Option(
            help=(
                "continuous: tokens of a step with no decodes in it, or beside decodes while "
                "a backlog of prompt work waits (at most --max-num-batched-tokens: none)."
            )
        ),
    ] = DEFAULT_ENGINE.max_num_prefill_tokens,
    shared_batched_tokens: Annotated[
        int,
        typer.Option(
            help=(
                "continuous: the step's budget while more than one tenant has work, or had "
                "in the last 10 s (0: no cap)."
            )
        ),
    ] = DEFAULT_ENGINE.shared_batched_tokens or 0,
    itl_target_ms: Annotated[
        float,
        typer.Option(
            help="continuous: ITL target that guards the prompt work beside decodes (0: none)."
        ),
    ] = DEFAULT_ENGINE.itl_target_ms or 0,
    block_size: Annotated[
        int, typer.Option(help="continuous: tokens per KV block.")
    ] = DEFAULT_ENGINE.block_size,
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
    ] = DEFAULT_ENGINE.queueing,
    quantum_tokens: Annotated[
        int, typer.Option(help="fair queuing: tokens a tenant may start per round per weight.")
    ] = DEFAULT_ENGINE.quantum_tokens,
    burst_tokens: Annotated[
        int | None,
        typer.Option(
            help="fair queuing: how far ahead of the others a tenant that starts "
            "waiting may go, in tokens of service (default: 4 quanta)."
        ),
    ] = None,
    forward: Annotated[
        str,
        typer.Option(
            help="continuous: auto (our own Llama-family forward where the model is one) "
            "| own | hf (the Hugging Face forward with our paged attention)."
        ),
    ] = DEFAULT_ENGINE.forward,
    prefix_caching: Annotated[
        bool,
        typer.Option(
            "--prefix-caching/--no-prefix-caching",
            help="continuous: reuse a tenant's own cached KV blocks of equal tokens.",
        ),
    ] = DEFAULT_ENGINE.prefix_caching,
    engine_kind: Annotated[
        str,
        typer.Option(
            "--engine",
            help="model (the deployment's weights) | echo (no model: each step a fixed "
            "period giving every sequence its prompt's next token; measures the platform).",
        ),
    ] = DEFAULT_ENGINE.engine,
    echo_tokens_per_s: Annotated[
        float, typer.Option(help="echo: tokens a second per sequence.")
    ] = DEFAULT_ENGINE.echo_tokens_per_s,
    echo_step_ms: Annotated[
        float | None,
        typer.Option(
            help="echo: a step every this many ms, each handing out the tokens of the "
            "sequences whose turn it is (default: one step a period, every sequence at once)."
        ),
    ] = DEFAULT_ENGINE.echo_step_ms,
    echo_emissions: Annotated[
        str | None,
        typer.Option(
            help="echo: append each token's request id and emission time (the monotonic "
            "clock) to this file, for measuring what the platform adds after it."
        ),
    ] = DEFAULT_ENGINE.echo_emissions_path,
    cuda_graphs: Annotated[
        bool,
        typer.Option(
            "--cuda-graphs/--no-cuda-graphs",
            help="continuous, on a GPU: decode-only steps replay CUDA graphs captured at "
            "start per batch size and context (ignored on the CPU).",
        ),
    ] = DEFAULT_ENGINE.cuda_graphs,
    device: Annotated[str, typer.Option(help="auto | cpu | cuda | cuda:N")] = "auto",
    dtype: Annotated[
        str, typer.Option(help="auto (bf16 on GPUs and AMX CPUs, else fp32) | float32 | bfloat16")
    ] = "auto",
    metrics_port: Annotated[
        int, typer.Option(help="Port of the worker's Prometheus /metrics; 0 = none.")
    ] = DEFAULT_WORKER_METRICS_PORT,
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
    standby: Annotated[
        bool,
        typer.Option(
            "--standby",
            help="dedicated: start on standby (weights loaded, no KV pool, pulls nothing) "
            "until the autoscaler's role for it says active; it may go back to standby.",
        ),
    ] = False,
    role: Annotated[
        str,
        typer.Option(
            help="both (serve requests whole) | prefill (compute prompts and first tokens, "
            "then hand each sequence with its KV to a decode worker) | decode (take "
            "hand-offs and stream the rest; pulls nothing from the queues)."
        ),
    ] = "both",
    kv_host: Annotated[
        str,
        typer.Option(
            help="decode: the address prefill workers send KV to (bound, and advertised "
            "in the heartbeat)."
        ),
    ] = "127.0.0.1",
    kv_port: Annotated[
        int, typer.Option(help="decode: the port for KV hand-offs (0: a free one).")
    ] = 0,
    cpus: Annotated[
        str | None,
        typer.Option(
            help="Pin the worker to these CPU cores (comma-separated ids), as several "
            "workers on one machine are: its threads then never compete with another's "
            "(Linux)."
        ),
    ] = None,
    kv_advertise: Annotated[
        str | None,
        typer.Option(
            help="decode: the endpoint prefill workers reach it at (tcp://HOST:PORT), where "
            "it is not --kv-host:--kv-port (a NAT, a proxy, a service name)."
        ),
    ] = None,
) -> None:
    """Run a worker that serves one model deployment (one version of a model), or, in the
    shared pool, the stable version of whichever of its models the control process assigns."""
    from shared.pool_assignments import POOL_SHARED, POOLS
    from worker.handoff import ROLE_BOTH, ROLES
    from worker.pool_member import PoolMember
    from worker.service import FAIRNESS_SCOPES, Worker, WorkerConfig

    _setup_logging()
    if cpus is not None:
        try:  # before torch starts its threads: they inherit the process's cores
            os.sched_setaffinity(0, {int(cpu) for cpu in cpus.split(",") if cpu.strip()})
        except (ValueError, OSError) as exc:
            raise typer.BadParameter(f"cannot pin to {cpus!r}: {exc}", param_hint="--cpus") from exc
    if pool not in POOLS:
        raise typer.BadParameter(f"one of {POOLS}", param_hint="--pool")
    pool_models = tuple(m.strip() for m in models.split(",") if m.strip())
    engine = db()
    if pool == POOL_SHARED:
        if standby:
            raise typer.BadParameter(
                "a shared worker follows the pool's assignments, not the autoscaler's roles",
                param_hint="--standby",
            )
        if not pool_models or model is not None or version is not None:
            raise typer.BadParameter(
                "a shared worker takes --models (at least one) and neither --model nor "
                "--version: it serves each model's stable version",
                param_hint="--pool shared",
            )
        for pool_model in pool_models:
            _deployment_to_serve(engine, pool_model, None)  # each must exist now
        deployment = None
    else:
        if model is None or pool_models:
            raise typer.BadParameter(
                "a dedicated worker takes --model (and not --models)", param_hint="--model"
            )
        deployment = _deployment_to_serve(engine, model, version)
    engine_config = EngineConfig(
        batching=batching,
        max_batch_size=max_batch_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_prefill_tokens=max_num_prefill_tokens,
        shared_batched_tokens=shared_batched_tokens or None,
        itl_target_ms=itl_target_ms or None,
        block_size=block_size,
        kv_cache_gb=kv_cache_gb,
        num_kv_blocks=num_kv_blocks,
        queueing=queueing,
        quantum_tokens=quantum_tokens,
        burst_tokens=burst_tokens,
        forward=forward,
        prefix_caching=prefix_caching,
        cuda_graphs=cuda_graphs,
        fault_token_id=get_settings().fault_token_id,
        engine=engine_kind,
        echo_tokens_per_s=echo_tokens_per_s,
        echo_step_ms=echo_step_ms,
        echo_emissions_path=echo_emissions,
    )
    if engine_kind not in ENGINE_KINDS:
        raise typer.BadParameter(f"one of {ENGINE_KINDS}", param_hint="--engine")
    if engine_kind == "echo" and (
        batching != "continuous"
        or not echo_tokens_per_s > 0
        or (echo_step_ms is not None and not echo_step_ms > 0)
    ):
        raise typer.BadParameter(
            "the echo engine batches continuously, at a rate and a step above 0",
            param_hint="--engine echo",
        )
    if fairness_scope not in FAIRNESS_SCOPES:
        raise typer.BadParameter(f"one of {FAIRNESS_SCOPES}", param_hint="--fairness-scope")
    if role not in ROLES:
        raise typer.BadParameter(f"one of {ROLES}", param_hint="--role")
    if role != ROLE_BOTH and (
        batching != "continuous" or engine_kind != "model" or pool == POOL_SHARED or standby
    ):
        raise typer.BadParameter(
            "prefill and decode workers are dedicated, active workers of a model engine "
            "batching continuously: the hand-off moves its KV blocks",
            param_hint="--role",
        )
    config = WorkerConfig(
        engine_config,
        device,
        dtype,
        metrics_port=metrics_port,
        metrics_host=metrics_host,
        fairness_scope=fairness_scope,
        preferred_tenants=frozenset(t.strip() for t in prefer_tenants.split(",") if t.strip()),
        fault_step_delay_s=get_settings().fault_step_delay_ms / 1000,
        pool=pool,
        pool_models=pool_models,
        standby=standby,
        role=role,
        kv_host=kv_host,
        kv_port=kv_port,
        kv_advertise=kv_advertise,
    )
    service: Worker | PoolMember
    if deployment is None:
        # A shared worker finds each model's stable version when it moves to it.
        service = PoolMember(
            get_settings(), config, lambda m: _deployment_to_serve(engine, m, None)
        )
    else:
        engine.dispose()  # a dedicated worker needs SQL only to find its deployment
        service = Worker(get_settings(), deployment, config)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, service.stop)
        await service.run()

    # Not uvloop: its transports raise RuntimeError on a write after the connection was reset,
    # which redis-py does not take for a connection error; a worker whose Redis connections
    # were cut crashed so (chaos scenario worker_connections_cut).
    asyncio.run(main())


def _deployment_to_serve(engine, model: str, version: str | None):
    from shared import deployments
    from shared.model_source import DEFAULT_MODEL_ID

    if version is not None:
        deployment = deployments.get_version(engine, model, version)
        if deployment is None or not deployment.is_active:
            raise typer.BadParameter(
                f"no active version {version!r} of model {model!r}; add one with "
                "`llmfleet model add --version`",
                param_hint="--version",
            )
        return deployment
    deployment = deployments.get_stable(engine, model)
    if deployment is None and model == DEFAULT_MODEL_ID:
        deployment = deployments.ensure_default(engine)
    if deployment is None:
        raise typer.BadParameter(
            f"no deployment for model {model!r}; add one with `llmfleet model add`"
        )
    return deployment


@app.command()
def control() -> None:
    """Run the control process: usage into the ledger, retention purges, chain-head exports,
    the rollout loop."""
    from control.jobs import make_worker

    _private_files()
    _setup_logging()
    worker = make_worker(get_settings(), db())
    worker.run()  # arq's loop; SIGTERM and SIGINT stop it after the running jobs


@app.command()
def redis() -> None:
    """Run the embedded redis-server in the foreground (on the unix socket under the home dir)."""
    from cli.redis_server import EmbeddedRedis

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

    deployment = deployments.ensure_default(db())
    typer.echo(f"database ready; default deployment {deployment.model_id} v{deployment.version}")


@app.command()
def status(
    window_s: Annotated[
        float, typer.Option(help="TTFT and ITL percentiles over the last WINDOW_S seconds.")
    ] = 60.0,
) -> None:
    """Workers, queues per tenant, KV-cache usage, batch occupancy, TTFT and ITL p50/p99."""
    from cli.status import print_status

    print_status(get_settings(), db(), window_s)


@app.command("admin-key")
def admin_key() -> None:
    """Print the admin key of the `/admin/v1` API (LLMFLEET_ADMIN_KEY, or the generated one)."""
    typer.echo(get_settings().admin_secret)


plugins.register(app)  # last: `llmfleet bench` after the platform's own commands

if __name__ == "__main__":
    app()
