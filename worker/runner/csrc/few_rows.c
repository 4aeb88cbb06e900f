/* `y = x @ w.T + bias` for a bf16 matmul of a few rows (a decode step of 1-8 sequences):
 * x [rows, k], w [n, k] as nn.Linear keeps it, bias [n] or NULL, y [rows, n]; fp32 sums,
 * rounded to bf16 once, as torch's matmul does.
 *
 * With so few rows the matmul reads each weight once and does almost no arithmetic with it:
 * its time is the time to stream the weights from memory. Each thread takes a contiguous run
 * of w's rows and reads it front to back (at one row of x, and at eight, one row of w at a
 * time: a single sequential stream per thread, which the hardware prefetcher follows, or on
 * AMD Zen 4 two, the run's halves side by side, `few_rows_streams`; at 2-7 rows of x, two or
 * four rows of w side by side, so that each load of x serves them all), and dots it with the few
 * rows of x, which stay in L1. oneDNN's matmul at one row read the same weights at about half
 * that rate here (docs/benchmarks.md, "Few-row matmuls"). k is a multiple of 32 (checked by
 * the caller).
 *
 * Each 64-byte line of w is asked for ahead of its use, into L2: on an Intel Xeon (Sapphire
 * Rapids class) the hardware prefetcher alone streamed a layer's weights at 25-28 GB/s, and
 * with the hint 3 KB ahead at 31-37 (a plain read of one large run: 30 against 39;
 * docs/benchmarks.md, session 26); on an AMD EPYC host a similar hint, 2-8 KB ahead, had
 * changed nothing at one row (session 23), and 8 KB ahead took up to a third off the
 * matmuls of 2-6 rows read side by side (session 27). */
#include <stdint.h>

#include "vec.h"

#ifdef _OPENMP
#include <omp.h>
static inline int omp_threads(void) { return omp_get_num_threads(); }
static inline int omp_thread(void) { return omp_get_thread_num(); }
#else
static inline int omp_threads(void) { return 1; }
static inline int omp_thread(void) { return 0; }
#endif

#define MAX_ROWS 8

