"""A decode step's matmuls of a few rows (the few-row kernel, `csrc/few_rows.c`) against a
plain read of the same weights, alternating in one process, and against another build of
the kernels where one is given (one row of x, a batch-1 step's, unless `--rows` says
otherwise): the default model's 30 layers (fused QKV, o, gate-up, down) and its LM head,
269 MB of bf16 weights in huge pages, streamed from memory.

On a shared host the memory's rate moves from second to second (docs/benchmarks.md: 32 to 58
GB/s within a minute on an AMD EPYC host), so the sides take turns, each round in another
order, and the figures are per side over the same rounds.

    python -m bench.few_rows_stream --json bench/results/few-rows-stream-cpu.json
    # against the kernels of another commit, built by its own tree into a cache of its own:
    git worktree add /tmp/wt-base BASE
    (cd /tmp/wt-base && LLMFLEET_KERNEL_CACHE=/tmp/base-kernels python -c \\
        "from worker.runner import cpu_kernels; cpu_kernels.load()")
    python -m bench.few_rows_stream --baseline /tmp/base-kernels/*.so --json ...
    # steps of 1-8 sequences, each row count measured as above in turn:
    python -m bench.few_rows_stream --rows 1 --rows 4 --rows 8 --baseline ... --json ...
    # this build reading each thread's rows of w in one place and in two, as sides
    # (`few_rows_streams`; `LLMFLEET_CPU_STREAMS` sets the runner's, `set_streams`):
    python -m bench.few_rows_stream --places --rows 1 --rows 2 --rows 8 --json ...
    # on a CPU with AMX, AMX's kernel as a side too, over the same weights in its tile layout
    # (`AMX_FROM_ROWS`, the rows from which a decode step takes it), and with --baseline the
    # baseline's AMX kernel as well:
    python -m bench.few_rows_stream --amx --rows 1 --rows 4 --rows 8 [--baseline ...] --json ...
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time

import torch

from bench import kernel_run, report
from worker.runner import host_memory
from worker.runner.cpu_kernels import amx_matmuls_available, load

HIDDEN, INTER, QKV, VOCAB, LAYERS = 576, 1536, 960, 49152, 30  # the default model's
SHAPES = [(QKV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER)] * LAYERS + [
    (VOCAB, HIDDEN)
]


def _weights() -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One arena in huge pages holding every matrix, in a decode step's order."""
    total = sum(n * k for n, k in SHAPES)
    arena = host_memory.zeros((total,), torch.bfloat16)
    generator = torch.Generator().manual_seed(0)
    matrices, start = [], 0
    for n, k in SHAPES:
        view = arena[start : start + n * k].view(n, k)
        view.copy_((torch.randn(n, k, generator=generator) * 0.05).to(torch.bfloat16))
        matrices.append(view)
        start += n * k
    return arena, matrices


def _matmuls(library: ctypes.CDLL, matrices, x: torch.Tensor, y: torch.Tensor) -> float:
    started = time.perf_counter()
    for w in matrices:
        n, k = w.shape
        failed = library.matmul_few_rows(
            x.data_ptr(), w.data_ptr(), None, y.data_ptr(), x.shape[0], n, k
        )
        if failed:
            raise RuntimeError(f"matmul_few_rows failed ({failed})")
    return time.perf_counter() - started


def _packed(library: ctypes.CDLL, matrices) -> tuple[torch.Tensor, list[tuple]]:
    """The matrices in AMX's tile layout (`amx_pack`), one arena in huge pages, in order."""
    arena = host_memory.zeros((sum(w.numel() for w in matrices),), torch.bfloat16)
    packed, start = [], 0
    for w in matrices:
        n, k = w.shape
        view = arena[start : start + n * k]
        library.amx_pack(w.data_ptr(), view.data_ptr(), n, k)
        packed.append((view, n, k))
        start += n * k
    return arena, packed


def _amx_matmuls(library: ctypes.CDLL, packed, x: torch.Tensor, y: torch.Tensor) -> float:
    started = time.perf_counter()
    for w, n, k in packed:
        failed = library.amx_matmul(
            x.data_ptr(), w.data_ptr(), None, y.data_ptr(), x.shape[0], n, k
        )
        if failed:
            raise RuntimeError(f"amx_matmul failed ({failed})")
    return time.perf_counter() - started


def _plain_read(arena: torch.Tensor) -> float:
    flat = arena.view(torch.float32)  # as the roofline's probe reads (bench/roofline.py)
    started = time.perf_counter()
    flat.sum()
    return time.perf_counter() - started


def _in_places(library: ctypes.CDLL, rows: int, places: int, matrices, x, y) -> float:
    was = library.few_rows_streams(rows, places)
    try:
        return _matmuls(library, matrices, x, y)
    finally:
        library.few_rows_streams(rows, was)


