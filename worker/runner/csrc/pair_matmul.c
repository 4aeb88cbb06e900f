/* `y = x @ w.T + bias` for a bf16 matmul of more than a few rows on CPUs with AVX512-BF16 but
 * no AMX (AMD EPYC Zen 4, Intel Cooper Lake): x [rows, k], w as `amx_pack` lays it out (pairs
 * of k side by side, 16 output columns a 64-byte row), bias [n] or NULL, y [rows, n]; fp32
 * sums over k in order, rounded to bf16 once, as torch's matmul does (oneDNN's sums in
 * another order: a rounding step apart in a few elements in 10,000).
 *
 * oneDNN's matmul, which these rows took before, made 430-840 GFLOP/s for the default model's
 * layers at 16-32 rows (a decode step of 16-32 sequences) on a 2-core AMD EPYC whose dot
 * products give about 1,000; a step of 32 sequences is bound by the arithmetic there, not by
 * the memory (8.6 GFLOP against 269 MB of weights). This kernel made 830-980 at the same rows
 * (docs/benchmarks.md, session 29). It takes only decode steps (`decode_layers.c`): its sums
 * are in another order than oneDNN's, and prompts keep oneDNN's, which are `transformers`'.
 *
 * The layout is AMX's B tiles (`amx_matmul.c`): for each block of 32 output columns and each
 * 32 values of k, two tiles of 16 pairs of k, each pair's row the 16 columns' two values. One
 * 64-byte row is what `vdpbf16ps` takes: 16 columns times one pair of k, against one pair of
 * x's values broadcast. A thread's work is whole blocks, two at a time (64 columns, four
 * vectors), for ROWS rows of x at a time: 4 x ROWS fp32 sums in registers, and per pair of k
 * four loads of the weights, ROWS broadcasts and 4 x ROWS dot products, the arithmetic the
 * bound. A decode step streams the weights once from memory; a panel's passes after the
 * first read them from L2. Each thread's blocks lie one after another in `packed`, and each
 * panel's passes ask for the thread's next panel into L2, a share in each pass's every step
 * of k, so that the memory is read at an even pace through all the passes, not only through
 * the first (the thread's first panel: each line asked for ahead on its first pass). Asked
 * for on the first pass only (sessions 29-36), a panel's lines came at six times the pace the
 * arithmetic needs and the memory idled through the other passes: from memory, 32 rows of the
 * default model's matmuls made 276-320 GFLOP/s against 350-430 with the weights in cache on
 * an AMD EPYC host, and 342-385 with the next panel spread (a C probe, session 37; a step of
 * 32 decodes 1.17x faster, docs/benchmarks.md).
 * x's rows are read as pairs from L1/L2. n and k are multiples of 32 (the caller checks). */
#include <stdint.h>
#include <string.h>

#include "vec.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>

#define ROWS 6           /* rows of x a pass: 24 sums in registers */
#define PAIR_AHEAD 4096  /* each line of the weights asked for this far ahead, into L2 */

int pair_matmul_available(void) { return 1; }

static inline int pair_at(const uint16_t *p) { /* two bf16 values as one 32-bit lane */
    int32_t pair;
    memcpy(&pair, p, sizeof pair);
    return pair;
}

/* Rows row0 .. row0 + R - 1 of x against C vectors of 16 columns (C = 4: blocks b and b + 1;
 * C = 2: block b), stored with the bias, rounded to bf16. */
static inline __attribute__((always_inline)) void pass(const uint16_t *x, const uint16_t *packed,
                                                       const uint16_t *bias, uint16_t *y,
                                                       int row0, const int R, const int C,
                                                       int block, int n, int k, int prefetch,
                                                       const char *ahead, int ahead_lines) {
    __m512 sum[ROWS][4];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) sum[r][c] = _mm512_setzero_ps();
    const uint16_t *b = packed + (int64_t)block * 32 * k;
    const int64_t next_block = 32 * (int64_t)k; /* elements from a block to the next */
    const uint16_t *xr = x + (int64_t)row0 * k;
    for (int step = 0; step < k / 32; step++, b += 1024) {
        if (prefetch)
            for (int line = 0; line < 2048; line += 64)
                for (int c = 0; c < C; c += 2)
                    _mm_prefetch((const char *)(b + c / 2 * next_block) + PAIR_AHEAD + line,
                                 _MM_HINT_T1);
        for (int line = step * ahead_lines / (k / 32); line < (step + 1) * ahead_lines / (k / 32); line++)
            _mm_prefetch(ahead + (int64_t)line * 64, _MM_HINT_T1);
        for (int pair = 0; pair < 16; pair++) {
            __m512bh w[4];
            for (int c = 0; c < C; c++) /* vector c: block c / 2, tile c % 2 */
                w[c] = (__m512bh)_mm512_loadu_si512(b + c / 2 * next_block + c % 2 * 512 + pair * 32);
            const int at = 32 * step + 2 * pair; /* x's pair of k */
            for (int r = 0; r < R; r++) {
                const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair_at(xr + (int64_t)r * k + at));
                for (int c = 0; c < C; c++) sum[r][c] = _mm512_dpbf16_ps(sum[r][c], w[c], xv);
            }
        }
    }
    for (int c = 0; c < C; c++) {
        const int col = 32 * block + 16 * c; /* vector c's columns: block c / 2's c % 2 half */
        const __m512 add = bias ? (__m512)load_bf16(bias + col) : _mm512_setzero_ps();
        for (int r = 0; r < R; r++)
            _mm256_storeu_si256((__m256i *)(y + (int64_t)(row0 + r) * n + col),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(sum[r][c], add)));
    }
}

