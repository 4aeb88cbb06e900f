/* Greedy sampling's argmax of each row of a step's logits [rows, cols], bf16 or fp32, as
 * torch's argmax gives it: the first index of the largest value, and the first NaN where a
 * row has one (torch takes NaN as the largest). torch's CPU argmax took 1.5 ms for 32 rows of
 * a 49,152-token vocabulary, 5-6% of a batch-32 decode step (docs/benchmarks.md, session 28):
 * it reads a value at a time. Here 16 lanes each keep their largest value and its first index
 * (a strict comparison keeps the first), and the lanes are reduced at the end. Rows are
 * shared out over torch's OpenMP threads. */
#include <stdint.h>
#include <string.h>

#include "vec.h"

static inline float value_at(const void *row, int j, int is_bf16) {
    if (!is_bf16) return ((const float *)row)[j];
    const uint32_t bits = (uint32_t)((const uint16_t *)row)[j] << 16;
    float v;
    memcpy(&v, &bits, sizeof v);
    return v;
}

static int64_t first_nan(const void *row, int cols, int is_bf16) {
    for (int j = 0; j < cols; j++) {
        const float v = value_at(row, j, is_bf16);
        if (v != v) return j;
    }
    return -1;
}

static int64_t argmax_row(const void *row, int cols, int is_bf16) {
    const int vector_cols = cols / 16 * 16;
    int64_t best_at = 0;
    float best = -__builtin_inff();
    int has_nan = 0;
    if (vector_cols) {
        f16v lane_best = load_any(row, 0, is_bf16);
        i32v at = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, lane_at = at;
        i32v nan = lane_best != lane_best;
        for (int j = 16; j < vector_cols; j += 16) {
            const f16v v = load_any(row, j, is_bf16);
            at += 16;
            const i32v larger = v > lane_best;
            lane_best = select_v(larger, v, lane_best);
            lane_at = (larger & at) | (~larger & lane_at);
            nan |= v != v;
        }
        for (int lane = 0; lane < 16; lane++) {
            has_nan |= nan[lane] != 0;
            if (lane_best[lane] > best || (lane_best[lane] == best && lane_at[lane] < best_at)) {
                best = lane_best[lane];
                best_at = lane_at[lane];
            }
        }
    }
    for (int j = vector_cols; j < cols; j++) {
        const float v = value_at(row, j, is_bf16);
        has_nan |= v != v;
        if (v > best) {
            best = v;
            best_at = j;
        }
    }
    return has_nan ? first_nan(row, cols, is_bf16) : best_at;
}

void argmax_rows(const void *x, int64_t *out, int rows, int cols, int is_bf16) {
    const int64_t row_bytes = (int64_t)cols * (is_bf16 ? 2 : 4);
#pragma omp parallel for if (rows > 1)
    for (int r = 0; r < rows; r++) out[r] = argmax_row((const char *)x + r * row_bytes, cols, is_bf16);
}
