"""The AMX matmul's ways of sharing a matmul between threads, taking turns in one process
(`csrc/amx_matmul.c`): `fixed` (each thread its contiguous blocks), `blocks` (items of each
thread's blocks, the others' stolen when its own are done: session 31) and `rows` (the
default: from the kernel's row threshold on, each thread's items are its contiguous rows over
every block instead: session 35). A "layer" is the default model's four projections (fused
QKV, o, the gate-up with its silu, down) at a row count. `--busy F` runs a process beside
that spins F of every 10 ms, as the API process and the clients do beside the worker on a
two-core machine (docs/benchmarks.md, session 31). `--steps` times whole prompt steps of the
model instead (`bench.step_times`' shapes through the runner), `blocks` against `rows`: the
row share's gain is its rows staying in the L2 of the thread whose element-wise work wrote
them, which a layer alone, its inputs hot in both caches, does not show.

    python -m bench.matmul_share --json bench/results/matmul-share-cpu.json
    python -m bench.matmul_share --busy 0.3 --json bench/results/matmul-share-busy-cpu.json
    python -m bench.matmul_share --steps --json bench/results/matmul-share-steps-cpu.json
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time

import torch

from bench import kernel_run, report
from bench.step_times import BLOCK_SIZE, StepShape, make_batch
from shared import model_source
from worker.runner import llama, loader
from worker.runner.cpu_kernels import amx_matmuls_available, load
from worker.runner.model_runner import ModelRunner

HIDDEN, INTER, QKV = 576, 1536, 960  # the default model's (9 heads, 3 KV heads of 64)
ROWS = [1, 8, 16, 32, 64, 192, 384, 1024, 2048]
NEVER = 1 << 30  # a row threshold no matmul reaches: the shares stay blocks
SIDES = ("fixed", "blocks", "rows")
STEP_SHAPES = [  # prompt steps: chunks of 256 tokens (a burst's prompts), one of 2,048
    StepShape("prompt 2 x 256", 0, 256, 2),
    StepShape("prompt 4 x 256", 0, 256, 4),
    StepShape("prompt 8 x 256", 0, 256, 8),
    StepShape("prompt 2048", 0, 2048),
    StepShape("32 decodes + 512 prompt tokens", 32, 512),
]


def _spin(duty: float) -> None:
    period = 0.01
    while True:
        started = time.perf_counter()
        while time.perf_counter() - started < duty * period:
            pass
        time.sleep((1 - duty) * period)


def _packed(library, n: int, k: int, generator: torch.Generator) -> torch.Tensor:
    weight = (torch.randn(n, k, generator=generator) * 0.05).to(torch.bfloat16)
    packed = torch.empty_like(weight)
    library.amx_pack(weight.data_ptr(), packed.data_ptr(), n, k)
    return packed


def _side(library, side: str, row_share: int) -> None:
    """The kernel's sharing set to `side`; `row_share` is its default row threshold."""
    library.amx_share(int(side != "fixed"))
    library.amx_row_share(row_share if side == "rows" else NEVER)


def _layer(library, layer, inputs, outputs, rows: int) -> float:
    """One layer's four matmuls as the kernel is set to share them: seconds."""
    started = time.perf_counter()
    for (packed, n, k, silu), out in zip(layer, outputs, strict=True):
        kernel = library.amx_matmul_silu if silu else library.amx_matmul
        kernel(inputs[k].data_ptr(), packed.data_ptr(), None, out.data_ptr(), rows, n, k)
    return time.perf_counter() - started


def measure(rounds: int, rows_list: list[int]) -> list[dict]:
    library = load()
    if library is None:
        raise RuntimeError("the CPU kernels could not be built")
    row_share = library.amx_row_share(NEVER)
    generator = torch.Generator().manual_seed(0)
    # (packed weight, n, k, fused silu): n is the output width (the gate-up's half when fused)
    layer = [
        (_packed(library, QKV, HIDDEN, generator), QKV, HIDDEN, False),
        (_packed(library, HIDDEN, HIDDEN, generator), HIDDEN, HIDDEN, False),
        (_packed(library, 2 * INTER, HIDDEN, generator), INTER, HIDDEN, True),
        (_packed(library, HIDDEN, INTER, generator), HIDDEN, INTER, False),
    ]
    results = []
    try:
        for rows in rows_list:
            inputs = {
                k: torch.randn(rows, k, generator=generator).to(torch.bfloat16)
                for k in (HIDDEN, INTER)
            }
            outputs = {
                side: [torch.empty(rows, n, dtype=torch.bfloat16) for _, n, _, _ in layer]
                for side in SIDES
            }
            times: dict[str, list[float]] = {side: [] for side in SIDES}
            for index in range(rounds + 1):  # the first round a warm-up
                for side in SIDES if index % 2 == 0 else SIDES[::-1]:
                    _side(library, side, row_share)
                    seconds = _layer(library, layer, inputs, outputs[side], rows)
                    if index:
                        times[side].append(seconds)
            ms = {side: statistics.median(times[side]) * 1e3 for side in SIDES}
            flops = (
                2 * rows * (QKV * HIDDEN + HIDDEN * HIDDEN + 2 * INTER * HIDDEN + HIDDEN * INTER)
            )
            results.append(
                {
                    "rows": rows,
                    "ms": ms,
                    "gflops": {side: flops / ms[side] / 1e6 for side in SIDES},
                    "same_bits": all(
                        torch.equal(a, b)
                        for side in SIDES[1:]
                        for a, b in zip(outputs["fixed"], outputs[side], strict=True)
                    ),
                }
            )
    finally:
        _side(library, "rows", row_share)
    return results


