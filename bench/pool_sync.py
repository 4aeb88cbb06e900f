"""The per-step cost of the pool's fair-queuing counters (`worker/pool_service.py`): one
sync (a worker's updates for two tenants in, every counter back) against an embedded Redis,
timed over many calls, for pools with more and more tenants.

    python -m bench.pool_sync --json bench/results/pool-sync-cpu.json
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path
from typing import Annotated

import typer

from bench import report
from cli.redis_server import EmbeddedRedis, free_port
from shared.redis_conn import async_client
from worker.pool_service import PoolService
from worker.tenant_counters import ServiceUpdates

NUM_SYNCS = 2000


async def _measure(url: str, num_tenants: int) -> dict[str, float]:
    redis = async_client(url)
    pool = PoolService(redis, f"bench-{num_tenants}")
    tenants = [f"tenant-{i:05d}" for i in range(num_tenants)]
    await pool.sync(ServiceUpdates(dict.fromkeys(tenants, 1.0)))
    started_cpu, started = time.process_time(), time.perf_counter()
    for i in range(NUM_SYNCS):
        a, b = tenants[i % num_tenants], tenants[(i + 1) % num_tenants]
        await pool.sync(ServiceUpdates({a: 64.0, b: 1.0}))
    wall_s = (time.perf_counter() - started) / NUM_SYNCS
    cpu_s = (time.process_time() - started_cpu) / NUM_SYNCS
    await redis.aclose()
    return {"num_tenants": num_tenants, "sync_ms": wall_s * 1e3, "worker_cpu_ms": cpu_s * 1e3}


def main(json_path: Annotated[str | None, typer.Option("--json")] = None) -> None:
    server = EmbeddedRedis(Path(tempfile.mkdtemp()), port=free_port()).start()
    try:
        points = [asyncio.run(_measure(server.url, n)) for n in (2, 10, 100, 1000)]
    finally:
        server.stop()
    for point in points:
        typer.echo(
            f"{point['num_tenants']:5d} tenants: {point['sync_ms']:.3f} ms per sync, "
            f"{point['worker_cpu_ms']:.3f} ms of the worker's CPU"
        )
    if json_path:
        report.write_json(json_path, {"created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ"),
                                      "num_syncs": NUM_SYNCS, "points": points})  # fmt: skip


if __name__ == "__main__":
    typer.run(main)
