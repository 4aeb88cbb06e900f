#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx.h"
#include "vec.h"

#define MAX_GROUP 16
#define MAX_DIMV 16
#define FEW_ITEMS 8 /* fewer (sequence, KV head) pairs than this: the work split further */
#define PARTIAL(dim) ((dim) + 2) /* a query's partial result: largest score, sum, dim sums */
#define MIN_PART_KEYS 64         /* a part of the keys: at least this many */
#define MAX_PARTS 64
#define NEXT_AHEAD 2 /* `prefetch_next`: the item this many on in a thread's run */

#ifdef _OPENMP
#include <omp.h>
#else
static inline int omp_get_max_threads(void) { return 1; }
#endif

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

/* e^x of 16 lanes, each as exp_nonpositive computes it (the same operations, so the same
 * bits). */
static inline f16v exp_nonpositive_v(f16v x) {
    const f16v lowest = (f16v){0} - 87.f;
    x = select_v(x < lowest, lowest, x);
    const f16v t = x * 1.4426950409f;
    const f16v n = round_v(t);
    const f16v f = (t - n) * 0.6931471806f;
    f16v p = (f16v){0} + 1.f / 720;
    p = p * f + 1.f / 120;
    p = p * f + 1.f / 24;
    p = p * f + 1.f / 6;
    p = p * f + 0.5f;
    p = p * f + 1.f;
    p = p * f + 1.f;
    return times_pow2(p, n);
}

/* The horizontal sums of 16 vectors, as one vector (lane j: hsum(v[j]), its lanes added in
 * hsum's order): four levels of pairwise shuffles and adds, 15 in all, where 16 hsums take 64. */
static inline f16v hsum16(const f16v v[16]) {
    f16v a[8], b[4], c[2];
    for (int i = 0; i < 8; i++) /* lanes l and l + 8 */
        a[i] = __builtin_shuffle(v[2 * i], v[2 * i + 1],
                                 (i32v){0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23}) +
               __builtin_shuffle(v[2 * i], v[2 * i + 1],
                                 (i32v){8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31});
    for (int i = 0; i < 4; i++) /* then 4 apart */
        b[i] = __builtin_shuffle(a[2 * i], a[2 * i + 1],
                                 (i32v){0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27}) +
               __builtin_shuffle(a[2 * i], a[2 * i + 1],
                                 (i32v){4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31});
    for (int i = 0; i < 2; i++) /* 2 apart */
        c[i] = __builtin_shuffle(b[2 * i], b[2 * i + 1],
                                 (i32v){0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29}) +
               __builtin_shuffle(b[2 * i], b[2 * i + 1],
                                 (i32v){2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31});
    return __builtin_shuffle(c[0], c[1], /* 1 apart */
                             (i32v){0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30}) +
           __builtin_shuffle(c[0], c[1],
                             (i32v){1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31});
}

/* A row of `len` scores (padded to whole vectors of 16) turned into e^(score - max) in
 * place; returns 1 / their sum. The max 16 lanes at a time (a scalar chain of maxes was 15%
 * of the dot-product kernel), then the exponentials, 16 at a time up to the last whole
 * vector. */
static inline float exp_scores_top(float *sc, int len, float *largest) {
    const int whole = len / 16 * 16;
    f16v top16 = (f16v){0} - INFINITY;
    for (int p = 0; p < whole; p += 16) top16 = max_v(top16, load_f32(sc + p));
    float top = -INFINITY, sum = 0.f;
    for (int i = 0; i < 16; i++) top = top16[i] > top ? top16[i] : top;
    for (int p = whole; p < len; p++) top = sc[p] > top ? sc[p] : top;
    f16v sums = {0};
    for (int p = 0; p < whole; p += 16) {
        const f16v e = exp_nonpositive_v(load_f32(sc + p) - top);
        memcpy(sc + p, &e, sizeof e);
        sums += e;
    }
    for (int p = whole; p < len; p++) {
        sc[p] = exp_nonpositive(sc[p] - top);
        sum += sc[p];
    }
    *largest = top;
    return 1.f / (hsum(sums) + sum);
}

static inline float exp_scores(float *sc, int len) {
    float top;
    return exp_scores_top(sc, len, &top);
}

typedef struct {
    const void *q, *k_pool, *v_pool; /* [rows, heads, dim]; [kv_heads, blocks, block_size, dim] */
    const int32_t *tables, *lengths; /* [rows, max_blocks]; [rows] */
    void *out;                       /* [rows, heads, dim] */
    int rows, heads, kv_heads, num_blocks, block_size, dim, max_blocks, is_bf16;
    float scale;
} Step;

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
/* On a CPU with AVX2 but not AVX-512, GCC keeps `f16v` (16 floats, two AVX2 registers) in
 * memory through the loops below, in 16-byte pieces: a broadcast of one weight became 16
 * scalar stores, and each sum went through the stack between its multiply-adds. A decode
 * step's attention of 32 sequences x 256 tokens took 61-87 ms there in fp32 (an AMD EPYC,
 * Zen 3), against ~10 on AVX-512 hosts. This item is the same computation in 8-float AVX2
 * vectors (`__m256`), which stay in registers: 2.0-2.7x faster in fp32, 2.3-4.2x in bf16
 * (docs/benchmarks.md, session 38). */
#define AVX2_ITEM 1
#include <immintrin.h>

/* 8 values of a pool, a query or an output at `at`: fp32, or bf16 widened (exact). */
static inline __m256 load8(const void *base, int64_t at, int is_bf16) {
    if (is_bf16) {
        const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + at));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_loadu_ps((const float *)base + at);
}

/* Lane j: the sum of v[j]'s 8 lanes. */
static inline __m256 hsum8x8(const __m256 v[8]) {
    const __m256 a0 = _mm256_hadd_ps(v[0], v[1]), a1 = _mm256_hadd_ps(v[2], v[3]);
    const __m256 a2 = _mm256_hadd_ps(v[4], v[5]), a3 = _mm256_hadd_ps(v[6], v[7]);
    const __m256 b0 = _mm256_hadd_ps(a0, a1), b1 = _mm256_hadd_ps(a2, a3); /* per 128 bits */
    return _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31));
}

/* e^x of 8 lanes, x <= 0, as exp_nonpositive computes it (its multiply-adds fused). */
static inline __m256 exp8_nonpositive(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
    const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.4426950409f));
    const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 f = _mm256_mul_ps(_mm256_sub_ps(t, n), _mm256_set1_ps(0.6931471806f));
    __m256 p = _mm256_set1_ps(1.f / 720);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f / 120));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f / 24));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f / 6));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

/* A row of `len` scores turned into its softmax in place, 8 lanes at a time up to the last
 * whole vector (`exp_scores`, whose 16-float vectors GCC keeps in memory here). */
static inline void softmax8(float *sc, int len) {
    const int whole = len / 8 * 8;
    __m256 top8 = _mm256_set1_ps(-INFINITY);
    for (int p = 0; p < whole; p += 8) top8 = _mm256_max_ps(top8, _mm256_loadu_ps(sc + p));
    float lanes[8], top = -INFINITY, tail = 0.f;
    _mm256_storeu_ps(lanes, top8);
    for (int i = 0; i < 8; i++) top = lanes[i] > top ? lanes[i] : top;
    for (int p = whole; p < len; p++) top = sc[p] > top ? sc[p] : top;
    const __m256 top_v = _mm256_set1_ps(top);
    __m256 sums = _mm256_setzero_ps();
    for (int p = 0; p < whole; p += 8) {
        const __m256 e = exp8_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(sc + p), top_v));
        _mm256_storeu_ps(sc + p, e);
        sums = _mm256_add_ps(sums, e);
    }
    for (int p = whole; p < len; p++) tail += sc[p] = exp_nonpositive(sc[p] - top);
    _mm256_storeu_ps(lanes, sums);
    float sum = tail;
    for (int i = 0; i < 8; i++) sum += lanes[i];
    const __m256 inv = _mm256_set1_ps(1.f / sum);
    for (int p = 0; p < whole; p += 8) _mm256_storeu_ps(sc + p, _mm256_mul_ps(_mm256_loadu_ps(sc + p), inv));
    for (int p = whole; p < len; p++) sc[p] *= 1.f / sum;
}