def measure_steps(rounds: int, source: str, baseline: str | None = None) -> list[dict]:
    """Whole prompt steps of the model, the sides taking turns: `blocks` and `rows` (this
    build's matmul sharing by blocks, and as it does by default) and, with `baseline`,
    another build's matmuls (a .so: its own defaults) over the same packed weights, the rest
    of the step this build's. Median ms each."""
    library = load()
    if library is None:
        raise RuntimeError("the CPU kernels could not be built")
    row_share = library.amx_row_share(NEVER)
    loaded = loader.load(model_source.resolve(source), "auto", "bfloat16")
    runner = ModelRunner(loaded, 4096, BLOCK_SIZE)
    sides = ("blocks", "rows", *(["baseline"] if baseline else []))
    matmuls = {"blocks": library, "rows": library}
    if baseline:
        matmuls["baseline"] = kernel_run.with_signatures(baseline)

    def use(side: str) -> None:
        llama.load = lambda: matmuls[side]  # type: ignore[assignment]  # `_Linear`'s name
        if side != "baseline":
            _side(library, side, row_share)

    results = []
    try:
        for shape in STEP_SHAPES:
            batch = make_batch(shape)
            times: dict[str, list[float]] = {side: [] for side in sides}
            for index in range(rounds + 1):  # the first round a warm-up
                for side in sides if index % 2 == 0 else sides[::-1]:
                    use(side)
                    started = time.perf_counter()
                    runner.execute(batch)
                    if index:
                        times[side].append(time.perf_counter() - started)
            ms = {side: statistics.median(times[side]) * 1e3 for side in sides}
            results.append(
                {
                    "shape": shape.name,
                    "num_decodes": shape.num_decodes,
                    "prefill_tokens": shape.prefill_tokens * shape.num_chunks,
                    "ms": ms,
                    "over_rows": {side: ms[side] / ms["rows"] for side in sides},
                }
            )
    finally:
        llama.load = load
        _side(library, "rows", row_share)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=60, help="alternations per row count")
    parser.add_argument("--rows", type=int, action="append", help=f"row counts (default {ROWS})")
    parser.add_argument("--busy", type=float, default=0.0, help="a spinning neighbour's duty, 0-1")
    parser.add_argument("--steps", action="store_true", help="whole prompt steps of the model")
    parser.add_argument("--source", default=model_source.DEFAULT_MODEL_ID, help="with --steps")
    parser.add_argument("--baseline", help="with --steps: another build of the kernels (a .so)")
    parser.add_argument("--json")
    args = parser.parse_args()
    if not amx_matmuls_available():
        raise SystemExit("the AMX matmul is not available here (a CPU with AMX-BF16, a compiler)")
    torch.set_grad_enabled(False)
    neighbour = None
    if args.busy > 0:
        neighbour = multiprocessing.get_context("spawn").Process(
            target=_spin, args=(args.busy,), daemon=True
        )
        neighbour.start()
    try:
        if args.steps:
            steps = measure_steps(args.rounds, args.source, args.baseline)
        else:
            rows = measure(args.rounds, args.rows or ROWS)
    finally:
        if neighbour is not None:
            neighbour.terminate()
    print(
        f"threads {torch.get_num_threads()}; neighbour spinning {args.busy:.0%}; median ms "
        + ("a step" if args.steps else "a layer")
    )
    if args.steps:
        for step in steps:
            times = "  ".join(
                f"{side} {ms:7.1f} ({step['over_rows'][side]:.3f}x)"
                for side, ms in step["ms"].items()
            )
            print(f"{step['shape']:>32}: {times}")
    else:
        for row in rows:
            times = "  ".join(f"{side} {row['ms'][side]:8.3f}" for side in SIDES)
            print(f"{row['rows']:5d} rows: {times}  (same bits: {row['same_bits']})")
    if args.json:
        report.write_json(
            args.json,
            {
                **kernel_run.header(),
                "busy": args.busy,
                "rounds": args.rounds,
                **(
                    {"source": args.source, "baseline": args.baseline, "steps": steps}
                    if args.steps
                    else {"rows": rows}
                ),
            },
        )


if __name__ == "__main__":
    main()
