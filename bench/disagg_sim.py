"""Aggregated against disaggregated serving on a simulated clock (issue 22's `--simulate`).

The same workload two ways, at equal hardware, with the real scheduler, KV-cache manager and
fair queue in every worker and a step-cost model for the device (`bench/simulate.py`):

- **aggregated**: two workers that each do both phases, pulling new requests whenever they
  have free places in the batch (as workers pull from the tenant streams): a long prompt's
  chunks share steps with the decodes, and every decode of the step waits for them;
- **disaggregated**: a prefill worker computes each prompt and its first token, then hands
  the sequence off (`ContinuousBatchingEngine`'s `hand_off`): its KV crosses the network (its
  bytes over the link's bandwidth) and the decode worker adopts it (`Scheduler.adopt`, only
  when it has room) and streams the rest; its steps carry decodes only.

Each worker has its own virtual clock; the loop always advances the worker whose clock is
earliest, so whatever happens before a step is known to it. Items that arrive during a step
are taken at the next one, as a real worker takes them. Metrics per mode: TTFT and ITL
(the gaps between a request's tokens; the hand-off's transfer and wait show in the gap
after the first token), TPOT, throughput, goodput within TTFT and TPOT SLOs, and the KV bytes
and transfer time per request.

    python -m bench.disagg_sim --cost flat --json bench/results/disagg-sim-flat.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
from collections import deque
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path

from bench.engine_direct import sequence_of
from bench.simulate import COST_MODELS, NullDecoder, StepCost, VirtualClock, build_engine
from bench.workload import RequestSpec, TenantSpec, make_workload
from worker.config import EngineConfig
from worker.engine import ContinuousBatchingEngine, HandOff
from worker.sequence import Sequence

KV_BYTES_PER_TOKEN = 30 * 3 * 64 * 2 * 2  # the default model in bf16 (23,040)
TENANT = TenantSpec("bench")


@dataclass(frozen=True, slots=True)
class Link:
    gbit_per_s: float
    kv_bytes_per_token: int

    def transfer_s(self, num_tokens: int) -> float:
        return num_tokens * self.kv_bytes_per_token * 8 / (self.gbit_per_s * 1e9)


@dataclass
class Trace:
    """One request's times, in seconds from the start."""

    arrival_s: float
    num_prompt_tokens: int
    token_times_s: list[float] = field(default_factory=list)
    transfer_s: float = 0.0
    kv_bytes: int = 0


@dataclass
class Worker:
    name: str
    engine: ContinuousBatchingEngine
    clock: VirtualClock
    takes_arrivals: bool
    handoffs: deque = field(default_factory=deque)  # (ready_s, request index), ready order

    def next_s(self, next_arrival_s: float | None) -> float | None:
        """When this worker next has something to do, or None: nothing known yet."""
        if self.engine.has_work():
            return self.clock.now_s
        candidates = []
        if self.takes_arrivals and next_arrival_s is not None:
            candidates.append(next_arrival_s)
        if self.handoffs:
            candidates.append(self.handoffs[0][0])
        return max(self.clock.now_s, min(candidates)) if candidates else None


def _start(
    config: EngineConfig,
    cost: StepCost,
    name: str,
    takes_arrivals: bool,
    hand_off: HandOff | None = None,
) -> Worker:
    clock = VirtualClock(now_s=0.0)
    engine = build_engine(config, clock, cost, hand_off)
    # The scheduler cuts late chunks of a long prompt for the CPU, where a chunk's attention
    # costs its tokens times its context; these cost models charge per token only.
    scheduler = engine.scheduler
    scheduler.config = replace(scheduler.config, max_prefill_attention=1 << 62)
    return Worker(name, engine, clock, takes_arrivals)