/* Item `next`'s keys and values (a later item of this thread's run, `attend`), into L2, their
 * rows spread evenly over the current item's `chunks` runs of 8 keys: those for chunk `c` (as
 * `prefetch_next` does for the AVX512-BF16 item). */
static inline __attribute__((always_inline)) void prefetch_next8(const Step *s, int next, int c,
                                                                 int chunks, int elem) {
    const int row = next / s->kv_heads, kvh = next % s->kv_heads, bs = s->block_size;
    const int len = s->lengths[row], row_bytes = s->dim * elem;
    const int32_t *table = s->tables + (int64_t)row * s->max_blocks;
    const int64_t head_at = (int64_t)kvh * s->num_blocks;
    const int hi = (int)((int64_t)(c + 1) * len / chunks);
    for (int j = (int)((int64_t)c * len / chunks); j < hi;) { /* a block's run of rows at a time */
        const int offset = j % bs, n = bs - offset < hi - j ? bs - offset : hi - j;
        const int64_t at = ((head_at + table[j / bs]) * bs + offset) * row_bytes;
        for (int64_t b = 0; b < (int64_t)n * row_bytes; b += 64) {
            _mm_prefetch((const char *)s->k_pool + at + b, _MM_HINT_T1);
            _mm_prefetch((const char *)s->v_pool + at + b, _MM_HINT_T1);
        }
        j += n;
    }
}

/* `attend_item` below, in AVX2 registers: a query's scores 8 keys at a time (8 sums, one a
 * key, then their 8 horizontal sums at once), and its weighted values with a sum a vector of
 * the head. */
static inline __attribute__((always_inline)) void attend_item_avx2(const Step *s, int item, int g0,
                                                                  int g1, float *scores, int max_len,
                                                                  int next, const int DIMV,
                                                                  const int BF16) {
    const int V = 2 * DIMV, group = s->heads / s->kv_heads, dim = s->dim, bs = s->block_size;
    const int row = item / s->kv_heads, kvh = item % s->kv_heads;
    const int len = s->lengths[row];
    const int32_t *table = s->tables + (int64_t)row * s->max_blocks;
    const int64_t q_at = ((int64_t)row * s->heads + (int64_t)kvh * group) * dim;
    const int64_t head_at = (int64_t)kvh * s->num_blocks;
    const __m256 scale = _mm256_set1_ps(s->scale);
    for (int g = g0; g < g1; g++) { /* the scores */
        __m256 qg[2 * MAX_DIMV];
        for (int c = 0; c < V; c++) qg[c] = _mm256_mul_ps(load8(s->q, q_at + g * dim + 8 * c, BF16), scale);
        float *sc = scores + g * max_len;
        for (int p0 = 0; p0 < len; p0 += 8) {
            if (next >= 0 && g == g0) prefetch_next8(s, next, p0 / 8, (len + 7) / 8, BF16 ? 2 : 4);
            /* the 8 keys' places (past the last key, the last key's again: its lanes are
             * past the row's length, never read), then their sums side by side, a vector of
             * the head at a time: 8 independent chains of multiply-adds, where one key's
             * whole chain at a time waited on each multiply-add's latency */
            int64_t at[8];
            int block = p0 / bs, offset = p0 % bs;
            for (int j = 0; j < 8; j++) {
                at[j] = ((head_at + table[block]) * bs + offset) * dim;
                if (p0 + j + 1 < len && ++offset == bs) offset = 0, block++;
            }
            __m256 dots[8];
            for (int j = 0; j < 8; j++) dots[j] = _mm256_mul_ps(qg[0], load8(s->k_pool, at[j], BF16));
            for (int c = 1; c < V; c++)
                for (int j = 0; j < 8; j++)
                    dots[j] = _mm256_fmadd_ps(qg[c], load8(s->k_pool, at[j] + 8 * c, BF16), dots[j]);
            _mm256_storeu_ps(sc + p0, hsum8x8(dots));
        }
        softmax8(sc, len);
    }
    for (int g = g0; g < g1; g++) { /* the weighted values */
        const float *w = scores + g * max_len;
        __m256 sum[2 * MAX_DIMV];
        for (int c = 0; c < V; c++) sum[c] = _mm256_setzero_ps();
        for (int p = 0, block = 0, offset = 0; p < len; p++) {
            const int64_t at = ((head_at + table[block]) * bs + offset) * dim;
            if (++offset == bs) offset = 0, block++;
            const __m256 wp = _mm256_set1_ps(w[p]);
            for (int c = 0; c < V; c++) sum[c] = _mm256_fmadd_ps(wp, load8(s->v_pool, at + 8 * c, BF16), sum[c]);
        }
        for (int c = 0; c < V; c++) {
            const int64_t at = q_at + g * dim + 8 * c;
            if (BF16) {
                float lanes[8];
                _mm256_storeu_ps(lanes, sum[c]);
                for (int i = 0; i < 8; i++) ((uint16_t *)s->out)[at + i] = to_bf16(lanes[i]);
            } else {
                _mm256_storeu_ps((float *)s->out + at, sum[c]);
            }
        }
    }
}
#else
#define AVX2_ITEM 0
#endif

/* One sequence's queries g0 .. g1 - 1 of one KV head (`item`): their scores against its keys,
 * the softmax, and the weighted values. Inlined with DIMV and BF16 literal constants where the
 * parallel loop below calls it: inside the loop, not around it, since OpenMP outlines a
 * parallel region before inlining and a constant passed around it reaches the region as a
 * runtime value (the vector loops then run on a count they test at every step). */
