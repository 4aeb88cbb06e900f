"""What every kernel benchmark's result file says of its run: when, the CPU's bf16 and AMX
features (the kernels are built for the CPU they run on) and torch's thread count
(`bench/matmul_share.py`, `bench/few_rows_stream.py`)."""

from __future__ import annotations

from datetime import UTC, datetime

import torch

from worker.runner.loader import cpu_flags


def header() -> dict:
    return {
        "created_at": datetime.now(UTC).isoformat(),
        "cpu_flags": sorted(f for f in cpu_flags() if f.startswith(("amx", "avx512_bf16"))),
        "threads": torch.get_num_threads(),
    }