def measure(
    rounds: int, baseline: str | None, rows: int = 1, amx: bool = False, places: bool = False
) -> dict:
    library = load()
    if library is None or not library.few_rows_available():
        raise RuntimeError("the few-row kernel needs a C compiler and a CPU with AVX512-BF16")
    if amx and not amx_matmuls_available():
        raise RuntimeError("--amx needs a CPU with AMX (and LLMFLEET_CPU_AMX not 0)")
    sides = {"kernel": library}
    if baseline:
        sides["baseline"] = kernel_run.with_signatures(baseline)
    arena, matrices = _weights()
    packed = _packed(library, matrices) if amx else None
    num_bytes = arena.numel() * arena.element_size()
    x = (torch.randn(rows, INTER) * 0.5).to(torch.bfloat16)  # each matmul reads [rows, k] of it
    outputs = {name: torch.empty(rows, VOCAB, dtype=torch.bfloat16) for name in sides}
    for name, lib in sides.items():  # warm-up, and the two builds' outputs compared
        _matmuls(lib, matrices, x, outputs[name])
    y = torch.empty(rows, VOCAB, dtype=torch.bfloat16)
    runs = {"plain read": lambda: _plain_read(arena)} | {
        name: lambda lib=lib, out=outputs[name]: _matmuls(lib, matrices, x, out)
        for name, lib in sides.items()
    }  # fmt: skip
    if places:  # this build's kernel in one place a thread and in two, in place of "kernel"
        del runs["kernel"]
        for name, count in (("one place", 1), ("two places", 2)):
            outputs[name] = torch.empty(rows, VOCAB, dtype=torch.bfloat16)
            runs[name] = lambda n=count, out=outputs[name]: _in_places(
                library, rows, n, matrices, x, out
            )
    if packed is not None:
        runs["amx"] = lambda: _amx_matmuls(library, packed[1], x, y)
        if baseline:  # the baseline's AMX kernel over the same packed weights
            runs["amx baseline"] = lambda: _amx_matmuls(sides["baseline"], packed[1], x, y)
    for run in runs.values():
        run()
    names = list(runs)
    times: dict[str, list[float]] = {name: [] for name in names}
    for index in range(rounds):
        for name in names[index % len(names) :] + names[: index % len(names)]:
            times[name].append(runs[name]())
    result: dict = {"rows": rows, "bytes": num_bytes, "rounds": rounds, "sides": {}}
    for name in names:
        rates = [num_bytes / t / 1e9 for t in times[name]]
        result["sides"][name] = {
            "mean_gb_per_s": num_bytes / statistics.mean(times[name]) / 1e9,
            "median_gb_per_s": statistics.median(rates),
            "best_gb_per_s": max(rates),
            "of_plain_read_median": statistics.median(
                p / t for p, t in zip(times["plain read"], times[name], strict=True)
            ),
        }
    if places:
        result["two_places_over_one_median"] = statistics.median(
            o / t for o, t in zip(times["one place"], times["two places"], strict=True)
        )
        result["same_bits"] = torch.equal(outputs["one place"], outputs["two places"])
    if baseline:
        result["kernel_over_baseline_median"] = statistics.median(
            b / k for k, b in zip(times["kernel"], times["baseline"], strict=True)
        )
        result["same_bits"] = torch.equal(outputs["kernel"], outputs["baseline"])
    if packed is not None:  # the AMX side's time over the few-row kernel's, round by round
        result["amx_over_kernel_median"] = statistics.median(
            a / k for k, a in zip(times["kernel"], times["amx"], strict=True)
        )
        if baseline:
            result["amx_over_amx_baseline_median"] = statistics.median(
                a / b for a, b in zip(times["amx"], times["amx baseline"], strict=True)
            )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--rows", type=int, action="append", help="rows of x (1-8; repeatable)")
    parser.add_argument("--baseline", help="another build of the kernels (a .so) to compare")
    parser.add_argument("--amx", action="store_true", help="AMX's kernel as a side too")
    parser.add_argument(
        "--places", action="store_true", help="the kernel in one place a thread and in two"
    )
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.places and (args.baseline or args.amx):
        parser.error("--places compares this build with itself: not with --baseline or --amx")
    torch.set_grad_enabled(False)
    results = [
        measure(args.rounds, args.baseline, rows, args.amx, args.places)
        for rows in args.rows or [1]
    ]
    for result in results:
        print(
            f"{result['rows']} rows of x: {result['bytes'] / 1e6:.0f} MB a pass, {args.rounds}"
            f" rounds, {torch.get_num_threads()} threads"
        )
        for name, side in result["sides"].items():
            print(
                f"{name:11s} mean {side['mean_gb_per_s']:5.1f} GB/s  median"
                f" {side['median_gb_per_s']:5.1f}  best {side['best_gb_per_s']:5.1f}  (median of"
                f" the rounds' ratios to the plain read: {side['of_plain_read_median']:.2f})"
            )
        if args.amx:
            print(f"AMX's time / the few-row kernel's, median of the rounds: "
                  f"{result['amx_over_kernel_median']:.3f}")  # fmt: skip
        if args.amx and args.baseline:
            print(f"AMX's time / the baseline's AMX time, median of the rounds: "
                  f"{result['amx_over_amx_baseline_median']:.3f}")  # fmt: skip
        if args.places:
            print(
                f"two places / one place speed, median of the rounds: "
                f"{result['two_places_over_one_median']:.3f}; same bits: {result['same_bits']}"
            )
        if args.baseline:
            print(
                f"kernel / baseline speed, median of the rounds: "
                f"{result['kernel_over_baseline_median']:.3f}; same bits: {result['same_bits']}"
            )
    if args.json:
        # one row count: its result at the top level, as before --rows; several: a list
        body = results[0] if len(results) == 1 else {"points": results}
        report.write_json(args.json, {**kernel_run.header(), "baseline": args.baseline, **body})


if __name__ == "__main__":
    main()