static inline __attribute__((always_inline)) void attend_item(const Step *s, int item, int g0,
                                                             int g1, float *scores, int max_len,
                                                             int next, const int DIMV, const int BF16) {
#if AVX2_ITEM
    attend_item_avx2(s, item, g0, g1, scores, max_len, next, DIMV, BF16);
    return;
#endif
    const int group = s->heads / s->kv_heads, dim = s->dim, bs = s->block_size;
    f16v q[MAX_GROUP][MAX_DIMV], acc[MAX_GROUP][MAX_DIMV];
    const int row = item / s->kv_heads, kvh = item % s->kv_heads;
    const int len = s->lengths[row];
    const int32_t *table = s->tables + (int64_t)row * s->max_blocks;
    const int64_t q_at = ((int64_t)row * s->heads + (int64_t)kvh * group) * dim;
    for (int g = g0; g < g1; g++)
        for (int c = 0; c < DIMV; c++)
            q[g][c] = load_any(s->q, q_at + g * dim + c * 16, BF16) * s->scale;
    const int64_t head_at = (int64_t)kvh * s->num_blocks;
    for (int g = g0; g < g1; g++) { /* the scores, a query at a time (its vectors
        stay in registers; the keys, read again for each query, in L1), 16 keys at once */
        f16v qg[MAX_DIMV];
        for (int c = 0; c < DIMV; c++) qg[c] = q[g][c];
        for (int p0 = 0; p0 < len; p0 += 16) {
            const int n = len - p0 < 16 ? len - p0 : 16;
            int block = p0 / bs, offset = p0 % bs; /* p0 + j's place in the table */
            f16v dots[16];
            for (int j = 0; j < 16; j++) {
                if (j >= n) {
                    dots[j] = (f16v){0};
                    continue;
                }
                const int64_t at = ((head_at + table[block]) * bs + offset) * dim;
                if (++offset == bs) offset = 0, block++;
                f16v dot = qg[0] * load_any(s->k_pool, at, BF16);
                for (int c = 1; c < DIMV; c++) dot += qg[c] * load_any(s->k_pool, at + c * 16, BF16);
                dots[j] = dot;
            }
            const f16v sums = hsum16(dots);
            memcpy(scores + g * max_len + p0, &sums, sizeof sums);
        }
    }
    for (int g = g0; g < g1; g++) { /* their softmax */
        float *sc = scores + g * max_len;
        const float inv = exp_scores(sc, len);
        for (int p = 0; p < len; p++) sc[p] *= inv;
    }
    for (int g = g0; g < g1; g++) { /* the weighted values, a query at a time */
        const float *w = scores + g * max_len;
        f16v sum[MAX_DIMV];
        for (int c = 0; c < DIMV; c++) sum[c] = (f16v){0};
        for (int p = 0, block = 0, offset = 0; p < len; p++) {
            const int64_t at = ((head_at + table[block]) * bs + offset) * dim;
            if (++offset == bs) offset = 0, block++;
            for (int c = 0; c < DIMV; c++)
                sum[c] += w[p] * load_any(s->v_pool, at + c * 16, BF16);
        }
        for (int c = 0; c < DIMV; c++) acc[g][c] = sum[c];
    }
    for (int g = g0; g < g1; g++) {
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

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define DOT_DECODE 1
/* The same item for bf16 pools on CPUs with AVX512-BF16 dot products, which multiply bf16
 * pairs exactly and sum in fp32, so nothing is widened first. Scores: q against each key, 32
 * dimensions an instruction, the scale after the sum. Values: the softmax weights rounded to
 * bf16 (as torch's SDPA and the prompt kernel do), two keys at a time, their value rows
 * interleaved into (key 0, key 1) pairs of each dimension; the interleave puts a 128-bit
 * lane's dimensions 0-3 in its low half and 4-7 in its high half, and the sums are put back
 * in order once at the end. Up to QB queries of the group share each interleaved pair. Keys
 * are read a block at a time: a block's rows are contiguous in the pool. */
static inline __m512 dot_row(const uint16_t *k, const __m512bh *q, const int W) {
    __m512 dot = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)_mm512_loadu_si512(k), q[0]);
    for (int c = 1; c < W; c++)
        dot = _mm512_dpbf16_ps(dot, (__m512bh)_mm512_loadu_si512(k + c * 32), q[c]);
    return dot;
}

/* Position `pos`'s row in a pool: for the default block size of 16, by a shift and a mask,
 * not a division by a size known only at run time (the values' pass takes one a pair). */
static inline const uint16_t *pool_at(const Step *s, const uint16_t *pool, const int32_t *table,
                                      int64_t head_at, int pos, int dim) {
    const int bs = s->block_size;
    const int block = bs == 16 ? pos >> 4 : pos / bs, offset = bs == 16 ? pos & 15 : pos % bs;
    return pool + ((head_at + table[block]) * bs + offset) * dim;
}

/* A pool's blocks lie anywhere in it, and the hardware's prefetcher, which follows a stream
 * within a page, starts cold on each: at 32 sequences the keys and values (as many bytes
 * as the weights) were read at ~21 GB/s, a step's attention a third of the step. The first
 * pass over an item's keys asks for the keys two 16-row runs ahead and for the values one
 * run ahead (read after the softmax): 5-15% off the attention from memory, at 2-64
 * sequences (docs/benchmarks.md, session 23; further ahead, or everything at once, gained
 * less). The values into L2 (T1); the keys into L1 (T0) where their run continues the one
 * before it in the pool (blocks handed out one after another: the hardware prefetcher
 * follows them there), else into L2: a request into L1 holds one of its few miss buffers
 * until the line comes. On an AMD EPYC host (a C probe, session 27) the step's attention from
 * memory took 0.71-0.91 of the time where blocks lie anywhere and 0.86-1.03 where they lie in
 * a row (into L2 for all: 1.10-1.16 in a row); the next item's keys and values asked for while
 * this one computes from its cache were slower. Where each thread takes a contiguous run of
 * whole items (`units_of`, session 37), the item NEXT_AHEAD on in the run is asked for as
 * well, into L2, a share at each of the current item's runs of 16 keys (`prefetch_next`):
 * 1.04-1.43x the attention from memory at 1-64 sequences of 256-1,000 tokens, blocks in runs
 * or anywhere, on an AMD EPYC host (docs/benchmarks.md, session 37); asked for
 * faster (in the first half of the item), one item on, or the values in the values' pass
 * instead, it gained less. A macro: the hint must be a constant where `_mm_prefetch` sees it. */
#define prefetch_16_rows(rows, dim, hint)                                                      \
    for (int at = 0; at < 16 * (dim) * 2; at += 64) _mm_prefetch((const char *)(rows) + at, hint)

/* Item `next`'s keys and values (a later item of this thread's run, `attend`), its whole
 * runs of 16 rows spread evenly over the current item's `chunks` runs of 16 keys: those for
 * the current item's chunk `c`, into L2. Inlined where it is called: as a call, with `dim` not
 * a constant and the caller's vectors saved around it, the attention was 20% slower. */
static inline __attribute__((always_inline)) void prefetch_next(const Step *s, int next, int c, int chunks, int dim) {
    const int row = next / s->kv_heads, kvh = next % s->kv_heads;
    const int runs = s->lengths[row] / 16;
    const int32_t *table = s->tables + (int64_t)row * s->max_blocks;
    const int64_t head_at = (int64_t)kvh * s->num_blocks;
    for (int j = c * runs / chunks; j < (c + 1) * runs / chunks; j++) {
        prefetch_16_rows(pool_at(s, s->k_pool, table, head_at, j * 16, dim), dim, _MM_HINT_T1);
        prefetch_16_rows(pool_at(s, s->v_pool, table, head_at, j * 16, dim), dim, _MM_HINT_T1);
    }
}

/* The weighted values of the group's queries gb .. gb + NQ - 1 (their softmax weights in
 * `weights`, rounded to bf16), two keys at a time: the two value rows interleaved into (key 0,
 * key 1) pairs of each dimension, each pair shared by the NQ queries; the sums put back in
 * dimension order once at the end. */