static inline float bias_value(const uint16_t *bias, int j) { /* bias[j] as fp32, or 0 */
    float b = 0.f;
    if (bias) {
        const uint32_t bits = (uint32_t)bias[j] << 16;
        memcpy(&b, &bits, sizeof b);
    }
    return b;
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>

int few_rows_available(void) { return MAX_ROWS; }

/* On an Intel Xeon 3-4 KB ahead streamed fastest of 0.5-4 KB (T1: into L2; T0 was slower, NTA
 * half as fast; session 26). On an AMD EPYC (Zen 4, which GCC 12's -march=native calls znver3)
 * 2 KB ahead read a batch-1 step's weights 3% faster than 3 KB (the median of seven runs,
 * from 2% slower to 8% faster, the gains where its memory was fast), 4-6 KB 4-7% slower
 * (`bench/few_rows_stream.py`, session 33). */
#if defined(__znver3__) || defined(__znver4__) || defined(__znver5__)
#define PREFETCH_AHEAD 2048
#else
#define PREFETCH_AHEAD 3072
#endif

/* How many places of its run of w's rows each thread reads at once, a row from each at a time
 * (`dot_rows`), at 1, 2 and 8 rows of x: the build's STREAMS (1, or 2 where `cpu_kernels.py`
 * defines it: AMD Zen 4) until `few_rows_streams` sets another (`LLMFLEET_CPU_STREAMS`). On
 * one Zen 4 host one core kept too few lines in flight from a single stream to take its share
 * where the memory was fast: a batch-1 step's matmuls read at 0.76 of the plain read in one
 * stream a thread and at 0.85 in two (0.91-0.93 and 0.94-0.95 where it was slow), and two took
 * 2 and 8 rows of x from 0.62-0.83 and 0.54-0.58 of the plain read to 0.67-0.92 and 0.75-0.78
 * (session 43). On another of the same model (session 44) two read 2 and 8 rows of x 8-14%
 * and 19-26% faster too, but one row 4-14% slower where the memory was fast, level where it
 * was slow (`bench/few_rows_stream.py --places`, docs/benchmarks.md). Intel and Zen 5 keep
 * one, not measured with two. */
#ifndef STREAMS
#define STREAMS 1
#endif
static int streams_at[MAX_ROWS + 1] = {1, STREAMS, STREAMS, 1, 1, 1, 1, 1, STREAMS};

/* Sets how many places each thread reads at `rows` rows of x (1, 2 or 8; 1 or 2 places; any
 * other value leaves it) and returns what it was. */
int few_rows_streams(int rows, int streams) {
    if (rows < 1 || rows > MAX_ROWS) return 1;
    const int was = streams_at[rows];
    if ((rows == 1 || rows == 2 || rows == 8) && (streams == 1 || streams == 2))
        streams_at[rows] = streams;
    return was;
}

/* 2-7 rows of x take dot_groups (J rows of w side by side, each load of x serving them all)
 * unless FEW_ROWS_ONE_STREAM is defined: then dot_rows, one row of w at a time, as at 1 and 8.
 * The build defines it (`cpu_kernels.py`) where a 512-bit dot product runs at full width
 * (AMD Zen 5): the group's loads and dot products bound it on Zen 4, whose 512-bit units run
 * each in two halves, but not there, where the single stream a thread reads the memory
 * faster. On an AMD EPYC Zen 5 a decode step's matmuls of 2-7 rows (the layers' and the LM
 * head's, 269 MB) took 0.77-0.86 of the grouped kernel's time, and whole steps of 2-7
 * sequences 0.78-0.88 (0.99 in one run of 6, in a minute the memory read 50-81 GB/s;
 * docs/benchmarks.md, session 39). */

/* Where J rows of w are read side by side (dot_group), each line is asked for at least 8 KB
 * ahead, at the same place in a later group's row: on an AMD EPYC host the layers' matmuls of
 * 5-6 rows took 0.69-0.90 of the old kernel's time with 8 KB (the less in the minutes its
 * memory was fast), 0.93-1.07 with one group (4.6 KB for the default model's k of 576) and
 * 1.02-1.39 with 2 KB spread over the rows (a C probe, session 27). */
#define GROUP_AHEAD 8192

/* The 64-byte line at p, its prefetch asked for on the way. */
static inline __m512bh load_pairs_ahead(const uint16_t *p) {
    _mm_prefetch((const char *)p + PREFETCH_AHEAD, _MM_HINT_T1);
    return (__m512bh)_mm512_loadu_si512(p);
}

static inline __m512bh load_pairs(const uint16_t *p) {
    return (__m512bh)_mm512_loadu_si512(p);
}

/* Rows j and, where P is 2, j + apart of w against the `ROWS` rows of x, side by side in one
 * pass over k. Four sums a (row of x, row of w) up to 4 rows of x, one from 5, so that the
 * dot-product instructions of one weight row do not wait on each other (at one row, with two,
 * the weights streamed at 66-70 GB/s where the host gave 76-78, and at 72 with four) and at
 * most 16 sums take registers (P 2 is read at 1, 2 and 8 rows). S follows the rows, not P,
 * so a row's sums are the same whether it is read in a pair or alone. */
static inline __attribute__((always_inline)) void dot_row(const uint16_t *x, const uint16_t *w,
                                                          const uint16_t *bias, uint16_t *y,
                                                          const int ROWS, const int P, int n,
                                                          int k, int j, int apart) {
    const int S = ROWS <= 4 ? 4 : 1; /* sums a (row of x, row of w) */
    const uint16_t *wp[2] = {w + (int64_t)j * k, w + (int64_t)(j + apart) * k};
    __m512 sum[MAX_ROWS][2][4];
    for (int r = 0; r < ROWS; r++)
        for (int p = 0; p < P; p++)
            for (int a = 0; a < S; a++) sum[r][p][a] = _mm512_setzero_ps();
    int i = 0;
    for (; i + 128 <= k; i += 128)
        for (int a = 0; a < 4; a++)
            for (int p = 0; p < P; p++) {
                const __m512bh wa = load_pairs_ahead(wp[p] + i + 32 * a);
                for (int r = 0; r < ROWS; r++)
                    sum[r][p][a % S] = _mm512_dpbf16_ps(sum[r][p][a % S], wa,
                                                        load_pairs(x + (int64_t)r * k + i + 32 * a));
            }
    /* the last 32-96 of the row, each into the sum it went to before (a % S): a loop of
     * three, unrolled, so that every sum's index is a constant. With a running index GCC
     * kept the sums on the stack, a store and a load around each dot product: a batch-1
     * step's matmuls read 0.59 of what a plain read of the same weights did where an AMD
     * EPYC host's memory was fast, 0.70 without (1.00-1.07x where it was slow;
     * `bench/few_rows_stream.py`, docs/benchmarks.md, session 33). */
    for (int a = 0; a < 3 && i + 32 * a < k; a++)
        for (int p = 0; p < P; p++) {
            const __m512bh wa = load_pairs_ahead(wp[p] + i + 32 * a);
            for (int r = 0; r < ROWS; r++)
                sum[r][p][a % S] = _mm512_dpbf16_ps(sum[r][p][a % S], wa,
                                                    load_pairs(x + (int64_t)r * k + i + 32 * a));
        }
    for (int p = 0; p < P; p++)
        for (int r = 0; r < ROWS; r++) {
            __m512 total = sum[r][p][0];
            if (S == 4)
                total = _mm512_add_ps(_mm512_add_ps(total, sum[r][p][1]),
                                      _mm512_add_ps(sum[r][p][2], sum[r][p][3]));
            else if (S == 2)
                total = _mm512_add_ps(total, sum[r][p][1]);
            y[(int64_t)r * n + j + p * apart] =
                to_bf16(_mm512_reduce_add_ps(total) + bias_value(bias, j + p * apart));
        }
}

/* w's rows n0 .. n1 - 1 against the `ROWS` rows of x (1 or 8, and 2 in two places; 1-8 with
 * FEW_ROWS_ONE_STREAM): one row of w at a time, or, in two places, a row from each half of
 * the run at a time, the odd row last. */
static inline void dot_rows(const uint16_t *x, const uint16_t *w, const uint16_t *bias,
                            uint16_t *y, const int ROWS, int n, int k, int n0, int n1) {
    const int half = streams_at[ROWS] == 2 ? (n1 - n0) / 2 : 0;
    for (int j = n0; j < n0 + half; j++) dot_row(x, w, bias, y, ROWS, 2, n, k, j, half);
    for (int j = n0 + 2 * half; j < n1; j++) dot_row(x, w, bias, y, ROWS, 1, n, k, j, 0);
}

/* The same with J rows of w at a time (2-7 rows of x): each 32 values of a row of x are
 * loaded once for the J rows of w, where one row of w at a time loaded them once a row of w.
 * With 2-8 rows of x those loads and the dot products, not the memory, had bound the kernel:
 * on an AMD EPYC host (Zen 4) its weights streamed from L2 at 84 GB/s at 2 rows, 50 at 4, 40
 * at 8, and from memory under the memory's rate (docs/benchmarks.md, session 27). S sums
 * per (row of x, row of w). */
static inline __attribute__((always_inline)) void dot_group(const uint16_t *x, const uint16_t *w,
                                                            const uint16_t *bias, uint16_t *y,
                                                            const int ROWS, const int J, const int S,
                                                            int n, int k, int j) {
    enum { J_MAX = 4 };
    const uint16_t *wj = w + (int64_t)j * k;
    /* the rows of w asked for: the same rows of the group GROUP_AHEAD bytes ahead or more */
    const int64_t ahead = (int64_t)(GROUP_AHEAD + J * k * 2 - 1) / (J * k * 2) * J * k;
    __m512 sum[MAX_ROWS][J_MAX][2];
    for (int r = 0; r < ROWS; r++)
        for (int a = 0; a < J; a++)
            for (int b = 0; b < S; b++) sum[r][a][b] = _mm512_setzero_ps();
    for (int i = 0, c = 0; i < k; i += 32, c++) {
        __m512bh wa[J_MAX];
        for (int a = 0; a < J; a++) {
            _mm_prefetch((const char *)(wj + ahead + (int64_t)a * k + i), _MM_HINT_T1);
            wa[a] = load_pairs(wj + (int64_t)a * k + i);
        }
        for (int r = 0; r < ROWS; r++) {
            const __m512bh xr = load_pairs(x + (int64_t)r * k + i);
            for (int a = 0; a < J; a++)
                sum[r][a][c % S] = _mm512_dpbf16_ps(sum[r][a][c % S], wa[a], xr);
        }
    }
    for (int a = 0; a < J; a++) {
        const float b = bias_value(bias, j + a);
        for (int r = 0; r < ROWS; r++) {
            const __m512 total = S == 1 ? sum[r][a][0] : _mm512_add_ps(sum[r][a][0], sum[r][a][1]);
            y[(int64_t)r * n + j + a] = to_bf16(_mm512_reduce_add_ps(total) + b);
        }
    }
}

/* w's rows n0 .. n1 - 1 against 2-7 rows of x: four rows of w at a time up to 4 rows of x,
 * two at 5-7 (more sums than the 32 vector registers hold otherwise); at 8 two at a time were
 * no faster than one (the dot products alone bound it). One sum per (row of x, row of w):
 * J * ROWS >= 8 of them, independent of each other; two for the last rows of w, one at a
 * time. */
static inline void dot_groups(const uint16_t *x, const uint16_t *w, const uint16_t *bias,
                              uint16_t *y, const int ROWS, int n, int k, int n0, int n1) {
    const int J = ROWS <= 4 ? 4 : 2;
    int j = n0;
    for (; j + J <= n1; j += J) dot_group(x, w, bias, y, ROWS, J, 1, n, k, j);
    for (; j < n1; j++) dot_group(x, w, bias, y, ROWS, 1, 2, n, k, j);
}

#ifdef FEW_ROWS_ONE_STREAM
#define DOT_FEW(ROWS) dot_rows(x, w, bias, y, ROWS, n, k, n0, n1)
#else
#define DOT_FEW(ROWS) dot_groups(x, w, bias, y, ROWS, n, k, n0, n1)
#endif

int matmul_few_rows(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                    int rows, int n, int k) {
    if (rows < 1 || rows > MAX_ROWS || k % 32 || n < 1) return -2;
#pragma omp parallel
    {
        const int threads = omp_threads(), t = omp_thread();
        const int per = (n + threads - 1) / threads;
        const int n0 = t * per < n ? t * per : n, n1 = n0 + per < n ? n0 + per : n;
        switch (rows) { /* a constant row count, so the loops over x's rows unroll */
        case 1: dot_rows(x, w, bias, y, 1, n, k, n0, n1); break;
        case 2: /* with two streams, one row of w a stream at a time read faster than groups */
            if (streams_at[2] == 2) dot_rows(x, w, bias, y, 2, n, k, n0, n1);
            else DOT_FEW(2);
            break;
        case 3: DOT_FEW(3); break;
        case 4: DOT_FEW(4); break;
        case 5: DOT_FEW(5); break;
        case 6: DOT_FEW(6); break;
        case 7: DOT_FEW(7); break;
        default: dot_rows(x, w, bias, y, 8, n, k, n0, n1); break;
        }
    }
    return 0;
}
#elif defined(__AVX2__) && defined(__FMA__)
/* CPUs with AVX2 but no AVX512-BF16 (AMD EPYC Zen 2-3, Intel Xeons before Cooper Lake): the
 * same matmul in fp32 multiply-adds, each 16 bf16 values of w widened into two vectors, the
 * even ones by a shift and the odd ones by a mask (both exact), x's rows widened once into
 * the same order (each 16 values: the 8 even, then the 8 odd), so that every product is the
 * dot-product instruction's, exact, summed in fp32. One row of w at a time, a single stream
 * per thread; at 1-2 rows of x, 4 or 2 sums a row, so that the multiply-adds of one weight
 * row do not wait on each other. */
#include <immintrin.h>
#include <stdlib.h>

int few_rows_available(void) { return MAX_ROWS; }

int few_rows_streams(int rows, int streams) { return 1; } /* one stream a thread here */

#define PREFETCH_AHEAD 2048 /* each line of w asked for this far ahead, into L2 */

static inline void widen_pairs(const uint16_t *p, __m256 *even, __m256 *odd) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)p);
    *even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    *odd = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xffff0000u)));
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* w's rows n0 .. n1 - 1 against the ROWS widened rows of x (`xw`). */
static inline __attribute__((always_inline)) void dot_rows_avx2(const float *xw, const uint16_t *w,
                                                                const uint16_t *bias, uint16_t *y,
                                                                const int ROWS, int n, int k,
                                                                int n0, int n1) {
    const int S = ROWS == 1 ? 4 : ROWS == 2 ? 2 : 1; /* sums a row of x */
    for (int j = n0; j < n1; j++) {
        const uint16_t *wj = w + (int64_t)j * k;
        __m256 sum[MAX_ROWS][4];
        for (int r = 0; r < ROWS; r++)
            for (int a = 0; a < S; a++) sum[r][a] = _mm256_setzero_ps();
        for (int i = 0; i < k; i += 32) /* a 64-byte line of w: two runs of 16 */
            for (int h = 0; h < 2; h++) {
                if (h == 0) _mm_prefetch((const char *)(wj + i) + PREFETCH_AHEAD, _MM_HINT_T1);
                __m256 even, odd;
                widen_pairs(wj + i + 16 * h, &even, &odd);
                const int a = (i / 16 + h) % S;
                for (int r = 0; r < ROWS; r++) {
                    const float *xr = xw + (int64_t)r * k + i + 16 * h;
                    sum[r][a] = _mm256_fmadd_ps(even, _mm256_loadu_ps(xr), sum[r][a]);
                    sum[r][a] = _mm256_fmadd_ps(odd, _mm256_loadu_ps(xr + 8), sum[r][a]);
                }
            }
        for (int r = 0; r < ROWS; r++) {
            __m256 total = sum[r][0];
            for (int a = 1; a < S; a++) total = _mm256_add_ps(total, sum[r][a]);
            y[(int64_t)r * n + j] = to_bf16(hsum8(total) + bias_value(bias, j));
        }
    }
}

