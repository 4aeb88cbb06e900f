"""Prompt-chunk attention on this CPU: our kernel (`cpu_attention.paged_prefill`) against
torch's SDPA on the same chunk, at the default model's shapes (9 query heads, 3 KV heads,
head dimension 64, blocks of 16), for whole prompts and later chunks of long ones. What
`cpu_attention.has_amx` chooses between is judged by this (docs/benchmarks.md, session 25).
`--steps`: one layer of a step's prompt chunks (each of its own sequence, rows one after the
other as the runner packs them), the kernel called once a chunk (`paged_prefill`, as `attend`
did up to session 34) against once for them all (`paged_prefill_spans`), taking turns.

    python -m bench.prompt_attention --json bench/results/prompt-attention-cpu.json
    python -m bench.prompt_attention --steps --json bench/results/prompt-spans-cpu.json

`--baseline`: the kernel of another build (a .so made by a worktree of an earlier commit, as
in `bench/few_rows_stream.py`) beside this build's, the two taking turns on each case.

    python -m bench.prompt_attention --baseline /tmp/base-kernels/*.so --json ...
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from bench import kernel_run, report
from worker.runner import cpu_attention

HEADS, KV_HEADS, DIM, BLOCK = 9, 3, 64, 16
SCALE = DIM**-0.5
CASES = [
    (64, 0),
    (256, 0),
    (512, 0),
    (1024, 0),
    (2048, 0),
    (256, 256),
    (128, 768),
    (32, 1000),
    (384, 1664),
]  # (tokens, start)


def _median_ms(fn, repeat: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return sorted(times)[len(times) // 2] * 1e3


def _turns_ms(sides: dict, repeat: int) -> dict[str, list[float]]:
    """Each side's times (ms), the sides taking turns, every other round in reverse order."""
    times: dict[str, list[float]] = {name: [] for name in sides}
    for index in range(repeat + 3):  # the first three rounds a warm-up
        for name, fn in list(sides.items())[:: 1 if index % 2 else -1]:
            started = time.perf_counter()
            fn()
            if index >= 3:
                times[name].append((time.perf_counter() - started) * 1e3)
    return times


