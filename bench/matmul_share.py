"""The AMX matmul's two ways of sharing a matmul between threads, alternating in one process:
fixed shares (each thread its contiguous blocks) against items with stealing (each thread its
own blocks' items first, then what is left of the others'; `csrc/amx_matmul.c`). A "layer"
is the default model's four projections (fused QKV, o, the gate-up with its silu, down) at a
row count. `--busy F` runs a process beside that spins F of every 10 ms, as the API process
and the clients do beside the worker on a two-core machine (docs/benchmarks.md, session 31).

    python -m bench.matmul_share --json bench/results/matmul-share-cpu.json
    python -m bench.matmul_share --busy 0.3 --json bench/results/matmul-share-busy-cpu.json
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time

import torch

from bench import kernel_run, report
from worker.runner.cpu_kernels import amx_matmuls_available, load

HIDDEN, INTER, QKV = 576, 1536, 960  # the default model's (9 heads, 3 KV heads of 64)
ROWS = [1, 8, 16, 32, 64, 192, 384, 1024, 2048]


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


def _layer(library, layer, inputs, outputs, rows: int, share: int) -> float:
    """One layer's four matmuls, sharing on (1) or off (0): seconds."""
    library.amx_share(share)
    started = time.perf_counter()
    for (packed, n, k, silu), out in zip(layer, outputs, strict=True):
        kernel = library.amx_matmul_silu if silu else library.amx_matmul
        kernel(inputs[k].data_ptr(), packed.data_ptr(), None, out.data_ptr(), rows, n, k)
    return time.perf_counter() - started


def measure(rounds: int, rows_list: list[int]) -> list[dict]:
    library = load()
    if library is None:
        raise RuntimeError("the CPU kernels could not be built")
    generator = torch.Generator().manual_seed(0)
    # (packed weight, n, k, fused silu): n is the output width (the gate-up's half when fused)
    layer = [
        (_packed(library, QKV, HIDDEN, generator), QKV, HIDDEN, False),
        (_packed(library, HIDDEN, HIDDEN, generator), HIDDEN, HIDDEN, False),
        (_packed(library, 2 * INTER, HIDDEN, generator), INTER, HIDDEN, True),
        (_packed(library, HIDDEN, INTER, generator), HIDDEN, INTER, False),
    ]
    results = []
    for rows in rows_list:
        inputs = {
            k: torch.randn(rows, k, generator=generator).to(torch.bfloat16) for k in (HIDDEN, INTER)
        }
        outputs = {
            share: [torch.empty(rows, n, dtype=torch.bfloat16) for _, n, _, _ in layer]
            for share in (0, 1)
        }

        for share in (0, 1):  # warm-up
            _layer(library, layer, inputs, outputs[share], rows, share)
        times: dict[int, list[float]] = {0: [], 1: []}
        for index in range(rounds):
            for share in (0, 1) if index % 2 == 0 else (1, 0):
                times[share].append(_layer(library, layer, inputs, outputs[share], rows, share))
        library.amx_share(1)
        fixed, shared = (statistics.median(times[s]) * 1e3 for s in (0, 1))
        flops = 2 * rows * (QKV * HIDDEN + HIDDEN * HIDDEN + 2 * INTER * HIDDEN + HIDDEN * INTER)
        results.append(
            {
                "rows": rows,
                "fixed_ms": fixed,
                "shared_ms": shared,
                "shared_over_fixed": shared / fixed,
                "fixed_gflops": flops / fixed / 1e6,
                "same_bits": all(
                    torch.equal(a, b) for a, b in zip(outputs[0], outputs[1], strict=True)
                ),
            }
        )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=60, help="alternations per row count")
    parser.add_argument("--rows", type=int, action="append", help=f"row counts (default {ROWS})")
    parser.add_argument("--busy", type=float, default=0.0, help="a spinning neighbour's duty, 0-1")
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
        rows = measure(args.rounds, args.rows or ROWS)
    finally:
        if neighbour is not None:
            neighbour.terminate()
    print(
        f"threads {torch.get_num_threads()}; neighbour spinning {args.busy:.0%}; median ms a layer"
    )
    for row in rows:
        print(
            f"{row['rows']:5d} rows: fixed {row['fixed_ms']:8.3f}  shared {row['shared_ms']:8.3f}"
            f"  ({row['shared_over_fixed']:.2f}x the time; same bits: {row['same_bits']})"
        )
    if args.json:
        report.write_json(
            args.json,
            {
                **kernel_run.header(),
                "busy": args.busy,
                "rounds": args.rounds,
                "rows": rows,
            },
        )


if __name__ == "__main__":
    main()
