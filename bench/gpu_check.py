"""The measurements of `bench/gpu_check.sh`, one section per process, each in its own time.

    python -m bench.gpu_check SECTION --out FILE --deadline EPOCH_S [--device auto|cpu|cuda]
        [--quick] [--source SOURCE]

Sections (docs/benchmarks.md, "GPU check"):
- `correctness`: greedy tokens of the engine, prompts served together, against
  `transformers` generate for each prompt alone, with and without decode graphs, for the
  GGUF file and an HF directory exported from it (`bench/export_hf.py`);
- `steps`: eager steps of fixed shapes (decodes beside prompt chunks), the runner with a
  step's prompt chunks in one padded attention call and its decodes in few groups, and
  without, taking turns (`bench/step_times.py`);
- `throughput`: output tokens/s, TTFT and ITL at 1, 32 and 128 streams, engine-direct, with
  and without decode graphs;
- `roofline`: decode steps at batch 1 and 64 against the device's memory bandwidth;
- `scenarios`: burst-fill and noisy-neighbour, engine-direct, at rates above the capacity
  the throughput section measured (`scale_scenarios`).

Each section writes its file after every measurement and starts none it cannot finish by
its deadline, so a section stopped by the script's time limit still leaves what it
measured; `bench/gpu_report.py` merges the files into one JSON and prints a summary. On the CPU everything runs (on the tiny model, `--quick`, in the e2e test); what
needs CUDA says "skipped: no CUDA" instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench import metrics, scenario_driver, scenarios, step_times
from bench.engine_direct import run_engine, sequence_of
from bench.step_times import StepShape
from bench.workload import RequestSpec, TenantSpec, make_workload
from shared import heap, model_source
from worker.config import DEFAULT_ENGINE, EngineConfig
from worker.engine import ContinuousBatchingEngine, build_scheduler
from worker.runner import loader
from worker.runner.model_runner import ModelRunner, kv_cache_budget_bytes, num_blocks_for_budget

SECTIONS = ("correctness", "steps", "throughput", "roofline", "scenarios")
NO_CUDA = "skipped: no CUDA"
STREAMS = (1, 32, 128)
ROOFLINE_BATCH_SIZES = (1, 64)
PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "Water boils at a temperature of",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "List three prime numbers:",
    "The mitochondria is",
    "import numpy as np\nx = np.arange(10)\nprint(",
    "Translate to French: good morning",
)
# noisy-neighbour: outputs Exp(64) capped at 128 (`scenarios.noisy_neighbour`): mean 55.3.
NOISY_MEAN_OUTPUT_TOKENS = 55.3
NOISY_OVERLOAD = 1.5  # A alone sends this many times the engine's capacity


@dataclasses.dataclass(frozen=True)
class Plan:
    """What a run measures, by device and mode: a GPU's full sizes, or `--quick`'s."""

    engine: EngineConfig
    scenario_engine: EngineConfig
    num_prompts: int
    max_tokens: int
    requests_per_stream: int
    prompt_tokens: tuple[int, int]
    output_tokens_mean: float
    roofline_steps: int
    scenario_duration_s: float
    burst_batches: int  # burst-fill: A's burst is this many full batches


def plan_for(device: torch.device, quick: bool) -> Plan:
    """A GPU runs the default model at serving sizes: 128 sequences, a 2,048-token step (the
    CPU default of 192 would take ~180 steps to prefill 128 prompts), an 8 GB KV pool (not a
    fraction of free memory: every engine of the run gets the same)."""
    is_cuda = device.type == "cuda"
    engine = EngineConfig(
        max_num_seqs=128,
        max_num_batched_tokens=2048 if is_cuda else 512,
        # No smaller step while tenants share the batch on a GPU: a step costs about the same
        # at 192 tokens as at 2,048 there, so the CPU's cap only slowed A's burst by half
        # (session 21's burst-fill, fair against FIFO).
        shared_batched_tokens=None if is_cuda else DEFAULT_ENGINE.shared_batched_tokens,
        kv_cache_gb=8.0 if is_cuda else 0.25,
    )
    if quick:  # the scenarios' burst: one batch of 8, not four of 128
        small = dataclasses.replace(engine, max_num_seqs=8)
        return Plan(engine, small, 2, 6, 1, (8, 48), 6.0, 3, 1.0, 1)
    return Plan(engine, engine, len(PROMPTS), 32, 3, (32, 512), 128.0, 20, 8.0, 4)


class Section:
    """One section's results, written to its file after every measurement, by a deadline
    (epoch seconds, from the script): a measurement that could not finish by it is
    recorded as skipped."""

    def __init__(self, name: str, out: Path, deadline_s: float) -> None:
        self.name, self.out, self.deadline_s = name, out, deadline_s
        self.start_s = time.perf_counter()
        self.data: dict[str, Any] = {"status": "running"}
        self.save()

    def has_time(self, needed_s: float = 0.0) -> bool:
        return time.time() + needed_s < self.deadline_s

    def put(self, key: str, value: Any) -> None:
        self.data[key] = value
        self.save()

    def save(self, status: str | None = None) -> None:
        if status is not None:
            self.data["status"] = status
        self.data["elapsed_s"] = time.perf_counter() - self.start_s
        self.out.write_text(json.dumps({self.name: self.data}, indent=1, default=str))


def device_info(device: torch.device) -> dict[str, Any]:
    import transformers

    info: dict[str, Any] = {
        "type": device.type,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info |= {
            "name": props.name,
            "memory_gib": props.total_memory / 2**30,
            "capability": f"{props.major}.{props.minor}",
            "cuda": torch.version.cuda,
        }
    else:
        info |= {"name": platform.processor() or platform.machine(), "cuda": NO_CUDA}
    return info


def make_engine(loaded, config: EngineConfig, graphs: bool):
    """An engine as `build_engine` makes it, with decode graphs on or off on any device (on
    the CPU "on" is the padded static path, called rather than replayed)."""
    num_blocks = config.num_kv_blocks or num_blocks_for_budget(
        loaded,
        kv_cache_budget_bytes(loaded, config.kv_cache_gb, config.gpu_memory_fraction),
        config.block_size,
    )
    runner = ModelRunner(
        loaded,
        num_blocks,
        config.block_size,
        config.forward,
        graphs="on" if graphs else "off",
        max_num_seqs=config.max_num_seqs,
    )
    if loaded.device.type == "cuda":  # as `build_engine` does
        runner.warm_up(config.max_num_batched_tokens, config.max_num_seqs)
    timed = TimedRunner(runner)
    return ContinuousBatchingEngine(build_scheduler(config, num_blocks), timed), timed


class TimedRunner:
    """The runner, with each step's seconds kept by kind: replayed through a decode graph,
    or eager (prompt chunks, or shapes past the graphs' buckets)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.step_s: dict[str, list[float]] = {"replayed": [], "eager": []}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runner, name)

    def execute(self, batch):
        replays, started_s = self.runner.num_graph_replays, time.perf_counter()
        sampled = self.runner.execute(batch)  # tokens as ints: the device has finished
        kind = "replayed" if self.runner.num_graph_replays > replays else "eager"
        self.step_s[kind].append(time.perf_counter() - started_s)
        return sampled

    def step_summary(self) -> dict[str, Any]:
        """Steps of each kind: how many, their seconds in all, and their percentiles."""
        return {
            kind: {"num": len(seconds), "total_s": sum(seconds)} | metrics.percentiles(seconds)
            for kind, seconds in self.step_s.items()
            if seconds
        }


def graph_label(device: torch.device, graphs: bool) -> str:
    if not graphs:
        return "eager"
    return "cuda-graphs" if device.type == "cuda" else "static-path (no CUDA: not replayed)"


# ---- correctness ------------------------------------------------------------------------


def correctness(args, section: Section, device: torch.device, plan: Plan) -> None:
    """Greedy tokens against `generate`, per weight format, dtype and graph mode."""
    resolved = model_source.resolve(args.source)
    formats: dict[str, str | None] = {"gguf": args.source if resolved.gguf_file else None}
    dtypes = ["bfloat16", "float32"] if device.type == "cuda" else ["float32"]
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as scratch:
        for weights in ("gguf", "hf-directory"):
            if weights == "hf-directory":
                formats[weights] = _hf_directory(args.source, resolved, Path(scratch), section)
            source = formats[weights]
            for dtype in dtypes:
                if source is None or not section.has_time(20):
                    why = "skipped: the source is not a GGUF file" if source is None else None
                    results.append({"weights": weights, "dtype": dtype,
                                    "status": why or "skipped: out of time"})  # fmt: skip
                else:
                    results += _check_greedy(source, weights, dtype, device, plan)
                section.put("results", results)
    mismatches = sum(r.get("num_mismatched", 0) for r in results)
    section.put("num_runs_matching", sum(r.get("is_identical", False) for r in results))
    section.save("ok" if mismatches == 0 else "mismatch")


def _hf_directory(source: str, resolved, scratch: Path, section: Section) -> str | None:
    if not resolved.gguf_file:
        return source  # already a directory
    if not section.has_time(40):
        return None
    from bench.export_hf import export

    started = time.perf_counter()
    exported = export(source, scratch / "hf")
    section.put("export_hf_s", time.perf_counter() - started)
    return str(exported)


def _check_greedy(source: str, weights: str, dtype: str, device, plan: Plan) -> list[dict]:
    resolved = model_source.resolve(source)
    loaded = loader.load(resolved, device.type, dtype)
    tokenizer = model_source.load_tokenizer(resolved)
    prompts = [tokenizer.encode(text) for text in PROMPTS[: plan.num_prompts]]
    rows = []
    expected = None
    for graphs in (True, False):
        engine, runner = make_engine(loaded, plan.engine, graphs)
        outputs = serve_together(engine, tokenizer, prompts, plan.max_tokens)
        if expected is None:  # after the runner is made: generate runs on its fused weights
            expected = [generate_alone(loaded, prompt, plan.max_tokens) for prompt in prompts]
        mismatched = [i for i, (o, e) in enumerate(zip(outputs, expected, strict=True)) if o != e]
        rows.append({
            "weights": weights,
            "dtype": dtype,
            "graphs": graph_label(device, graphs),
            "num_prompts": len(prompts),
            "max_tokens": plan.max_tokens,
            "is_identical": not mismatched,
            "num_mismatched": len(mismatched),
            "first_divergence": [_first_divergence(outputs[i], expected[i]) for i in mismatched],
            "num_graph_replays": runner.num_graph_replays,
            "graphs_error": runner.graphs_error,
        })  # fmt: skip
        del engine, runner  # its KV pool, before the next one's
    return rows


def serve_together(engine, decoder, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Every prompt in one engine at once (a tenant each), greedy, to `max_tokens`."""
    seqs = []
    for i, prompt in enumerate(prompts):
        spec = RequestSpec(i, 0.0, prompt, max_tokens, f"t{i}")
        seq = sequence_of(spec, TenantSpec(f"t{i}"), decoder)
        if (refused := engine.add(seq)) is not None:
            raise RuntimeError(f"prompt {i} refused: {refused.error}")
        seqs.append(seq)
    while engine.has_work():
        engine.step()
    return [seq.output_token_ids for seq in seqs]


def generate_alone(loaded, prompt: list[int], max_tokens: int) -> list[int]:
    """`transformers` generate, greedy, one prompt alone: the reference (tests/reference.py)."""
    input_ids = torch.tensor([prompt], device=loaded.device)
    out = loaded.model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=max_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=loaded.pad_token_id,
    )
    return out[0, len(prompt) :].tolist()


def _first_divergence(output: list[int], expected: list[int]) -> int:
    return next(
        (i for i, (o, e) in enumerate(zip(output, expected, strict=False)) if o != e), len(output)
    )


# ---- steps, throughput, roofline, scenarios ---------------------------------------------

# Eager steps as a burst at 128 streams makes them: decodes of contexts from 37 to 600
# tokens beside the next prompts' chunks (the 2,048-token budget); `--quick`'s on the CPU.
STEP_SHAPES = [
    StepShape("128 decodes", 128, 0, 0, context_spread=True),
    StepShape("128 decodes + 4 prompt chunks of 256", 128, 256, 4, context_spread=True),
    StepShape("128 decodes + 16 prompt chunks of 64", 128, 64, 16, context_spread=True),
    StepShape("32 decodes + 8 prompt chunks of 200", 32, 200, 8, context_spread=True),
    StepShape("8 prompt chunks of 256", 0, 256, 8),
]
QUICK_STEP_SHAPES = [
    StepShape("8 decodes + 3 prompt chunks of 16", 8, 16, 3, context_spread=True),
    StepShape("3 prompt chunks of 16", 0, 16, 3),
]


def steps_section(args, section: Section, device: torch.device, plan: Plan) -> None:
    """Median eager step times: padded attention (a GPU's default) against a call per prompt
    chunk and per group of decodes (the CPU's way), in one process, taking turns."""
    loaded, _decoder = load_default(args, device)
    runners = {
        label: ModelRunner(
            loaded,
            step_times.NUM_BLOCKS,
            step_times.BLOCK_SIZE,
            plan.engine.forward,
            graphs="off",
            pad_attention=pad,
        )
        for label, pad in (("padded", True), ("per call", False))
    }
    shapes = QUICK_STEP_SHAPES if args.quick else STEP_SHAPES
    rows = step_times.measure_runners(
        runners, shapes, num_rounds=10, deadline=lambda: not section.has_time(10)
    )
    section.put("rows", [{k: v for k, v in row.items() if k != "all_s"} for row in rows])
    section.save("ok" if len(rows) == len(shapes) else "cut short: out of time")


def load_default(args, device: torch.device):
    resolved = model_source.resolve(args.source)
    dtype = "auto" if device.type == "cuda" else "float32"
    return loader.load(resolved, device.type, dtype), model_source.load_tokenizer(resolved)


def throughput(args, section: Section, device: torch.device, plan: Plan) -> None:
    """Engine-direct runs of `streams * requests_per_stream` requests arriving at once, at
    most `streams` in flight, with and without decode graphs."""
    loaded, decoder = load_default(args, device)
    runs: dict[str, Any] = {}
    # A warm process: kernels loaded, the allocator's cache grown.
    section.put("process_warm_up_s", _warm_process(loaded, decoder, plan))
    for streams in STREAMS:
        workload = make_workload(
            max(2, streams * plan.requests_per_stream),
            seed=streams,
            arrival="burst",
            burst_window_s=0.01,
            prompt_tokens_min=plan.prompt_tokens[0],
            prompt_tokens_max=plan.prompt_tokens[1],
            output_tokens_mean=plan.output_tokens_mean,
            output_tokens_max=4 * round(plan.output_tokens_mean),
        )
        for graphs in (True, False):
            label = f"{streams} streams, {graph_label(device, graphs)}"
            if not section.has_time(10):
                runs[label] = "skipped: out of time"
                continue
            engine, runner = make_engine(loaded, plan.engine, graphs)
            run = run_engine(
                engine, decoder, workload, max_concurrency=streams, show_progress=False
            )
            summary = metrics.summarize(run.results, run.duration_s)
            runs[label] = summary | {
                "streams": streams,
                "graphs": graphs,
                "num_steps": run.num_steps,
                "graph_replay_fraction": runner.num_graph_replays / max(1, run.num_steps),
                "graph_capture_s": runner.graph_capture_s,
                "graphs_error": runner.graphs_error,
                "steps": runner.step_summary(),
            }
            del engine, runner
            section.put("runs", runs)
    section.put("engine", dataclasses.asdict(plan.engine))
    section.save("ok")


def _warm_process(loaded, decoder, plan: Plan) -> float:
    """One unrecorded run of 32 streams with graphs and one eager, so that every row is
    measured in a warm process, as a serving worker is after its first minutes: the
    session 21 check measured each graph row first and cold, and its eager steps stalled
    up to a second on first-use costs the rows after it no longer paid."""
    started_s = time.perf_counter()
    workload = make_workload(
        32, seed=0, arrival="burst", burst_window_s=0.01,
        prompt_tokens_min=plan.prompt_tokens[0], prompt_tokens_max=plan.prompt_tokens[1],
        output_tokens_mean=plan.output_tokens_mean / 4, output_tokens_max=plan.max_tokens,
    )  # fmt: skip
    for graphs in (True, False):
        engine, _runner = make_engine(loaded, plan.engine, graphs)
        run_engine(engine, decoder, workload, max_concurrency=32, show_progress=False)
        del engine, _runner
    return time.perf_counter() - started_s


def roofline_section(args, section: Section, device: torch.device, plan: Plan) -> None:
    from bench import roofline

    loaded, decoder = load_default(args, device)
    heap.freeze_long_lived()  # as a worker does once its model is loaded (`shared/heap.py`)
    bandwidth = roofline.measure_bandwidth(loaded.device)
    method = "device copy" if device.type == "cuda" else "CPU tensor sum (no CUDA)"
    section.put("bandwidth", {"bytes_per_s": bandwidth, "method": method})
    points: dict[str, Any] = {}
    for batch_size in ROOFLINE_BATCH_SIZES:
        for graphs in (True, False):
            label = f"batch {batch_size}, {graph_label(device, graphs)}"
            if graphs and device.type != "cuda":
                points[label] = NO_CUDA  # the CPU's default path is the eager one
            elif section.has_time(10):
                point = roofline.measure_decode(
                    loaded, decoder, batch_size, 256, bandwidth,
                    num_steps=plan.roofline_steps, cuda_graphs=graphs,
                )  # fmt: skip
                points[label] = point.as_dict()
            else:
                points[label] = "skipped: out of time"
            section.put("points", points)
    section.save("ok")


def scale_scenarios(plan: Plan, capacity_tokens_per_s: float) -> dict[str, float]:
    """Scenario sizes that overload the engine whatever the device: A's burst is
    `burst_batches` full batches and B's light requests arrive while it drains; in
    noisy-neighbour A alone sends `NOISY_OVERLOAD` times the capacity (B and C each a tenth
    of A's rate). `capacity_tokens_per_s`: the throughput section's at 128 streams."""
    burst_size = plan.burst_batches * plan.scenario_engine.max_num_seqs
    drain_s = burst_size * 128 / capacity_tokens_per_s  # burst-fill: 128 tokens each
    capacity_requests_per_s = capacity_tokens_per_s / NOISY_MEAN_OUTPUT_TOKENS
    return {
        "burst_size": burst_size,
        "burst_duration_s": min(
            max(drain_s, plan.scenario_duration_s / 2), 4 * plan.scenario_duration_s
        ),
        "burst_light_rate_per_s": 4.0,
        "noisy_steady_rate_per_s": NOISY_OVERLOAD * capacity_requests_per_s / 10,
        "noisy_duration_s": plan.scenario_duration_s,
    }


def scenarios_section(args, section: Section, device: torch.device, plan: Plan) -> None:
    capacity = args.capacity_tokens_per_s or _capacity_from(args.throughput_json)
    if capacity is None:
        section.put("note", "no capacity measured: the throughput section's file is missing")
        capacity = 2000.0 if device.type == "cuda" else 200.0
    sizes = scale_scenarios(plan, capacity)
    section.put("capacity_tokens_per_s", capacity)
    section.put("sizes", sizes)
    loaded, decoder = load_default(args, device)
    is_flat = device.type == "cuda"  # a GPU's step time barely grows with the batch
    # The burst first: it is the larger, and a section cut short keeps what came first.
    builds = {
        "burst-fill": lambda: scenarios.burst(
            0, sizes["burst_duration_s"], sizes["burst_light_rate_per_s"],
            scenarios.FLAT_BURST_TTFT_RATIO_MAX if is_flat else scenarios.BURST_TTFT_RATIO_MAX,
            fills_kv=False, burst_size=int(sizes["burst_size"]),
        ),
        "noisy-neighbour": lambda: scenarios.noisy_neighbour(
            0, sizes["noisy_duration_s"], sizes["noisy_steady_rate_per_s"]
        ),
    }  # fmt: skip
    results: dict[str, Any] = {}
    for name, build in builds.items():
        if not section.has_time(30):
            results[name] = "skipped: out of time"
            continue
        results[name] = _run_scenario(build(), loaded, decoder, plan.scenario_engine)
        section.put("results", results)
    section.save("ok")


def _run_scenario(plan, loaded, decoder, base: EngineConfig) -> dict[str, Any]:
    def engine_for(config: EngineConfig):
        return make_engine(loaded, config, graphs=True)[0], None

    runs, durations = scenario_driver.run_plan(plan, base, engine_for, decoder)
    tenant_of = scenarios.tenant_of(plan)
    per_tenant = {
        f"{label} / {tenant}": metrics.summarize([r for r in rs if r.end_s], durations[label])
        for label, results in runs.items()
        for tenant, rs in sorted(scenarios.per_tenant(results, tenant_of).items())
    }
    evaluation = plan.evaluate(runs, durations, plan)
    return {"per_tenant": per_tenant, "checks": evaluation["checks"]}


def _capacity_from(path: str | None) -> float | None:
    if not path or not Path(path).exists():
        return None
    runs = json.loads(Path(path).read_text()).get("throughput", {}).get("runs", {})
    rates = [
        run["output_tokens_per_s"]
        for run in runs.values()
        if isinstance(run, dict) and run["streams"] == max(STREAMS) and run["graphs"]
    ]
    return max(rates) if rates else None


RUNNERS: dict[str, Callable[..., None]] = {
    "correctness": correctness,
    "steps": steps_section,
    "throughput": throughput,
    "roofline": roofline_section,
    "scenarios": scenarios_section,
}


def run_section(args) -> None:
    device, _ = loader.pick_device(args.device)
    plan = plan_for(device, args.quick)
    section = Section(args.section, Path(args.out), args.deadline)
    section.put("device", device_info(device))
    try:
        RUNNERS[args.section](args, section, device, plan)
    except Exception as exc:  # the report says which section failed, and how
        section.put("error", f"{type(exc).__name__}: {exc}")
        section.save("failed")
        raise


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_check")
    parser.add_argument("section", choices=SECTIONS)
    parser.add_argument("--out", required=True)
    parser.add_argument("--deadline", type=float, required=True, help="epoch seconds")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--source", default=model_source.DEFAULT_MODEL_ID)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--throughput-json", help="scenarios: the throughput section's file")
    parser.add_argument("--capacity-tokens-per-s", type=float)
    run_section(parser.parse_args(argv))


if __name__ == "__main__":
    main(sys.argv[1:])
