"""`llmfleet bench --platform-load`: what the platform itself costs, measured with the echo
engine (`llmfleet worker --engine echo`: no model, each step a fixed period) so that no
model's cost hides it.

The run starts a platform of its own (Redis on a loopback TCP port, so that its clients can
be told apart by address; SQLite in a temporary home; one API process; two echo workers:
one at the streams' low rate, one stepping fast for the admission burst) and a tenant
without limits, then measures in two phases:

1. **Streams**: `num_streams` streams opened at `ramp_per_s`, each `tokens_per_s` tokens a
   second for long enough that all are open together for `hold_s`. From the client's
   records (`bench/sse_load.py`, in `num_client_processes` processes): the most streams
   open at once, the errors (a failed stream, or a usage other than `max_tokens`), the ITL
   the platform added over the echo engine's fixed period (`bench/load_metrics.py`). From
   the API process, sampled every `sample_interval_s` (`bench/process_sampler.py`): its
   memory, descriptors and Redis connections while it held the most streams, against a
   baseline taken before; its CPU per token delivered while all streams were open.
2. **Admission**: `num_burst_requests` requests of `max_tokens` 1 at `burst_concurrency`
   (closed loop; each lane keeps its connection with `burst_keep_alive`, else a new one per
   request): the requests the API admitted a second, the errors, and its CPU per request.

The control process is not started: usage events wait in Redis (its cost is not the
API's), as do the journals until they expire. Everything is stopped afterwards and the home
removed (kept, with the logs, when the run failed).
"""

from __future__ import annotations

import json
import math
import os
import platform as host
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import psutil
import redis

from bench import load_metrics, sse_load
from bench.load_plan import NUM_WARMUP_REQUESTS, LoadPlan
from bench.process_sampler import Processes, Sample, Sampler, take_sample
from bench.sse_load import LoadConfig, StreamRecord
from cli.redis_server import EmbeddedRedis, free_port
from cli.supervisor import Child
from cli.up import LocalStack, api_ready
from shared import deployments, keys, model_source, tenants
from shared.db import create_schema, make_engine
from shared.settings import Settings
from shared.tenants import TenantLimits

STREAMS_MODEL = "load-streams"
BURST_MODEL = "load-burst"
START_TIMEOUT_S = 300
PROMPT_TEXT = " the platform's own cost"  # plain words: every echoed token decodes to text


@dataclass(frozen=True)
class Platform:
    settings: Settings
    api: psutil.Process
    workers: dict[str, psutil.Process]  # by model
    redis_server: psutil.Process
    redis_port: int
    api_key: str
    prompt_token_ids: list[int]
    emissions_path: Path  # the streams' echo worker's emission log


def run(plan: LoadPlan, *, echo: Callable[[str], None] = print) -> dict[str, Any]:
    """Both phases on a platform of their own; the report (JSON-able)."""
    limits = raise_open_file_limit()
    echo(f"open files: soft limit {limits['soft']} (hard {limits['hard']})")
    with platform(plan) as started:
        echo("warming up ...")
        _warm_up(started, plan)
        time.sleep(plan.sample_interval_s)  # the warm-up's connections close
        echo(f"streams: {plan.num_streams} at {plan.ramp_per_s:g}/s, {plan.max_tokens} tokens each")
        streams = _streams_phase(started, plan)
        echo(f"admission: {plan.num_burst_requests} requests at {plan.burst_concurrency} at once")
        admission = _admission_phase(started, plan)
        redis_config = _redis_config(started)
    return {
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine(),
        "plan": asdict(plan)
        | {"max_tokens": plan.max_tokens, "stream_idle_check_s": plan.stream_idle_check_s},
        "open_files": limits | {"redis_maxclients": redis_config.get("maxclients")},
        "streams": streams,
        "admission": admission,
    }