static inline __attribute__((always_inline)) void values_dot(const Step *s, int row, int kvh,
                                                             int gb, const uint16_t *weights,
                                                             int max_len, int lo, int hi,
                                                             float *partial, const int DIMV,
                                                             const int NQ) {
    const int W = DIMV / 2, group = s->heads / s->kv_heads, dim = DIMV * 16, bs = s->block_size;
    const int32_t *table = s->tables + (int64_t)row * s->max_blocks;
    const uint16_t *v_pool = s->v_pool;
    const int64_t head_at = (int64_t)kvh * s->num_blocks;
    const __m512i lo_order = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i hi_order = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    __m512 low[NQ][MAX_DIMV / 2], high[NQ][MAX_DIMV / 2];
    const uint32_t *w[NQ];
    for (int i = 0; i < NQ; i++) {
        w[i] = (const uint32_t *)(weights + (int64_t)(gb + i) * max_len);
        for (int c = 0; c < W; c++) low[i][c] = high[i][c] = _mm512_setzero_ps();
    }
    for (int p = lo; p < hi; p += 2) {
        const uint16_t *v0 = pool_at(s, v_pool, table, head_at, p, dim), *v1 = 0;
        if (p + 1 < hi) /* the next row of the block where blocks are of even size */
            v1 = bs % 2 == 0 ? v0 + dim : pool_at(s, v_pool, table, head_at, p + 1, dim);
        for (int c = 0; c < W; c++) {
            const __m512i a = _mm512_loadu_si512(v0 + c * 32);
            const __m512i b = v1 ? _mm512_loadu_si512(v1 + c * 32) : _mm512_setzero_si512();
            const __m512bh pl = (__m512bh)_mm512_unpacklo_epi16(a, b);
            const __m512bh ph = (__m512bh)_mm512_unpackhi_epi16(a, b);
            for (int i = 0; i < NQ; i++) {
                const __m512bh wp = (__m512bh)_mm512_set1_epi32((int)w[i][(p - lo) / 2]);
                low[i][c] = _mm512_dpbf16_ps(low[i][c], pl, wp);
                high[i][c] = _mm512_dpbf16_ps(high[i][c], ph, wp);
            }
        }
    }
    for (int i = 0; i < NQ; i++) {
        uint16_t *out = (uint16_t *)s->out +
                        ((int64_t)row * s->heads + (int64_t)kvh * group + gb + i) * dim;
        float *sums = partial ? partial + (int64_t)(gb + i) * PARTIAL(dim) + 2 : NULL;
        for (int c = 0; c < W; c++) {
            const __m512 first = _mm512_permutex2var_ps(low[i][c], lo_order, high[i][c]);
            const __m512 second = _mm512_permutex2var_ps(low[i][c], hi_order, high[i][c]);
            if (sums) {
                _mm512_storeu_ps(sums + c * 32, first);
                _mm512_storeu_ps(sums + c * 32 + 16, second);
                continue;
            }
            _mm256_storeu_si256((__m256i *)(out + c * 32), (__m256i)_mm512_cvtneps_pbh(first));
            _mm256_storeu_si256((__m256i *)(out + c * 32 + 16), (__m256i)_mm512_cvtneps_pbh(second));
        }
    }
}

static inline __attribute__((always_inline)) void attend_item_dot(const Step *s, int item,
                                                                 int g0, int g1, int lo, int hi,
                                                                 float *scores, uint16_t *weights,
                                                                 int max_len, float *partial,
                                                                 int next, const int DIMV) {
    enum { QB_MAX = 4 };
    const int W = DIMV / 2, QB = DIMV <= 4 ? 4 : DIMV <= 8 ? 2 : 1; /* 32-dim vectors */
    const int group = s->heads / s->kv_heads, dim = DIMV * 16, bs = s->block_size;
    const int row = item / s->kv_heads, kvh = item % s->kv_heads;
    const int whole = hi / 16 * 16; /* lo: a multiple of 16 */
    const int32_t *table = s->tables + (int64_t)row * s->max_blocks;
    const uint16_t *q = (const uint16_t *)s->q + ((int64_t)row * s->heads + (int64_t)kvh * group) * dim;
    const uint16_t *k_pool = s->k_pool, *v_pool = s->v_pool;
    const int64_t head_at = (int64_t)kvh * s->num_blocks;
    const f16v scale = (f16v){0} + s->scale;
    __m512bh qs[MAX_GROUP][MAX_DIMV / 2];
    for (int g = g0; g < g1; g++)
        for (int c = 0; c < W; c++) qs[g][c] = (__m512bh)_mm512_loadu_si512(q + g * dim + c * 32);
    for (int p0 = lo; p0 < hi; p0 += 16) { /* scores, 16 keys at once, every query on them
        while they are in L1 */
        const int in_block = p0 < whole && bs % 16 == 0; /* 16 rows of one block */
        const uint16_t *k = in_block ? pool_at(s, k_pool, table, head_at, p0, dim) : NULL;
        if (in_block && p0 + 32 < hi) { /* ahead of the reads from memory */
            const uint16_t *ahead = pool_at(s, k_pool, table, head_at, p0 + 32, dim);
            if (ahead == pool_at(s, k_pool, table, head_at, p0 + 16, dim) + 16 * dim)
                prefetch_16_rows(ahead, dim, _MM_HINT_T0); /* a run the hardware follows */
            else
                prefetch_16_rows(ahead, dim, _MM_HINT_T1);
            prefetch_16_rows(pool_at(s, v_pool, table, head_at, p0 + 16, dim), dim, _MM_HINT_T1);
        }
        if (next >= 0 && bs % 16 == 0)
            prefetch_next(s, next, (p0 - lo) / 16, (hi - lo + 15) / 16, dim);
        for (int g = g0; g < g1; g++) {
            f16v dots[16];
            if (in_block) {
                for (int j = 0; j < 16; j++) dots[j] = (f16v)dot_row(k + j * dim, qs[g], W);
            } else {
                for (int j = 0; j < 16; j++)
                    dots[j] = p0 + j < hi ? (f16v)dot_row(pool_at(s, k_pool, table, head_at, p0 + j, dim), qs[g], W)
                                          : (f16v){0};
            }
            const f16v sums = hsum16(dots) * scale;
            memcpy(scores + g * max_len + (p0 - lo), &sums, sizeof sums);
        }
    }
    const int n = hi - lo;
    for (int g = g0; g < g1; g++) { /* softmax, the weights rounded to bf16 */
        float *sc = scores + g * max_len, top;
        uint16_t *w = weights + g * max_len;
        const float inv_sum = exp_scores_top(sc, n, &top);
        if (partial) /* the keys' largest score and the sum of their e^(score - largest) */
            partial[g * PARTIAL(dim)] = top, partial[g * PARTIAL(dim) + 1] = 1.f / inv_sum;
        const __m512 inv = _mm512_set1_ps(inv_sum);
        for (int p = 0; p < n; p += 16) /* past n: never read as a weight */
            _mm256_storeu_si256((__m256i *)(w + p),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(sc + p), inv)));
        w[n] = 0; /* an odd count's last pair: the key past the end weighs nothing */
    }
    for (int gb = g0; gb < g1; gb += QB) { /* values: QB queries a pass, the last pass's as
        many as are left (a constant count each, so that no query is computed for nothing) */
        const int nq = g1 - gb < QB ? g1 - gb : QB;
        if (nq == 1) values_dot(s, row, kvh, gb, weights, max_len, lo, hi, partial, DIMV, 1);
        else if (nq == 2) values_dot(s, row, kvh, gb, weights, max_len, lo, hi, partial, DIMV, 2);
        else if (nq == 3) values_dot(s, row, kvh, gb, weights, max_len, lo, hi, partial, DIMV, 3);
        else values_dot(s, row, kvh, gb, weights, max_len, lo, hi, partial, DIMV, QB_MAX);
    }
}
#else
#define DOT_DECODE 0
#endif

/* How many parts each (sequence, KV head)'s keys are split into (`attend`): enough parts
 * for two a thread, each of at least MIN_PART_KEYS keys; 1 where there are items enough. */
static int key_parts(const Step *s, int max_len) {
    const int pairs = s->rows * s->kv_heads;
    if (pairs >= FEW_ITEMS) return 1;
    int parts = (2 * omp_get_max_threads() + pairs - 1) / pairs;
    const int most = max_len / MIN_PART_KEYS;
    parts = parts < most ? parts : most;
    parts = parts < MAX_PARTS ? parts : MAX_PARTS;
    return parts > 1 ? parts : 1;
}

