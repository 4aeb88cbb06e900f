/* `y = x @ w.T + bias` for a bf16 matmul of any rows in AMX tiles, on Intel CPUs with AMX-BF16
 * (every bf16 matmul there, the decode steps' in `decode_layers.c` too): x [rows, k], w as
 * `amx_pack` lays it out, bias [n] or NULL, y [rows, n]; fp32 sums over k in order, rounded
 * to bf16 once, as torch's matmul does (bit for bit oneDNN's at up to 32 rows, the same
 * instruction in the same order; past that oneDNN blocks k otherwise).
 *
 * At a decode step's rows (9-64 sequences) a matmul still reads each weight once and does
 * little arithmetic with it, and AMX has arithmetic to spare: its time is the time to stream
 * the weights. oneDNN's matmul at 16-32 rows streamed the default model's layers at 17-22
 * GB/s on an Intel Xeon whose memory gives 29, where this kernel streams them at 27-30
 * (docs/benchmarks.md, session 28). Each thread reads a contiguous run of the packed weights
 * front to back, each line asked for ahead into L2, while x stays in L1/L2. A prompt's
 * hundreds of rows take the thread's blocks a panel of 8 at a time (`blocks`), the panel in
 * L2 while every 32 rows of x cross it (session 30: 2,048 rows 1.2-1.4x the GFLOP/s of a
 * block at a time, as fast as oneDNN or faster). Past 16 rows the work is shared out in items
 * (a panel times 128 rows), each thread its own blocks' first, then what is left of the
 * others': on a host where one core is slowed (another process on it, or the machine's
 * neighbours) the other takes more, where a thread's fixed share waited for the slower one
 * (session 31: 1.4x at 192-2,048 rows and 1.1-1.25x at 32-64 in the slow minutes, the same
 * sums bit for bit).
 *
 * The packed layout (`amx_pack`): w's n rows in blocks of 32 (two tiles of 16 output columns),
 * each block's k in steps of 32, each step two B tiles of 1 KB: tile[r][2c + j] = w[16 * t + c]
 * [32 * s + 2 * r + j] (AMX's pairs of k side by side). A thread's work is whole blocks; for
 * each block and each 32 rows of x it keeps four C tiles (2 x 2 of 16 x 16 fp32) and, per
 * step of k, loads two A tiles (x, straight from its rows) and two B tiles (`tileloadd`:
 * the streaming hint, `tileloaddt1`, made one matmul alone 3-11% faster but the engine's
 * decode steps 2.8x slower on an Intel host whose 300 MB L3 holds the weights from step to
 * step; session 30). n and k are multiples of 32 (checked by the caller). */
#include <stdint.h>
#include <string.h>

#include "vec.h"

/* The layout `amx_matmul` reads, and `pair_matmul.c` on CPUs with AVX512-BF16 but no AMX
 * (plain C: packed on any CPU). */
void amx_pack(const uint16_t *w, uint16_t *packed, int n, int k) {
    int64_t at = 0;
    for (int block = 0; block < n / 32; block++)
        for (int step = 0; step < k / 32; step++)
            for (int t = 0; t < 2; t++)
                for (int r = 0; r < 16; r++)
                    for (int c = 0; c < 16; c++)
                        for (int j = 0; j < 2; j++)
                            packed[at++] = w[(int64_t)(32 * block + 16 * t + c) * k + 32 * step +
                                             2 * r + j];
}

#include "amx.h"

#ifdef LLMFLEET_AMX
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
/* Each line of the packed weights asked for this far ahead, into L2 (as `few_rows.c` does) */
#define AMX_AHEAD 4096

int amx_available(void) {
    static int permitted = -1;
    if (permitted < 0)
        permitted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return permitted;
}

/* Tiles 0-3: C (rows of x 0-15 and 16-31 of a run of 32, times the block's two halves);
 * 4-5: A (those rows' 32 values of k); 6-7: B. rows0 and rows1: the rows in each half. */
static void configure(int rows0, int rows1) {
    const int rows[8] = {rows0, rows0, rows1, rows1, rows0, rows1, 16, 16};
    configure_tiles(rows);
}

