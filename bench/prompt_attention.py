"""Prompt-chunk attention on this CPU: our kernel (`cpu_attention.paged_prefill`) against
torch's SDPA on the same chunk, at the default model's shapes (9 query heads, 3 KV heads,
head dimension 64, blocks of 16), for whole prompts and later chunks of long ones. What
`cpu_attention.has_amx` chooses between is judged by this (docs/benchmarks.md, session 25).

    python -m bench.prompt_attention --json bench/results/prompt-attention-cpu.json
"""

from __future__ import annotations

import argparse
import time
from datetime import UTC, datetime

import torch
import torch.nn.functional as F

from bench import report
from worker.runner import cpu_attention
from worker.runner.loader import cpu_flags

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


def measure(repeat: int = 20) -> list[dict]:
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
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    rows = measure(args.repeat)
    print(f"threads {torch.get_num_threads()}; AMX {cpu_attention.has_amx()}; median ms")
    for row in rows:
        kernel = row.get("kernel_ms")
        versus = f"{kernel:8.2f} ms kernel, {kernel / row['sdpa_ms']:.2f}x" if kernel else ""
        print(f"{row['tokens']:5d} at {row['start']:5d}: {row['sdpa_ms']:8.2f} ms SDPA {versus}")
    if args.json:
        flags = cpu_flags()
        report.write_json(
            args.json,
            {
                "created_at": datetime.now(UTC).isoformat(),
                "cpu_flags": sorted(f for f in flags if f.startswith(("amx", "avx512_bf16"))),
                "threads": torch.get_num_threads(),
                "rows": rows,
            },
        )


if __name__ == "__main__":
    main()
