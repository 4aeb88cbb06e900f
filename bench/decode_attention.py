"""Decode attention from memory, as a decode step reads it: `cpu_attention.paged_decode` over
each of the default model's layers in turn (each layer its own pools, as the runner keeps
them), with a layer's worth of other memory (9 MB, about a layer's weights) read between the
calls, so that the keys and values come from memory, not from a cache the last call filled.
Each sequence's blocks lie in a run of their own, or (`--scattered`) anywhere in the pool, as
a server's do once sequences have come and gone. The figure is the keys' and values' bytes
over the attention's time a step, against the plain read of the roofline's probe between
the steps (docs/benchmarks.md, session 36: 8-17 GB/s at one sequence where the memory gave
30-60).

With `--baseline` (another build of the kernels, a .so made from an earlier commit's
worktree as in `bench/few_rows_stream.py`), each step is taken by both builds in turn, in a
rotating order, so that the two see the same memory (its rate flips from second to second on
some hosts); the figures are per build over the same steps.

    python -m bench.decode_attention --json bench/results/decode-attention-cpu.json
    python -m bench.decode_attention --rows 32 --context 256 --steps 20 --json ...
    python -m bench.decode_attention --baseline /tmp/base-kernels/*.so --scattered --json ...
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time

import torch

from bench import kernel_run, report, roofline
from worker.runner import cpu_kernels, host_memory

HEADS, KV_HEADS, DIM, BLOCK, LAYERS = 9, 3, 64, 16, 30  # the default model's
BETWEEN_BYTES = 9 * 2**20  # read between two layers' calls: about a layer's weights


def _pools(
    layers: int, num_blocks: int, dtype: torch.dtype = torch.bfloat16
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    shape = (KV_HEADS, num_blocks, BLOCK, DIM)
    keys = [host_memory.zeros(shape, dtype).normal_(0, 1) for _ in range(layers)]
    values = [host_memory.zeros(shape, dtype).normal_(0, 1) for _ in range(layers)]
    return keys, values


def _tables(rows: int, blocks: int, scattered: bool = False) -> torch.Tensor:
    """Each sequence's block table, none shared: its blocks in a run of their own, or (where
    `scattered`) a seeded shuffle of the pool's blocks."""
    order = torch.arange(rows * blocks, dtype=torch.int32)
    if scattered:
        order = order[torch.randperm(rows * blocks, generator=torch.Generator().manual_seed(0))]
    return order.view(rows, blocks).contiguous()


def measure_case(
    rows: int,
    context: int,
    steps: int,
    layers: int = LAYERS,
    scattered: bool = False,
    baseline: ctypes.CDLL | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> dict:
    """One (rows, context): the attention's milliseconds a step (the median of `steps`), and
    its keys' and values' rate against the plain read around the steps; with `baseline`, the
    same for that build, its steps taken in turns with this one's."""
    blocks = (context + BLOCK - 1) // BLOCK
    keys, values = _pools(layers, rows * blocks, dtype)
    tables = _tables(rows, blocks, scattered)
    lengths = torch.full((rows,), context, dtype=torch.int32)
    q = torch.randn(rows, HEADS, DIM).to(dtype)
    between = host_memory.zeros((layers, BETWEEN_BYTES // 4), torch.float32).fill_(1.0)
    out = torch.empty_like(q)
    # the kernel's own entry, its arguments made once: a decode step calls it from C
    # (`decode_layers.c`), where `cpu_attention.paged_decode`'s checks and tensors cost
    # ~20 us a call (as much as the attention itself at one sequence)
    library = cpu_kernels.load()
    if library is None:
        raise RuntimeError("the CPU attention kernel needs a C compiler")
    libraries = {"this": library, **({"baseline": baseline} if baseline else {})}
    calls = [
        (q.data_ptr(), k.data_ptr(), v.data_ptr(), tables.data_ptr(), lengths.data_ptr(),
         out.data_ptr(), rows, HEADS, KV_HEADS, rows * blocks, BLOCK, DIM, blocks,
         int(dtype == torch.bfloat16), DIM**-0.5)
        for k, v in zip(keys, values, strict=True)
    ]  # fmt: skip
    probe = roofline.BandwidthProbe()
    plain = [probe.bytes / probe.read() / 1e9]

    def step(kernels: ctypes.CDLL) -> float:
        elapsed = 0.0
        for layer in range(layers):
            between[layer].sum()
            started = time.perf_counter()
            status = kernels.paged_decode(*calls[layer])
            elapsed += time.perf_counter() - started
            if status != 0:
                raise RuntimeError(f"paged_decode failed ({status})")
        return elapsed

    names = list(libraries)
    for name in names:
        step(libraries[name])  # warm-up: the first calls' allocations
    times: dict[str, list[float]] = {name: [] for name in names}
    for index in range(steps):
        for name in names[index % len(names) :] + names[: index % len(names)]:
            times[name].append(step(libraries[name]))
    plain.append(probe.bytes / probe.read() / 1e9)
    kv_bytes = rows * layers * context * KV_HEADS * DIM * 2 * q.element_size()  # keys, values

    def figures(side: list[float]) -> dict:
        median_s = statistics.median(side)
        return {
            "attention_ms": [t * 1e3 for t in side],
            "median_attention_ms": median_s * 1e3,
            "kv_gb_per_s": kv_bytes / median_s / 1e9,
        }

    case = {
        "rows": rows,
        "context": context,
        "layers": layers,
        "steps": steps,
        "scattered": scattered,
        "dtype": str(dtype).removeprefix("torch."),
        "kv_bytes": kv_bytes,
        **figures(times["this"]),
        "plain_read_gb_per_s": plain,  # before and after the steps
    }
    if baseline:
        case["baseline"] = figures(times["baseline"])
        # the baseline's time over this build's, step by step (same memory, a step apart)
        case["speedup_median"] = statistics.median(
            b / a for a, b in zip(times["this"], times["baseline"], strict=True)
        )
    return case


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, action="append", help="sequences (repeatable)")
    parser.add_argument("--context", type=int, action="append", help="tokens (repeatable)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--scattered", action="store_true", help="blocks anywhere in the pool")
    parser.add_argument("--baseline", help="another build of the kernels (a .so), in turns")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                        help="the pools' and queries' (fp32: a model on a CPU without bf16 units)")  # fmt: skip
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    dtype = getattr(torch, args.dtype)
    baseline = kernel_run.with_signatures(args.baseline) if args.baseline else None
    cases = []
    for rows in args.rows or [1, 8, 32]:
        for context in args.context or [256, 1000]:
            case = measure_case(
                rows, context, args.steps, scattered=args.scattered, baseline=baseline, dtype=dtype
            )
            cases.append(case)
            low, high = sorted(case["plain_read_gb_per_s"])
            line = (
                f"{rows:3d} sequences x {context:5d} tokens: {case['median_attention_ms']:7.2f} ms"
                f" a step, KV {case['kv_bytes'] / 1e6:6.1f} MB at {case['kv_gb_per_s']:5.1f} GB/s"
            )
            if baseline:
                line += (
                    f"; baseline {case['baseline']['median_attention_ms']:7.2f} ms"
                    f" ({case['speedup_median']:.2f}x this build's time, median)"
                )
            print(f"{line} (plain read {low:.1f}-{high:.1f})")
    if args.json:
        header = {**kernel_run.header(), "scattered": args.scattered, "baseline": args.baseline,
                  "dtype": args.dtype}  # fmt: skip
        report.write_json(args.json, {**header, "cases": cases})


if __name__ == "__main__":
    main()
