"""`llmfleet bench --autoscale-ramp`: the autoscaler and the local actuator on the real
platform, as a new user runs it: `llmfleet up --autoscale POLICY` (the default model, the
embedded Redis, SQLite, in a temporary home), then a ramp of load.

Requests arrive at a rate that rises linearly from `start_rate_per_s` to `peak_rate_per_s`
over `ramp_s`, then holds for `hold_s` (deterministic arrivals: the n-th request when the
ramp's integral reaches n). Every half second the run records the worker processes `up`
supervises, their states (heartbeats), and the autoscaler's decision (workers wanted, the
forecast, requests waiting). Reported: when the second worker was started and when it
served, against when the queue backed up (`backed_up_waiting` requests waiting to start),
and TTFT per phase. The cold start is `up`'s own measurement of its first worker; the
worker's capacity is measured by the autoscaler, or given (`worker_tokens_per_s`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import redis

from bench.client import RequestResult, run_http
from bench.load_plan import RampPlan
from bench.workload import RequestSpec
from cli.redis_server import free_port
from shared import keys
from shared.redis_conn import text

UP_TIMEOUT_S = 600.0
SAMPLE_S = 0.5


@dataclass
class _Timeline:
    samples: list[dict[str, Any]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def record(self, client: redis.Redis, name: str, started_s: float) -> None:
        while not self.stop.is_set():
            with contextlib.suppress(redis.RedisError, OSError):
                self.samples.append(_sample(client, name, time.monotonic() - started_s))
            time.sleep(SAMPLE_S)

    def first(self, predicate) -> float | None:
        return next((s["t_s"] for s in self.samples if predicate(s)), None)


def arrivals_s(plan: RampPlan) -> list[float]:
    """The n-th arrival when the rate's integral reaches n (rate linear, then flat)."""
    times, n, t, dt = [], 0, 0.0, 0.01
    integral = 0.0
    while t < plan.ramp_s + plan.hold_s:
        share = min(1.0, t / plan.ramp_s)
        integral += (
            plan.start_rate_per_s + (plan.peak_rate_per_s - plan.start_rate_per_s) * share
        ) * dt
        while integral >= n:
            times.append(t)
            n += 1
        t += dt
    return times


def run(plan: RampPlan, *, echo=print) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="llmfleet-autoscale-") as tmp:
        home = Path(tmp) / "home"
        up, url, key = _start_up(plan, home, Path(tmp) / "up.out", echo)
        client = redis.Redis(unix_socket_path=str(home / "redis" / "redis.sock"))
        timeline, name = _Timeline(), _deployment_name(client, plan.model)
        try:
            started_s = time.monotonic()
            recorder = threading.Thread(target=timeline.record, args=(client, name, started_s))
            recorder.start()
            workload = [
                RequestSpec(i, at_s, [1000 + (i + j) % 5000 for j in range(plan.prompt_tokens)],
                            plan.max_tokens)
                for i, at_s in enumerate(arrivals_s(plan))
            ]  # fmt: skip
            echo(f"{len(workload)} requests over {plan.ramp_s + plan.hold_s:.0f} s")
            results, _ = asyncio.run(
                run_http(url, key, plan.model, workload, show_progress=False, timeout_s=900)
            )
            time.sleep(2 * SAMPLE_S)
        finally:
            timeline.stop.set()
            up.send_signal(signal.SIGTERM)
            up.wait(120)
            client.close()
        up_log = (
            (home / "logs" / "up.log").read_text() if (home / "logs" / "up.log").exists() else ""
        )
        cold_start = re.search(r"a cold start of (\d+) s", (Path(tmp) / "up.out").read_text())
    return _report(plan, results, timeline, cold_start, up_log)


