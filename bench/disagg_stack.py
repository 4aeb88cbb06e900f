"""Aggregated against disaggregated serving on this machine, over the whole stack (issue 22):
the same seeded workload over HTTP/SSE on two platforms of their own (`bench/full_stack.py`),
at equal hardware, each worker pinned to a core of its own (`llmfleet worker --cpus`):

- **aggregated**: two `both` workers, each computing prompts and decoding;
- **disaggregated**: a `prefill` and a `decode` worker (`worker/handoff.py`): the prefill
  worker computes each prompt and its first token, its KV goes to the decode worker over
  ZeroMQ, and the decode worker streams the rest.

Reported per mode: `metrics.summarize` (TTFT, ITL, TPOT, throughput, goodput within the
SLOs) and, from each request's hand-off record in Redis (`shared/handoff.py`), the KV bytes
sent and the seconds from the send to the decode worker's answer. `bench/disagg_sim.py` is
the same comparison on a simulated clock.

    llmfleet bench --disaggregation --arrival poisson --num-requests 120 --rate-per-s 2 \
        --long-prompt-fraction 0.1
"""

from __future__ import annotations

import asyncio
from contextlib import closing
from typing import Any

import redis

from bench import full_stack, metrics
from bench.client import RequestResult, run_http
from bench.scenarios import Run
from bench.workload import RequestSpec, TenantSpec
from shared import keys
from shared.redis_conn import text
from worker.config import EngineConfig

MODES = {"aggregated": ("both", "both"), "disaggregated": ("prefill", "decode")}
TENANT = TenantSpec("bench")


def run(
    workload: list[RequestSpec],
    base: EngineConfig,
    source: str,
    dtype: str,
    *,
    slo: tuple[float, float],
    pin_cores: bool = True,
    modes: tuple[str, ...] = tuple(MODES),
) -> dict[str, Any]:
    """Each mode's summary and KV transfers; the aggregated/disaggregated ITL p99 ratio."""
    report: dict[str, Any] = {}
    for label in modes:
        planned = Run(
            label, base.queueing, "main", num_workers=2, roles=MODES[label], pin_cores=pin_cores
        )
        with full_stack.platform(planned, [TENANT], base, source, dtype) as started:
            full_stack.warm_up(started)
            results, duration_s = asyncio.run(
                run_http(started.url, "none", full_stack.MODEL_ID, workload,
                         tenant_keys=started.tenant_keys)
            )  # fmt: skip
            transfers = kv_transfers(started.redis_url, results)
        summary = metrics.summarize(results, duration_s, slo_ttft_s=slo[0], slo_tpot_s=slo[1])
        report[label] = summary | {"roles": list(MODES[label]), "kv_transfer": transfers}
    if all(label in report for label in MODES):
        aggregated, disaggregated = (report[label]["itl_s"]["p99"] for label in MODES)
        report["itl_p99_aggregated_over_disaggregated"] = aggregated / max(disaggregated, 1e-9)
        throughput = [report[label]["output_tokens_per_s"] for label in MODES]
        report["throughput_disaggregated_over_aggregated"] = throughput[1] / max(
            throughput[0], 1e-9
        )
    return report


def kv_transfers(redis_url: str, results: list[RequestResult]) -> dict[str, Any]:
    """The hand-offs of the run's requests, from their records: how many were handed to the
    decode worker, and the bytes and seconds of each transfer."""
    num_bytes, seconds = [], []
    with closing(redis.Redis.from_url(redis_url)) as client:
        for result in results:
            if not result.request_id:
                continue
            fields = client.hgetall(keys.handoff(result.request_id))
            values = {text(k): text(v) for k, v in fields.items()}  # type: ignore[union-attr]  # redis-py: sync client typed Awaitable | T (redis-py#2399)
            if values.get("state") == "accepted" and "bytes" in values:
                num_bytes.append(float(values["bytes"]))
                seconds.append(float(values["transfer_s"]))
    return {
        "num_handed_off": len(num_bytes),
        "num_requests": len(results),
        "bytes": metrics.percentiles(num_bytes),
        "transfer_s": metrics.percentiles(seconds),
        "bytes_per_s": sum(num_bytes) / sum(seconds) if seconds else 0.0,
    }


def print_report(report: dict[str, Any], echo) -> None:
    echo("mode            out tok/s  TTFT p50/p99 s   ITL p50/p99 ms  goodput/s  handed off"
         "  KV MB p50  transfer ms p50/p99")  # fmt: skip
    for label in MODES:
        if label not in report:
            continue
        row, kv = report[label], report[label]["kv_transfer"]
        echo(
            f"{label:15s} {row['output_tokens_per_s']:9.1f}  "
            f"{row['ttft_s']['p50']:6.2f}/{row['ttft_s']['p99']:6.2f}  "
            f"{row['itl_s']['p50'] * 1e3:7.1f}/{row['itl_s']['p99'] * 1e3:7.1f}  "
            f"{row['goodput_requests_per_s']:9.2f}  {kv['num_handed_off']:4d}/{kv['num_requests']:<4d}  "
            f"{kv['bytes']['p50'] / 1e6:9.2f}  "
            f"{kv['transfer_s']['p50'] * 1e3:7.1f}/{kv['transfer_s']['p99'] * 1e3:7.1f}"
        )
    if "itl_p99_aggregated_over_disaggregated" in report:
        echo(
            f"ITL p99 aggregated / disaggregated: "
            f"{report['itl_p99_aggregated_over_disaggregated']:.2f}x; throughput "
            f"disaggregated / aggregated: {report['throughput_disaggregated_over_aggregated']:.2f}x"
        )