def run(
    mode: str,
    workload: list[RequestSpec],
    config: EngineConfig,
    cost: StepCost,
    link: Link,
    decode_config: EngineConfig | None = None,
) -> list[Trace]:
    """Serve `workload` "aggregated" or "disaggregated" (the decode worker on `decode_config`,
    default `config`); every request's trace."""
    traces = {spec.index: Trace(spec.arrival_s, len(spec.prompt_token_ids)) for spec in workload}
    specs = {spec.index: spec for spec in workload}
    pending = deque(workload)
    if mode == "aggregated":
        workers = [_start(config, cost, f"both-{i}", True) for i in range(2)]
    elif mode == "disaggregated":
        decode = _start(decode_config or config, cost, "decode", False)

        def hand_off(seq: Sequence, block_ids: list[int]) -> bool:
            trace = traces[int(seq.request_id)]
            trace.transfer_s = link.transfer_s(seq.num_computed_tokens)
            trace.kv_bytes = seq.num_computed_tokens * link.kv_bytes_per_token
            decode.handoffs.append((prefill.clock.now_s + trace.transfer_s, int(seq.request_id)))
            return True

        prefill = _start(config, cost, "prefill", True, hand_off)
        workers = [prefill, decode]
    else:
        raise ValueError(f"mode must be aggregated or disaggregated, not {mode!r}")
    while True:
        next_arrival_s = pending[0].arrival_s if pending else None
        timed = [
            (t, i) for i, w in enumerate(workers) if (t := w.next_s(next_arrival_s)) is not None
        ]
        if not timed:
            break
        now_s, index = min(timed)
        worker = workers[index]
        worker.clock.now_s = now_s
        if worker.takes_arrivals:
            while pending and pending[0].arrival_s <= now_s and worker.engine.num_free_slots() > 0:
                spec = pending.popleft()
                worker.engine.add(sequence_of(spec, TENANT, NullDecoder()))
        while worker.handoffs and worker.handoffs[0][0] <= now_s:
            seq = sequence_of(specs[worker.handoffs[0][1]], TENANT, NullDecoder())
            seq.adopt_first_token(0)  # the cost runner samples token 0
            if worker.engine.adopt(seq, lambda block_ids: None):
                worker.handoffs.popleft()
            elif worker.engine.has_work():
                break  # no room: it waits, in order, for a later step
            else:
                worker.handoffs.popleft()  # it could never fit here: lost (counted)
        if not worker.engine.has_work():
            continue
        outputs = worker.engine.step()
        for output in outputs:
            if output.num_new_tokens:
                traces[int(output.request_id)].token_times_s.append(worker.clock.now_s)
    return [traces[spec.index] for spec in workload]


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]


def summarize(traces: list[Trace], ttft_slo_s: float, tpot_slo_s: float) -> dict:
    ttfts = [t.token_times_s[0] - t.arrival_s for t in traces if t.token_times_s]
    itls = [b - a for t in traces for a, b in itertools.pairwise(t.token_times_s)]
    tpots = [
        (t.token_times_s[-1] - t.token_times_s[0]) / (len(t.token_times_s) - 1)
        for t in traces
        if len(t.token_times_s) > 1
    ]
    start = min(t.arrival_s for t in traces)
    end = max(t.token_times_s[-1] for t in traces if t.token_times_s)
    num_tokens = sum(len(t.token_times_s) for t in traces)
    good = sum(
        1
        for t in traces
        if t.token_times_s
        and t.token_times_s[0] - t.arrival_s <= ttft_slo_s
        and (
            len(t.token_times_s) == 1
            or (t.token_times_s[-1] - t.token_times_s[0]) / (len(t.token_times_s) - 1) <= tpot_slo_s
        )
    )
    moved = [t for t in traces if t.kv_bytes]
    return {
        "num_requests": len(traces),
        "num_completed": sum(1 for t in traces if t.token_times_s),
        "output_tokens_per_s": num_tokens / (end - start),
        "ttft_s": {"p50": _percentile(ttfts, 0.5), "p99": _percentile(ttfts, 0.99)},
        "itl_s": {"p50": _percentile(itls, 0.5), "p99": _percentile(itls, 0.99)},
        "tpot_s": {"p50": _percentile(tpots, 0.5), "p99": _percentile(tpots, 0.99)},
        "goodput_requests_per_s": good / (end - start),
        "slo_attainment": good / len(traces),
        "kv_transfer": {
            "requests": len(moved),
            "bytes_mean": statistics.fmean(t.kv_bytes for t in moved) if moved else 0,
            "seconds_mean": statistics.fmean(t.transfer_s for t in moved) if moved else 0,
            "seconds_max": max((t.transfer_s for t in moved), default=0),
        },
    }