/* Rows of two C tiles (a block's columns 0-15 and 16-31) with the bias, rounded to bf16 by
 * `vcvtne2ps2bf16` (to nearest even, as torch and oneDNN round; the instruction takes fp32
 * denormals, sums below 1.2e-38, as 0), 32 columns of y a row in one store. */
static inline void store_pairs(int tile_rows, const float *c0, const float *c1, __m512 b0,
                               __m512 b1, uint16_t *y, int64_t n) {
    for (int r = 0; r < tile_rows; r++) {
        const __m512 lo = _mm512_add_ps(_mm512_load_ps(c0 + 16 * r), b0);
        const __m512 hi = _mm512_add_ps(_mm512_load_ps(c1 + 16 * r), b1);
        _mm512_storeu_si512(y + r * n, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
}

/* One block's sums for rows row0 .. row0 + 15 (C tiles 0-1) and row0 + 16 .. (tiles 2-3, where
 * rows1), over all of k, in C tiles 0-3. */
static inline void block_sums(const uint16_t *x, const uint16_t *b, int row0, int rows1, int k,
                              int prefetch) {
    const int64_t stride = (int64_t)k * 2;
    const uint16_t *a0 = x + (int64_t)row0 * k, *a1 = a0 + 16 * (int64_t)k;
    _tile_zero(0);
    _tile_zero(1);
    if (rows1) {
        _tile_zero(2);
        _tile_zero(3);
    }
    for (int step = 0; step < k / 32; step++, b += 1024) {
        if (prefetch)
            for (int line = 0; line < 2048; line += 64)
                _mm_prefetch((const char *)b + AMX_AHEAD + line, _MM_HINT_T1);
        _tile_loadd(4, a0 + 32 * step, stride);
        _tile_loadd(6, b, 64);
        _tile_loadd(7, b + 512, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (rows1) {
            _tile_loadd(5, a1 + 32 * step, stride);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
}

/* C tiles 0-3 into c (2 and 3 only where rows1). */
static inline void store_sums(float c[4][256], int rows1) {
    _tile_stored(0, c[0], 64);
    _tile_stored(1, c[1], 64);
    if (rows1) {
        _tile_stored(2, c[2], 64);
        _tile_stored(3, c[3], 64);
    }
}

/* One block of 32 output columns for rows row0 .. row0 + rows0 + rows1 - 1 of x. */
static inline void block_rows(const uint16_t *x, const uint16_t *b, const uint16_t *bias,
                              uint16_t *y, int block, int row0, int rows0, int rows1, int n,
                              int k, int prefetch) {
    float c[4][256] __attribute__((aligned(64)));
    block_sums(x, b, row0, rows1, k, prefetch);
    store_sums(c, rows1);
    uint16_t *out = y + (int64_t)row0 * n + 32 * block;
    const __m512 b0 = bias ? (__m512)load_bf16(bias + 32 * block) : _mm512_setzero_ps();
    const __m512 b1 = bias ? (__m512)load_bf16(bias + 32 * block + 16) : _mm512_setzero_ps();
    store_pairs(rows0, c[0], c[1], b0, b1, out, n);
    if (rows1)
        store_pairs(rows1, c[2], c[3], b0, b1, out + 16 * (int64_t)n, n);
}

/* A C tile's row rounded to bf16 as `store_pairs` rounds it, back in fp32. */
static inline f16v as_output(const float *c) {
    const __m256bh h = _mm512_cvtneps_pbh(_mm512_load_ps(c));
    return (f16v)_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)h), 16);
}

/* silu(gate) * up for tile_rows rows of 32 columns: gate's and up's sums (two C tiles each)
 * rounded to bf16 as the matmul's output would be, then `layer_ops.c`'s silu_mul on them. */
static inline void store_silu(int tile_rows, const float (*gate)[256], const float (*up)[256],
                              uint16_t *y, int64_t n) {
    for (int r = 0; r < tile_rows; r++)
        for (int half = 0; half < 2; half++) {
            const f16v g = as_output(gate[half] + 16 * r);
            const f16v silu = rnd(g / (1.f + exp_v(-g)), 1);
            store_v(y, r * n + 16 * half, silu * as_output(up[half] + 16 * r), 1);
        }
}

/* silu(gate) * up of one block of 32 columns of gate (block) and of up (block + inter / 32),
 * for rows row0 .. of x. */
static inline void silu_rows(const uint16_t *x, const uint16_t *packed, uint16_t *y, int block,
                             int row0, int rows0, int rows1, int inter, int k, int prefetch) {
    float gate[4][256] __attribute__((aligned(64))), up[4][256] __attribute__((aligned(64)));
    block_sums(x, packed + (int64_t)block * 32 * k, row0, rows1, k, prefetch);
    store_sums(gate, rows1);
    block_sums(x, packed + (int64_t)(block + inter / 32) * 32 * k, row0, rows1, k, prefetch);
    store_sums(up, rows1);
    uint16_t *out = y + (int64_t)row0 * inter + 32 * block;
    store_silu(rows0, gate, up, out, inter);
    if (rows1)
        store_silu(rows1, gate + 2, up + 2, out + 16 * (int64_t)inter, inter);
}

/* A thread's blocks in panels of PANEL_BLOCKS (256 columns of the weight, 295-786 KB of the
 * default model's, in L2), each panel swept by every run of 32 rows of x: a prompt's x is read
 * from L3 once a panel, where it was once a block (2,048 rows: 1.2-1.4x the GFLOP/s). */
#define PANEL_BLOCKS 8

/* silu: y is silu(gate) * up of a fused gate-up projection, n its width (the projection's
 * half; `amx_matmul_silu`). */
static void blocks(const uint16_t *x, const uint16_t *packed, const uint16_t *bias, uint16_t *y,
                   int rows, int n, int k, int first, int last, int silu) {
    const int tail = rows % 32 ? rows % 32 : 32; /* rows in the last run of 32 */
    const int full_runs = (rows - tail) / 32;
    int configured = -1; /* the run whose shape the tiles hold: full (0) or the tail (1) */
    for (int panel = first; panel < last; panel += PANEL_BLOCKS) {
        const int panel_end = panel + PANEL_BLOCKS < last ? panel + PANEL_BLOCKS : last;
        for (int run = 0; run <= full_runs; run++) {
            const int is_tail = run == full_runs;
            const int run_rows = is_tail ? tail : 32;
            const int rows0 = run_rows < 16 ? run_rows : 16;
            if (configured != is_tail) {
                configure(rows0, run_rows - rows0);
                configured = is_tail;
            }
            for (int block = panel; block < panel_end; block++)
                if (silu)
                    silu_rows(x, packed, y, block, 32 * run, rows0, run_rows - rows0, n, k,
                              run == 0);
                else
                    block_rows(x, packed + (int64_t)block * 32 * k, bias, y, block, 32 * run,
                               rows0, run_rows - rows0, n, k, run == 0);
        }
    }
}

/* A matmul of more than SHARE_MIN_ROWS rows (a prompt's, or a decode step's of 17 or more
 * sequences) is shared out in items of a panel's blocks times SHARE_ROWS rows: each thread
 * takes the items of its own blocks front to back, then what is left of the others' from
 * the back. At 1-16 rows, where a matmul streams its weights and takes 0.2 ms a layer, the
 * fixed shares were as fast (session 31). */
#define SHARE_ROWS 128
#define SHARE_MIN_ROWS 16
#define MAX_THREADS 64

static int sharing = 1; /* 0: every thread its fixed share, as before session 31 */

/* Items and stealing on (1, the default) or off (0): `bench.matmul_share` compares the two. */
void amx_share(int on) { sharing = on; }

/* A thread's items not yet taken, [front, back), in one word so that its owner (from the
 * front) and the others (from the back) never take the same one. */
typedef struct {
    _Alignas(64) uint64_t range;
} Share;

static int take(Share *share, int from_back) {
    uint64_t old = __atomic_load_n(&share->range, __ATOMIC_ACQUIRE);
    for (;;) {
        const uint32_t front = (uint32_t)old, back = (uint32_t)(old >> 32);
        if (front >= back) return -1;
        const uint64_t taken = from_back ? (uint64_t)(back - 1) << 32 | front
                                         : (uint64_t)back << 32 | (front + 1);
        if (__atomic_compare_exchange_n(&share->range, &old, taken, 0, __ATOMIC_ACQ_REL,
                                        __ATOMIC_ACQUIRE))
            return (int)(from_back ? back - 1 : front);
    }
}

static void share_item(const uint16_t *x, const uint16_t *packed, const uint16_t *bias,
                       uint16_t *y, int rows, int n, int k, int silu, int threads, int owner,
                       int item) {
    const int chunks = (rows + SHARE_ROWS - 1) / SHARE_ROWS;
    int first, last;
    share_of(n / 32, owner, threads, &first, &last);
    const int panel = first + item / chunks * PANEL_BLOCKS, row0 = item % chunks * SHARE_ROWS;
    const int panel_end = panel + PANEL_BLOCKS < last ? panel + PANEL_BLOCKS : last;
    const int chunk_rows = rows - row0 < SHARE_ROWS ? rows - row0 : SHARE_ROWS;
    blocks(x + (int64_t)row0 * k, packed, bias, y + (int64_t)row0 * n, chunk_rows, n, k, panel,
           panel_end, silu);
}

static int matmul(const uint16_t *x, const uint16_t *packed, const uint16_t *bias, uint16_t *y,
                  int rows, int n, int k, int silu) {
    if (rows < 1 || n % 32 || k % 32 || !amx_available()) return 1;
    const int num_blocks = n / 32;
#ifdef _OPENMP
    const int threads = omp_get_max_threads() < MAX_THREADS ? omp_get_max_threads() : MAX_THREADS;
#else
    const int threads = 1;
#endif
    if (sharing && rows > SHARE_MIN_ROWS && threads > 1) {
        Share shares[MAX_THREADS];
        const int chunks = (rows + SHARE_ROWS - 1) / SHARE_ROWS;
        for (int t = 0; t < threads; t++) {
            int first, last;
            share_of(num_blocks, t, threads, &first, &last);
            const int panels = (last - first + PANEL_BLOCKS - 1) / PANEL_BLOCKS;
            shares[t].range = (uint64_t)(panels * chunks) << 32;
        }
#pragma omp parallel
        {
#ifdef _OPENMP
            const int me = omp_get_thread_num();
#else
            const int me = 0;
#endif
            for (int i = 0; i < threads; i++) {
                const int owner = (me + i) % threads;
                int item;
                while ((item = take(&shares[owner], owner != me)) >= 0)
                    share_item(x, packed, bias, y, rows, n, k, silu, threads, owner, item);
            }
            _tile_release();
        }
        return 0;
    }
#pragma omp parallel
    {
        int first, last;
        thread_share(num_blocks, &first, &last);
        if (first < last) {
            blocks(x, packed, bias, y, rows, n, k, first, last, silu);
            _tile_release();
        }
    }
    return 0;
}

int amx_matmul(const uint16_t *x, const uint16_t *packed, const uint16_t *bias, uint16_t *y,
               int rows, int n, int k) {
    return matmul(x, packed, bias, y, rows, n, k, 0);
}

/* y [rows, inter] = silu(gate) * up, where x @ w.T = [gate | up] and w ([2 * inter, k], no
 * bias) is packed as `amx_pack` lays it out: a Llama MLP's fused gate-up projection and
 * `layer_ops.c`'s silu_mul in one pass, bit for bit the two (the projection's output never
 * written: 2 x inter bf16 a row, 12.6 MB for 2,048 rows of the default model). `bias` is
 * unused (NULL). */
int amx_matmul_silu(const uint16_t *x, const uint16_t *packed, const uint16_t *bias, uint16_t *y,
                    int rows, int inter, int k) {
    (void)bias;
    return matmul(x, packed, NULL, y, rows, inter, k, 1);
}

#else /* no AMX here: the callers keep oneDNN */

void amx_share(int on) { (void)on; }

int amx_available(void) { return 0; }

int amx_matmul(const uint16_t *x, const uint16_t *packed, const uint16_t *bias, uint16_t *y,
               int rows, int n, int k) {
    (void)x, (void)packed, (void)bias, (void)y, (void)rows, (void)n, (void)k;
    return 1;
}

int amx_matmul_silu(const uint16_t *x, const uint16_t *packed, const uint16_t *bias, uint16_t *y,
                    int rows, int inter, int k) {
    return amx_matmul(x, packed, bias, y, rows, inter, k);
}

#endif
