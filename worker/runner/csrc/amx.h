/* What the kernels that compute in AMX tiles share (`amx_matmul.c`, and `paged_attention.c`'s
 * prompt attention): Linux's permission to use the tile state, and the tiles' shapes. Only
 * where the compiler targets AMX-BF16 (-march=native on such a CPU). */
#ifndef LLMFLEET_AMX_H
#define LLMFLEET_AMX_H

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define LLMFLEET_AMX 1
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

/* 1 once Linux has let the process use AMX's tile state (asked on the first call), else 0
 * (`amx_matmul.c`). */
int amx_available(void);

typedef struct {
    uint8_t palette_id;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) tile_config;

/* The calling thread's eight tiles, each `rows[t]` rows (at least 1) of 64 bytes: 16 fp32 sums,
 * or 32 bf16 values (an A tile), or 16 pairs of bf16 (a B tile's row). */
static inline void configure_tiles(const int rows[8]) {
    tile_config config;
    memset(&config, 0, sizeof config);
    config.palette_id = 1;
    for (int t = 0; t < 8; t++) {
        config.rows[t] = rows[t] ? rows[t] : 1;
        config.colsb[t] = 64;
    }
    _tile_loadconfig(&config);
}
#endif

#endif
