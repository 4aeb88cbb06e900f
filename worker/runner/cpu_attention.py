"""Decode attention over the paged KV cache on the CPU: a small C kernel that follows the
block tables and reads each key and value once.

The torch path (`paged_attention._decode`) gathers every decode's blocks out of the pool
into a contiguous copy, layer by layer, and two batched matmuls then read that copy: three
passes over the bytes, in many small ops. On this CPU a decode step's attention was 44% of
the worker's CPU on the 64-request workload (docs/benchmarks.md, session 18). For each
sequence and KV head this kernel computes the scores of the head's query group (fp32, one
read of each key, a block's keys being contiguous in the pool), their softmax, and the
weighted sum of the values (one read of each value). vLLM's CPU backend has its own C++
paged attention for the same reason; no well-kept package offers one for torch's CPU build.

It is C with GCC's vector extensions (16-lane vectors: one AVX-512 register or two AVX2
ones), built once per machine by the system's C compiler into a cache directory
(`LLMFLEET_KERNEL_CACHE`, else `~/.cache/llmfleet/kernels`; the file is named by a hash of
the source, the flags and the CPU's feature flags, since it is built for the CPU it runs on),
and called through ctypes on the tensors' memory: no Python or torch headers, a second to
build. It runs on the calling thread only: torch's own threads spin between its ops, and a
second thread of the kernel competed with them (167 output tokens a second against 196 on
one thread, docs/benchmarks.md).

Where no compiler is found, the build fails, `LLMFLEET_CPU_ATTENTION_KERNEL=0` is set, or
the shapes are not the kernel's (a head dimension not a multiple of 16, or over 256), the
torch path runs. The two agree within a rounding step of the model's dtype: the kernel keeps
scores, weights and sums in fp32 where the torch path rounds scores and weights to bf16.
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

import torch

from worker.runner.loader import cpu_flags

log = logging.getLogger("llmfleet.worker")

MAX_HEAD_DIM = 256
MAX_QUERIES_PER_KV_HEAD = 16

_SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef float f16v __attribute__((vector_size(64)));
typedef uint32_t u32v __attribute__((vector_size(64)));
typedef uint16_t u16v __attribute__((vector_size(32)));
typedef int32_t i32v __attribute__((vector_size(64)));

#define MAX_GROUP 16
#define MAX_DIMV 16

static inline f16v load_bf16(const uint16_t *p) {
    u16v h;
    memcpy(&h, p, sizeof h);
    return (f16v)(__builtin_convertvector(h, u32v) << 16);
}

static inline f16v load_f32(const float *p) {
    f16v v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline f16v load_any(const void *base, int64_t at, int is_bf16) {
    return is_bf16 ? load_bf16((const uint16_t *)base + at) : load_f32((const float *)base + at);
}

static inline float hsum(f16v v) {
    v += __builtin_shuffle(v, (i32v){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
    v += __builtin_shuffle(v, (i32v){4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
    v += __builtin_shuffle(v, (i32v){2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
    v += __builtin_shuffle(v, (i32v){1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14});
    return v[0];
}

/* e^x for x <= 0 (a score less its row's largest): 2^n e^f, n = round(x log2 e),
 * |f| <= ln2 / 2, by the Taylor series to degree 6 (relative error about 1e-7). */
static inline float exp_nonpositive(float x) {
    x = x < -87.f ? -87.f : x;
    const float t = x * 1.4426950409f;
    const float n = rintf(t);
    const float f = (t - n) * 0.6931471806f;
    float p = 1.f / 720;
    p = p * f + 1.f / 120;
    p = p * f + 1.f / 24;
    p = p * f + 1.f / 6;
    p = p * f + 0.5f;
    p = p * f + 1.f;
    p = p * f + 1.f;
    union { uint32_t u; float f; } scale;
    scale.u = (uint32_t)((int32_t)n + 127) << 23;
    return p * scale.f;
}

static inline uint16_t to_bf16(float f) { /* round to nearest even, as torch does */
    union { uint32_t u; float f; } x;
    x.f = f;
    return (uint16_t)((x.u + 0x7fffu + ((x.u >> 16) & 1u)) >> 16);
}

typedef struct {
    const void *q, *k_pool, *v_pool; /* [rows, heads, dim]; [kv_heads, blocks, block_size, dim] */
    const int32_t *tables, *lengths; /* [rows, max_blocks]; [rows] */
    void *out;                       /* [rows, heads, dim] */
    int rows, heads, kv_heads, num_blocks, block_size, dim, max_blocks;
    float scale;
} Step;

static inline __attribute__((always_inline)) int attend(const Step *s, const int DIMV,
                                                        const int BF16) {
    const int group = s->heads / s->kv_heads, dim = s->dim, bs = s->block_size;
    const int max_len = s->max_blocks * bs > 0 ? s->max_blocks * bs : 1;
    float *scores = malloc(sizeof(float) * group * max_len);
    if (scores == NULL) return -1;
    f16v q[MAX_GROUP][MAX_DIMV], acc[MAX_GROUP][MAX_DIMV];
    for (int row = 0; row < s->rows; row++) {
        const int len = s->lengths[row];
        const int32_t *table = s->tables + (int64_t)row * s->max_blocks;
        for (int kvh = 0; kvh < s->kv_heads; kvh++) {
            const int64_t q_at = ((int64_t)row * s->heads + (int64_t)kvh * group) * dim;
            for (int g = 0; g < group; g++)
                for (int c = 0; c < DIMV; c++)
                    q[g][c] = load_any(s->q, q_at + g * dim + c * 16, BF16) * s->scale;
            const int64_t head_at = (int64_t)kvh * s->num_blocks;
            for (int p = 0; p < len; p++) { /* the scores: each key read once */
                const int64_t at = ((head_at + table[p / bs]) * bs + p % bs) * dim;
                f16v k[MAX_DIMV];
                for (int c = 0; c < DIMV; c++) k[c] = load_any(s->k_pool, at + c * 16, BF16);
                for (int g = 0; g < group; g++) {
                    f16v dot = q[g][0] * k[0];
                    for (int c = 1; c < DIMV; c++) dot += q[g][c] * k[c];
                    scores[g * max_len + p] = hsum(dot);
                }
            }
            for (int g = 0; g < group; g++) { /* their softmax */
                float *sc = scores + g * max_len, top = -INFINITY, sum = 0.f;
                for (int p = 0; p < len; p++) top = sc[p] > top ? sc[p] : top;
                for (int p = 0; p < len; p++) {
                    sc[p] = exp_nonpositive(sc[p] - top);
                    sum += sc[p];
                }
                const float inv = 1.f / sum;
                for (int p = 0; p < len; p++) sc[p] *= inv;
                for (int c = 0; c < DIMV; c++) acc[g][c] = (f16v){0};
            }
            for (int p = 0; p < len; p++) { /* the weighted values: each value read once */
                const int64_t at = ((head_at + table[p / bs]) * bs + p % bs) * dim;
                f16v v[MAX_DIMV];
                for (int c = 0; c < DIMV; c++) v[c] = load_any(s->v_pool, at + c * 16, BF16);
                for (int g = 0; g < group; g++) {
                    const float w = scores[g * max_len + p];
                    for (int c = 0; c < DIMV; c++) acc[g][c] += w * v[c];
                }
            }
            for (int g = 0; g < group; g++) {
                for (int c = 0; c < DIMV; c++) {
                    const int64_t at = q_at + g * dim + c * 16;
                    if (BF16) {
                        uint16_t *out = (uint16_t *)s->out + at;
                        for (int i = 0; i < 16; i++) out[i] = to_bf16(acc[g][c][i]);
                    } else {
                        memcpy((float *)s->out + at, &acc[g][c], sizeof(f16v));
                    }
                }
            }
        }
    }
    free(scores);
    return 0;
}

/* The common head dimensions get their own copy, with the vector count a constant. */
static int attend_64_bf16(const Step *s) { return attend(s, 4, 1); }
static int attend_64_f32(const Step *s) { return attend(s, 4, 0); }
static int attend_128_bf16(const Step *s) { return attend(s, 8, 1); }
static int attend_128_f32(const Step *s) { return attend(s, 8, 0); }
static int attend_any_bf16(const Step *s) { return attend(s, s->dim / 16, 1); }
static int attend_any_f32(const Step *s) { return attend(s, s->dim / 16, 0); }

int paged_decode(const void *q, const void *k_pool, const void *v_pool,
                 const int32_t *tables, const int32_t *lengths, void *out,
                 int rows, int heads, int kv_heads, int num_blocks, int block_size, int dim,
                 int max_blocks, int is_bf16, float scale) {
    if (dim % 16 || dim / 16 > MAX_DIMV || kv_heads < 1 || heads % kv_heads ||
        heads / kv_heads > MAX_GROUP)
        return -2;
    const Step s = {q, k_pool, v_pool, tables, lengths, out,
                    rows, heads, kv_heads, num_blocks, block_size, dim, max_blocks, scale};
    if (dim == 64) return is_bf16 ? attend_64_bf16(&s) : attend_64_f32(&s);
    if (dim == 128) return is_bf16 ? attend_128_bf16(&s) : attend_128_f32(&s);
    return is_bf16 ? attend_any_bf16(&s) : attend_any_f32(&s);
}
"""

