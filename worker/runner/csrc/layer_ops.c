/* A Llama-family decoder layer's element-wise work, fused: what torch runs as some 25 small
 * ops a layer (each a dispatch, an allocation and a pass over memory) in four calls. Each
 * op rounds where torch's eager ops round (to bf16 after every op of a bf16 model), so the
 * results are torch's up to the order of a sum (rms_norm) and the last bit of an exp (silu):
 * worker/runner/cpu_layer_ops.py, tests/worker/test_cpu_layer_ops.py. Rows are spread over
 * torch's OpenMP threads when there are enough of them to pay for it. Every dimension is a
 * multiple of 16 (of 32 for a head: its two rotated halves), checked by the caller. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vec.h"

#define PARALLEL_ROWS 8 /* fewer rows than this run on the calling thread */

/* out = weight * round(x * rsqrt(mean(x^2) + eps)): HF's LlamaRMSNorm (normalised in fp32,
 * cast back to the model's dtype, then scaled). */
static inline __attribute__((always_inline)) void norm_row(const void *x, void *out,
                                                          const void *weight, int64_t at,
                                                          int dim, float eps, const int BF16) {
    f16v squares = {0};
    for (int c = 0; c < dim; c += 16) {
        const f16v v = load_any(x, at + c, BF16);
        squares += v * v;
    }
    const float r = 1.f / sqrtf(hsum(squares) / (float)dim + eps);
    for (int c = 0; c < dim; c += 16) {
        const f16v normed = rnd(load_any(x, at + c, BF16) * r, BF16);
        store_v(out, at + c, load_any(weight, c, BF16) * normed, BF16);
    }
}

static inline __attribute__((always_inline)) void rms_norm_rows(const void *x, const void *weight,
                                                               void *out, int rows, int dim,
                                                               float eps, const int BF16) {
#pragma omp parallel for schedule(static) if (rows >= PARALLEL_ROWS)
    for (int row = 0; row < rows; row++) norm_row(x, out, weight, (int64_t)row * dim, dim, eps, BF16);
}

void rms_norm(const void *x, const void *weight, void *out, int rows, int dim, float eps,
              int is_bf16) {
    if (is_bf16)
        rms_norm_rows(x, weight, out, rows, dim, eps, 1);
    else
        rms_norm_rows(x, weight, out, rows, dim, eps, 0);
}

/* hidden = round(hidden + delta) in place (the residual), then out = its RMS norm. */
static inline __attribute__((always_inline)) void add_rms_norm_rows(void *hidden, const void *delta,
                                                                   const void *weight, void *out,
                                                                   int rows, int dim, float eps,
                                                                   const int BF16) {
#pragma omp parallel for schedule(static) if (rows >= PARALLEL_ROWS)
    for (int row = 0; row < rows; row++) {
        const int64_t at = (int64_t)row * dim;
        for (int c = 0; c < dim; c += 16)
            store_v(hidden, at + c, load_any(hidden, at + c, BF16) + load_any(delta, at + c, BF16), BF16);
        norm_row(hidden, out, weight, at, dim, eps, BF16);
    }
}

void add_rms_norm(void *hidden, const void *delta, const void *weight, void *out, int rows,
                  int dim, float eps, int is_bf16) {
    if (is_bf16)
        add_rms_norm_rows(hidden, delta, weight, out, rows, dim, eps, 1);
    else
        add_rms_norm_rows(hidden, delta, weight, out, rows, dim, eps, 0);
}

/* out[row] = round(silu(gate)) * up, gate and up the two halves of gate_up[row]: torch's
 * F.silu(gate) * up on the fused projection's output. */
static inline __attribute__((always_inline)) void silu_mul_rows(const void *gate_up, void *out,
                                                               int rows, int inter,
                                                               const int BF16) {
#pragma omp parallel for schedule(static) if (rows >= PARALLEL_ROWS)
    for (int row = 0; row < rows; row++) {
        const int64_t in_at = (int64_t)row * 2 * inter, out_at = (int64_t)row * inter;
        for (int c = 0; c < inter; c += 16) {
            const f16v gate = load_any(gate_up, in_at + c, BF16);
            const f16v silu = rnd(gate / (1.f + exp_v(-gate)), BF16);
            store_v(out, out_at + c, silu * load_any(gate_up, in_at + inter + c, BF16), BF16);
        }
    }
}

void silu_mul(const void *gate_up, void *out, int rows, int inter, int is_bf16) {
    if (is_bf16)
        silu_mul_rows(gate_up, out, rows, inter, 1);
    else
        silu_mul_rows(gate_up, out, rows, inter, 0);
}

/* RoPE on the queries and keys of the fused projection's output, in place, then the keys and
 * values into one layer's paged pool at each token's slot. qkv: [tokens, (heads + 2 kv_heads)
 * * dim] (queries, keys, values); cos, sin: [tokens, dim]; the pools: [kv_heads, num_slots,
 * dim]. As HF's x * cos + rotate_half(x) * sin, rounded after each op. */
static inline __attribute__((always_inline)) void rope_write_rows(
    void *qkv, const void *cos, const void *sin, void *k_pool, void *v_pool,
    const int64_t *slots, int tokens, int heads, int kv_heads, int dim, int num_slots,
    const int BF16) {
    const int half = dim / 2, width = (heads + 2 * kv_heads) * dim;
    const size_t head_bytes = (size_t)dim * (BF16 ? 2 : 4);
#pragma omp parallel for schedule(static) if (tokens >= PARALLEL_ROWS)
    for (int t = 0; t < tokens; t++) {
        const int64_t row = (int64_t)t * width, angles = (int64_t)t * dim;
        for (int h = 0; h < heads + kv_heads; h++) {
            const int64_t at = row + (int64_t)h * dim;
            for (int c = 0; c < half; c += 16) {
                const f16v x1 = load_any(qkv, at + c, BF16), x2 = load_any(qkv, at + half + c, BF16);
                const f16v c1 = load_any(cos, angles + c, BF16), c2 = load_any(cos, angles + half + c, BF16);
                const f16v s1 = load_any(sin, angles + c, BF16), s2 = load_any(sin, angles + half + c, BF16);
                store_v(qkv, at + c, rnd(x1 * c1, BF16) + rnd(-x2 * s1, BF16), BF16);
                store_v(qkv, at + half + c, rnd(x2 * c2, BF16) + rnd(x1 * s2, BF16), BF16);
            }
        }
        const char *keys = (const char *)qkv + (row + (int64_t)heads * dim) * (BF16 ? 2 : 4);
        const char *values = keys + (size_t)kv_heads * head_bytes;
        for (int h = 0; h < kv_heads; h++) {
            const int64_t slot = (int64_t)h * num_slots + slots[t];
            memcpy((char *)k_pool + slot * head_bytes, keys + h * head_bytes, head_bytes);
            memcpy((char *)v_pool + slot * head_bytes, values + h * head_bytes, head_bytes);
        }
    }
}

void rope_write(void *qkv, const void *cos, const void *sin, void *k_pool, void *v_pool,
                const int64_t *slots, int tokens, int heads, int kv_heads, int dim,
                int num_slots, int is_bf16) {
    if (is_bf16)
        rope_write_rows(qkv, cos, sin, k_pool, v_pool, slots, tokens, heads, kv_heads, dim,
                        num_slots, 1);
    else
        rope_write_rows(qkv, cos, sin, k_pool, v_pool, slots, tokens, heads, kv_heads, dim,
                        num_slots, 0);
}
