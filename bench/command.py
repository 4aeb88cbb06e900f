"""`llmfleet bench`: load a running platform (or any OpenAI-compatible URL) and/or the engine
directly with one seeded workload, and report TTFT, TPOT, ITL, E2E, throughput and goodput.

- `--url URL --api-key KEY`: over HTTP/SSE, open loop (the full stack).
- `--engine-direct`: the same workload straight into an in-process engine (no HTTP/Redis).
- both: also prints full stack / engine-direct throughput.
- `--peer-url URL`: the same workload against a peer server (vLLM) in the same invocation.
- `--compare`: one-at-a-time, static and continuous batching, engine-direct, on the same
  workload in one invocation, with the ratios.
- `--step-times`: the runner's step latency on fixed step shapes, per forward.
- `--scenario noisy-neighbour|weighted`: multi-tenant fairness, engine-direct, fair queuing
  against FIFO (bench/scenarios.py).
- `--autoscale-ramp`: `llmfleet up --autoscale` under a ramp of load (bench/autoscale_ramp.py).
- `--pool-spike`: the shared pool, with and without a shared worker, while one model's
  traffic spikes (bench/pool_spike.py).
- `--platform-load`: the platform's own cost, on a platform it starts with echo workers (no
  model): concurrent streams per API process, memory per stream, Redis connections, API CPU
  per token, added ITL, admissions per second (bench/platform_load.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from contextlib import nullcontext
from dataclasses import asdict
from itertools import pairwise
from typing import Annotated

import typer

from bench.load_plan import LoadPlan, RampPlan, SpikePlan
from worker.config import DEFAULT_ENGINE, EngineConfig

# Heavy modules (numpy, matplotlib, torch) are imported inside the functions, so that every
# other `llmfleet` command starts fast.

COMPARED_MODES = ("one", "static", "continuous")
PLATFORM_LOAD = LoadPlan()  # the defaults of --platform-load
POOL_SPIKE = SpikePlan()  # the defaults of --pool-spike
AUTOSCALE_RAMP = RampPlan()  # the defaults of --autoscale-ramp


def bench(
    url: Annotated[str | None, typer.Option(help="OpenAI-compatible base URL (no /v1).")] = None,
    api_key: Annotated[str, typer.Option(envvar="LLMFLEET_API_KEY")] = "none",
    model: Annotated[str, typer.Option(help="Model name sent over HTTP.")] = "smollm2-135m",
    name: Annotated[str | None, typer.Option(help="Label of the HTTP run (e.g. vllm).")] = None,
    peer_url: Annotated[
        str | None,
        typer.Option(
            help="A second OpenAI-compatible server (e.g. vLLM) given the same workload "
            "after --url, in the same invocation; both are reported side by side."
        ),
    ] = None,
    peer_name: Annotated[str, typer.Option(help="Label of the --peer-url run.")] = "peer",
    peer_model: Annotated[
        str | None, typer.Option(help="Model name sent to the peer (default: --model).")
    ] = None,
    peer_api_key: Annotated[str, typer.Option(envvar="PEER_API_KEY")] = "none",
    redis_url: Annotated[
        str | None, typer.Option(help="llmfleet's Redis: sample KV-cache usage from heartbeats.")
    ] = None,
    engine_direct: Annotated[bool, typer.Option(help="Also run the engine in-process.")] = False,
    compare: Annotated[
        bool, typer.Option(help="one vs static vs continuous, engine-direct.")
    ] = False,
    roofline: Annotated[
        bool, typer.Option(help="Decode steps at --roofline-batch sizes vs memory bandwidth.")
    ] = False,
    roofline_batch: Annotated[list[int] | None, typer.Option()] = None,
    roofline_context: int = 256,
    disaggregation: Annotated[
        bool,
        typer.Option(
            help="The workload aggregated (two workers doing both phases) and disaggregated "
            "(a prefill and a decode worker), side by side: over the whole stack with the "
            "model, each worker pinned to a core (bench/disagg_stack.py), or with --simulate "
            "cpu|flat on a simulated clock (bench/disagg_sim.py)."
        ),
    ] = False,
    network_gbps: Annotated[
        float, typer.Option(help="--disaggregation: the KV link's bandwidth, Gbit/s.")
    ] = 100.0,
    kv_bytes_per_token: Annotated[
        int,
        typer.Option(help="--disaggregation: KV bytes a token (default: the default model, bf16)."),
    ] = 23040,
    step_times: Annotated[
        bool,
        typer.Option(
            help="Runner step latency on fixed step shapes, one column per --step-forward "
            "(bench/step_times.py)."
        ),
    ] = False,
    step_forward: Annotated[
        list[str] | None, typer.Option(help="--step-times: forwards to compare (hf, own).")
    ] = None,
    scenario: Annotated[
        str | None,
        typer.Option(
            help="noisy-neighbour | weighted | burst-fill | burst-kv | weighted-pool "
            "(multi-tenant; engine-direct, --simulate, or over HTTP with --url and --admin-key)."
        ),
    ] = None,
    scenario_duration_s: Annotated[
        float, typer.Option(help="noisy-neighbour: seconds of steady arrivals.")
    ] = 40.0,
    steady_rate_per_s: Annotated[
        float,
        typer.Option(help="noisy-neighbour: B's and C's rate (A sends 10x); burst-*: B's rate."),
    ] = 0.4,
    num_workers: Annotated[int, typer.Option(help="weighted-pool: workers in the pool.")] = 2,
    requests_per_worker: Annotated[
        int, typer.Option(help="weighted-pool: each tenant's requests per worker.")
    ] = 80,
    full_stack: Annotated[
        bool,
        typer.Option(
            help="Scenarios: each run on a platform of its own (embedded Redis, SQLite, API, "
            "control, the run's workers) over HTTP (bench/full_stack.py)."
        ),
    ] = False,
    simulate: Annotated[
        str | None,
        typer.Option(
            help="Scenarios: the real scheduler on a simulated clock, step cost "
            "model cpu | flat (bench/simulate.py); no model is run."
        ),
    ] = None,
    repeat: Annotated[
        int,
        typer.Option(
            min=1,
            help="Scenarios: run the plan this many times, in reverse order every other "
            "time; the checks are the repeats' means.",
        ),
    ] = 1,
    num_requests: int = 64,
    seed: int = 0,
    arrival: Annotated[str, typer.Option(help="burst | poisson")] = "burst",
    rate_per_s: float = 16.0,
    burst_window_s: float = 3.0,
    prompt_tokens_min: int = 32,
    prompt_tokens_max: int = 512,
    output_tokens_mean: Annotated[
        float, typer.Option(help="Mean output tokens (also weighted, weighted-pool: at most 2x).")
    ] = 128.0,
    output_tokens_max: int = 512,
    long_prompt_fraction: float = 0.0,
    long_prompt_tokens: int = 2048,
    shared_prefix_tokens: Annotated[
        int, typer.Option(help="Every prompt starts with the same this many tokens.")
    ] = 0,
    max_concurrency: Annotated[int | None, typer.Option(help="Cap on requests in flight.")] = None,
    slo_ttft_s: float = 2.0,
    slo_tpot_s: float = 0.2,
    source: Annotated[str, typer.Option(help="Weights for engine-direct runs.")] = "smollm2-135m",
    batching: Annotated[str, typer.Option(help="Engine-direct engine.")] = DEFAULT_ENGINE.batching,
    max_batch_size: int = DEFAULT_ENGINE.max_batch_size,
    max_num_seqs: int = DEFAULT_ENGINE.max_num_seqs,
    max_num_batched_tokens: int = DEFAULT_ENGINE.max_num_batched_tokens,
    max_num_prefill_tokens: int | None = DEFAULT_ENGINE.max_num_prefill_tokens,
    shared_batched_tokens: Annotated[
        int, typer.Option(help="The step's budget while several tenants have work (0: no cap).")
    ] = DEFAULT_ENGINE.shared_batched_tokens or 0,
    itl_target_ms: Annotated[
        float,
        typer.Option(help="The ITL target guarding the prompt work beside decodes (0: none)."),
    ] = DEFAULT_ENGINE.itl_target_ms or 0,
    kv_cache_gb: float | None = DEFAULT_ENGINE.kv_cache_gb,
    quantum_tokens: Annotated[
        int, typer.Option(help="Scenarios: fair queuing's tokens per round per unit of weight.")
    ] = DEFAULT_ENGINE.quantum_tokens,
    burst_tokens: Annotated[
        int | None, typer.Option(help="Scenarios: fair queuing's burst allowance (4 quanta).")
    ] = None,
    dtype: Annotated[str, typer.Option(help="auto | float32 | bfloat16")] = "auto",
    forward: Annotated[
        str, typer.Option(help="Engine-direct runs: auto | own | hf (worker/config.py).")
    ] = DEFAULT_ENGINE.forward,
    prefix_caching: Annotated[
        bool,
        typer.Option(
            "--prefix-caching/--no-prefix-caching",
            help="Engine-direct and scenario runs: reuse a tenant's own cached KV blocks of equal tokens.",
        ),
    ] = DEFAULT_ENGINE.prefix_caching,
    platform_load: Annotated[
        bool,
        typer.Option(
            help="The platform's own cost: a platform of its own with echo workers (no model), "
            "streams held by one API process, its memory, Redis connections and CPU per "
            "token, the ITL it adds, admissions per second (bench/platform_load.py)."
        ),
    ] = False,
    load_streams: Annotated[
        int, typer.Option(help="--platform-load: concurrent streams to reach.")
    ] = PLATFORM_LOAD.num_streams,
    load_tokens_per_s: Annotated[
        float, typer.Option(help="--platform-load: each stream's tokens a second.")
    ] = PLATFORM_LOAD.tokens_per_s,
    load_step_ms: Annotated[
        float,
        typer.Option(
            help="--platform-load: the streams' echo worker hands out tokens this often, to "
            "the streams whose turn it is."
        ),
    ] = PLATFORM_LOAD.step_ms,
    load_ramp_per_s: Annotated[
        float, typer.Option(help="--platform-load: streams opened a second.")
    ] = PLATFORM_LOAD.ramp_per_s,
    load_hold_s: Annotated[
        float, typer.Option(help="--platform-load: seconds all streams are open together.")
    ] = PLATFORM_LOAD.hold_s,
    load_burst_requests: Annotated[
        int, typer.Option(help="--platform-load: requests (max_tokens 1) of the admission burst.")
    ] = PLATFORM_LOAD.num_burst_requests,
    load_burst_concurrency: Annotated[
        int, typer.Option(help="--platform-load: the burst's requests in flight at once.")
    ] = PLATFORM_LOAD.burst_concurrency,
    load_burst_keep_alive: Annotated[
        bool,
        typer.Option(
            help="--platform-load: the burst's clients keep their connections between "
            "requests, as a pooling client or a load balancer does (--no-load-burst-keep-alive: "
            "a new connection per request)."
        ),
    ] = PLATFORM_LOAD.burst_keep_alive,
    load_client_processes: Annotated[
        int, typer.Option(help="--platform-load: load-generating processes.")
    ] = PLATFORM_LOAD.num_client_processes,
    load_sample_interval_s: Annotated[
        float, typer.Option(help="--platform-load: seconds between samples of the API process.")
    ] = PLATFORM_LOAD.sample_interval_s,
    pool_spike: Annotated[
        bool,
        typer.Option(
            "--pool-spike",
            help="Two models with a dedicated echo worker each, with and without a shared "
            "worker: TTFT of both while one model's traffic spikes (bench/pool_spike.py).",
        ),
    ] = False,
    spike_rate_per_s: Annotated[
        float, typer.Option(help="--pool-spike: each model's requests a second before it.")
    ] = POOL_SPIKE.rate_per_s,
    spike_factor: Annotated[
        float, typer.Option(help="--pool-spike: A's rate during the spike, times the rate.")
    ] = POOL_SPIKE.spike_factor,
    spike_warmup_s: Annotated[
        float, typer.Option(help="--pool-spike: seconds before the spike.")
    ] = POOL_SPIKE.warmup_s,
    spike_s: Annotated[float, typer.Option(help="--pool-spike: the spike's seconds.")] = (
        POOL_SPIKE.spike_s
    ),
    spike_repeats: Annotated[
        int,
        typer.Option(
            min=1,
            help="--pool-spike: runs of each platform (seeds --seed, --seed + 1, ...); the "
            "figures are over all of their spikes' requests.",
        ),
    ] = POOL_SPIKE.repeats,
    autoscale_ramp: Annotated[
        bool,
        typer.Option(
            "--autoscale-ramp",
            help="`llmfleet up --autoscale POLICY` (the default model) under a ramp of load: "
            "when the second worker starts and serves, against when the queue backs up "
            "(bench/autoscale_ramp.py).",
        ),
    ] = False,
    autoscale_policy: Annotated[
        str, typer.Option(help="--autoscale-ramp: reactive | predictive | predictive+warm.")
    ] = AUTOSCALE_RAMP.policy,
    ramp_peak_rate_per_s: Annotated[
        float, typer.Option(help="--autoscale-ramp: requests a second at the ramp's top.")
    ] = AUTOSCALE_RAMP.peak_rate_per_s,
    ramp_s: Annotated[
        float, typer.Option(help="--autoscale-ramp: the ramp's seconds.")
    ] = AUTOSCALE_RAMP.ramp_s,
    ramp_hold_s: Annotated[
        float, typer.Option(help="--autoscale-ramp: seconds held at the top.")
    ] = AUTOSCALE_RAMP.hold_s,
    autoscale_worker_tokens_per_s: Annotated[
        float | None,
        typer.Option(help="--autoscale-ramp: a worker's capacity; default: measured."),
    ] = None,
    cuda_graphs: Annotated[
        bool,
        typer.Option(
            "--cuda-graphs/--no-cuda-graphs",
            help="Engine-direct, scenario and roofline runs on a GPU: decode steps replay "
            "CUDA graphs (ignored on the CPU).",
        ),
    ] = DEFAULT_ENGINE.cuda_graphs,
    json_path: Annotated[str | None, typer.Option("--json", help="Write results here.")] = None,
    plot_path: Annotated[str | None, typer.Option("--plot", help="Write a PNG here.")] = None,
) -> None:
    """Benchmark llmfleet (or a peer) with an open-loop, seeded workload."""
    if autoscale_ramp:
        ramp = dataclasses.replace(
            AUTOSCALE_RAMP,
            policy=autoscale_policy,
            peak_rate_per_s=ramp_peak_rate_per_s,
            ramp_s=ramp_s,
            hold_s=ramp_hold_s,
            worker_tokens_per_s=autoscale_worker_tokens_per_s,
        )
        _autoscale_ramp(ramp, json_path)
        return
    if pool_spike:
        spike = SpikePlan(
            rate_per_s=spike_rate_per_s,
            spike_factor=spike_factor,
            warmup_s=spike_warmup_s,
            spike_s=spike_s,
            seed=seed,
            repeats=spike_repeats,
            source=source,
        )
        _pool_spike(spike, json_path)
        return
    if platform_load:
        plan = LoadPlan(
            num_streams=load_streams,
            tokens_per_s=load_tokens_per_s,
            step_ms=load_step_ms,
            ramp_per_s=load_ramp_per_s,
            hold_s=load_hold_s,
            num_burst_requests=load_burst_requests,
            burst_concurrency=load_burst_concurrency,
            burst_keep_alive=load_burst_keep_alive,
            num_client_processes=load_client_processes,
            source=source,
            sample_interval_s=load_sample_interval_s,
        )
        _platform_load(plan, json_path)
        return
    from bench.workload import make_workload

    workload = make_workload(
        num_requests,
        seed=seed,
        arrival=arrival,
        rate_per_s=rate_per_s,
        burst_window_s=burst_window_s,
        prompt_tokens_min=prompt_tokens_min,
        prompt_tokens_max=prompt_tokens_max,
        output_tokens_mean=output_tokens_mean,
        output_tokens_max=output_tokens_max,
        long_prompt_fraction=long_prompt_fraction,
        long_prompt_tokens=long_prompt_tokens,
        shared_prefix_tokens=shared_prefix_tokens,
    )
    base = EngineConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_prefill_tokens=max_num_prefill_tokens,
        shared_batched_tokens=shared_batched_tokens or None,
        itl_target_ms=itl_target_ms or None,
        kv_cache_gb=kv_cache_gb,
        quantum_tokens=quantum_tokens,
        burst_tokens=burst_tokens,
        forward=forward,
        prefix_caching=prefix_caching,
        cuda_graphs=cuda_graphs,
    )
    if disaggregation and simulate is None:
        from bench import disagg_stack

        report = disagg_stack.run(workload, base, source, dtype, slo=(slo_ttft_s, slo_tpot_s))
        disagg_stack.print_report(report, typer.echo)
        if json_path:
            from bench import report as bench_report

            bench_report.write_json(json_path, {
                "workload": {
                    "num_requests": num_requests, "seed": seed, "arrival": arrival,
                    "rate_per_s": rate_per_s, "burst_window_s": burst_window_s,
                    "shared_prefix_tokens": shared_prefix_tokens,
                    "prompt_tokens": [prompt_tokens_min, prompt_tokens_max],
                    "output_tokens_mean": output_tokens_mean,
                    "output_tokens_max": output_tokens_max,
                    "long_prompt_fraction": long_prompt_fraction,
                    "long_prompt_tokens": long_prompt_tokens,
                },
                "engine": dataclasses.asdict(base),
                "slo": {"ttft_s": slo_ttft_s, "tpot_s": slo_tpot_s},
                "pinned": "each worker to one core (--cpus)",
                **report,
            })  # fmt: skip
        return
    if disaggregation:
        _disaggregation(
            [
                f"--cost={simulate}",
                f"--network-gbps={network_gbps}",
                f"--kv-bytes-per-token={kv_bytes_per_token}",
                f"--num-requests={num_requests}",
                f"--rate-per-s={rate_per_s}",
                f"--seed={seed}",
                f"--prompt-tokens-min={prompt_tokens_min}",
                f"--prompt-tokens-max={prompt_tokens_max}",
                f"--output-tokens-mean={output_tokens_mean}",
                f"--output-tokens-max={output_tokens_max}",
                f"--long-prompt-fraction={long_prompt_fraction}",
                f"--long-prompt-tokens={long_prompt_tokens}",
                f"--max-num-seqs={max_num_seqs}",
                f"--max-num-batched-tokens={max_num_batched_tokens}",
                *([f"--json={json_path}"] if json_path else []),
            ]
        )
        return
    if step_times:
        _step_times(source, dtype, step_forward or ["hf", "own"], json_path)
        return
    if roofline:
        batch_sizes = roofline_batch or [1, 8, 32, 64]
        _roofline(source, dtype, forward, batch_sizes, roofline_context, json_path, cuda_graphs)
        return
    if scenario:
        args = ScenarioArgs(
            scenario,
            seed,
            scenario_duration_s,
            steady_rate_per_s,
            num_workers,
            requests_per_worker,
            output_tokens_mean,
            "full-stack" if full_stack else simulate or "engine-direct",
            source,
            dtype,
            repeat,
        )
        _scenario(args, base, json_path)
        return
    from bench.client import run_http

    runs: dict[str, tuple[list, float, dict]] = {}
    if url:
        from bench.kv_sampler import KVSampler

        with KVSampler(redis_url, model) if redis_url else nullcontext() as sampler:
            results, duration_s = asyncio.run(
                run_http(url, api_key, model, workload, max_concurrency=max_concurrency)
            )
        extra = _kv_stats(sampler.samples, sampler.waste_samples) if sampler is not None else {}
        runs[f"http:{name or model}"] = (results, duration_s, extra)
    if peer_url:
        results, duration_s = asyncio.run(
            run_http(
                peer_url,
                peer_api_key,
                peer_model or model,
                workload,
                max_concurrency=max_concurrency,
            )
        )
        runs[f"http:{peer_name}"] = (results, duration_s, {})
    modes = COMPARED_MODES if compare else ((batching,) if engine_direct else ())
    if modes:
        from bench.engine_direct import run_engine
        from shared import model_source
        from worker.model_engine import build_engine
        from worker.runner import loader

        resolved = model_source.resolve(source)
        loaded = loader.load(resolved, "auto", dtype)
        decoder = model_source.load_tokenizer(resolved)
        for mode in modes:
            config = EngineConfig(
                batching=mode,
                max_batch_size=max_batch_size,
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                max_num_prefill_tokens=max_num_prefill_tokens,
                shared_batched_tokens=shared_batched_tokens or None,
                itl_target_ms=itl_target_ms or None,
                kv_cache_gb=kv_cache_gb,
                forward=forward,
                prefix_caching=prefix_caching,
                cuda_graphs=cuda_graphs,
            )
            typer.echo(f"engine-direct: {mode} ...")
            run = run_engine(
                build_engine(loaded, config), decoder, workload, max_concurrency=max_concurrency
            )
            extra = _kv_stats(run.kv_cache_usage, run.kv_cache_waste) | {"num_steps": run.num_steps}
            runs[f"engine:{mode}"] = (run.results, run.duration_s, extra)
    if not runs:
        raise typer.BadParameter("give --url, --peer-url, --engine-direct or --compare")
    _report(
        runs,
        workload_args=locals(),
        slo=(slo_ttft_s, slo_tpot_s),
        json_path=json_path,
        plot_path=plot_path,
    )


def _platform_load(plan: LoadPlan, json_path: str | None) -> None:
    from bench import platform_load, report

    result = platform_load.run(plan, echo=typer.echo)
    typer.echo(platform_load.format_report(result))
    if json_path:
        report.write_json(json_path, result)


def _autoscale_ramp(plan: RampPlan, json_path: str | None) -> None:
    from bench import autoscale_ramp, report

    result = autoscale_ramp.run(plan, echo=typer.echo)
    typer.echo(autoscale_ramp.format_report(result))
    if json_path:
        report.write_json(json_path, result)
        typer.echo(f"wrote {json_path}")


def _pool_spike(plan: SpikePlan, json_path: str | None) -> None:
    from bench import pool_spike, report

    result = pool_spike.run(plan, echo=typer.echo)
    typer.echo(pool_spike.format_report(result))
    if json_path:
        report.write_json(json_path, result)


def _disaggregation(argv: list[str]) -> None:
    from bench import disagg_sim

    disagg_sim.main(argv)


def _step_times(source: str, dtype: str, forwards: list[str], json_path) -> None:
    from bench import report, step_times
    from shared import model_source
    from worker.runner import loader

    loaded = loader.load(model_source.resolve(source), "auto", dtype)
    typer.echo(f"dtype {loaded.model.dtype}; median ms per step")
    typer.echo(f"{'step':34s}" + "".join(f"{name:>10s}" for name in forwards))
    rows = step_times.measure(loaded, forwards)
    for row in rows:
        cells = "".join(f"{row['median_s'][name] * 1e3:10.1f}" for name in forwards)
        typer.echo(f"{row['shape']:34s}{cells}")
    if json_path:
        report.write_json(json_path, {"dtype": str(loaded.model.dtype), "steps": rows})


def _roofline(
    source: str,
    dtype: str,
    forward: str,
    batch_sizes: list[int],
    context: int,
    json_path,
    cuda_graphs: bool = True,
) -> None:
    from bench import report, roofline
    from shared import heap, model_source
    from worker.runner import loader

    resolved = model_source.resolve(source)
    loaded = loader.load(resolved, "auto", dtype)
    decoder = model_source.load_tokenizer(resolved)
    heap.freeze_long_lived()  # as a worker does once its model is loaded (`shared/heap.py`)
    bandwidth = roofline.measure_bandwidth(loaded.device)
    typer.echo(
        f"measured bandwidth: {bandwidth / 1e9:.1f} GB/s on {loaded.device}; "
        f"dtype {loaded.model.dtype}"
        + ("; on the CPU each batch probes it again between its steps (GB/s column)"
           if loaded.device.type == "cpu" else "")
    )  # fmt: skip
    typer.echo("batch  context  step ms  weights MB  KV MB  GB/s  roofline ms  of roofline  tok/s")
    points = []
    for batch_size in batch_sizes:
        point = roofline.measure_decode(
            loaded, decoder, batch_size, context,
            None if loaded.device.type == "cpu" else bandwidth, forward, cuda_graphs=cuda_graphs,
        )  # fmt: skip
        points.append(point.as_dict())
        typer.echo(
            f"{batch_size:5d}  {context:7d}  {point.step_s * 1e3:7.1f}  "
            f"{point.weight_bytes / 1e6:10.0f}  {point.kv_bytes / 1e6:5.0f}  "
            f"{point.bandwidth_bytes_per_s / 1e9:4.0f}  "
            f"{point.roofline_s * 1e3:11.1f}  {point.fraction_of_roofline:11.0%}  "
            f"{batch_size / point.step_s:5.0f}"
        )
    if json_path:
        report.write_json(json_path, {"bandwidth_bytes_per_s": bandwidth, "points": points})


@dataclasses.dataclass(frozen=True)
class ScenarioArgs:
    name: str
    seed: int
    duration_s: float
    steady_rate_per_s: float
    num_workers: int
    requests_per_worker: int
    output_tokens_mean: float  # weighted, weighted-pool
    mode: str  # "engine-direct", "full-stack", or a --simulate cost model
    source: str
    dtype: str
    repeat: int = 1


def _scenario(args: ScenarioArgs, base, json_path: str | None) -> None:
    from bench import scenarios

    simulated = args.mode if args.mode not in ("engine-direct", "full-stack") else None
    plan = scenarios.build(
        args.name,
        seed=args.seed,
        duration_s=args.duration_s,
        steady_rate_per_s=args.steady_rate_per_s,
        num_workers=args.num_workers,
        requests_per_worker=args.requests_per_worker,
        output_tokens_mean=args.output_tokens_mean,
        ttft_ratio_max=scenarios.burst_ttft_ratio_max(simulated, args.name),
    )

    def on_run(label: str) -> None:
        typer.echo(f"{args.name}: {label} ...")

    if args.mode == "full-stack":
        from bench import full_stack

        def run_plan(ordered):
            return full_stack.run_plan(ordered, base, args.source, args.dtype, on_run=on_run)
    else:
        from bench import scenario_driver

        make_engine, decoder = _engines(args, simulated)

        def run_plan(ordered):
            return scenario_driver.run_plan(ordered, base, make_engine, decoder, on_run=on_run)

    repeats = []
    for index in range(args.repeat):
        # Every other repeat in reverse order: a drift of the machine over the session
        # then weighs on every run alike (the checks compare runs of one repeat).
        ordered = plan if index % 2 == 0 else dataclasses.replace(plan, runs=plan.runs[::-1])
        if args.repeat > 1:
            typer.echo(f"{args.name}: repeat {index + 1} of {args.repeat}")
        repeats.append(run_plan(ordered))
    _report_scenario(args, plan, repeats, base, json_path)


def _engines(args: ScenarioArgs, simulated: str | None):
    """`make_engine(config) -> (engine, clock or None)` and the decoder of in-process runs:
    the real model (engine-direct), or the step-cost model of `--simulate`."""
    from bench import simulate

    if simulated is None:
        from shared import model_source
        from worker.model_engine import build_engine
        from worker.runner import loader

        resolved = model_source.resolve(args.source)
        loaded = loader.load(resolved, "auto", args.dtype)
        return (lambda config: (build_engine(loaded, config), None)), (
            model_source.load_tokenizer(resolved)
        )
    if simulated not in simulate.COST_MODELS:
        raise typer.BadParameter(f"one of {sorted(simulate.COST_MODELS)}", param_hint="--simulate")
    return simulate.engine_factory(simulate.COST_MODELS[simulated]), simulate.NullDecoder()


def _report_scenario(args: ScenarioArgs, plan, repeats, base, json_path) -> None:
    """Each repeat's table and checks; with several, the checks' means (`combine_repeats`)."""
    from bench import metrics, report, scenarios, simulate

    tenant_of = scenarios.tenant_of(plan)
    measured = []
    for runs, durations in repeats:
        rows = {
            f"{label} / {tenant}": metrics.summarize(
                [r for r in tenant_results if r.end_s], durations[label]
            )
            for label, results in runs.items()
            for tenant, tenant_results in sorted(scenarios.per_tenant(results, tenant_of).items())
        }
        typer.echo(report.format_table(rows))
        evaluation = plan.evaluate(runs, durations, plan)
        _echo_checks(evaluation["checks"])
        requests = {
            label: [dataclasses.asdict(r) | {"tenant": tenant_of[r.index]} for r in results]
            for label, results in runs.items()
        }
        measured.append({"per_tenant": rows, "evaluation": evaluation, "requests": requests})
    if len(measured) == 1:
        result = measured[0]
    else:
        combined = scenarios.combine_repeats([m["evaluation"] for m in measured])
        typer.echo(f"means over {len(measured)} repeats:")
        _echo_checks(combined["checks"])
        result = {"evaluation": {"checks": combined["checks"]}, "repeats": measured}
    if not json_path:
        return
    cost = simulate.COST_MODELS.get(args.mode)
    arguments = dataclasses.asdict(args) | {
        "engine": dataclasses.asdict(base),
        "simulated_step_cost": cost and dataclasses.asdict(cost),
    }
    report.write_json(
        json_path,
        {
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "scenario": args.name,
            "arguments": arguments,
            "tenants": [dataclasses.asdict(t) for t in plan.tenants],
            **result,
        },
    )


def _echo_checks(checks: dict) -> None:
    for check, outcome in checks.items():
        verdict = "met" if outcome["is_met"] else "NOT met"
        typer.echo(f"{check}: {outcome['value']:.3f} (target {outcome['target']}): {verdict}")


def _kv_stats(usage: list[float], waste: list[float]) -> dict:
    """KV-cache usage, and waste (slots in use that hold no token), mean and max."""
    stats = {}
    for name, samples in (("kv_cache_usage", usage), ("kv_cache_waste", waste)):
        if samples:
            stats[f"{name}_mean"] = sum(samples) / len(samples)
            stats[f"{name}_max"] = max(samples)
    return stats


def _report(runs, *, workload_args: dict, slo: tuple[float, float], json_path, plot_path) -> None:
    from bench import metrics, report

    summaries = {
        name: metrics.summarize(results, duration_s, slo_ttft_s=slo[0], slo_tpot_s=slo[1]) | extra
        for name, (results, duration_s, extra) in runs.items()
    }
    typer.echo(report.format_table(summaries))
    ratios = _ratios(summaries)
    for name, value in ratios.items():
        typer.echo(f"{name}: {value:.2f}")
    for name, summary in summaries.items():
        if "kv_cache_usage_max" in summary:
            typer.echo(
                f"{name}: KV cache usage mean {summary['kv_cache_usage_mean']:.1%}, "
                f"max {summary['kv_cache_usage_max']:.1%}"
            )
        if "kv_cache_waste_max" in summary:
            typer.echo(
                f"{name}: KV waste (slots in use holding no token) mean "
                f"{summary['kv_cache_waste_mean']:.1%}, max {summary['kv_cache_waste_max']:.1%}"
            )
    if json_path:
        arguments = {
            k: v for k, v in workload_args.items() if isinstance(v, int | float | str | None)
        }
        arguments.pop("api_key", None)
        payload = {
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "arguments": arguments,
            "summaries": summaries,
            "ratios": ratios,
            "requests": {
                name: [asdict(r) for r in results] for name, (results, _, _) in runs.items()
            },
        }
        report.write_json(json_path, payload)
    if plot_path:
        report.plot({name: results for name, (results, _, _) in runs.items()}, plot_path)


def _ratios(summaries: dict[str, dict]) -> dict[str, float]:
    """Output-throughput ratios between the runs that were made."""

    def tps(name: str) -> float | None:
        summary = summaries.get(name)
        return summary["output_tokens_per_s"] if summary else None

    ratios = {}
    pairs = [
        ("continuous / one (throughput)", "engine:continuous", "engine:one"),
        ("continuous / static (throughput)", "engine:continuous", "engine:static"),
    ]
    pairs += [
        (f"{name} / engine:{mode} (throughput)", name, f"engine:{mode}")
        for name in summaries
        if name.startswith("http:")
        for mode in COMPARED_MODES
    ]
    http_runs = [name for name in summaries if name.startswith("http:")]
    pairs += [  # --url against --peer-url
        (f"{first} / {second} (throughput)", first, second) for first, second in pairwise(http_runs)
    ]
    for label, numerator, denominator in pairs:
        top, bottom = tps(numerator), tps(denominator)
        if top is not None and bottom:
            ratios[label] = top / bottom
    return ratios