def _start_up(
    plan: RampPlan, home: Path, out_path: Path, echo
) -> tuple[subprocess.Popen, str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMFLEET_")}
    env.pop("REDIS_URL", None)
    env.pop("DATABASE_URL", None)
    env |= {
        "LLMFLEET_HOME_DIR": str(home),
        "LLMFLEET_API_PORT": str(free_port()),
        "LLMFLEET_AUTOSCALE_TICK_S": "1",
        "LLMFLEET_AUTOSCALE_MAX_WORKERS": str(plan.max_workers),
        "OMP_NUM_THREADS": "1",  # each worker one core of this machine's two
        # The development tenant's default in-flight limit (64) would refuse the backlog
        # this run is about; admission limits are measured elsewhere.
        "LLMFLEET_DEFAULT_MAX_REQUESTS_IN_FLIGHT": "0",
    }
    if plan.worker_tokens_per_s is not None:
        env["LLMFLEET_AUTOSCALE_WORKER_TOKENS_PER_S"] = str(plan.worker_tokens_per_s)
    args = ["up", "--model", plan.model, "--autoscale", plan.policy, "--worker-metrics-port", "0",
            "--", "--max-num-seqs", str(plan.max_num_seqs)]  # fmt: skip
    with out_path.open("wb") as out:
        up = subprocess.Popen(
            [sys.executable, "-m", "cli", *args], env=env, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    deadline_s = time.monotonic() + UP_TIMEOUT_S
    while "llmfleet is up" not in (output := out_path.read_text(errors="replace")):
        if up.poll() is not None or time.monotonic() > deadline_s:
            up.kill()
            raise RuntimeError(f"`llmfleet up` did not come up:\n{output}")
        time.sleep(0.5)
    echo(next(line for line in output.splitlines() if line.startswith("autoscaling")))
    url = re.search(r"llmfleet is up at (\S+)", output).group(1)  # type: ignore[union-attr]
    key = re.search(r"development API key: (lf-\S+)", output).group(1)  # type: ignore[union-attr]
    return up, url, key


def _deployment_name(client: redis.Redis, model: str) -> str:
    for key in client.scan_iter(match=keys.worker_heartbeat_pattern()):
        version = client.hget(key, "version")
        if version is not None:
            return keys.deployment_name(model, text(version))  # type: ignore[arg-type]
    return keys.deployment_name(model, "1")


def _sample(client: redis.Redis, name: str, t_s: float) -> dict[str, Any]:
    names: list[bytes] = client.hkeys(keys.SUPERVISED_PROCESSES)  # type: ignore[assignment]  # redis-py: sync commands typed Awaitable[T] | T (redis-py#2399)
    processes = sorted(text(k) for k in names if text(k).startswith("worker-"))
    states = []
    for key in client.scan_iter(match=keys.worker_heartbeat_pattern()):
        state = client.hget(key, "state")
        if state is not None:
            states.append(text(state))  # type: ignore[arg-type]
    decision = {text(k): text(v) for k, v in client.hgetall(keys.autoscale_decision(name)).items()}  # type: ignore[union-attr]
    return {
        "t_s": round(t_s, 2),
        "num_processes": len(processes),
        "states": sorted(states),
        "num_ready": states.count("ready"),
        "wanted_ready": int(decision.get("num_ready", 0) or 0),
        "wanted_standby": int(decision.get("num_standby", 0) or 0),
        "num_waiting": int(decision.get("num_waiting", 0) or 0),
        "arrival_rate_per_s": float(decision.get("arrival_rate_per_s", 0) or 0),
        "forecast_tokens_per_s": float(decision.get("forecast_tokens_per_s") or 0),
        "worker_tokens_per_s": float(decision.get("worker_tokens_per_s", 0) or 0),
    }


def _report(plan, results: list[RequestResult], timeline: _Timeline, cold_start, up_log: str):
    second_started_s = timeline.first(lambda s: s["num_processes"] >= 2)
    second_serving_s = timeline.first(lambda s: s["num_ready"] >= 2)
    backed_up_s = timeline.first(lambda s: s["num_waiting"] >= plan.backed_up_waiting)
    run_start_s = min(r.start_s for r in results)

    def ttfts(lo_s: float, hi_s: float) -> dict[str, Any]:
        values = sorted(
            r.ttft_s for r in results
            if r.ttft_s is not None and lo_s <= r.start_s - run_start_s < hi_s
        )  # fmt: skip
        if not values:
            return {"num_requests": 0}
        p99 = values[min(len(values) - 1, round(0.99 * (len(values) - 1)))]
        return {"num_requests": len(values), "p50_s": statistics.median(values), "p99_s": p99}

    end_s = plan.ramp_s + plan.hold_s
    return {
        "plan": asdict(plan),
        "cold_start_s": int(cold_start.group(1)) if cold_start else None,
        "num_requests": len(results),
        "num_failed": sum(not r.is_ok for r in results),
        "errors": dict(Counter(r.error for r in results if not r.is_ok)),
        "second_worker_started_s": second_started_s,
        "second_worker_serving_s": second_serving_s,
        "queue_backed_up_s": backed_up_s,
        "max_waiting": max((s["num_waiting"] for s in timeline.samples), default=0),
        "worker_tokens_per_s_last": timeline.samples[-1]["worker_tokens_per_s"]
        if timeline.samples
        else None,
        "ttft": {
            "ramp_first_half": ttfts(0, plan.ramp_s / 2),
            "ramp_second_half": ttfts(plan.ramp_s / 2, plan.ramp_s),
            "hold": ttfts(plan.ramp_s, end_s),
            "all": ttfts(0, end_s),
        },
        "up_log": up_log.splitlines(),
        "timeline": timeline.samples,
    }


def format_report(result: dict[str, Any]) -> str:
    plan = result["plan"]

    def at(value: float | None) -> str:
        return "never" if value is None else f"{value:.1f} s"

    lines = [
        f"policy {plan['policy']}: {plan['start_rate_per_s']:g} -> {plan['peak_rate_per_s']:g} "
        f"requests/s over {plan['ramp_s']:g} s, then {plan['hold_s']:g} s; cold start "
        f"{result['cold_start_s']} s (measured by up)",
        f"second worker started {at(result['second_worker_started_s'])}, serving "
        f"{at(result['second_worker_serving_s'])}; queue backed up "
        f"(>= {plan['backed_up_waiting']} waiting) {at(result['queue_backed_up_s'])}; "
        f"most waiting {result['max_waiting']}",
        f"requests {result['num_requests']}, failed {result['num_failed']} {result['errors']}",
    ]
    for phase, figures in result["ttft"].items():
        if figures.get("num_requests"):
            lines.append(
                f"TTFT {phase}: p50 {figures['p50_s']:.2f} s, p99 {figures['p99_s']:.2f} s "
                f"({figures['num_requests']} requests)"
            )
    return "\n".join(lines)