/* Every row of x against blocks `block` (C = 4: and the next), ROWS rows a pass, the last pass
 * as many as are left (a constant count each, so that the loops unroll). With `fetch`, the
 * first pass asks for the panel's weights ahead of itself; `next_lines` lines from `next` (the
 * thread's next panel) are asked for meanwhile, spread evenly over every pass. */
static inline __attribute__((always_inline)) void columns(const uint16_t *x, const uint16_t *packed,
                                                          const uint16_t *bias, uint16_t *y,
                                                          int rows, const int C, int block, int n,
                                                          int k, int fetch, const uint16_t *next,
                                                          int next_lines) {
    const int passes = (rows + ROWS - 1) / ROWS;
    /* pass i's share of the next panel's lines: [i * next_lines / passes, (i + 1) * ...) */
#define PASS(R)                                                                                \
    pass(x, packed, bias, y, row0, R, C, block, n, k, fetch && row0 == 0,                      \
         next ? (const char *)next + (int64_t)(row0 / ROWS) * next_lines / passes * 64 : NULL, \
         (row0 / ROWS + 1) * next_lines / passes - (row0 / ROWS) * next_lines / passes)
    int row0 = 0;
    for (; row0 + ROWS <= rows; row0 += ROWS) PASS(ROWS);
    switch (rows - row0) {
    case 1: PASS(1); break;
    case 2: PASS(2); break;
    case 3: PASS(3); break;
    case 4: PASS(4); break;
    case 5: PASS(5); break;
    default: break;
    }
#undef PASS
}

int pair_matmul(const uint16_t *x, const uint16_t *packed, const uint16_t *bias, uint16_t *y,
                int rows, int n, int k) {
    if (rows < 1 || n % 32 || k % 32) return 1;
    const int num_blocks = n / 32;
#pragma omp parallel
    {
        int first, last;
        thread_share(num_blocks, &first, &last);
        for (int block = first; block < last; block += 2) {
            /* the thread's next panel: its blocks follow this panel's in `packed` */
            const int next = last - block - 2 < 2 ? last - block - 2 : 2;
            const uint16_t *ahead = next > 0 ? packed + (int64_t)(block + 2) * 32 * k : NULL;
            const int lines = next > 0 ? next * k : 0; /* a block: 32 columns x k x 2 bytes */
            const int fetch = block == first; /* no panel before it asked for it */
            if (block + 2 <= last) columns(x, packed, bias, y, rows, 4, block, n, k, fetch, ahead, lines);
            else columns(x, packed, bias, y, rows, 2, block, n, k, fetch, ahead, lines);
        }
    }
    return 0;
}

#elif defined(__AVX2__) && defined(__FMA__)
/* CPUs with AVX2 but no AVX512-BF16 (AMD EPYC Zen 2-3, Intel Xeons before Cooper Lake), where
 * oneDNN's bf16 matmul is emulated (a step of 32 decodes took 854 ms against 258 in fp32 on
 * an AMD EPYC, Zen 3, session 38): the same layout read in fp32 multiply-adds. A 64-byte row
 * (16 columns x one pair of k) is two 8-column vectors; each splits into its even-k values
 * (a shift) and odd-k values (a mask), both exact, against x's two values broadcast from its
 * rows, widened to fp32 once. A thread's work is whole tiles (16 columns), ROWS8 rows of x at
 * a time: 12 fp32 sums in registers, and per pair of k two loads of the weights, four
 * splits, 12 broadcasts and 24 multiply-adds. Sums over k in order, as the AVX512-BF16
 * kernel's. Rows are taken in chunks of CHUNK_ROWS, every tile of the thread's share per
 * chunk, so that a chunk's widened rows stay in L2 for all its tiles (a prompt's thousands of
 * rows do not fit). */
#include <immintrin.h>
#include <stdlib.h>

#define ROWS8 6
#define CHUNK_ROWS 48

int pair_matmul_available(void) { return 1; }

/* Row r's sums (8 columns each, `lo##r` and `hi##r`) and their two multiply-adds for one
 * value of k (x's at `at`, the two weight vectors' `w0`, `w1`). Named variables, not arrays:
 * GCC stored an array of them to the stack at every pair of k (12 stores to each 24
 * multiply-adds; the kernel made about 55 GFLOP/s in a decode step of 32 sequences). */
#define SUMS(r) __m256 lo##r = _mm256_setzero_ps(), hi##r = _mm256_setzero_ps()
#define MADD(r, at, w0, w1)                                               \
    if (R > r) {                                                          \
        const __m256 xv = _mm256_broadcast_ss(xr + (int64_t)(r) * k + (at)); \
        lo##r = _mm256_fmadd_ps(w0, xv, lo##r);                           \
        hi##r = _mm256_fmadd_ps(w1, xv, hi##r);                           \
    }

