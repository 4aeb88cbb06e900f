/* `y = x @ w.T + bias` for a bf16 matmul of a few rows (a decode step of 1-8 sequences):
 * x [rows, k], w [n, k] as nn.Linear keeps it, bias [n] or NULL, y [rows, n]; fp32 sums,
 * rounded to bf16 once, as torch's matmul does.
 *
 * With so few rows the matmul reads each weight once and does almost no arithmetic with it:
 * its time is the time to stream the weights from memory. Each thread takes a contiguous run
 * of w's rows and reads it front to back, one row at a time (a single sequential stream per
 * thread, which the hardware prefetcher follows at full rate), and dots each row with the
 * few rows of x, which stay in L1. oneDNN's matmul at one row read the same weights at about
 * half that rate here (docs/benchmarks.md, "Few-row matmuls"). k is a multiple of 32 (checked
 * by the caller).
 *
 * Each 64-byte line of w is asked for PREFETCH_AHEAD bytes before it is read, into L2: on an
 * Intel Xeon (Sapphire Rapids class) the hardware prefetcher alone streamed a layer's weights
 * at 25-28 GB/s, and with the hint at 31-37 (a plain read of one large run: 30 against 39;
 * docs/benchmarks.md, session 26); on an AMD EPYC host a similar hint, 2-8 KB ahead, had
 * changed nothing (session 23). */
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

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>

int few_rows_available(void) { return MAX_ROWS; }

/* 3-4 KB ahead streamed fastest of 0.5-4 KB (T1: into L2; T0 was slower, NTA half as fast) */
#define PREFETCH_AHEAD 3072

/* The 64-byte line at p, its prefetch asked for on the way. */
static inline __m512bh load_pairs_ahead(const uint16_t *p) {
    _mm_prefetch((const char *)p + PREFETCH_AHEAD, _MM_HINT_T1);
    return (__m512bh)_mm512_loadu_si512(p);
}

static inline __m512bh load_pairs(const uint16_t *p) {
    return (__m512bh)_mm512_loadu_si512(p);
}

/* w's rows n0 .. n1 - 1 against the `ROWS` rows of x; four sums a row of x up to 4 rows, so
 * that the dot-product instructions of one weight row do not wait on each other (with two,
 * the weights streamed at 66-70 GB/s where the host gave 76-78, and at 72 with four); two a
 * row at 5-7 rows and one at 8, where the rows alone keep the instructions independent (two
 * a row at 8 rows took a layer 510 us against 400 with one in a C probe, likely from the
 * pressure on the 32 vector registers). */
static inline void dot_rows(const uint16_t *x, const uint16_t *w, const uint16_t *bias,
                            uint16_t *y, const int ROWS, int n, int k, int n0, int n1) {
    for (int j = n0; j < n1; j++) {
        const uint16_t *wj = w + (int64_t)j * k;
        const int S = ROWS <= 4 ? 4 : ROWS < 8 ? 2 : 1; /* sums a row of x */
        __m512 sum[MAX_ROWS][4];
        for (int r = 0; r < ROWS; r++)
            for (int a = 0; a < S; a++) sum[r][a] = _mm512_setzero_ps();
        int i = 0;
        for (; i + 128 <= k; i += 128)
            for (int a = 0; a < 4; a++) {
                const __m512bh wa = load_pairs_ahead(wj + i + 32 * a);
                for (int r = 0; r < ROWS; r++)
                    sum[r][a % S] = _mm512_dpbf16_ps(sum[r][a % S], wa,
                                                     load_pairs(x + (int64_t)r * k + i + 32 * a));
            }
        for (int a = 0; i < k; i += 32, a++) { /* the last 32-96 of the row */
            const __m512bh wa = load_pairs_ahead(wj + i);
            for (int r = 0; r < ROWS; r++)
                sum[r][a % S] = _mm512_dpbf16_ps(sum[r][a % S], wa, load_pairs(x + (int64_t)r * k + i));
        }
        float b = 0.f;
        if (bias) {
            const uint32_t bits = (uint32_t)bias[j] << 16;
            memcpy(&b, &bits, sizeof b);
        }
        for (int r = 0; r < ROWS; r++) {
            const __m512 total = S == 1 ? sum[r][0] : S == 2 ? _mm512_add_ps(sum[r][0], sum[r][1])
                                        : _mm512_add_ps(_mm512_add_ps(sum[r][0], sum[r][1]),
                                                        _mm512_add_ps(sum[r][2], sum[r][3]));
            y[(int64_t)r * n + j] = to_bf16(_mm512_reduce_add_ps(total) + b);
        }
    }
}

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
        case 2: dot_rows(x, w, bias, y, 2, n, k, n0, n1); break;
        case 3: dot_rows(x, w, bias, y, 3, n, k, n0, n1); break;
        case 4: dot_rows(x, w, bias, y, 4, n, k, n0, n1); break;
        case 5: dot_rows(x, w, bias, y, 5, n, k, n0, n1); break;
        case 6: dot_rows(x, w, bias, y, 6, n, k, n0, n1); break;
        case 7: dot_rows(x, w, bias, y, 7, n, k, n0, n1); break;
        default: dot_rows(x, w, bias, y, 8, n, k, n0, n1); break;
        }
    }
    return 0;
}
#else
int few_rows_available(void) { return 0; }
int matmul_few_rows(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                    int rows, int n, int k) {
    return -3; /* not built for this CPU: the caller takes torch's matmul */
}
#endif