/* Keys lo .. hi - 1 of a row's `len`, part `part` of `parts`: split at multiples of 16. */
static inline void part_bounds(int len, int part, int parts, int *lo, int *hi) {
    *lo = part == 0 ? 0 : (int)((int64_t)len * part / parts) / 16 * 16;
    *hi = part + 1 == parts ? len : (int)((int64_t)len * (part + 1) / parts) / 16 * 16;
}

/* Query `h` of `row`: its parts' weighted values, each a softmax over its own keys, made one
 * (each part weighed by its sum of e^(score - the largest of all parts)), rounded to bf16. */
static void merge_parts(const Step *s, const float *partials, int row, int h, int parts) {
    const int group = s->heads / s->kv_heads, dim = s->dim, kvh = h / group, g = h % group;
    const float *first = partials + ((int64_t)(row * s->kv_heads + kvh) * parts * group + g) * PARTIAL(dim);
    const int64_t stride = (int64_t)group * PARTIAL(dim); /* from one part to the next */
    float top = -INFINITY, total = 0.f, weight[MAX_PARTS];
    for (int i = 0; i < parts; i++)
        if (first[i * stride + 1] > 0.f && first[i * stride] > top) top = first[i * stride];
    for (int i = 0; i < parts; i++) {
        const float *part = first + i * stride;
        weight[i] = part[1] > 0.f ? part[1] * exp_nonpositive(part[0] - top) : 0.f;
        total += weight[i];
    }
    uint16_t *out = (uint16_t *)s->out + ((int64_t)row * s->heads + h) * dim;
    for (int d = 0; d < dim; d++) {
        float sum = 0.f;
        for (int i = 0; i < parts; i++)
            if (weight[i] > 0.f) sum += weight[i] * first[i * stride + 2 + d];
        out[d] = to_bf16(sum / total);
    }
}

/* Unit `unit`'s share of the work: its keys, and a little for what every unit costs. */
static inline int64_t unit_cost(const Step *s, int unit, int parts, int split) {
    const int len = s->lengths[unit / parts / s->kv_heads];
    return (split > 1 ? len / parts : len) + 16;
}

/* Thread `me`'s run of units, [*first, *last): contiguous, so that the thread knows which
 * items come next to it (`prefetch_next`), and balanced by the units' keys, not their count,
 * since sequences' lengths differ. */
static void units_of(const Step *s, int items, int parts, int split, int me, int threads,
                     int *first, int *last) {
    int64_t total = 0, at = 0;
    for (int u = 0; u < items; u++) total += unit_cost(s, u, parts, split);
    const int64_t from = total * me / threads, to = total * (me + 1) / threads;
    *first = *last = items;
    for (int u = 0; u < items; u++) {
        if (*first == items && at >= from) *first = u;
        if (at >= to) {
            *last = u;
            break;
        }
        at += unit_cost(s, u, parts, split);
    }
    if (*first > *last) *first = *last;
}

static int attend(const Step *s) {
    const int group = s->heads / s->kv_heads, bs = s->block_size;
    /* each query's scores, padded to whole vectors of 16 keys */
    const int max_len = ((s->max_blocks * bs > 0 ? s->max_blocks * bs : 1) + 15) / 16 * 16;
    const int bf16 = s->is_bf16, vectors = s->dim / 16;
    const int dot = DOT_DECODE && bf16 && s->dim % 32 == 0; /* attend_item_dot */
    /* Work items: a sequence's KV head, all its queries. Where there are too few of those to
     * keep the threads busy (one sequence has as many as the model has KV heads, 3 for the
     * default model, and 3 on 2 threads take 2 rounds): with the dot-product kernel, its keys
     * in parts (`key_parts`), each part's softmax and weighted values kept apart and made one
     * at the end (`merge_parts`, as flash-decoding does), so that each key and value is read
     * once, by one thread; without, each query alone (it reads the head's keys again). */
    const int split = dot ? key_parts(s, max_len) : 1;
    const int parts = split > 1 ? split : s->rows * s->kv_heads < FEW_ITEMS ? group : 1;
    const int items = s->rows * s->kv_heads * parts;
    float *partials = NULL;
    if (split > 1 && !(partials = malloc(sizeof(float) * items * group * PARTIAL(s->dim))))
        return -1;
    int status = 0;
#pragma omp parallel if (items > 1)
    {
        float *scores = malloc(sizeof(float) * group * max_len);
        uint16_t *weights = dot ? malloc(sizeof(uint16_t) * (group * max_len + 1)) : NULL;
        if (scores == NULL || (dot && weights == NULL)) {
#pragma omp atomic write
            status = -1;
        }
#ifdef _OPENMP
        const int me = omp_get_thread_num(), threads = omp_get_num_threads();
#else
        const int me = 0, threads = 1;
#endif
        int first, last;
        units_of(s, items, parts, split, me, threads, &first, &last);
        for (int unit = first; unit < last; unit++) {
            if (scores == NULL || (dot && weights == NULL)) continue;
            /* whole items: the one NEXT_AHEAD on in the thread's run is asked for meanwhile */
            const int next = parts == 1 && unit + NEXT_AHEAD < last ? unit + NEXT_AHEAD : -1;
            const int item = unit / parts, part = unit % parts;
            const int len = s->lengths[item / s->kv_heads];
            /* split: every query of the KV head over keys lo .. hi - 1, kept apart in
             * `partial`; else queries g0 .. g1 - 1 over every key */
            int g0 = 0, g1 = group, lo = 0, hi = len;
            float *partial = NULL;
            if (split > 1) {
                partial = partials + (int64_t)unit * group * PARTIAL(s->dim);
                part_bounds(len, part, parts, &lo, &hi);
                if (lo >= hi) { /* an empty part: it weighs nothing in the merge */
                    for (int g = 0; g < group; g++) partial[g * PARTIAL(s->dim) + 1] = 0.f;
                    continue;
                }
            } else {
                g0 = part * group / parts, g1 = (part + 1) * group / parts;
            }
            /* the common head dimensions get their own copy, the vector count a constant */
#if DOT_DECODE
            if (dot && vectors == 4) attend_item_dot(s, item, g0, g1, lo, hi, scores, weights, max_len, partial, next, 4);
            else if (dot && vectors == 8) attend_item_dot(s, item, g0, g1, lo, hi, scores, weights, max_len, partial, next, 8);
            else if (dot) attend_item_dot(s, item, g0, g1, lo, hi, scores, weights, max_len, partial, next, vectors);
            else
#endif
            if (vectors == 4 && bf16) attend_item(s, item, g0, g1, scores, max_len, next, 4, 1);
            else if (vectors == 4) attend_item(s, item, g0, g1, scores, max_len, next, 4, 0);
            else if (vectors == 8 && bf16) attend_item(s, item, g0, g1, scores, max_len, next, 8, 1);
            else if (vectors == 8) attend_item(s, item, g0, g1, scores, max_len, next, 8, 0);
            else if (bf16) attend_item(s, item, g0, g1, scores, max_len, next, vectors, 1);
            else attend_item(s, item, g0, g1, scores, max_len, next, vectors, 0);
        }
        free(scores), free(weights);
#pragma omp barrier
        int failed; /* after the barrier: every thread's allocation is known */
#pragma omp atomic read
        failed = status;
        if (split > 1 && !failed) {
#pragma omp for
            for (int h = 0; h < s->rows * s->heads; h++)
                merge_parts(s, partials, h / s->heads, h % s->heads, parts);
        }
    }
    free(partials);
    return status;
}

int paged_decode(const void *q, const void *k_pool, const void *v_pool,
                 const int32_t *tables, const int32_t *lengths, void *out,
                 int rows, int heads, int kv_heads, int num_blocks, int block_size, int dim,
                 int max_blocks, int is_bf16, float scale) {
    if (dim % 16 || dim / 16 > MAX_DIMV || kv_heads < 1 || heads % kv_heads ||
        heads / kv_heads > MAX_GROUP)
        return -2;
    const Step s = {q, k_pool, v_pool, tables, lengths, out, rows, heads, kv_heads,
                    num_blocks, block_size, dim, max_blocks, is_bf16, scale};
    return attend(&s);
}