static inline const uint16_t *tile_at(const uint16_t *packed, int tile, int k) {
    return packed + (int64_t)(tile / 2) * 32 * k + (tile % 2) * 512;
}

static inline __attribute__((always_inline)) void pass8(const float *xw, const uint16_t *packed,
                                                        const uint16_t *bias, uint16_t *y,
                                                        int row0, const int R, int tile, int n,
                                                        int k) {
    SUMS(0); SUMS(1); SUMS(2); SUMS(3); SUMS(4); SUMS(5);
    const uint16_t *b = tile_at(packed, tile, k);
    const float *xr = xw + (int64_t)row0 * k;
    const __m256i odd_mask = _mm256_set1_epi32((int)0xffff0000u);
    for (int step = 0; step < k / 32; step++, b += 1024)
        for (int pair = 0; pair < 16; pair++) {
            const __m256i v0 = _mm256_loadu_si256((const __m256i *)(b + pair * 32));
            const __m256i v1 = _mm256_loadu_si256((const __m256i *)(b + pair * 32 + 16));
            const int at = 32 * step + 2 * pair; /* x's pair of k */
            const __m256 e0 = _mm256_castsi256_ps(_mm256_slli_epi32(v0, 16));
            const __m256 e1 = _mm256_castsi256_ps(_mm256_slli_epi32(v1, 16));
            MADD(0, at, e0, e1) MADD(1, at, e0, e1) MADD(2, at, e0, e1)
            MADD(3, at, e0, e1) MADD(4, at, e0, e1) MADD(5, at, e0, e1)
            const __m256 o0 = _mm256_castsi256_ps(_mm256_and_si256(v0, odd_mask));
            const __m256 o1 = _mm256_castsi256_ps(_mm256_and_si256(v1, odd_mask));
            MADD(0, at + 1, o0, o1) MADD(1, at + 1, o0, o1) MADD(2, at + 1, o0, o1)
            MADD(3, at + 1, o0, o1) MADD(4, at + 1, o0, o1) MADD(5, at + 1, o0, o1)
        }
    const __m256 lo[ROWS8] = {lo0, lo1, lo2, lo3, lo4, lo5}, hi[ROWS8] = {hi0, hi1, hi2, hi3, hi4, hi5};
    const int col = 16 * tile;
    float add[16] = {0};
    if (bias)
        for (int i = 0; i < 16; i++) {
            const uint32_t bits = (uint32_t)bias[col + i] << 16;
            memcpy(&add[i], &bits, sizeof(float));
        }
    for (int r = 0; r < R; r++) {
        float lanes[16];
        _mm256_storeu_ps(lanes, _mm256_add_ps(lo[r], _mm256_loadu_ps(add)));
        _mm256_storeu_ps(lanes + 8, _mm256_add_ps(hi[r], _mm256_loadu_ps(add + 8)));
        for (int i = 0; i < 16; i++) y[(int64_t)(row0 + r) * n + col + i] = to_bf16(lanes[i]);
    }
}
#undef SUMS
#undef MADD

int pair_matmul(const uint16_t *x, const uint16_t *packed, const uint16_t *bias, uint16_t *y,
                int rows, int n, int k) {
    if (rows < 1 || n % 32 || k % 32) return 1;
    float *xw = malloc(sizeof(float) * rows * k);
    if (xw == NULL) return -1;
    for (int64_t i = 0; i < (int64_t)rows * k; i += 8) /* x widened to fp32, in order */
        _mm256_storeu_ps(xw + i, _mm256_castsi256_ps(_mm256_slli_epi32(
                                     _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(x + i))), 16)));
#pragma omp parallel
    {
        int first, last;
        thread_share(n / 16, &first, &last);
        for (int chunk = 0; chunk < rows; chunk += CHUNK_ROWS) {
            const int end = chunk + CHUNK_ROWS < rows ? chunk + CHUNK_ROWS : rows;
            for (int tile = first; tile < last; tile++) {
#define PASS(R) pass8(xw, packed, bias, y, row0, R, tile, n, k)
                int row0 = chunk;
                for (; row0 + ROWS8 <= end; row0 += ROWS8) PASS(ROWS8);
                switch (end - row0) { /* a constant count each, so that the loops unroll */
                case 1: PASS(1); break;
                case 2: PASS(2); break;
                case 3: PASS(3); break;
                case 4: PASS(4); break;
                case 5: PASS(5); break;
                default: break;
                }
#undef PASS
            }
        }
    }
    free(xw);
    return 0;
}

#else /* neither AVX512-BF16 nor AVX2 here: the callers keep oneDNN */

int pair_matmul_available(void) { return 0; }

int pair_matmul(const uint16_t *x, const uint16_t *packed, const uint16_t *bias, uint16_t *y,
                int rows, int n, int k) {
    (void)x, (void)packed, (void)bias, (void)y, (void)rows, (void)n, (void)k;
    return 1;
}

#endif