def measure(repeat: int = 20, baseline: str | None = None) -> list[dict]:
    other = kernel_run.with_signatures(baseline) if baseline else None
    generator = torch.Generator().manual_seed(0)
    rows = []
    for tokens, start in CASES:
        end = start + tokens
        num_blocks = -(-end // BLOCK)
        shape = (KV_HEADS, num_blocks, BLOCK, DIM)
        k_pool = torch.randn(shape, generator=generator).to(torch.bfloat16)
        v_pool = torch.randn(shape, generator=generator).to(torch.bfloat16)
        table = torch.arange(num_blocks, dtype=torch.int32)
        q = torch.randn(tokens, HEADS, DIM, generator=generator).to(torch.bfloat16)
        k = k_pool.flatten(1, 2)[None, :, :end]
        v = v_pool.flatten(1, 2)[None, :, :end]
        mask = (torch.arange(end)[None, :] <= torch.arange(start, end)[:, None])[None, None]

        def kernel(q=q, k_pool=k_pool, v_pool=v_pool, table=table, start=start):
            return cpu_attention.paged_prefill(q, k_pool, v_pool, table, start, SCALE)

        def sdpa(q=q, k=k, v=v, mask=mask, start=start):
            return F.scaled_dot_product_attention(
                q.transpose(0, 1)[None], k, v,
                attn_mask=mask if start else None, is_causal=not start,
                scale=SCALE, enable_gqa=True,
            )[0].transpose(0, 1)  # fmt: skip

        row = {"tokens": tokens, "start": start, "sdpa_ms": _median_ms(sdpa, repeat)}
        if cpu_attention.has_prefill_kernel():
            row["kernel_ms"] = _median_ms(kernel, repeat)
            row["max_abs_difference"] = (kernel().float() - sdpa().float()).abs().max().item()
        if other is not None:

            def kernel_of_baseline(kernel=kernel):
                with kernel_run.attention_from(other):
                    return kernel()

            times = _turns_ms({"kernel": kernel, "baseline": kernel_of_baseline}, repeat)
            row["kernel_ms"] = statistics.median(times["kernel"])
            row["baseline_ms"] = statistics.median(times["baseline"])
            row["baseline_over_kernel"] = statistics.median(
                b / a for a, b in zip(times["kernel"], times["baseline"], strict=True)
            )
            row["same_bits"] = torch.equal(kernel(), kernel_of_baseline())
        rows.append(row)
    return rows


STEP_CASES = [(32, 64), (16, 128), (8, 256), (4, 512), (2, 1024)]  # (chunks, tokens each)


def measure_steps(repeat: int = 20) -> list[dict]:
    """Median ms of one layer's chunks, a call each against one call, taking turns."""
    generator = torch.Generator().manual_seed(0)
    rows = []
    for count, tokens in STEP_CASES:
        per_chunk = -(-tokens // BLOCK)
        shape = (KV_HEADS, count * per_chunk, BLOCK, DIM)
        k_pool = torch.randn(shape, generator=generator).to(torch.bfloat16)
        v_pool = torch.randn(shape, generator=generator).to(torch.bfloat16)
        order = torch.randperm(count * per_chunk, generator=generator).to(torch.int32)
        chunks = [
            (c * tokens, tokens, 0, order[c * per_chunk : (c + 1) * per_chunk])
            for c in range(count)
        ]
        spans = cpu_attention.PromptSpans.of(chunks)
        q = torch.randn(count * tokens, HEADS, DIM, generator=generator).to(torch.bfloat16)
        out = torch.empty_like(q)

        def each(q=q, k_pool=k_pool, v_pool=v_pool, chunks=chunks, out=out):
            for first, length, start, table in chunks:
                rows_of = slice(first, first + length)
                out[rows_of] = cpu_attention.paged_prefill(
                    q[rows_of], k_pool, v_pool, table, start, SCALE
                )

        def together(q=q, k_pool=k_pool, v_pool=v_pool, spans=spans, out=out):
            cpu_attention.paged_prefill_spans(q, k_pool, v_pool, spans, out, SCALE)

        times = _turns_ms({"each": each, "together": together}, repeat)
        each()
        by_chunk = out.clone()
        together()
        ms = {name: statistics.median(t) for name, t in times.items()}
        rows.append(
            {
                "chunks": count,
                "tokens": tokens,
                "each_ms": ms["each"],
                "together_ms": ms["together"],
                "together_over_each": ms["together"] / ms["each"],
                "same_bits": torch.equal(out, by_chunk),
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--steps", action="store_true", help="a step's chunks: each or together")
    parser.add_argument("--baseline", help="another build of the kernels (a .so), in turns")
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    if (args.steps or args.baseline) and not cpu_attention.has_prefill_kernel():
        raise SystemExit("the prompt kernel is not built here (a CPU with AVX512-BF16)")
    rows = measure_steps(args.repeat) if args.steps else measure(args.repeat, args.baseline)
    print(f"threads {torch.get_num_threads()}; AMX {cpu_attention.has_amx()}; median ms")
    for row in rows if args.steps else []:
        print(
            f"{row['chunks']:3d} x {row['tokens']:5d}: each {row['each_ms']:7.2f}  together "
            f"{row['together_ms']:7.2f} ({row['together_over_each']:.2f}x; same bits: "
            f"{row['same_bits']})"
        )
    for row in [] if args.steps else rows:
        kernel = row.get("kernel_ms")
        versus = f"{kernel:8.2f} ms kernel, {kernel / row['sdpa_ms']:.2f}x" if kernel else ""
        if "baseline_ms" in row:
            versus += (
                f"; baseline {row['baseline_ms']:7.2f} ms ({row['baseline_over_kernel']:.2f}x the "
                f"kernel's time; same bits: {row['same_bits']})"
            )
        print(f"{row['tokens']:5d} at {row['start']:5d}: {row['sdpa_ms']:8.2f} ms SDPA {versus}")
    if args.json:
        report.write_json(
            args.json, {**kernel_run.header(), "baseline": args.baseline, "rows": rows}
        )


if __name__ == "__main__":
    main()