# Not -ffast-math: a shared library built with it (GCC before 13) sets the CPU's flush-to-zero
# and denormals-are-zero modes for the whole process when it is loaded, and every float in
# the process then reads a denormal as 0 (5e-324 became a temperature of 0).
_FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-shared", "-fPIC")
_DTYPES = {torch.bfloat16: 1, torch.float32: 0}


def _cache_dir() -> Path:
    if configured := os.environ.get("LLMFLEET_KERNEL_CACHE"):
        return Path(configured)
    return Path.home() / ".cache" / "llmfleet" / "kernels"


def _build(compiler: str) -> Path:
    cpu = " ".join(sorted(cpu_flags()))  # -march=native: built for this CPU
    key = hashlib.sha256("\n".join([_SOURCE, *_FLAGS, cpu]).encode()).hexdigest()
    library = _cache_dir() / f"paged_decode-{key[:16]}.so"
    if library.exists():
        return library
    library.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=library.parent) as build_dir:
        source = Path(build_dir) / "paged_decode.c"
        source.write_text(_SOURCE)
        built = Path(build_dir) / library.name
        command = [compiler, *_FLAGS, str(source), "-o", str(built), "-lm"]
        subprocess.run(command, check=True, capture_output=True, timeout=120)
        os.replace(built, library)  # whole or not at all, for workers building at once
    return library