def raise_open_file_limit() -> dict[str, int]:
    """Raise this process's soft limit of open files to its hard limit (the API, Redis and the
    clients it starts inherit it): each stream takes a descriptor in the client and one or
    more in the API, and Redis one per connection."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    raised, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return {"soft_before": soft, "soft": raised, "hard": hard}


@contextmanager
def platform(plan: LoadPlan) -> Iterator[Platform]:
    home = Path(tempfile.mkdtemp(prefix="llmfleet-load-"))
    api_port = free_port()
    redis_server = EmbeddedRedis(home / "redis", port=free_port())
    settings = Settings(
        home_dir=home, api_port=api_port, REDIS_URL=redis_server.url, DATABASE_URL=None
    )
    env = {
        "REDIS_URL": settings.redis_url,
        "DATABASE_URL": settings.database_url,
        "LLMFLEET_STREAM_IDLE_CHECK_S": str(plan.stream_idle_check_s),
    }
    stack = LocalStack(settings, env_overrides=env)
    is_done = False
    try:
        redis_server.start()
        api_key = prepare_database(settings, plan.source, (STREAMS_MODEL, BURST_MODEL), "load")
        api = stack.spawn("api", "api", "--port", str(api_port))
        emissions_path = home / "emissions.txt"
        streams_args = [
            *_echo_args(
                STREAMS_MODEL,
                plan.tokens_per_s,
                plan.step_ms,
                plan.num_streams + NUM_WARMUP_REQUESTS,
                _streams_budget(plan),
            ),
            "--echo-emissions",
            str(emissions_path),
        ]
        burst_args = _echo_args(
            BURST_MODEL,
            plan.burst_tokens_per_s,
            None,
            plan.burst_concurrency,
            plan.burst_concurrency * 2,
        )
        workers = {
            STREAMS_MODEL: stack.spawn("worker-streams", "worker", *streams_args),
            BURST_MODEL: stack.spawn("worker-burst", "worker", *burst_args),
        }
        _wait_ready(settings, stack, len(workers))
        tokenizer = model_source.load_tokenizer(
            model_source.resolve(plan.source), settings.home / "cache"
        )
        yield Platform(
            settings,
            psutil.Process(_pid(api)),
            {model: psutil.Process(_pid(child)) for model, child in workers.items()},
            psutil.Process(_redis_pid(settings.redis_url)),
            redis_server.port,
            api_key,
            tokenizer.encode(PROMPT_TEXT, add_special_tokens=False),
            emissions_path,
        )
        is_done = True
    finally:
        stack.stop()
        redis_server.stop()
        if is_done:
            shutil.rmtree(home, ignore_errors=True)  # else the logs stay, for the error


def _pid(child: Child) -> int:
    if child.process is None:
        raise RuntimeError(f"{child.name} is not running")
    return child.process.pid


def _redis_pid(redis_url: str) -> int:
    with closing(redis.Redis.from_url(redis_url)) as client:
        info: dict = client.info("server")  # type: ignore[assignment]  # redis-py: sync commands typed Awaitable[T] | T (redis-py#2399)
        return int(info["process_id"])


def prepare_database(
    settings: Settings, source: str, models: tuple[str, ...], tenant_name: str
) -> str:
    """The deployments of `models` (all with `source`'s tokenizer) and a tenant without
    limits; its key."""
    engine = make_engine(settings)
    try:
        create_schema(engine)
        for model in models:
            deployments.register(engine, model, source)
        tenant = tenants.create_tenant(engine, tenant_name, limits=TenantLimits())
        return tenants.create_key(engine, tenant.id, settings.pepper)
    finally:
        engine.dispose()


def _echo_args(
    model: str, tokens_per_s: float, step_ms: float | None, max_num_seqs: int, budget: int
) -> list[str]:
    args = [
        "--model", model, "--engine", "echo", "--echo-tokens-per-s", str(tokens_per_s),
        "--max-num-seqs", str(max_num_seqs), "--max-num-batched-tokens", str(budget),
        "--metrics-port", "0",
    ]  # fmt: skip
    return args if step_ms is None else [*args, "--echo-step-ms", str(step_ms)]


def _streams_budget(plan: LoadPlan) -> int:
    """A step's token budget that gives every running stream its token and leaves room for
    the prompts that arrive in a step (twice the ramp's, of up to 16 tokens each)."""
    num_new_per_step = math.ceil(plan.ramp_per_s / plan.tokens_per_s)
    return plan.num_streams + NUM_WARMUP_REQUESTS + 2 * 16 * num_new_per_step


def _wait_ready(settings: Settings, stack: LocalStack, num_workers: int) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    with closing(redis.Redis.from_url(settings.redis_url)) as client:
        while time.monotonic() < deadline:
            if stack.exited():
                raise RuntimeError(f"a process exited; see the logs under {settings.home}/logs")
            states = [
                client.hget(key, "state")
                for key in client.scan_iter(keys.worker_heartbeat_pattern())
            ]
            if sum(s == b"ready" for s in states) == num_workers and api_ready(settings):
                return
            time.sleep(0.3)
    raise RuntimeError(f"the platform did not start in {START_TIMEOUT_S} s")


def _warm_up(started: Platform, plan: LoadPlan) -> None:
    """A few requests to each model: the API loads its tokenizers and opens its pools."""
    for model in (STREAMS_MODEL, BURST_MODEL):
        config = _config(started, model, NUM_WARMUP_REQUESTS, max_tokens=2)
        records, _ = _load([replace(config, concurrency=NUM_WARMUP_REQUESTS)], started.settings)
        if failed := [r.error for r in records if not r.is_ok]:
            raise RuntimeError(f"warm-up requests failed: {failed[:3]}")


def _streams_phase(started: Platform, plan: LoadPlan) -> dict[str, Any]:
    processes = _processes(started, STREAMS_MODEL)
    with closing(redis.Redis.from_url(started.settings.redis_url)) as client:
        baseline = take_sample(processes, client)
    base = _config(started, STREAMS_MODEL, plan.num_streams, max_tokens=plan.max_tokens)
    base = replace(base, timeout_s=plan.stream_s * 2 + 60)
    configs = _spread(base, plan.num_client_processes, plan.ramp_per_s)
    deployment = keys.deployment_name(STREAMS_MODEL, "1")  # registered as version 1
    sampler = Sampler(processes, started.settings.redis_url, deployment, plan.sample_interval_s)
    own_cpu_before_s = sse_load.cpu_s()
    with sampler:
        records, client_cpu_s = _load(configs, started.settings)
    sampler_cpu_s = sse_load.cpu_s() - own_cpu_before_s
    with closing(redis.Redis.from_url(started.settings.redis_url)) as client:
        after = take_sample(processes, client)
    with started.emissions_path.open() as lines:
        emissions = load_metrics.read_emissions(lines)
    report = _streams_report(plan, records, [baseline, *sampler.samples, after], emissions)
    return report | {
        "client_cpu_s": client_cpu_s,
        "sampler_cpu_s": sampler_cpu_s,  # this process, sampling the others
        "worker_itl_ms": load_metrics.ms(sampler.worker_itl_s),
    }


def _streams_report(
    plan: LoadPlan,
    records: list[StreamRecord],
    samples: list[Sample],
    emissions: dict[str, list[float]],
):
    """`samples`: the baseline, those taken during the phase, one after it; `emissions`: the
    echo worker's token times by request (`load_metrics.read_emissions`)."""
    errors = load_metrics.stream_errors(records, plan.max_tokens)
    num_errors = sum(errors.values())
    baseline, after = samples[0], samples[-1]
    period_s = 1.0 / plan.tokens_per_s
    window = load_metrics.hold_window(records)
    num_tokens = sum(len(r.token_times_s) for r in records)
    return {
        "num_streams": len(records),
        "num_ok": len(records) - num_errors,
        "num_errors": num_errors,
        "errors": dict(errors),
        "max_concurrent_streams": load_metrics.max_concurrent(load_metrics.open_intervals(records)),
        "tokens_delivered": num_tokens,
        **load_metrics.held_figures(baseline, *load_metrics.sample_when_held(samples, records)),
        "step_period_ms": period_s * 1e3,
        "added_itl_ms": load_metrics.ms(load_metrics.added_itl_s(records, period_s)),
        **_over_emission(records, emissions, None),
        "hold": _hold_report(records, samples, window, period_s)
        | (_over_emission(records, emissions, window) if window else {}),
        # The whole phase: the ramp's admissions included.
        "phase": load_metrics.costs(baseline, after, num_tokens, "token"),
        "samples": [asdict(s) for s in samples],
    }


def _hold_report(
    records: list[StreamRecord],
    samples: list[Sample],
    window: tuple[float, float] | None,
    period_s: float,
) -> dict[str, Any]:
    """While every stream was open: the added ITL, and the costs per token between the
    first and the last sample taken then."""
    if window is None:
        return {}
    report: dict[str, Any] = {
        "window_s": window[1] - window[0],
        "added_itl_ms": load_metrics.ms(load_metrics.added_itl_s(records, period_s, window)),
    }
    inside = [s for s in samples if window[0] <= s.at_s <= window[1]]
    if len(inside) >= 2:
        num_tokens = load_metrics.num_tokens_between(records, inside[0].at_s, inside[-1].at_s)
        report |= load_metrics.costs(inside[0], inside[-1], num_tokens, "token")
    return report


def _over_emission(
    records: list[StreamRecord],
    emissions: dict[str, list[float]],
    window: tuple[float, float] | None,
) -> dict[str, Any]:
    """Each token's delivery (arrival less emission) and the ITL added over the emission."""
    delivery, added = load_metrics.delivery_s(records, emissions, window)
    return {
        "num_tokens_matched": len(delivery),
        "delivery_ms": load_metrics.ms(delivery),
        "added_itl_over_emission_ms": load_metrics.ms(added),
    }


def _admission_phase(started: Platform, plan: LoadPlan) -> dict[str, Any]:
    base = _config(started, BURST_MODEL, plan.num_burst_requests, max_tokens=1)
    base = replace(base, timeout_s=120.0, keep_alive=plan.burst_keep_alive)
    per_process = max(1, plan.burst_concurrency // plan.num_client_processes)
    configs = [
        replace(config, concurrency=per_process)
        for config in _spread(base, plan.num_client_processes, None)
    ]
    processes = _processes(started, BURST_MODEL)
    with closing(redis.Redis.from_url(started.settings.redis_url)) as client:
        before = take_sample(processes, client)
        records, client_cpu_s = _load(configs, started.settings)
        after = take_sample(processes, client)
    figures = load_metrics.admission_figures(records, 1)
    costs = load_metrics.costs(before, after, figures.get("num_admitted", 0), "request")
    api_cpu_per_request_us = costs.get("api_cpu_per_request_us")
    return (
        figures
        | costs
        | {
            "client_cpu_s": client_cpu_s,
            # What one API process could admit with a core of its own, at this CPU per request.
            "admitted_per_api_core_s": 1e6 / api_cpu_per_request_us
            if api_cpu_per_request_us
            else None,
        }
    )


def _processes(started: Platform, model: str) -> Processes:
    return Processes(
        started.api,
        started.settings.api_port,
        started.workers[model],
        started.redis_server,
        started.redis_port,
    )


def _config(started: Platform, model: str, num_requests: int, *, max_tokens: int) -> LoadConfig:
    return LoadConfig(
        host="127.0.0.1",
        port=started.settings.api_port,
        api_key=started.api_key,
        model=model,
        prompt_token_ids=started.prompt_token_ids,
        max_tokens=max_tokens,
        num_requests=num_requests,
        start_at_s=0.0,  # set by `_load`
    )


def _spread(base: LoadConfig, num_processes: int, ramp_per_s: float | None) -> list[LoadConfig]:
    """`base`'s requests shared by `num_processes` clients; with a ramp, each paced at its
    share and started a step after the one before, so that together they keep the pace."""
    num_processes = max(1, min(num_processes, base.num_requests))
    configs = []
    for index in range(num_processes):
        num_requests = base.num_requests // num_processes + (
            index < base.num_requests % num_processes
        )
        offset_s = index / ramp_per_s if ramp_per_s else 0.0
        configs.append(
            replace(
                base,
                num_requests=num_requests,
                ramp_per_s=ramp_per_s / num_processes if ramp_per_s else None,
                start_at_s=offset_s,  # relative until `_load`
            )
        )
    return configs


def _load(configs: list[LoadConfig], settings: Settings) -> tuple[list[StreamRecord], float]:
    """Run the client processes (`bench/sse_load.py`) together; their records and CPU time."""
    folder = Path(tempfile.mkdtemp(prefix="load-", dir=settings.home))
    start_at_s = time.perf_counter() + 1.0  # every process started by then
    children = []
    for index, config in enumerate(configs):
        config_path, out_path = folder / f"config-{index}.json", folder / f"out-{index}.json"
        absolute = replace(config, start_at_s=start_at_s + config.start_at_s)
        config_path.write_text(json.dumps(asdict(absolute)))
        command = [sys.executable, "-m", "bench.sse_load", str(config_path), str(out_path)]
        children.append((subprocess.Popen(command), out_path))
    records, client_cpu_s = [], 0.0
    for child, out_path in children:
        if child.wait() != 0:
            raise RuntimeError(f"a load client exited with {child.returncode}")
        payload = json.loads(out_path.read_text())
        client_cpu_s += payload["cpu_s"]
        records += [StreamRecord(**record) for record in payload["records"]]
    shutil.rmtree(folder, ignore_errors=True)
    return records, client_cpu_s


def _redis_config(started: Platform) -> dict[str, str]:
    with closing(redis.Redis.from_url(started.settings.redis_url, decode_responses=True)) as c:
        return c.config_get("maxclients")  # type: ignore[return-value]  # redis-py: sync commands typed Awaitable[T] | T (redis-py#2399)


def machine() -> dict[str, Any]:
    """What the figures were measured on."""
    return {
        "cpu": _cpu_model() or host.machine(),
        "num_cpus": os.cpu_count(),
        "memory_bytes": psutil.virtual_memory().total,
        "load_average": os.getloadavg(),
    }


def _cpu_model() -> str | None:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return None
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return names[0] if names else None


def format_report(report: dict[str, Any]) -> str:
    """The figures a reader looks for, one a line."""
    streams, admission = report["streams"], report["admission"]
    hold, mib = streams["hold"], 2**20

    def value(number: float | None, fmt: str) -> str:
        return "n/a" if number is None else format(number, fmt)

    lines = [
        f"streams: {streams['max_concurrent_streams']} concurrent (the API held "
        f"{streams['api_streams_held']} at a sample), {streams['num_errors']} errors of "
        f"{streams['num_streams']}, {streams['tokens_delivered']} tokens",
        f"API memory: {streams['api_rss_baseline_bytes'] / mib:.0f} MiB -> "
        f"{streams['api_rss_held_bytes'] / mib:.0f} MiB held, "
        f"{value(streams['memory_per_stream_bytes'], '.0f')} bytes per stream",
        f"API Redis connections: {streams['api_redis_connections_baseline']} -> "
        f"{streams['api_redis_connections_held']} held "
        f"({value(streams['redis_connections_per_stream'], '.2f')} per stream); "
        f"descriptors {streams['api_fds_baseline']} -> {streams['api_fds_held']} "
        f"({value(streams['fds_per_stream'], '.2f')} per stream)",
        f"added ITL over the {streams['step_period_ms']:.0f} ms period: whole phase p50 "
        f"{streams['added_itl_ms']['p50']:.1f} p99 {streams['added_itl_ms']['p99']:.1f} ms; "
        f"all open p50 {value(hold.get('added_itl_ms', {}).get('p50'), '.1f')} "
        f"p99 {value(hold.get('added_itl_ms', {}).get('p99'), '.1f')} ms (the worker's own "
        f"ITL p50 {streams['worker_itl_ms']['p50']:.1f}, p99 {streams['worker_itl_ms']['p99']:.1f} ms)",
        f"added ITL over the worker's emission: whole phase p50 "
        f"{value(streams.get('added_itl_over_emission_ms', {}).get('p50'), '.1f')} p99 "
        f"{value(streams.get('added_itl_over_emission_ms', {}).get('p99'), '.1f')} ms; all open p50 "
        f"{value(hold.get('added_itl_over_emission_ms', {}).get('p50'), '.1f')} p99 "
        f"{value(hold.get('added_itl_over_emission_ms', {}).get('p99'), '.1f')} ms; delivery "
        f"(emission to client) all open p50 {value(hold.get('delivery_ms', {}).get('p50'), '.1f')} "
        f"p99 {value(hold.get('delivery_ms', {}).get('p99'), '.1f')} ms; "
        f"{value(streams.get('num_tokens_matched'), 'd')} of {streams['tokens_delivered']} "
        "tokens matched",
        f"per token while all were open: API {value(hold.get('api_cpu_per_token_us'), '.1f')} us, "
        f"worker {value(hold.get('worker_cpu_per_token_us'), '.1f')} us, Redis "
        f"{value(hold.get('redis_cpu_per_token_us'), '.1f')} us CPU, "
        f"{value(hold.get('redis_calls_per_token'), '.1f')} Redis commands",
        f"admission: {admission['admitted_per_s']:.0f} admitted/s, {admission['num_errors']} "
        f"errors of {admission['num_requests']}; per request: API "
        f"{value(admission.get('api_cpu_per_request_us'), '.0f')} us CPU "
        f"({value(admission.get('admitted_per_api_core_s'), '.0f')}/s per API core), worker "
        f"{value(admission.get('worker_cpu_per_request_us'), '.0f')} us, Redis "
        f"{value(admission.get('redis_cpu_per_request_us'), '.0f')} us, "
        f"{value(admission.get('redis_calls_per_request'), '.1f')} Redis commands",
        f"client CPU s: streams {streams['client_cpu_s']:.1f}, admission "
        f"{admission['client_cpu_s']:.1f}",
        f"open files: soft limit {report['open_files']['soft']}, Redis maxclients "
        f"{report['open_files']['redis_maxclients']}",
    ]
    return "\n".join(lines)