def compare(args: argparse.Namespace) -> dict:
    workload = make_workload(
        args.num_requests,
        seed=args.seed,
        rate_per_s=args.rate_per_s,
        prompt_tokens_min=args.prompt_tokens_min,
        prompt_tokens_max=args.prompt_tokens_max,
        output_tokens_mean=args.output_tokens_mean,
        output_tokens_max=args.output_tokens_max,
        long_prompt_fraction=args.long_prompt_fraction,
        long_prompt_tokens=args.long_prompt_tokens,
    )
    config = EngineConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        shared_batched_tokens=None,
        num_kv_blocks=args.num_kv_blocks,
    )
    # The decode worker holds the places both aggregated workers have (its steps carry no
    # prompt work, so its batch is all decodes); the same KV blocks per device.
    decode_config = replace(config, max_num_seqs=2 * args.max_num_seqs)
    cost = COST_MODELS[args.cost]
    link = Link(args.network_gbps, args.kv_bytes_per_token)
    modes = {
        mode: summarize(
            run(mode, workload, config, cost, link, decode_config), args.ttft_slo_s, args.tpot_slo_s
        )
        for mode in ("aggregated", "disaggregated")
    }
    agg, dis = modes["aggregated"], modes["disaggregated"]
    return {
        "created_at": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "arguments": vars(args) | {"json": str(args.json) if args.json else None},
        "cost_model": {"name": args.cost, **asdict(cost)},
        "modes": modes,
        "itl_p99_aggregated_over_disaggregated": agg["itl_s"]["p99"] / dis["itl_s"]["p99"],
        "throughput_disaggregated_over_aggregated": dis["output_tokens_per_s"]
        / agg["output_tokens_per_s"],
    }


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--cost", choices=sorted(COST_MODELS), default="flat")
    add("--network-gbps", type=float, default=100.0, help="the link's bandwidth, Gbit/s")
    add("--kv-bytes-per-token", type=int, default=KV_BYTES_PER_TOKEN)
    add("--num-requests", type=int, default=2000)
    add("--rate-per-s", type=float, default=40.0)
    add("--seed", type=int, default=0)
    add("--prompt-tokens-min", type=int, default=64)
    add("--prompt-tokens-max", type=int, default=512)
    add("--output-tokens-mean", type=float, default=256.0)
    add("--output-tokens-max", type=int, default=1024)
    add("--long-prompt-fraction", type=float, default=0.1)
    add("--long-prompt-tokens", type=int, default=8192)
    add("--max-num-seqs", type=int, default=64)
    add("--max-num-batched-tokens", type=int, default=2048)
    add("--num-kv-blocks", type=int, default=8192)
    add("--ttft-slo-s", type=float, default=1.0)
    add("--tpot-slo-s", type=float, default=0.025)
    add("--json", type=Path)
    return parser


def main(argv: list[str] | None = None) -> None:
    """Also `llmfleet bench --disaggregation --simulate cpu|flat` (bench/command.py)."""
    args = _parser().parse_args(argv)
    result = compare(args)
    print(f"{'mode':14} {'out tok/s':>10} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} "
          f"{'ITL p99':>8} {'goodput':>8} {'in SLO':>7} {'KV MB':>6} {'xfer ms':>7}")  # fmt: skip
    for mode, m in result["modes"].items():
        print(f"{mode:14} {m['output_tokens_per_s']:10.1f} {m['ttft_s']['p50'] * 1e3:9.1f} "
              f"{m['ttft_s']['p99'] * 1e3:9.1f} {m['itl_s']['p50'] * 1e3:8.1f} "
              f"{m['itl_s']['p99'] * 1e3:8.1f} {m['goodput_requests_per_s']:8.2f} "
              f"{m['slo_attainment']:7.1%} {m['kv_transfer']['bytes_mean'] / 1e6:6.1f} "
              f"{m['kv_transfer']['seconds_mean'] * 1e3:7.1f}")  # fmt: skip
    print(f"ITL p99 aggregated / disaggregated: {result['itl_p99_aggregated_over_disaggregated']:.2f}; "
          f"throughput disaggregated / aggregated: {result['throughput_disaggregated_over_aggregated']:.2f}")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
