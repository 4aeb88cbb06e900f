"""The runner's C kernels for the CPU: built once per machine, loaded through ctypes.

The sources are in `csrc/` (`paged_attention.c`: attention over the paged KV cache,
`cpu_attention.py`; `layer_ops.c`: a decoder layer's fused element-wise ops,
`cpu_layer_ops.py`; `few_rows.c`: bf16 matmuls of a few rows, `amx_matmul.c` and
`pair_matmul.c`: bf16 matmuls over weights packed in AMX's tile layout, with AMX's tiles or
AVX512-BF16's dot products, `llama.py`'s `_Linear`;
`decode_layers.c`: a decode step of a few sequences, tokens to logits, `cpu_decode.py`;
`vec.h`: the vector type and helpers they use). The system's C compiler builds them into one library in a cache
directory (`LLMFLEET_KERNEL_CACHE`, else `~/.cache/llmfleet/kernels`; the file is named by a
hash of the sources, the flags and the CPU's feature flags, since it is built for the CPU it
runs on): no Python or torch headers, a few seconds to build. Their work is shared out with
OpenMP over **torch's own threads**: built with `-fopenmp`, the library links the
`libgomp.so.1` torch has already loaded (the dynamic linker reuses a loaded library of the
same name), so there is one pool of threads, torch's. A pool of the kernels' own competed
with torch's spinning threads (an earlier draft on two pthreads of its own: 167 output tokens
a second against 196 on one thread, docs/benchmarks.md). Without OpenMP the pragmas are
ignored and the kernels run on the calling thread.

Where no compiler is found, the build fails or `LLMFLEET_CPU_ATTENTION_KERNEL=0` is set,
`load()` is None and the runner takes the torch paths.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger("llmfleet.worker")

_SOURCES = (
    "paged_attention.c",
    "layer_ops.c",
    "few_rows.c",
    "amx_matmul.c",
    "pair_matmul.c",
    "decode_layers.c",
    "argmax.c",
)  # each includes "vec.h"
_HEADERS = ("vec.h", "amx.h")
# Not -ffast-math: a shared library built with it (GCC before 13) sets the CPU's flush-to-zero
# and denormals-are-zero modes for the whole process when it is loaded, and every float in
# the process then reads a denormal as 0 (5e-324 became a temperature of 0).
_FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-shared", "-fPIC")
_P, _I, _L, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
_SIGNATURES = {  # name: (argument types, result type)
    "paged_decode": ((*[_P] * 6, *[_I] * 8, _F), _I),
    "paged_prefill_spans": ((_P, _L, *[_P] * 5, _L, *[_I] * 7, _F), _I),
    "prefill_available": ((), _I),
    "rms_norm": ((*[_P] * 3, _I, _I, _F, _I), None),
    "add_rms_norm": ((*[_P] * 4, _I, _I, _F, _I), None),
    "silu_mul": ((_P, _P, _I, _I, _I), None),
    "rope_write": ((*[_P] * 6, *[_I] * 6), None),
    "few_rows_available": ((), _I),
    "matmul_few_rows": ((*[_P] * 4, *[_I] * 3), _I),
    "few_rows_streams": ((_I, _I), _I),
    "decode_step": ((*[_P] * 8, _I, _I, _P, _P), _I),
    "decode_step_at": ((*[_P] * 5, _I, *[_P] * 4, _I, _I, _P, _P, _P), _I),
    "amx_available": ((), _I),
    "amx_pack": ((_P, _P, _I, _I), None),
    "amx_matmul": ((*[_P] * 4, *[_I] * 3), _I),
    "amx_matmul_silu": ((*[_P] * 4, *[_I] * 3), _I),
    "amx_share": ((_I,), None),
    "amx_row_share": ((_I,), _I),
    "pair_matmul_available": ((), _I),
    "pair_matmul": ((*[_P] * 4, *[_I] * 3), _I),
    "argmax_rows": ((_P, _P, _I, _I, _I), None),
}


@functools.cache
def _cpuinfo() -> dict[str, str]:
    """The first processor's fields in `/proc/cpuinfo`; none where it cannot be read."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in lines:
        if not line.strip():
            break
        name, _, value = line.partition(":")
        fields[name.strip()] = value.strip()
    return fields


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (`/proc/cpuinfo`); none where it cannot be read."""
    return frozenset(_cpuinfo().get("flags", "").split())


def cpu_defines() -> tuple[str, ...]:
    """The kernels' build-time choices for this CPU that `-march=native` does not make (GCC 12
    calls an AMD Zen 4 and a Zen 5 both znver3), in `csrc/few_rows.c`:
    - `FEW_ROWS_ONE_STREAM` where a 512-bit dot product runs at full width, on AMD from family
      0x1A (Zen 5) on (the server parts, measured; Zen 5's laptop parts run AVX-512 in halves,
      as Zen 4 does, and are not told apart here). Intel's AVX-512 units are full width too,
      but the choice is not measured there yet: they keep the grouped kernel.
    - `STREAMS=2` on AMD family 0x19 (Zen 4 with AVX512-BF16; Zen 3, of the same family, takes
      the AVX2 kernel, which does not read it): each thread reads its rows of the weight in
      two places at once, where one stream a core left the memory idle. Measured on Zen 4
      only (sessions 43-44); `LLMFLEET_CPU_STREAMS` sets it at load (`set_streams`)."""
    info = _cpuinfo()
    family = info.get("cpu family", "")
    if info.get("vendor_id") != "AuthenticAMD" or not family.isdigit():
        return ()
    if int(family) >= 0x1A:
        return ("-DFEW_ROWS_ONE_STREAM",)
    return ("-DSTREAMS=2",) if int(family) == 0x19 else ()


def _cache_dir() -> Path:
    if configured := os.environ.get("LLMFLEET_KERNEL_CACHE"):
        return Path(configured)
    return Path.home() / ".cache" / "llmfleet" / "kernels"


def _build(compiler: str) -> Path:
    here = Path(__file__).parent / "csrc"
    sources = {name: (here / name).read_text() for name in (*_HEADERS, *_SOURCES)}
    cpu = " ".join(sorted(cpu_flags()))  # -march=native: built for this CPU
    flags = (*_FLAGS, *cpu_defines())
    key = hashlib.sha256("\n".join([*sources.values(), *flags, cpu]).encode()).hexdigest()
    library = _cache_dir() / f"llmfleet-kernels-{key[:16]}.so"
    if library.exists():
        return library
    library.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=library.parent) as build_dir:
        for name, text in sources.items():
            (Path(build_dir) / name).write_text(text)
        built = Path(build_dir) / library.name
        paths = [str(Path(build_dir) / name) for name in _SOURCES]
        command = [compiler, *flags, *paths, "-o", str(built), "-lm"]
        try:  # with OpenMP where the compiler has it; its pragmas are ignored without
            subprocess.run([*command, "-fopenmp"], check=True, capture_output=True, timeout=120)
        except subprocess.CalledProcessError:
            subprocess.run(command, check=True, capture_output=True, timeout=120)
        os.replace(built, library)  # whole or not at all, for workers building at once
    return library


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


@functools.cache
def load() -> ctypes.CDLL | None:
    """The kernels (built on first use), or None where they are off or cannot be built."""
    if os.environ.get("LLMFLEET_CPU_ATTENTION_KERNEL", "1") == "0":
        return None
    compiler = _compiler()
    if compiler is None:
        log.warning("no C compiler found: the runner takes the slower torch paths")
        return None
    try:
        library = ctypes.CDLL(str(_build(compiler)))
    except (OSError, subprocess.SubprocessError) as exc:
        stderr = getattr(exc, "stderr", None) or b""
        log.warning("the CPU kernels could not be built (%s %s): the runner takes the "
                    "slower torch paths", exc, stderr.decode(errors="replace")[-500:])  # fmt: skip
        return None
    for name, (argtypes, restype) in _SIGNATURES.items():
        function = getattr(library, name)
        function.argtypes, function.restype = argtypes, restype
    set_streams(library)
    return library


# The rows of x at which the few-row kernel can read a thread's rows of w in two places
# (`csrc/few_rows.c`, `few_rows_streams`).
STREAM_ROWS = (1, 2, 8)


def set_streams(library: ctypes.CDLL) -> dict[int, int]:
    """Where `LLMFLEET_CPU_STREAMS` is `1` or `2`, has the few-row kernel read each thread's
    rows of w in that many places at each of `STREAM_ROWS`, in place of the build's choice
    (`cpu_defines`); returns the places in use. For a host that reads faster the other way:
    `python -m bench.few_rows_stream --places` measures both. Not measured at load: on an AMD
    EPYC Zen 4 host, 11 paired rounds over 96 MB of weights picked two places at one row in
    the minutes the memory was fast, where the model's own matmuls read 4-14% slower in two
    (docs/benchmarks.md, session 44)."""
    forced = os.environ.get("LLMFLEET_CPU_STREAMS", "")
    if forced in ("1", "2"):
        for rows in STREAM_ROWS:
            library.few_rows_streams(rows, int(forced))
    elif forced:
        log.warning("LLMFLEET_CPU_STREAMS=%r is neither 1 nor 2: the build's choice", forced)
    return {rows: library.few_rows_streams(rows, 0) for rows in STREAM_ROWS}


# On a CPU with AMX, a matmul of fewer rows than this takes the few-row kernel
# (`csrc/few_rows.c`) where it can, not `csrc/amx_matmul.c`: a tile product costs the same
# at 1 row as at 16, and at 1-3 rows the few-row kernel streamed the default model's weights
# at 0.88-0.94 of the plain read where AMX's reached 0.82-0.83; at 4 rows the two were level, at
# 8 AMX's 1.4x as fast (docs/benchmarks.md, session 42). With AMX's weights asked for 1 KB
# ahead instead of 4 (the same session) the two kernels were level at 1-3 rows (AMX's time
# 1.00-1.03x the few-row kernel's) and AMX's ahead from 4 rows.
AMX_FROM_ROWS = 4


def amx_matmuls_available() -> bool:
    """Whether bf16 matmuls take `csrc/amx_matmul.c` here (from `AMX_FROM_ROWS` rows where the
    few-row kernel can take the weight): a CPU with AMX that Linux lets us use, the kernels
    built, and `LLMFLEET_CPU_AMX` not `0`."""
    if os.environ.get("LLMFLEET_CPU_AMX", "1") == "0":
        return False
    library = load()
    return library is not None and bool(library.amx_available())


def pair_matmuls_available() -> bool:
    """Whether bf16 matmuls past the few-row kernel's rows take `csrc/pair_matmul.c` here: a
    CPU with AVX512-BF16 or AVX2 but no AMX (`amx_matmuls_available`), the kernels built, and
    `LLMFLEET_CPU_PAIR_MATMUL` not `0`."""
    if os.environ.get("LLMFLEET_CPU_PAIR_MATMUL", "1") == "0" or amx_matmuls_available():
        return False
    library = load()
    return library is not None and bool(library.pair_matmul_available())


def pair_matmuls_for_prompts() -> bool:
    """Whether prompts' bf16 matmuls take `csrc/pair_matmul.c` too, not only decode steps:
    where it runs (`pair_matmuls_available`) on a CPU without AVX512-BF16 (AVX2 only), whose
    oneDNN bf16 matmul is emulated and several times slower than the kernel (docs/
    benchmarks.md, session 38). With AVX512-BF16 prompts keep oneDNN's matmul, whose sums are
    `transformers`' bit for bit."""
    return pair_matmuls_available() and not {"avx512_bf16", "amx_bf16"} & cpu_flags()
