/* What the CPU kernels share: 16 floats as one vector (one AVX-512 register, or two AVX2
 * ones: GCC's vector extensions), loads of bf16 or fp32 into it, its horizontal sum,
 * torch's rounding to bf16, e^x, and an OpenMP thread's share of a loop. */
#ifndef LLMFLEET_VEC_H
#define LLMFLEET_VEC_H

#include <stdint.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

typedef float f16v __attribute__((vector_size(64)));
typedef uint32_t u32v __attribute__((vector_size(64)));
typedef uint16_t u16v __attribute__((vector_size(32)));
typedef int32_t i32v __attribute__((vector_size(64)));

#ifdef __AVX512F__
#include <immintrin.h>
static inline f16v load_bf16(const uint16_t *p) { /* one widening load and a shift */
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return (f16v)_mm512_slli_epi32(wide, 16);
}
#else /* GCC lowers the conversion of the generic vectors in halves, with extra shuffles */
static inline f16v load_bf16(const uint16_t *p) {
    u16v h;
    memcpy(&h, p, sizeof h);
    return (f16v)(__builtin_convertvector(h, u32v) << 16);
}
#endif

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

/* Lane by lane: yes where mask (a vector comparison's result) is set, else no. */
static inline f16v select_v(i32v mask, f16v yes, f16v no) {
    i32v a, b;
    memcpy(&a, &yes, sizeof a);
    memcpy(&b, &no, sizeof b);
    a = (mask & a) | (~mask & b);
    memcpy(&yes, &a, sizeof yes);
    return yes;
}

/* Lane by lane, the larger of a and b. */
static inline f16v max_v(f16v a, f16v b) {
#ifdef __AVX512F__
    return (f16v)_mm512_max_ps((__m512)a, (__m512)b);
#else
    return select_v(a > b, a, b);
#endif
}

/* The e^x kernels' shared steps: t rounded to the nearest whole number, half to even as rintf
 * does (the 1.5 * 2^23 trick, for |t| < 2^22), and p * 2^n for whole n in [-126, 127] (the
 * exponent's bits built directly). */
static inline f16v round_v(f16v t) { return (t + 12582912.f) - 12582912.f; }

static inline f16v times_pow2(f16v p, f16v n) {
    const i32v bits = (__builtin_convertvector(n, i32v) + 127) << 23;
    f16v scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

static inline uint16_t to_bf16(float f) { /* round to nearest even, as torch does */
    union { uint32_t u; float f; } x;
    x.f = f;
    return (uint16_t)((x.u + 0x7fffu + ((x.u >> 16) & 1u)) >> 16);
}

/* Round to the nearest bf16, ties to even (torch's rounding); the identity for fp32. */
static inline f16v rnd(f16v v, const int BF16) {
    if (!BF16) return v;
    u32v u;
    memcpy(&u, &v, sizeof u);
    u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    memcpy(&v, &u, sizeof v);
    return v;
}

static inline void store_v(void *base, int64_t at, f16v v, const int BF16) {
    if (BF16) {
        u32v u;
        v = rnd(v, 1);
        memcpy(&u, &v, sizeof u);
        const u16v h = __builtin_convertvector(u >> 16, u16v);
        memcpy((uint16_t *)base + at, &h, sizeof h);
    } else {
        memcpy((float *)base + at, &v, sizeof v);
    }
}

/* e^x, 16 lanes: a degree-7 polynomial on x's fraction of ln 2, clamped to [-87, 88]
 * (`layer_ops.c`'s silu, and `amx_matmul.c`'s where it fuses the two). */
static inline f16v exp_v(f16v x) {
    const f16v zero = {0};
    x = select_v(x < -87.f, zero - 87.f, x);
    x = select_v(x > 88.f, zero + 88.f, x);
    const f16v t = x * 1.4426950409f;
    const f16v n = round_v(t);
    const f16v f = (t - n) * 0.6931471806f;
    f16v p = zero + 1.f / 5040;
    p = p * f + 1.f / 720;
    p = p * f + 1.f / 120;
    p = p * f + 1.f / 24;
    p = p * f + 1.f / 6;
    p = p * f + 0.5f;
    p = p * f + 1.f;
    p = p * f + 1.f;
    return times_pow2(p, n);
}

/* Thread `thread`'s contiguous share [*first, *last) of `count` items among `threads`. */
static inline void share_of(int count, int thread, int threads, int *first, int *last) {
    *first = (int)((int64_t)count * thread / threads);
    *last = (int)((int64_t)count * (thread + 1) / threads);
}

/* The calling OpenMP thread's contiguous share [*first, *last) of `count` items (all of them
 * outside a parallel region, or built without OpenMP). */
static inline void thread_share(int count, int *first, int *last) {
#ifdef _OPENMP
    share_of(count, omp_get_thread_num(), omp_get_num_threads(), first, last);
#else
    share_of(count, 0, 1, first, last);
#endif
}

#endif
