"""`llmfleet bench --pool-spike`: what the shared pool buys when one model's traffic spikes.

Two models, A and B, one dedicated worker each, on a platform of its own (API, control
process, Redis, SQLite under a temporary home), run three times: with a shared worker that
may serve both (`--pool shared --models B,A`: it starts on B), without one, and with a
second worker dedicated to A (what a static split would do, and the same processes on this
machine's cores as the shared run: B's figures against it show what the pool costs B, and
not what serving more of A costs a machine that hosts every process). Both models get
Poisson traffic at `rate_per_s`; after `warmup_s`, A's rises to `spike_factor` times that
for `spike_s`. Reported per run: TTFT p50/p99 of each model's requests that arrived during
the spike, and when the shared worker was assigned to A and ready on it.

The workers are echo workers (`worker/echo_engine.py`): each a device of fixed speed
(`tokens_per_s` per sequence, `max_num_seqs` places), since three workers computing a real
model on this machine's two cores would share its CPU, and a move would slow the model
left behind for a reason no fleet of GPUs has. What is measured is the platform's part:
queues, the pool's decision, the move's drain and load, and the fair queue on both sides.
"""

from __future__ import annotations

import asyncio
import random
import shutil
import statistics
import tempfile
import threading
import time
from contextlib import closing
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import redis

from bench import platform_load
from bench.client import RequestResult, run_http
from bench.load_plan import SpikePlan
from bench.workload import RequestSpec
from cli.redis_server import EmbeddedRedis, free_port
from cli.up import LocalStack, api_ready
from shared import keys, model_source
from shared.settings import Settings

MODEL_A, MODEL_B = "spike-a", "spike-b"
# The runs: a third worker, shared (starting on B) or a second one dedicated to A (the
# static answer, and the same processes on this machine's two cores as the shared run), or
# none.
THIRD_WORKER: dict[str, list[str] | None] = {
    "with_shared_worker": ["--pool", "shared", "--models", f"{MODEL_B},{MODEL_A}"],
    "without_shared_worker": None,
    "second_dedicated_a_worker": ["--model", MODEL_A],
}
PROMPT_TEXT = " a spike on one model"


def run(plan: SpikePlan, *, echo=print) -> dict[str, Any]:
    echo(
        f"each worker serves {plan.capacity_per_s:.1f} requests/s; A: {plan.rate_per_s:g}/s, "
        f"then {plan.rate_per_s * plan.spike_factor:g}/s for {plan.spike_s:g} s; "
        f"B: {plan.rate_per_s:g}/s"
    )
    repeats = []
    for index in range(plan.repeats):
        seeded = replace(plan, seed=plan.seed + index)  # the same arrivals for each run
        runs = {}
        for name, third in THIRD_WORKER.items():
            echo(f"{name} (seed {seeded.seed}) ...")
            runs[name] = _run_once(seeded, third)
            echo(format_run(name, runs[name]))
        repeats.append(runs)
    # Each run's spike holds some 70 of B's requests, so its p99 is one or two requests:
    # the ratios are taken over every repeat's requests together.
    pooled = {name: _pooled([runs[name] for runs in repeats]) for name in THIRD_WORKER}
    with_, without = pooled["with_shared_worker"], pooled["without_shared_worker"]
    return {
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": platform_load.machine(),
        "plan": asdict(plan) | {"capacity_per_s": plan.capacity_per_s},
        "runs": repeats[0],
        "repeats": repeats,
        "pooled": pooled,
        "a_ttft_p99_ratio": with_["a"]["ttft_p99_s"] / without["a"]["ttft_p99_s"],
        "b_ttft_p99_ratio": with_["b"]["ttft_p99_s"] / without["b"]["ttft_p99_s"],
        "b_ttft_p99_ratio_same_hosts": with_["b"]["ttft_p99_s"]
        / pooled["second_dedicated_a_worker"]["b"]["ttft_p99_s"],
    }


