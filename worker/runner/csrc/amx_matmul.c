/* `y = x @ w.T + bias` for a bf16 matmul of any rows in AMX tiles, on Intel CPUs with AMX-BF16
 * (every bf16 matmul there from 4 rows, the decode steps' in `decode_layers.c` too; at 1-3 rows
 * the few-row kernel streams the weights faster, `cpu_kernels.AMX_FROM_ROWS`): x [rows, k], w as
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
 * step of k, loads two A tiles (x, straight from its rows) and two B tiles (`tileloadd` at a
 * decode step's rows, `tileloaddt1` at a prompt's: `block_sums`). Each block is rounded and
 * written to y while the next one's products run (`Pending`). n and k are multiples of 32
 * (checked by the caller). */
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
/* Each line of the packed weights asked for this far ahead, into L2 (as `few_rows.c` does): at
 * a decode step's rows 1 KB, at a prompt's 4 KB. On an Intel host (session 42) the default
 * model's weights streamed at 0.86-0.99 of the plain read at 1-8 rows with the lines asked for
 * 1 KB ahead, against 0.83-0.88 at 4 KB (session 28's distance), and whole decode steps of
 * 4, 8 and 32 sequences were 0.8-5% faster (docs/benchmarks.md). */
#define AMX_AHEAD_DECODE 1024
#define AMX_AHEAD_PROMPT 4096

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

/* A block whose sums are in memory (`store_sums`) and not yet in y: its 32 columns for up
 * to 32 rows, plain (the bias added, rounded to bf16 by `vcvtne2ps2bf16`: to nearest even,
 * as torch and oneDNN round; the instruction takes fp32 denormals, sums below 1.2e-38, as
 * 0) or silu (`layer_ops.c`'s silu_mul of the gate's and the up's sums, each rounded to bf16
 * as the matmul's output would be). The next block's sums write it a few rows at each step
 * of k (`block_sums`): the vector units round and store while AMX multiplies, where written
 * after the sums the writing took a quarter of a prompt's matmul (session 35). */
typedef struct {
    const float (*sums)[256]; /* plain: C tiles 0-3's sums; silu: the gate's 4, then the up's */
    uint16_t *out;            /* y at the block's first row and column */
    int64_t n;                /* y's row length */
    __m512 b0, b1;            /* the bias's halves (plain; zero without one) */
    int rows0, rows1, silu;   /* rows in C tiles 0-1 and 2-3 */
} Pending;

/* A C tile's row rounded to bf16 as the plain write rounds it, back in fp32. */
static inline f16v as_output(const float *c) {
    const __m256bh h = _mm512_cvtneps_pbh(_mm512_load_ps(c));
    return (f16v)_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)h), 16);
}

/* Rows [r0, r1) of a pending block's 32 into y: rows 0-15 from C tiles 0-1's sums, 16-31
 * from 2-3's. */