/* ---- Prompt (prefill) attention: bf16 on CPUs with AVX512-BF16 dot products ---------------
 * One sequence's chunk of `n` queries at positions start .. start + n - 1 over its keys
 * 0 .. start + n - 1, causal. For each KV head, the keys and values are first packed out of
 * the paged pool into the layouts the dot-product instruction reads (pairs of bf16 in 32-bit
 * words: keys as [16-key block][dim pair][key], values as [key pair][dim]); then for each tile
 * of 16 query positions (times the head's query group) three passes: the scores (exact
 * products, fp32 sums), their causal softmax in fp32, and the weights (rounded to bf16, as
 * torch's SDPA does for bf16) times the values, summed in fp32. Where the CPU has AMX
 * (`prefill_tile_amx`), the first and last pass are AMX tiles over the same packed layouts. */
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>

#define TILE 16   /* query positions per tile */
#define ROWS_QK 8 /* query rows scored together: one key load serves them all */

int prefill_available(void) { return 1; }

typedef struct {
    const uint16_t *q, *k_pool, *v_pool; /* the chunk's [n, heads, dim] rows (q_stride apart);
                                            [kv_heads, blocks, block_size, dim] */
    const int32_t *table;                /* the sequence's block table */
    uint16_t *out;                       /* [n, heads, dim] rows, out_stride apart */
    int n, start, heads, kv_heads, num_blocks, block_size, dim;
    int amx; /* the tiles in AMX (`prefill_tile_amx`) */
    float scale;
    int64_t q_stride, out_stride; /* elements from a query's row to the next one's */
} Prefill;

static inline const uint32_t *pool_row(const Prefill *s, const uint16_t *pool, int kvh, int pos) {
    const int bs = s->block_size;
    const int64_t block = (int64_t)kvh * s->num_blocks + s->table[pos / bs];
    return (const uint32_t *)(pool + (block * bs + pos % bs) * s->dim);
}

static inline __m512 exp512_nonpositive(__m512 x) { /* as exp_nonpositive, 16 lanes */
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
    const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.4426950409f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.6931471806f));
    __m512 p = _mm512_set1_ps(1.f / 720);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 120));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 24));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 6));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}

/* The blocks of 16 keys packed for a chunk: its keys', rounded up to an even count (AMX takes
 * the keys 32 at a time). */
static inline int packed_blocks(const Prefill *s) { return (s->start + s->n + 31) / 32 * 2; }

static void prefill_pack(const Prefill *s, int kvh, uint32_t *kp, uint32_t *vp) {
    const int dim = s->dim, half = dim / 2;
    const int keys = s->start + s->n, key_blocks = packed_blocks(s);
    /* keys [block][pair][16 keys], values [key pair][dim], zero past the last key */
    for (int key = 0; key < key_blocks * 16; key++) {
        uint32_t *dst = kp + (int64_t)(key / 16) * half * 16 + key % 16;
        if (key < keys) {
            const uint32_t *src = pool_row(s, s->k_pool, kvh, key);
            for (int p = 0; p < half; p++) dst[p * 16] = src[p];
        } else {
            for (int p = 0; p < half; p++) dst[p * 16] = 0;
        }
    }
    for (int pair = 0; pair < key_blocks * 8; pair++) {
        uint32_t *dst = vp + (int64_t)pair * dim;
        const int key = 2 * pair;
        const uint16_t *lo = key < keys ? (const uint16_t *)pool_row(s, s->v_pool, kvh, key) : 0;
        const uint16_t *hi =
            key + 1 < keys ? (const uint16_t *)pool_row(s, s->v_pool, kvh, key + 1) : 0;
        for (int d = 0; d < dim; d++)
            dst[d] = (lo ? lo[d] : 0u) | (uint32_t)(hi ? hi[d] : 0u) << 16;
    }
}

/* The tile's rows of scores (times `scale`) in sc, to their causal softmax in fp32, the
 * weights rounded to bf16 in pw (pairs of keys in 32-bit words): row r is query position
 * i0 + r % tn. Weights are written for the tile's key blocks rounded up to an even count,
 * zero past each row's last key (AMX takes the keys 32 at a time). Where `inv` is given, the
 * weights are left unnormalised (each e^(score - max) rounded to bf16) and inv[r] is 1 / the
 * row's sum, for the caller to scale the weighted sum of values by: one pass over the row
 * fewer. */
static inline void prefill_softmax(const Prefill *s, int i0, int tn, int rows, int tile_blocks,
                                   float *sc, uint32_t *pw, int stride, float scale, float *inv) {
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 by = _mm512_set1_ps(scale);
    const int written = (tile_blocks + 1) / 2 * 2;
    for (int r = 0; r < rows; r++) {
        float *row = sc + (int64_t)r * stride;
        uint32_t *w = pw + (int64_t)r * (stride / 2);
        const int len = s->start + i0 + r % tn + 1;
        __m512 top = _mm512_set1_ps(-INFINITY);
        for (int b = 0; b < tile_blocks; b++) {
            const __mmask16 m = _mm512_cmplt_epi32_mask(lane, _mm512_set1_epi32(len - b * 16));
            top = _mm512_mask_max_ps(top, m, top, _mm512_mul_ps(_mm512_load_ps(row + b * 16), by));
        }
        const __m512 max = _mm512_set1_ps(_mm512_reduce_max_ps(top));
        __m512 sum = _mm512_setzero_ps();
        for (int b = 0; b < written; b++) {
            const __mmask16 m = _mm512_cmplt_epi32_mask(lane, _mm512_set1_epi32(len - b * 16));
            const __m512 x = _mm512_mul_ps(_mm512_maskz_load_ps(m, row + b * 16), by);
            const __m512 e = _mm512_maskz_mov_ps(m, exp512_nonpositive(_mm512_sub_ps(x, max)));
            if (inv)
                _mm256_store_si256((__m256i *)(w + b * 8), (__m256i)_mm512_cvtneps_pbh(e));
            else
                _mm512_store_ps(row + b * 16, e);
            sum = _mm512_add_ps(sum, e);
        }
        if (inv) {
            inv[r] = 1.f / _mm512_reduce_add_ps(sum);
            continue;
        }
        const __m512 by_sum = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(sum));
        for (int b = 0; b < written; b++) {
            const __m256bh h =
                _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(row + b * 16), by_sum));
            _mm256_store_si256((__m256i *)(w + b * 8), (__m256i)h);
        }
    }
}