def _pooled(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each model's TTFT over the spikes of all `runs` (one platform's repeats)."""
    pooled = {}
    for model in ("a", "b"):
        ttfts = [ttft for run in runs for _, ttft in run[model]["ttft_by_arrival_s"]]
        pooled[model] = {
            "num_requests": sum(run[model]["num_requests"] for run in runs),
            "num_errors": sum(run[model]["num_errors"] for run in runs),
            **_ttft_figures([t for t in ttfts if t is not None]),
        }
    return pooled


def _ttft_figures(ttfts: list[float]) -> dict[str, float | None]:
    ttfts = sorted(ttfts)
    cuts = statistics.quantiles(ttfts, n=100, method="inclusive") if len(ttfts) > 1 else None
    return {
        "ttft_p50_s": cuts[49] if cuts else None,
        "ttft_p99_s": cuts[98] if cuts else None,
        "ttft_max_s": ttfts[-1] if ttfts else None,
    }


def format_run(name: str, result: dict[str, Any]) -> str:
    a, b = result["a"], result["b"]
    moved = result["shared_moved_s"]
    return (
        f"{name}: A TTFT p50 {a['ttft_p50_s']:.2f} p99 {a['ttft_p99_s']:.2f} s "
        f"({a['num_requests']} requests, {a['num_errors']} errors); B TTFT p50 "
        f"{b['ttft_p50_s']:.2f} p99 {b['ttft_p99_s']:.2f} s ({b['num_requests']}, "
        f"{b['num_errors']} errors)"
        + ("" if moved is None else f"; shared worker ready on A {moved:.1f} s into the spike")
    )


def format_report(report: dict[str, Any]) -> str:
    num_repeats = len(report["repeats"])
    pooled = "".join(
        format_run(f"{name}, all {num_repeats} runs", runs | {"shared_moved_s": None}) + "\n"
        for name, runs in report["pooled"].items()
    )
    return pooled + (
        f"A's TTFT p99 with the shared worker / without: {report['a_ttft_p99_ratio']:.2f}; "
        f"B's: {report['b_ttft_p99_ratio']:.2f} (against a second dedicated A worker: "
        f"{report['b_ttft_p99_ratio_same_hosts']:.2f})"
    )


def _run_once(plan: SpikePlan, third: list[str] | None) -> dict[str, Any]:
    home = Path(tempfile.mkdtemp(prefix="llmfleet-spike-"))
    redis_server = EmbeddedRedis(home / "redis", port=free_port())
    api_port = free_port()
    settings = Settings(
        home_dir=home, api_port=api_port, REDIS_URL=redis_server.url, DATABASE_URL=None
    )
    env = {"REDIS_URL": settings.redis_url, "DATABASE_URL": settings.database_url}
    stack = LocalStack(settings, env_overrides=env)
    is_done = False
    try:
        redis_server.start()
        api_key = platform_load.prepare_database(settings, plan.source, (MODEL_A, MODEL_B), "spike")
        # Converted from the GGUF once, into the home's cache, before any process starts:
        # a worker's load is then its tokenizer's from local disk (about a second), not
        # three conversions at once on two cores (50 s).
        tokenizer = model_source.load_tokenizer(
            model_source.resolve(plan.source), settings.home / "cache"
        )
        prompt = tokenizer.encode(PROMPT_TEXT, add_special_tokens=False)
        stack.spawn("api", "api", "--port", str(api_port))
        stack.spawn("control", "control")
        workers = {"worker-a": ["--model", MODEL_A], "worker-b": ["--model", MODEL_B]}
        if third is not None:
            workers["worker-third"] = third
        for name, args in workers.items():
            stack.spawn(name, "worker", *args, *_echo_args(plan))
        platform_load._wait_ready(settings, stack, len(workers))
        while not api_ready(settings):
            time.sleep(0.2)
        base_url = f"http://{settings.api_host}:{api_port}"
        result = _drive(plan, base_url, api_key, prompt, settings.redis_url)
        is_done = True
        return result
    finally:
        stack.stop()
        redis_server.stop()
        if is_done:
            shutil.rmtree(home, ignore_errors=True)  # else the logs stay, for the error


def _echo_args(plan: SpikePlan) -> list[str]:
    return [
        "--engine", "echo", "--echo-tokens-per-s", str(plan.tokens_per_s),
        "--max-num-seqs", str(plan.max_num_seqs), "--metrics-port", "0",
    ]  # fmt: skip


def _drive(
    plan: SpikePlan, base_url: str, api_key: str, prompt: list[int], redis_url: str
) -> dict[str, Any]:
    rng = random.Random(plan.seed)
    end_s = plan.warmup_s + plan.spike_s

    def arrivals(rate_before: float, rate_during: float) -> list[float]:
        times: list[float] = []
        t = 0.0
        while True:
            t += rng.expovariate(rate_during if t >= plan.warmup_s else rate_before)
            if t >= end_s:
                return times
            times.append(t)

    a_times = arrivals(plan.rate_per_s, plan.rate_per_s * plan.spike_factor)
    b_times = arrivals(plan.rate_per_s, plan.rate_per_s)
    workloads = {
        model: [RequestSpec(i, t, prompt, plan.max_tokens) for i, t in enumerate(times)]
        for model, times in ((MODEL_A, a_times), (MODEL_B, b_times))
    }
    watcher = _ShareWatcher(redis_url)
    with watcher:

        async def both() -> list[tuple[list[RequestResult], float]]:
            return await asyncio.gather(
                *(
                    run_http(base_url, api_key, model, specs, show_progress=False)
                    for model, specs in workloads.items()
                )
            )

        started_s = time.time()
        (a_results, _), (b_results, _) = asyncio.run(both())
    spike_start_s = started_s + plan.warmup_s
    moved = next(
        (t - spike_start_s for t, model, state in watcher.seen if model == MODEL_A and state == "ready"
         and t >= spike_start_s),
        None,
    )  # fmt: skip
    return {
        "a": _summary(a_results, workloads[MODEL_A], plan.warmup_s),
        "b": _summary(b_results, workloads[MODEL_B], plan.warmup_s),
        "shared_moved_s": moved,
        "shared_states": [(round(t - spike_start_s, 2), m, s) for t, m, s in watcher.changes()],
    }


def _summary(results: list[RequestResult], specs: list[RequestSpec], since_s: float) -> dict:
    """Of the requests that arrived during the spike."""
    during = [r for r, spec in zip(results, specs, strict=True) if spec.arrival_s >= since_s]
    ttfts = [r.ttft_s for r in during if r.is_ok and r.ttft_s is not None]
    return {
        "num_requests": len(during),
        "num_errors": sum(not r.is_ok for r in during),
        "errors": sorted({r.error or "" for r in during if not r.is_ok})[:5],
        **_ttft_figures(ttfts),
        # (arrival s into the spike, TTFT s) of each: when the slow ones came
        "ttft_by_arrival_s": [
            (round(spec.arrival_s - since_s, 3), None if r.ttft_s is None else round(r.ttft_s, 4))
            for r, spec in zip(results, specs, strict=True)
            if spec.arrival_s >= since_s
        ],
    }


class _ShareWatcher:
    """Samples the shared worker's heartbeat (model, state) every 0.25 s on a thread."""

    def __init__(self, redis_url: str) -> None:
        self._redis_url = redis_url
        self.seen: list[tuple[float, str, str]] = []
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="share-watcher", daemon=True)

    def __enter__(self) -> _ShareWatcher:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stopping.set()
        self._thread.join()

    def changes(self) -> list[tuple[float, str, str]]:
        out: list[tuple[float, str, str]] = []
        for sample in self.seen:
            if not out or out[-1][1:] != sample[1:]:
                out.append(sample)
        return out

    def _run(self) -> None:
        with closing(redis.Redis.from_url(self._redis_url)) as client:
            while not self._stopping.is_set():
                for key in client.scan_iter(keys.worker_heartbeat_pattern()):
                    fields: dict = client.hgetall(key)  # type: ignore[assignment]  # redis-py: sync commands typed Awaitable[T] | T (redis-py#2399)
                    if fields.get(b"pool") == b"shared":
                        model = fields.get(b"model", b"").decode()
                        state = fields.get(b"state", b"").decode()
                        self.seen.append((time.time(), model, state))
                self._stopping.wait(0.25)
