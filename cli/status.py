"""`llmfleet status`: the fleet snapshot (`shared/fleet.py`) as tables in the terminal.

The figures are the ones `/dashboard` draws and the API's `/metrics` exports: per model
version (`model@version`) the workers ready (and on standby), KV-cache usage, batch occupancy
and TTFT/ITL p50/p99 over the last window; the autoscaler's latest decision, while one
runs; the live workers, by state (`loading`, `standby`,
`ready`, `draining`); the queue state of every tenant stream (entries, pending, not
yet delivered, consumers); and, under `llmfleet up`, the processes it supervises with their
restarts and last exit.
"""

from __future__ import annotations

import asyncio

from rich.console import Console
from rich.table import Table
from sqlalchemy.engine import Engine

from shared import fleet
from shared.fleet import FleetSnapshot, ModelSnapshot
from shared.redis_conn import async_client
from shared.settings import Settings

PIPE_WIDTH = 200  # columns when the output is not a terminal: no wrapped or elided cells


def print_status(
    settings: Settings, engine: Engine, window_s: float, console: Console | None = None
) -> None:
    models, tenant_names = fleet.catalog(engine)
    snapshot = asyncio.run(_read(settings.redis_url, models, tenant_names, window_s))
    if console is None:
        console = Console()
        if not console.is_terminal:
            console = Console(width=PIPE_WIDTH)
    console.print(models_table(snapshot, window_s))
    if any(snap.scale is not None for snap in snapshot.models.values()):
        console.print(autoscale_table(snapshot))
    console.print(workers_table(snapshot))
    console.print(queues_table(snapshot))
    if snapshot.processes:
        console.print(processes_table(snapshot))


async def _read(url: str, models: list[str], tenant_names, window_s: float) -> FleetSnapshot:
    redis = async_client(url, retries=2)
    try:
        return await fleet.read_fleet(redis, models, tenant_names, window_s)
    finally:
        await redis.aclose()


def models_table(snapshot: FleetSnapshot, window_s: float) -> Table:
    table = Table(title=f"Models (latency over the last {window_s:g} s)", title_justify="left")
    for name in ["MODEL", "WORKERS", "RUNNING", "WAITING", "QUEUED", "KV CACHE", "BATCH"]:
        table.add_column(name, justify="left" if name == "MODEL" else "right")
    for name in ["TTFT P50", "TTFT P99", "ITL P50", "ITL P99", "SAMPLES"]:
        table.add_column(name, justify="right")
    for model, snap in snapshot.models.items():
        table.add_row(
            model,
            _num_workers(snap),
            str(sum(w.num_running for w in snap.workers)),
            str(sum(w.num_waiting for w in snap.workers)),
            str(snap.num_queued),
            _percent(snap.kv_cache_usage),
            _percent(snap.batch_occupancy),
            _ms(snap.ttft.p50_s),
            _ms(snap.ttft.p99_s),
            _ms(snap.itl.p50_s),
            _ms(snap.itl.p99_s),
            f"{snap.ttft.num_samples}/{snap.itl.num_samples}",
        )
    return table


def _num_workers(snap: ModelSnapshot) -> str:
    """Ready out of all, and how many of them are on standby (loaded, not serving)."""
    by_state = snap.num_workers_by_state()
    ready = f"{by_state['ready']}/{len(snap.workers)}"
    return f"{ready} ({by_state['standby']} standby)" if by_state["standby"] else ready


def autoscale_table(snapshot: FleetSnapshot) -> Table:
    """The autoscaler's latest decision per model version (`shared/scale_decisions.py`),
    beside the workers it has: wanted serving and on standby, and what it decided from."""
    table = Table(title="Autoscaling (the control process's latest decision)",
                  title_justify="left")  # fmt: skip
    for name in ["MODEL", "POLICY"]:
        table.add_column(name)
    for name in ["WANTED READY", "WANTED STANDBY", "ARRIVALS TOK/S", "FORECAST TOK/S",
                 "WORKER TOK/S", "WAITING"]:  # fmt: skip
        table.add_column(name, justify="right")
    for model, snap in snapshot.models.items():
        if (view := snap.scale) is None:
            continue
        forecast = view.forecast_tokens_per_s
        table.add_row(
            model,
            view.policy,
            str(view.num_ready),
            str(view.num_standby),
            f"{view.arrival_tokens_per_s:.0f}",
            "-" if forecast is None else f"{forecast:.0f}",
            f"{view.worker_tokens_per_s:.0f}",
            str(view.num_waiting),
        )
    return table


def workers_table(snapshot: FleetSnapshot) -> Table:
    table = Table(title="Workers (heartbeats)", title_justify="left")
    for name in ["WORKER", "POOL", "MODEL", "STATE"]:
        table.add_column(name)
    for name in ["RUNNING", "WAITING", "MAX SEQS", "KV CACHE", "PREEMPTIONS", "SERVED TOKENS",
                 "HEARTBEAT AGE"]:  # fmt: skip
        table.add_column(name, justify="right")
    for snap in snapshot.models.values():
        for w in snap.workers:
            table.add_row(
                w.worker_id,
                _pool(w),
                w.deployment_name,
                w.state,
                str(w.num_running),
                str(w.num_waiting),
                "-" if w.max_num_seqs is None else str(w.max_num_seqs),
                _percent(w.kv_cache_usage),
                str(w.num_preemptions),
                str(w.num_served_tokens),
                f"{w.heartbeat_age_s:.1f} s",
            )
    return table


def _pool(worker) -> str:
    """`dedicated`, or `shared (a,b)`: the models a shared worker may serve."""
    if worker.pool_models:
        return f"{worker.pool} ({','.join(worker.pool_models)})"
    return worker.pool


def queues_table(snapshot: FleetSnapshot) -> Table:
    table = Table(
        title="Queues (stream per model and tenant; consumer group `workers`)",
        title_justify="left",
    )
    for name in ["MODEL", "TENANT", "TENANT ID"]:
        table.add_column(name)
    for name in ["ENTRIES", "PENDING", "UNDELIVERED", "CONSUMERS"]:
        table.add_column(name, justify="right")
    for model, snap in snapshot.models.items():
        for q in snap.queues:
            table.add_row(
                model,
                snapshot.tenant_name(q.tenant_id),
                q.tenant_id,
                str(q.num_entries),
                str(q.num_pending),
                str(q.num_undelivered),
                str(q.num_consumers),
            )
    return table


def processes_table(snapshot: FleetSnapshot) -> Table:
    table = Table(title="Processes (supervised by `llmfleet up`)", title_justify="left")
    for name in ["PROCESS", "STATE", "PID", "RESTARTS", "LAST EXIT", "UP FOR", "METRICS PORT"]:
        table.add_column(
            name, justify="left" if name in ("PROCESS", "STATE", "LAST EXIT") else "right"
        )
    for p in snapshot.processes:
        up_for_s = None if p.up_since_ts is None else max(0.0, snapshot.taken_at_s - p.up_since_ts)
        table.add_row(
            p.name,
            p.state,
            "-" if p.pid is None else str(p.pid),
            str(p.num_restarts),
            p.last_exit or "-",
            "-" if up_for_s is None else _duration(up_for_s),
            "-" if p.metrics_port is None else str(p.metrics_port),
        )
    return table


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _percent(fraction: float | None) -> str:
    return "-" if fraction is None else f"{fraction:.1%}"


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f} ms"
