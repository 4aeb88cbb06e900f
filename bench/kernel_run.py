"""What the kernel benchmarks share: what every result file says of its run (when, the CPU's
bf16 and AMX features, the kernels being built for the CPU they run on, and torch's thread
count), and another build of the kernels loaded beside this one's (`--baseline`)."""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Iterator
from datetime import UTC, datetime

import torch

from worker.runner import cpu_attention, cpu_kernels
from worker.runner.cpu_kernels import cpu_flags


def header() -> dict:
    library = cpu_kernels.load()
    return {
        "created_at": datetime.now(UTC).isoformat(),
        "cpu_flags": sorted(f for f in cpu_flags() if f.startswith(("amx", "avx512_bf16"))),
        "cpu_defines": list(cpu_kernels.cpu_defines()),  # the kernels' build-time choices
        # and the places a thread at 1, 2 and 8 rows of x in use (`set_streams`)
        "few_rows_streams": {
            rows: library.few_rows_streams(rows, 0) for rows in cpu_kernels.STREAM_ROWS
        }
        if library is not None
        else {},
        "threads": torch.get_num_threads(),
    }


def with_signatures(path: str) -> ctypes.CDLL:
    """Another build of the kernels (a .so, e.g. an earlier commit's), with this build's
    signatures on the functions it has."""
    other = ctypes.CDLL(path)  # its own symbols (ctypes loads with RTLD_LOCAL)
    for name, (argtypes, restype) in cpu_kernels._SIGNATURES.items():
        if hasattr(other, name):
            function = getattr(other, name)
            function.argtypes, function.restype = argtypes, restype
    return other


@contextlib.contextmanager
def attention_from(library: ctypes.CDLL) -> Iterator[None]:
    """Inside, the attention entries of `cpu_attention` call into `library` (another build):
    one process times both builds' attention in turns, the rest of a step the same."""
    saved = cpu_attention.load
    cpu_attention.load = lambda: library  # type: ignore[assignment]  # a bench-only swap
    try:
        yield
    finally:
        cpu_attention.load = saved