static inline void write_rows(const Pending *p, int r0, int r1) {
    for (int r = r0; r < r1; r++) {
        const int high = r >= 16, t = r - 16 * high; /* the tile row */
        if (t >= (high ? p->rows1 : p->rows0)) continue;
        const float *c0 = p->sums[2 * high] + 16 * t, *c1 = p->sums[2 * high + 1] + 16 * t;
        uint16_t *y = p->out + (int64_t)r * p->n;
        if (!p->silu) {
            const __m512 lo = _mm512_add_ps(_mm512_load_ps(c0), p->b0);
            const __m512 hi = _mm512_add_ps(_mm512_load_ps(c1), p->b1);
            _mm512_storeu_si512(y, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
            continue;
        }
        const float *u0 = p->sums[4 + 2 * high] + 16 * t, *u1 = p->sums[5 + 2 * high] + 16 * t;
        for (int half = 0; half < 2; half++) {
            const f16v g = as_output(half ? c1 : c0);
            const f16v silu = rnd(g / (1.f + exp_v(-g)), 1);
            store_v(y, 16 * half, silu * as_output(half ? u1 : u0), 1);
        }
    }
}

/* One block's sums for rows row0 .. row0 + 15 (C tiles 0-1) and row0 + 16 .. (tiles 2-3, where
 * rows1), over all of k, in C tiles 0-3; rows [from, to) of `pending` (if any) written
 * meanwhile, spread over the steps of k. `stream`: the B tiles loaded with `tileloaddt1`,
 * which keeps them out of L1 (a prompt's rows: x's run of 32 rows, read again by every block
 * of the panel, then stays in L1, where each block's B tiles passing through pushed it out to
 * L2; 1.2-1.35x the default model's matmuls at 128-2,048 rows, session 35). A decode step's
 * few rows keep `tileloadd`: there the hint made the steps 2.8x slower on an Intel host
 * whose 300 MB L3 holds the weights from step to step (session 30). */
static inline void block_sums(const uint16_t *x, const uint16_t *b, int row0, int rows1, int k,
                              int prefetch, int stream, const Pending *pending, int from,
                              int to) {
    const int64_t stride = (int64_t)k * 2;
    const uint16_t *a0 = x + (int64_t)row0 * k, *a1 = a0 + 16 * (int64_t)k;
    const int steps = k / 32;
    _tile_zero(0);
    _tile_zero(1);
    if (rows1) {
        _tile_zero(2);
        _tile_zero(3);
    }
    const int ahead = stream ? AMX_AHEAD_PROMPT : AMX_AHEAD_DECODE;
    for (int step = 0; step < steps; step++, b += 1024) {
        if (prefetch)
            for (int line = 0; line < 2048; line += 64)
                _mm_prefetch((const char *)b + ahead + line, _MM_HINT_T1);
        _tile_loadd(4, a0 + 32 * step, stride);
        if (stream) {
            _tile_stream_loadd(6, b, 64);
            _tile_stream_loadd(7, b + 512, 64);
        } else {
            _tile_loadd(6, b, 64);
            _tile_loadd(7, b + 512, 64);
        }
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (rows1) {
            _tile_loadd(5, a1 + 32 * step, stride);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
        if (pending)
            write_rows(pending, from + (to - from) * step / steps,
                       from + (to - from) * (step + 1) / steps);
    }
}

/* C tiles 0-3 into c (2 and 3 only where rows1). */
static inline void store_sums(float (*c)[256], int rows1) {
    _tile_stored(0, c[0], 64);
    _tile_stored(1, c[1], 64);
    if (rows1) {
        _tile_stored(2, c[2], 64);
        _tile_stored(3, c[3], 64);
    }
}

/* The sums of one block of 32 output columns (silu: of the gate's block and of the up's,
 * `n` blocks of 32 further on) for rows row0 .. row0 + rows0 + rows1 - 1 of x into `sums`,
 * writing `pending` meanwhile; the block is then `next`, pending. */
static inline void block_rows(const uint16_t *x, const uint16_t *packed, const uint16_t *bias,
                              uint16_t *y, int block, int row0, int rows0, int rows1, int n,
                              int k, int prefetch, int stream, int silu, const Pending *pending,
                              float (*sums)[256], Pending *next) {
    const int half = silu ? 16 : 32; /* the pending rows written beside the first sums */
    block_sums(x, packed + (int64_t)block * 32 * k, row0, rows1, k, prefetch, stream, pending, 0,
               half);
    store_sums(sums, rows1);
    if (silu) {
        block_sums(x, packed + (int64_t)(block + n / 32) * 32 * k, row0, rows1, k, prefetch,
                   stream, pending, half, 32);
        store_sums(sums + 4, rows1);
    }
    next->sums = (const float (*)[256])sums;
    next->out = y + (int64_t)row0 * n + 32 * block;
    next->n = n;
    next->b0 = bias ? (__m512)load_bf16(bias + 32 * block) : _mm512_setzero_ps();
    next->b1 = bias ? (__m512)load_bf16(bias + 32 * block + 16) : _mm512_setzero_ps();
    next->rows0 = rows0, next->rows1 = rows1, next->silu = silu;
}

/* A thread's blocks in panels of PANEL_BLOCKS (256 columns of the weight, 295-786 KB of the
 * default model's, in L2), each panel swept by every run of 32 rows of x: a prompt's x is read
 * from L3 once a panel, where it was once a block (2,048 rows: 1.2-1.4x the GFLOP/s). */
#define PANEL_BLOCKS 8

/* silu: y is silu(gate) * up of a fused gate-up projection, n its width (the projection's
 * half; `amx_matmul_silu`). stream: `block_sums`'. Each block is written to y while the
 * next one's sums run, the last after them. */
static void blocks(const uint16_t *x, const uint16_t *packed, const uint16_t *bias, uint16_t *y,
                   int rows, int n, int k, int first, int last, int silu, int stream) {
    const int tail = rows % 32 ? rows % 32 : 32; /* rows in the last run of 32 */
    const int full_runs = (rows - tail) / 32;
    int configured = -1; /* the run whose shape the tiles hold: full (0) or the tail (1) */
    float sums[2][8][256] __attribute__((aligned(64))); /* the pending block's, the next one's */
    Pending pending[2];
    int count = 0; /* blocks summed so far: the latest is pending */
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
            for (int block = panel; block < panel_end; block++, count++)
                block_rows(x, packed, bias, y, block, 32 * run, rows0, run_rows - rows0, n, k,
                           run == 0, stream, silu, count ? &pending[(count - 1) & 1] : NULL,
                           sums[count & 1], &pending[count & 1]);
        }
    }
    if (count) write_rows(&pending[(count - 1) & 1], 0, 32);
}