@functools.cache
def load() -> ctypes.CDLL | None:
    """The kernel (built on first use), or None where it is off or cannot be built."""
    if os.environ.get("LLMFLEET_CPU_ATTENTION_KERNEL", "1") == "0":
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("no C compiler found: decode attention takes the slower torch path")
        return None
    try:
        library = ctypes.CDLL(str(_build(compiler)))
    except (OSError, subprocess.SubprocessError) as exc:
        stderr = getattr(exc, "stderr", None) or b""
        log.warning("the CPU attention kernel could not be built (%s %s): decode attention "
                    "takes the slower torch path", exc, stderr.decode(errors="replace")[-500:])  # fmt: skip
        return None
    library.paged_decode.restype = ctypes.c_int
    library.paged_decode.argtypes = [*[ctypes.c_void_p] * 6, *[ctypes.c_int] * 8, ctypes.c_float]
    return library


def supports(q: torch.Tensor, key_pool: torch.Tensor) -> bool:
    """Whether the kernel takes a layer's decodes: q [heads, tokens, head_dim] and its pool
    [kv_heads, blocks, block_size, head_dim] on the CPU, in bf16 or fp32, of shapes it has
    (a head dimension a multiple of 16 up to 256, at most 16 query heads a KV head)."""
    heads, kv_heads, head_dim = q.shape[0], key_pool.shape[0], q.shape[-1]
    return (
        q.device.type == "cpu"
        and q.dtype in _DTYPES
        and key_pool.dtype == q.dtype
        and head_dim % 16 == 0
        and head_dim <= MAX_HEAD_DIM
        and heads % kv_heads == 0
        and heads // kv_heads <= MAX_QUERIES_PER_KV_HEAD
        and load() is not None
    )


def paged_decode(
    q: torch.Tensor,  # [rows, heads, head_dim]
    key_pool: torch.Tensor,  # one layer's [kv_heads, blocks, block_size, head_dim], contiguous
    value_pool: torch.Tensor,
    tables: torch.Tensor,  # [rows, max_blocks] int32, contiguous
    lengths: torch.Tensor,  # [rows] int32: the keys each row attends to, at least 1
    scale: float,
) -> torch.Tensor:
    """Each row's attention over its first `lengths[row]` keys: [rows, heads, head_dim]. Only
    where `supports` said so."""
    library = load()
    if library is None:
        raise RuntimeError("the CPU attention kernel is not available")
    q = q.contiguous()
    if not (key_pool.is_contiguous() and value_pool.is_contiguous() and tables.is_contiguous()):
        raise ValueError("paged_decode: the pools and tables must be contiguous")
    if tables.dtype != torch.int32 or lengths.dtype != torch.int32:
        raise ValueError("paged_decode: tables and lengths are int32")
    lengths = lengths.contiguous()  # held here: the kernel reads its memory
    rows, heads, head_dim = q.shape
    kv_heads, num_blocks, block_size, _ = key_pool.shape
    out = torch.empty_like(q)
    status = library.paged_decode(
        q.data_ptr(),
        key_pool.data_ptr(),
        value_pool.data_ptr(),
        tables.data_ptr(),
        lengths.data_ptr(),
        out.data_ptr(),
        rows,
        heads,
        kv_heads,
        num_blocks,
        block_size,
        head_dim,
        tables.shape[1],
        _DTYPES[q.dtype],
        scale,
    )
    if status != 0:
        raise RuntimeError(f"paged_decode failed ({status})")
    return out