int matmul_few_rows(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                    int rows, int n, int k) {
    if (rows < 1 || rows > MAX_ROWS || k % 32 || n < 1) return -2;
    float *xw = malloc(sizeof(float) * rows * k);
    if (xw == NULL) return -1;
    for (int64_t i = 0; i < (int64_t)rows * k; i += 16) {
        __m256 even, odd;
        widen_pairs(x + i, &even, &odd);
        _mm256_storeu_ps(xw + i, even);
        _mm256_storeu_ps(xw + i + 8, odd);
    }
#pragma omp parallel
    {
        int n0, n1;
        thread_share(n, &n0, &n1);
        switch (rows) { /* a constant row count, so the loops over x's rows unroll */
        case 1: dot_rows_avx2(xw, w, bias, y, 1, n, k, n0, n1); break;
        case 2: dot_rows_avx2(xw, w, bias, y, 2, n, k, n0, n1); break;
        case 3: dot_rows_avx2(xw, w, bias, y, 3, n, k, n0, n1); break;
        case 4: dot_rows_avx2(xw, w, bias, y, 4, n, k, n0, n1); break;
        case 5: dot_rows_avx2(xw, w, bias, y, 5, n, k, n0, n1); break;
        case 6: dot_rows_avx2(xw, w, bias, y, 6, n, k, n0, n1); break;
        case 7: dot_rows_avx2(xw, w, bias, y, 7, n, k, n0, n1); break;
        default: dot_rows_avx2(xw, w, bias, y, 8, n, k, n0, n1); break;
        }
    }
    free(xw);
    return 0;
}
#else
int few_rows_available(void) { return 0; }
int few_rows_streams(int rows, int streams) { return 1; }
int matmul_few_rows(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                    int rows, int n, int k) {
    return -3; /* not built for this CPU: the caller takes torch's matmul */
}
#endif