/* One tile: queries i0 .. i0 + 15 of KV head kvh's query group, over the packed kp, vp. */
static inline __attribute__((always_inline)) void prefill_tile(
    const Prefill *s, int kvh, int i0, const int DIMV, const uint32_t *kp, const uint32_t *vp,
    float *sc, uint32_t *pw, int stride) {
    const int dim = DIMV * 16, half = DIMV * 8, group = s->heads / s->kv_heads;
    const int tn = s->n - i0 < TILE ? s->n - i0 : TILE, rows = tn * group;
    const int tile_blocks = (s->start + i0 + tn - 1) / 16 + 1;
    /* row r: query position i0 + r % tn of the group's head r / tn */
    const uint32_t *q[TILE * 16];
    for (int r = 0; r < rows; r++)
        q[r] = (const uint32_t *)(s->q + (int64_t)(i0 + r % tn) * s->q_stride +
                                  ((int64_t)kvh * group + r / tn) * dim);
    for (int r0 = 0; r0 < rows; r0 += ROWS_QK) { /* scores */
        const uint32_t *qr[ROWS_QK];
        for (int j = 0; j < ROWS_QK; j++) qr[j] = q[r0 + j < rows ? r0 + j : r0];
        for (int b = 0; b < tile_blocks; b++) {
            const uint32_t *kb = kp + (int64_t)b * half * 16;
            __m512 acc[ROWS_QK];
            for (int j = 0; j < ROWS_QK; j++) acc[j] = _mm512_setzero_ps();
            for (int p = 0; p < half; p++) {
                const __m512bh k = (__m512bh)_mm512_load_si512(kb + p * 16);
                for (int j = 0; j < ROWS_QK; j++)
                    acc[j] = _mm512_dpbf16_ps(acc[j], k,
                                              (__m512bh)_mm512_set1_epi32((int)qr[j][p]));
            }
            for (int j = 0; j < ROWS_QK && r0 + j < rows; j++)
                _mm512_store_ps(sc + (int64_t)(r0 + j) * stride + b * 16,
                                _mm512_mul_ps(acc[j], _mm512_set1_ps(s->scale)));
        }
    }
    prefill_softmax(s, i0, tn, rows, tile_blocks, sc, pw, stride, 1.f, NULL);
    /* weights times values: RPV rows at once, DIMV vectors each */
    const int RPV = DIMV >= 16 ? 1 : 16 / DIMV;
    for (int r0 = 0; r0 < rows; r0 += RPV) {
        __m512 o[16];
        for (int j = 0; j < RPV * DIMV; j++) o[j] = _mm512_setzero_ps();
        const uint32_t *w[16];
        for (int j = 0; j < RPV; j++) w[j] = pw + (int64_t)(r0 + j < rows ? r0 + j : r0) * (stride / 2);
        for (int pair = 0; pair < tile_blocks * 8; pair++) {
            const uint32_t *vrow = vp + (int64_t)pair * dim;
            for (int c = 0; c < DIMV; c++) {
                const __m512bh v = (__m512bh)_mm512_load_si512(vrow + c * 16);
                for (int j = 0; j < RPV; j++)
                    o[j * DIMV + c] = _mm512_dpbf16_ps(
                        o[j * DIMV + c], v, (__m512bh)_mm512_set1_epi32((int)w[j][pair]));
            }
        }
        for (int j = 0; j < RPV && r0 + j < rows; j++) {
            const int r = r0 + j;
            uint16_t *dst = s->out + (int64_t)(i0 + r % tn) * s->out_stride +
                            ((int64_t)kvh * group + r / tn) * dim;
            for (int c = 0; c < DIMV; c++)
                _mm256_storeu_si256((__m256i *)(dst + c * 16),
                                    (__m256i)_mm512_cvtneps_pbh(o[j * DIMV + c]));
        }
    }
}

#ifdef LLMFLEET_AMX
/* C tiles 0 .. count - 1 (count 1-4) += the A tile at a (tile 4, a_stride bytes a row) times
 * the B tiles at b, b + b_step, ... (b_stride bytes a row; tiles 5-7, then 5 again). */
static inline void four_products(const void *a, int64_t a_stride, const uint32_t *b,
                                 int64_t b_step, int64_t b_stride, int count) {
    _tile_loadd(4, a, a_stride);
    _tile_loadd(5, b, b_stride);
    _tile_dpbf16ps(0, 4, 5);
    if (count > 1) {
        _tile_loadd(6, b + b_step, b_stride);
        _tile_dpbf16ps(1, 4, 6);
    }
    if (count > 2) {
        _tile_loadd(7, b + 2 * b_step, b_stride);
        _tile_dpbf16ps(2, 4, 7);
    }
    if (count > 3) {
        _tile_loadd(5, b + 3 * b_step, b_stride);
        _tile_dpbf16ps(3, 4, 5);
    }
}

/* C tiles 0 .. count - 1 into c, c + c_step, ... (c_stride bytes a row). */
static inline void store_products(float *c, int64_t c_step, int64_t c_stride, int count) {
    _tile_stored(0, c, c_stride);
    if (count > 1) _tile_stored(1, c + c_step, c_stride);
    if (count > 2) _tile_stored(2, c + 2 * c_step, c_stride);
    if (count > 3) _tile_stored(3, c + 3 * c_step, c_stride);
}

static inline void zero_products(void) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
}

/* The tile's scores and its weights times values in AMX tiles, where the CPU has them (the
 * softmax between as above): the packed keys' words are already a B tile's rows (a pair of
 * dims, 16 keys), and so are the values' (a pair of keys, 16 dims). A query head's 16
 * positions are an A tile (32 dims at a time, straight from q) against four blocks of 16
 * keys (C tiles 0-3), then its weights (32 keys at a time) against four tiles of 16 dims of
 * the values. Tiles: 0-3 C (tn rows), 4 A (tn rows), 5-7 B (16 rows). */
static void prefill_tile_amx(const Prefill *s, int kvh, int i0, const int DIMV, const uint32_t *kp,
                             const uint32_t *vp, float *sc, uint32_t *pw, int stride) {
    const int dim = DIMV * 16, half = DIMV * 8, group = s->heads / s->kv_heads;
    const int tn = s->n - i0 < TILE ? s->n - i0 : TILE;
    const int tile_blocks = (s->start + i0 + tn - 1) / 16 + 1;
    const int tiles[8] = {tn, tn, tn, tn, tn, 16, 16, 16};
    configure_tiles(tiles);
    const int64_t q_stride = s->q_stride * 2, k_block = (int64_t)half * 16;
    for (int g = 0; g < group; g++) { /* scores: sc's row g * tn + i, query position i0 + i */
        const uint16_t *q = s->q + (int64_t)i0 * s->q_stride + ((int64_t)kvh * group + g) * dim;
        for (int b = 0; b < tile_blocks; b += 4) {
            const int nb = tile_blocks - b < 4 ? tile_blocks - b : 4;
            zero_products();
            for (int step = 0; step < dim / 32; step++)
                four_products(q + 32 * step, q_stride, kp + b * k_block + 256 * step, k_block, 64,
                              nb);
            store_products(sc + (int64_t)g * tn * stride + 16 * b, 16, stride * 4, nb);
        }
    }
    float inv[TILE * MAX_GROUP];
    prefill_softmax(s, i0, tn, group * tn, tile_blocks, sc, pw, stride, s->scale, inv);
    float o[4][256] __attribute__((aligned(64)));
    const int key_steps = (tile_blocks + 1) / 2; /* 32 keys each: the weights are zero past */
    for (int g = 0; g < group; g++) {
        const uint32_t *w = pw + (int64_t)g * tn * (stride / 2);
        uint16_t *out = s->out + (int64_t)i0 * s->out_stride + ((int64_t)kvh * group + g) * dim;
        for (int t0 = 0; t0 < DIMV; t0 += 4) {
            const int nt = DIMV - t0 < 4 ? DIMV - t0 : 4;
            zero_products();
            for (int step = 0; step < key_steps; step++)
                four_products(w + 16 * step, stride * 2, vp + (int64_t)16 * step * dim + 16 * t0,
                              16, dim * 4, nt);
            store_products(o[0], 256, 64, nt);
            for (int i = 0; i < tn; i++) {
                const __m512 by_sum = _mm512_set1_ps(inv[g * tn + i]);
                for (int t = 0; t < nt; t++)
                    _mm256_storeu_si256(
                        (__m256i *)(out + (int64_t)i * s->out_stride + 16 * (t0 + t)),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(o[t] + 16 * i), by_sum)));
            }
        }
    }
}
#endif