/* A matmul of more than SHARE_MIN_ROWS rows (a prompt's, or a decode step's of 17 or more
 * sequences) is shared out in items of a panel's blocks times SHARE_ROWS rows: each thread
 * takes the items of its own share front to back, then what is left of the others' from
 * the back. At 1-16 rows, where a matmul streams its weights and takes 0.2 ms a layer, the
 * fixed shares were as fast (session 31).
 *
 * A thread's share is a rectangle of rows times blocks. Up to ROW_SHARE_MIN_ROWS rows it is
 * its contiguous run of the blocks over every row: each weight is read by one thread, and x
 * is small. From there on it is its contiguous run of the rows (as `layer_ops.c`'s static
 * split hands them out) over every block: x is then the larger operand, and a thread's rows
 * stay in its own L2 from panel to panel where, shared by blocks, every thread re-read every
 * row of x (2.4 MB at 2,048 rows of the default model) from L3 once a panel. */
#define SHARE_ROWS 128
#define SHARE_MIN_ROWS 16
#define STREAM_MIN_ROWS 64 /* past this many rows (a prompt's), `block_sums` streams B */
#define ROW_SHARE_MIN_ROWS 1024
#define MAX_THREADS 64

static int sharing = 1; /* 0: every thread its fixed share of the blocks, as before session 31 */
static int row_share_min_rows = ROW_SHARE_MIN_ROWS;

/* Items and stealing on (1, the default) or off (0): `bench.matmul_share` compares the two. */
void amx_share(int on) { sharing = on; }

/* The rows from which the threads' shares are rows, not blocks, set to `min_rows`; the rows
it was (`bench.matmul_share` compares the two). */
int amx_row_share(int min_rows) {
    const int was = row_share_min_rows;
    row_share_min_rows = min_rows;
    return was;
}

/* A thread's rectangle: rows [row0, row1), blocks [first, last), in items of a panel times
 * SHARE_ROWS rows (panel-major: a panel stays in L2 while its rows cross it). */
typedef struct {
    int row0, row1, first, last;
} Rect;

static Rect rect_of(int rows, int num_blocks, int owner, int threads, int by_rows) {
    Rect r = {0, rows, 0, num_blocks};
    if (by_rows)
        share_of(rows, owner, threads, &r.row0, &r.row1);
    else
        share_of(num_blocks, owner, threads, &r.first, &r.last);
    return r;
}

static int rect_chunks(Rect r) { return (r.row1 - r.row0 + SHARE_ROWS - 1) / SHARE_ROWS; }

static int rect_items(Rect r) {
    return (r.last - r.first + PANEL_BLOCKS - 1) / PANEL_BLOCKS * rect_chunks(r);
}

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
                       uint16_t *y, int n, int k, int silu, int stream, Rect r, int item) {
    const int chunks = rect_chunks(r);
    const int panel = r.first + item / chunks * PANEL_BLOCKS;
    const int row0 = r.row0 + item % chunks * SHARE_ROWS;
    const int panel_end = panel + PANEL_BLOCKS < r.last ? panel + PANEL_BLOCKS : r.last;
    const int chunk_rows = r.row1 - row0 < SHARE_ROWS ? r.row1 - row0 : SHARE_ROWS;
    blocks(x + (int64_t)row0 * k, packed, bias, y + (int64_t)row0 * n, chunk_rows, n, k, panel,
           panel_end, silu, stream);
}

static int matmul(const uint16_t *x, const uint16_t *packed, const uint16_t *bias, uint16_t *y,
                  int rows, int n, int k, int silu) {
    if (rows < 1 || n % 32 || k % 32 || !amx_available()) return 1;
    const int num_blocks = n / 32, stream = rows > STREAM_MIN_ROWS;
#ifdef _OPENMP
    const int threads = omp_get_max_threads() < MAX_THREADS ? omp_get_max_threads() : MAX_THREADS;
#else
    const int threads = 1;
#endif
    if (sharing && rows > SHARE_MIN_ROWS && threads > 1) {
        const int by_rows = rows >= row_share_min_rows;
        Share shares[MAX_THREADS];
        for (int t = 0; t < threads; t++)
            shares[t].range = (uint64_t)rect_items(rect_of(rows, num_blocks, t, threads, by_rows))
                              << 32;
#pragma omp parallel
        {
#ifdef _OPENMP
            const int me = omp_get_thread_num();
#else
            const int me = 0;
#endif
            for (int i = 0; i < threads; i++) {
                const int owner = (me + i) % threads;
                const Rect r = rect_of(rows, num_blocks, owner, threads, by_rows);
                int item;
                while ((item = take(&shares[owner], owner != me)) >= 0)
                    share_item(x, packed, bias, y, n, k, silu, stream, r, item);
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
            blocks(x, packed, bias, y, rows, n, k, first, last, silu, stream);
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

int amx_row_share(int min_rows) { return min_rows; }

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
