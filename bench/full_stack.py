"""Full-stack scenario runs: each run of a scenario on a platform of its own, started for it
as `llmfleet up` starts one (embedded Redis, SQLite in a temporary home, the API, the
control process) with the run's workers (`llmfleet worker` processes: as many as the run
has, each with the run's queueing, fairness scope, KV pool and tenant affinity), and the
workload sent over HTTP/SSE, each tenant with its own key. Everything is stopped and the
home removed afterwards, so runs do not see each other's queues or counters.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import closing, contextmanager
from pathlib import Path

import redis
from sqlmodel import Session, select

from bench import service_recorder
from bench.client import RequestResult, run_http
from bench.scenarios import WARMUP_TENANT, Run, Scenario, warmup_workload
from bench.workload import TenantSpec
from cli.redis_server import free_port
from cli.up import LocalStack, api_ready
from shared import deployments, keys, tenants
from shared.db import create_schema, make_engine
from shared.settings import Settings
from shared.tables import UsageRecord
from shared.tenants import TenantLimits

MODEL_ID = "bench"
START_TIMEOUT_S = 600
LEDGER_TIMEOUT_S = 60


@dataclasses.dataclass(frozen=True)
class Platform:
    url: str
    tenant_keys: dict[str, str]  # scenario tenant name -> API key
    redis_url: str
    settings: Settings
    home: Path


def run_plan(plan: Scenario, base, source: str, dtype: str, *, on_run=None):
    """Every run of `plan` over HTTP on a platform of its own serving `source` with the
    engine settings of `base`; the results and durations by label."""
    runs, durations = {}, {}
    for planned in plan.runs:
        if on_run is not None:
            on_run(planned.label)
        with platform(planned, plan.tenants, base, source, dtype) as started:
            warm_up(started)
            with service_recorder.recording(
                started.redis_url, started.home / "published.jsonl"
            ) as published:
                results, duration_s = asyncio.run(
                    run_http(
                        started.url,
                        "none",
                        MODEL_ID,
                        plan.workloads[planned.workload],
                        tenant_keys=started.tenant_keys,
                    )
                )
            computed = _computed_tokens(started.settings, results)
        for result in results:
            result.num_computed_tokens = computed.get(result.request_id, 0)
            result.published = published.get(result.request_id, [])
        runs[planned.label], durations[planned.label] = results, duration_s
    return runs, durations


def warm_up(started: Platform) -> None:
    """A few short requests of the warm-up tenant, through the whole path, before the run."""
    results, _ = asyncio.run(
        run_http(
            started.url,
            "none",
            MODEL_ID,
            warmup_workload(),
            tenant_keys=started.tenant_keys,
            show_progress=False,
        )
    )
    if failed := [r.error for r in results if not r.is_ok]:
        raise RuntimeError(f"warm-up requests failed: {failed[:3]}")


@contextmanager
def platform(
    run: Run, scenario_tenants: list[TenantSpec], base, source: str, dtype: str
) -> Iterator[Platform]:
    home = Path(tempfile.mkdtemp(prefix="llmfleet-bench-"))
    port = free_port()
    # Its own Redis and SQLite, whatever REDIS_URL or DATABASE_URL the caller has set.
    settings = Settings(home_dir=home, api_port=port, REDIS_URL=None, DATABASE_URL=None)
    # The children get the same: the embedded Redis on its socket, SQLite in the home. The
    # workers share the machine's cores, as several workers on one machine are pinned: each
    # gets its part as torch threads (with 4 workers of 2 threads each on 2 cores, OpenMP
    # teams spinning against each other stalled every worker for seconds at a time).
    env = {
        "REDIS_URL": settings.redis_url,
        "DATABASE_URL": settings.database_url,
        "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // run.num_workers)),
    }
    stack = LocalStack(settings, env_overrides=env)
    is_done = False
    try:
        stack.start_redis()
        engine = make_engine(settings)
        create_schema(engine)
        deployments.register(engine, MODEL_ID, source)
        ids, tenant_keys = {}, {}
        for spec in [*(run.tenants or scenario_tenants), TenantSpec(WARMUP_TENANT)]:
            limits = TenantLimits(max_requests_in_flight=spec.max_requests_in_flight)
            tenant = tenants.create_tenant(
                engine, f"bench-{spec.name}", tier=spec.tier, weight=spec.weight, limits=limits
            )
            ids[spec.name] = tenant.id
            tenant_keys[spec.name] = tenants.create_key(engine, tenant.id, settings.pepper)
        engine.dispose()
        stack.spawn("api", "api", "--port", str(port))
        stack.spawn("control", "control")
        for index in range(run.num_workers):
            stack.spawn(f"worker-{index}", "worker", *_worker_args(run, index, ids, base, dtype))
        _wait_ready(settings, run.num_workers, stack)
        url = f"http://127.0.0.1:{port}"
        yield Platform(url, tenant_keys, settings.redis_url, settings, home)
        is_done = True
    finally:
        stack.stop()
        if is_done:
            shutil.rmtree(home, ignore_errors=True)  # else the logs stay, for the error


def _computed_tokens(settings: Settings, results: list[RequestResult]) -> dict[str, int]:
    """Each finished request's computed tokens (prompt, decodes, recompute), as the usage
    ledger has them: the control process writes a record per request a moment after its
    stream ends, so this waits up to `LEDGER_TIMEOUT_S` for all of them."""
    request_ids = [r.request_id for r in results if r.is_ok and r.request_id]
    engine = make_engine(settings)
    deadline = time.monotonic() + LEDGER_TIMEOUT_S
    try:
        while True:
            with Session(engine) as session:
                rows = session.exec(
                    select(UsageRecord.request_id, UsageRecord.computed_tokens)
                ).all()
            computed = dict(rows)
            if all(rid in computed for rid in request_ids) or time.monotonic() > deadline:
                return computed
            time.sleep(0.5)
    finally:
        engine.dispose()


def _worker_args(run: Run, index: int, ids: dict[str, str], base, dtype: str) -> list[str]:
    config = dataclasses.replace(base, **run.engine)
    args = [
        "--model", MODEL_ID, "--metrics-port", "0", "--dtype", dtype,
        "--queueing", run.queueing, "--fairness-scope", run.fairness_scope,
        "--max-num-seqs", str(config.max_num_seqs),
        "--max-num-batched-tokens", str(config.max_num_batched_tokens),
        "--shared-batched-tokens", str(config.shared_batched_tokens or 0),
        "--itl-target-ms", str(config.itl_target_ms or 0),
        "--quantum-tokens", str(config.quantum_tokens), "--forward", config.forward,
    ]  # fmt: skip
    if config.burst_tokens is not None:
        args += ["--burst-tokens", str(config.burst_tokens)]
    if not config.prefix_caching:
        args.append("--no-prefix-caching")
    if config.max_num_prefill_tokens is not None:
        args += ["--max-num-prefill-tokens", str(config.max_num_prefill_tokens)]
    if config.num_kv_blocks is not None:
        args += ["--num-kv-blocks", str(config.num_kv_blocks)]
    elif config.kv_cache_gb is not None:
        args += ["--kv-cache-gb", str(config.kv_cache_gb)]
    if run.affinity:
        preferred = run.affinity[index % len(run.affinity)]
        args += ["--prefer-tenants", ",".join(ids[name] for name in preferred)]
    if run.roles:
        args += ["--role", run.roles[index]]
    if run.pin_cores:
        args += ["--cpus", str(index % (os.cpu_count() or 1))]
    return args


def _wait_ready(settings: Settings, num_workers: int, stack: LocalStack) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    with closing(redis.Redis.from_url(settings.redis_url)) as client:
        while time.monotonic() < deadline:
            if stack.exited():
                raise RuntimeError(f"a process exited; see the logs under {settings.home}/logs")
            if _num_ready(client) == num_workers and api_ready(settings):
                return
            time.sleep(0.3)
    raise RuntimeError(f"the platform did not start in {START_TIMEOUT_S} s")


def _num_ready(client: redis.Redis) -> int:
    states = [
        client.hget(key, "state") for key in client.scan_iter(keys.worker_heartbeat_pattern())
    ]
    return sum(state == b"ready" for state in states)