/* One tile's work: a chunk's 16 query positions from i0, for one KV head's query group. */
typedef struct {
    int span, kvh, i0, keys; /* keys: the tile's last query sees this many (its cost) */
} PrefillItem;

static int longer_first(const void *a, const void *b) {
    return ((const PrefillItem *)b)->keys - ((const PrefillItem *)a)->keys;
}

/* The chunks of a step (`count` of them, each its own sequence), in one parallel region over
 * torch's own OpenMP threads (the kernel links the libgomp torch has loaded, so no second
 * pool competes with torch's): every (chunk, KV head)'s keys and values packed, then every
 * tile of every chunk, longest first. One call a layer, where a call a chunk cost ~50 us of
 * fork, join and Python each (a step of 32 chunks of 64 tokens: 960 calls, 62 ms of
 * attention where the arithmetic is ~5; session 35). */
static int prefill_run(const Prefill *spans, int count, const int DIMV) {
    const Prefill *s0 = &spans[0];
    const int dim = DIMV * 16, kv_heads = s0->kv_heads, group = s0->heads / kv_heads;
    int64_t total = 0;
    int max_stride = 0, items = 0;
    for (int c = 0; c < count; c++) {
        const int key_blocks = packed_blocks(&spans[c]);
        total += (int64_t)key_blocks * 8 * dim * 2 * kv_heads;
        if (key_blocks * 16 > max_stride) max_stride = key_blocks * 16;
        items += (spans[c].n + TILE - 1) / TILE * kv_heads;
    }
    uint32_t *packs = aligned_alloc(64, (size_t)total * 4);
    int64_t *at = malloc(sizeof(int64_t) * count); /* each chunk's packed keys in `packs` */
    PrefillItem *list = malloc(sizeof(PrefillItem) * (items ? items : 1));
    if (packs == NULL || at == NULL || list == NULL) {
        free(packs), free(at), free(list);
        return -1;
    }
    int item = 0;
    int64_t offset = 0;
    for (int c = 0; c < count; c++) {
        at[c] = offset;
        offset += packed_blocks(&spans[c]) * 8 * dim * 2 * kv_heads;
        for (int i0 = 0; i0 < spans[c].n; i0 += TILE)
            for (int kvh = 0; kvh < kv_heads; kvh++) {
                const int tn = spans[c].n - i0 < TILE ? spans[c].n - i0 : TILE;
                list[item++] = (PrefillItem){c, kvh, i0, spans[c].start + i0 + tn};
            }
    }
    qsort(list, items, sizeof(PrefillItem), longer_first);
    int status = 0;
#pragma omp parallel if (items > 1)
    {
#pragma omp for schedule(dynamic, 1)
        for (int j = 0; j < count * kv_heads; j++) {
            const Prefill *s = &spans[j / kv_heads];
            const int64_t words = (int64_t)packed_blocks(s) * 8 * dim; /* a head's keys; values alike */
            uint32_t *kp = packs + at[j / kv_heads], *vp = kp + words * kv_heads;
            prefill_pack(s, j % kv_heads, kp + j % kv_heads * words, vp + j % kv_heads * words);
        }
        float *sc = aligned_alloc(64, (size_t)TILE * group * max_stride * 4);
        uint32_t *pw = aligned_alloc(64, (size_t)TILE * group * max_stride * 2);
        if (sc == NULL || pw == NULL) {
#pragma omp atomic write
            status = -1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int j = 0; j < items; j++) {
            if (sc == NULL || pw == NULL) continue;
            const PrefillItem it = list[j];
            const Prefill *s = &spans[it.span];
            const int stride = packed_blocks(s) * 16;
            const int64_t words = (int64_t)packed_blocks(s) * 8 * dim;
            const uint32_t *kp = packs + at[it.span] + it.kvh * words;
            const uint32_t *vp = packs + at[it.span] + words * kv_heads + it.kvh * words;
#ifdef LLMFLEET_AMX
            if (s->amx) {
                prefill_tile_amx(s, it.kvh, it.i0, DIMV, kp, vp, sc, pw, stride);
                continue;
            }
#endif
            /* the common head dimensions get their own copy, the vector count a constant, as
             * `attend` does for decodes. GCC outlines this region's body into a function of
             * its own before it inlines anything, so DIMV is a value read at run time here;
             * passed on as such, the weighted values' sums (`o` in prefill_tile) lived on
             * the stack, a load and a store around each dot product. With the constants the
             * kernel was 1.45-2.13x faster at 64-2,048 tokens, the same bits, and whole
             * prompt steps 1.07x (192 tokens) to 1.26x (2,048) on an AMD EPYC, Zen 4
             * (`bench/prompt_attention.py`, `bench/prompt_sides.py`; docs/benchmarks.md,
             * session 40) */
            if (DIMV == 4) prefill_tile(s, it.kvh, it.i0, 4, kp, vp, sc, pw, stride);
            else if (DIMV == 8) prefill_tile(s, it.kvh, it.i0, 8, kp, vp, sc, pw, stride);
            else prefill_tile(s, it.kvh, it.i0, DIMV, kp, vp, sc, pw, stride);
        }
#ifdef LLMFLEET_AMX
        if (s0->amx) _tile_release();
#endif
        free(sc), free(pw);
    }
    free(packs), free(at), free(list);
    return status;
}

/* Causal attention of `count` prompt chunks, each of its own sequence: chunk c's queries are
 * rows spans[4c] .. spans[4c] + spans[4c + 1] - 1 of q and out (q_stride and out_stride
 * elements apart, each row [heads, dim]), at positions spans[4c + 2] .. over its keys, its
 * block table at tables + spans[4c + 3]. 0, or < 0 where the shapes are not the kernel's. */
int paged_prefill_spans(const void *q, int64_t q_stride, const void *k_pool, const void *v_pool,
                        const int32_t *spans, const int32_t *tables, void *out,
                        int64_t out_stride, int count, int heads, int kv_heads, int num_blocks,
                        int block_size, int dim, int amx, float scale) {
    if (dim % 32 || dim / 16 > MAX_DIMV || kv_heads < 1 || heads % kv_heads ||
        heads / kv_heads > MAX_GROUP || count < 1 || q_stride < (int64_t)heads * dim ||
        out_stride < (int64_t)heads * dim)
        return -2;
    for (int c = 0; c < count; c++)
        if (spans[4 * c + 1] < 1 || spans[4 * c + 2] < 0 || spans[4 * c] < 0) return -2;
#ifdef LLMFLEET_AMX
    amx = amx && amx_available();
#else
    amx = 0;
#endif
    Prefill *chunks = malloc(sizeof(Prefill) * count);
    if (chunks == NULL) return -1;
    for (int c = 0; c < count; c++) {
        const int32_t *span = spans + 4 * c;
        chunks[c] = (Prefill){(const uint16_t *)q + span[0] * q_stride, k_pool, v_pool,
                              tables + span[3], (uint16_t *)out + span[0] * out_stride,
                              span[1], span[2], heads, kv_heads, num_blocks, block_size, dim,
                              amx, scale, q_stride, out_stride};
    }
    const int status = prefill_run(chunks, count, dim / 16); /* each tile's DIMV made constant inside */
    free(chunks);
    return status;
}

#else
int prefill_available(void) { return 0; }
int paged_prefill_spans(const void *q, int64_t q_stride, const void *k_pool, const void *v_pool,
                        const int32_t *spans, const int32_t *tables, void *out,
                        int64_t out_stride, int count, int heads, int kv_heads, int num_blocks,
                        int block_size, int dim, int amx, float scale) {
    return -3; /* not built for this CPU: the caller takes torch's SDPA */
}
#endif
