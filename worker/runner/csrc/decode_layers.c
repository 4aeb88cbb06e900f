/* A decode step of a few sequences (1-8; where the tiled matmuls run, any number) in one call,
 * from its tokens to its logits: the embedding, every decoder layer, the final norm and the LM
 * head. That is what `llama.py`'s fused forward does from Python, here with no Python between
 * the kernels. At one sequence a layer's weights stream in about a quarter of a millisecond,
 * and the forward's Python glue, the kernels' argument conversion and each torch op's
 * dispatch added close to half of that again (docs/benchmarks.md, "Few-row matmuls"); the
 * Python around the layers (the embedding, the norms, the LM head's call: cheap on their own)
 * ran with caches the step's weights had just swept, at about 0.15 ms a step (session 33).
 *
 * The kernels are this library's own, called in the order `_fused_forward` calls them, so
 * the results are that forward's bit for bit: the matmuls (`few_rows.c`; from `Model.tiled_from`
 * rows where `Model.tiled` is set, `amx_matmul.c` (from 4 rows) or `pair_matmul.c` (past 8) over
 * the weights in AMX's tile layout), RoPE and the pool
 * writes, the residual adds and norms, SiLU (`layer_ops.c`), and the attention over the
 * paged pool (`paged_attention.c`), one call per group of decodes. bf16 only. */
#include <stdint.h>
#include <string.h>

#include "vec.h"

/* The other sources' entry points (one library). */
int matmul_few_rows(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                    int rows, int n, int k);
int amx_matmul(const uint16_t *x, const uint16_t *packed, const uint16_t *bias, uint16_t *y,
               int rows, int n, int k);
int pair_matmul(const uint16_t *x, const uint16_t *packed, const uint16_t *bias, uint16_t *y,
                int rows, int n, int k);
int paged_decode(const void *q, const void *k_pool, const void *v_pool, const int32_t *tables,
                 const int32_t *lengths, void *out, int rows, int heads, int kv_heads,
                 int num_blocks, int block_size, int dim, int max_blocks, int is_bf16,
                 float scale);
void rms_norm(const void *x, const void *weight, void *out, int rows, int dim, float eps,
              int is_bf16);
void add_rms_norm(void *hidden, const void *delta, const void *weight, void *out, int rows,
                  int dim, float eps, int is_bf16);
void silu_mul(const void *gate_up, void *out, int rows, int inter, int is_bf16);
void argmax_rows(const void *x, int64_t *out, int rows, int cols, int is_bf16);
void rope_write(void *qkv, const void *cos, const void *sin, void *k_pool, void *v_pool,
                const int64_t *slots, int tokens, int heads, int kv_heads, int dim,
                int num_slots, int is_bf16);

typedef struct { /* a matmul's weight: as nn.Linear keeps it, and in AMX's tile layout */
    const uint16_t *plain, *tiled; /* tiled: NULL where `Model.tiled` is not set */
} Weight;

typedef struct { /* one layer's weights, bf16, as `llama.py`'s _Layer holds them */
    const uint16_t *input_norm, *qkv_bias, *post_norm;
    Weight qkv, o, gate_up, down;
} LayerWeights;

typedef struct { /* a group of decodes attended in one call (`DecodeGroup`) */
    const int32_t *tables, *lengths; /* [rows, max_blocks], [rows] */
    int query_start, rows, max_blocks;
} Group;

typedef struct {
    const LayerWeights *layers;
    int num_layers, hidden, inter, heads, kv_heads, dim, num_blocks, block_size;
    float eps, scale;
    int tiled;      /* 0: the few-row matmuls only; TILED_AMX: amx_matmul; TILED_PAIRS: pair_matmul */
    int tiled_from; /* from this many rows on, the tiled matmul; below, the few-row one */
    const uint16_t *embed, *norm; /* [embed_rows, hidden]; the final norm's [hidden] */
    Weight lm_head;               /* [vocab, hidden] */
    int embed_rows, vocab;
} Model;

enum { TILED_AMX = 1, TILED_PAIRS = 2 };

static inline int matmul(const Model *m, const uint16_t *x, Weight w, const uint16_t *bias,
                         uint16_t *y, int rows, int n, int k) {
    if (m->tiled && rows >= m->tiled_from)
        return m->tiled == TILED_AMX ? amx_matmul(x, w.tiled, bias, y, rows, n, k)
                                     : pair_matmul(x, w.tiled, bias, y, rows, n, k);
    return matmul_few_rows(x, w.plain, bias, y, rows, n, k);
}

/* hidden [rows, hidden]: the embedded tokens in, the last layer's residual stream out.
 * x: the first layer's input norm of it. scratch: rows * ((3 * heads + 2 * kv_heads) * dim +
 * hidden + 3 * inter) bf16 values. */
int decode_layers(const Model *m, uint16_t *hidden, uint16_t *x, const uint16_t *cos,
                  const uint16_t *sin, const int64_t *slots, uint16_t *k_pool, uint16_t *v_pool,
                  const Group *groups, int num_groups, int rows, uint16_t *scratch) {
    const int hd = m->hidden, q_width = m->heads * m->dim;
    const int qkv_width = q_width + 2 * m->kv_heads * m->dim;
    const int64_t layer_pool = (int64_t)m->kv_heads * m->num_blocks * m->block_size * m->dim;
    uint16_t *qkv = scratch, *q = qkv + (int64_t)rows * qkv_width, *attn = q + (int64_t)rows * q_width;
    uint16_t *delta = attn + (int64_t)rows * q_width, *gate_up = delta + (int64_t)rows * hd;
    uint16_t *act = gate_up + (int64_t)rows * 2 * m->inter;
    int status;
    for (int i = 0; i < m->num_layers; i++) {
        const LayerWeights *l = &m->layers[i];
        uint16_t *k_layer = k_pool + i * layer_pool, *v_layer = v_pool + i * layer_pool;
        if ((status = matmul(m, x, l->qkv, l->qkv_bias, qkv, rows, qkv_width, hd))) return status;
        rope_write(qkv, cos, sin, k_layer, v_layer, slots, rows, m->heads, m->kv_heads, m->dim,
                   m->num_blocks * m->block_size, 1);
        for (int r = 0; r < rows; r++) /* the queries, out of the fused projection's rows */
            memcpy(q + (int64_t)r * q_width, qkv + (int64_t)r * qkv_width, (size_t)q_width * 2);
        for (int g = 0; g < num_groups; g++) {
            const Group *group = &groups[g];
            const int64_t at = (int64_t)group->query_start * q_width;
            if ((status = paged_decode(q + at, k_layer, v_layer, group->tables, group->lengths,
                                       attn + at, group->rows, m->heads, m->kv_heads,
                                       m->num_blocks, m->block_size, m->dim, group->max_blocks,
                                       1, m->scale)))
                return status;
        }
        if ((status = matmul(m, attn, l->o, NULL, delta, rows, hd, q_width))) return status;
        add_rms_norm(hidden, delta, l->post_norm, x, rows, hd, m->eps, 1);
        if ((status = matmul(m, x, l->gate_up, NULL, gate_up, rows, 2 * m->inter, hd))) return status;
        silu_mul(gate_up, act, rows, m->inter, 1);
        if ((status = matmul(m, act, l->down, NULL, delta, rows, hd, m->inter))) return status;
        if (i + 1 < m->num_layers) {
            add_rms_norm(hidden, delta, m->layers[i + 1].input_norm, x, rows, hd, m->eps, 1);
        } else {
            for (int64_t j = 0; j < (int64_t)rows * hd; j++) { /* the last residual add */
                const uint32_t a = (uint32_t)hidden[j] << 16, b = (uint32_t)delta[j] << 16;
                float fa, fb;
                memcpy(&fa, &a, 4);
                memcpy(&fb, &b, 4);
                hidden[j] = to_bf16(fa + fb);
            }
        }
    }
    return 0;
}

/* token_ids [rows] in, logits [rows, vocab] out; the rest as `decode_layers`, with scratch
 * for 2 * rows * hidden more values (the residual stream and its norm). -4: a token id
 * outside the embedding. */
int decode_step(const Model *m, const int64_t *token_ids, const uint16_t *cos, const uint16_t *sin,
                const int64_t *slots, uint16_t *k_pool, uint16_t *v_pool, const Group *groups,
                int num_groups, int rows, uint16_t *scratch, uint16_t *logits) {
    const int hd = m->hidden;
    uint16_t *hidden = scratch, *x = hidden + (int64_t)rows * hd;
    for (int r = 0; r < rows; r++) { /* the embedding */
        if (token_ids[r] < 0 || token_ids[r] >= m->embed_rows) return -4;
        memcpy(hidden + (int64_t)r * hd, m->embed + token_ids[r] * hd, (size_t)hd * 2);
    }
    rms_norm(hidden, m->layers[0].input_norm, x, rows, hd, m->eps, 1);
    const int status = decode_layers(m, hidden, x, cos, sin, slots, k_pool, v_pool, groups,
                                     num_groups, rows, x + (int64_t)rows * hd);
    if (status) return status;
    rms_norm(hidden, m->norm, x, rows, hd, m->eps, 1);
    return matmul(m, x, m->lm_head, NULL, logits, rows, m->vocab, hd);
}

/* `decode_step` from what the host holds, with no tensor made for it: each row's cos and sin
 * read from the RoPE table ([table_rows, dim] each, `llama._rope_table`) at its position, and,
 * where `tokens` is not NULL, each row's argmax of the logits written to it (greedy
 * sampling, as `argmax_rows`). scratch: 2 * rows * dim values more than `decode_step`'s.
 * -5: a position outside the table. In a batch-1 step the torch ops this stands in for (the
 * inputs' tensors, the table's lookup, the argmax) took about 0.5 ms, run with caches the
 * step's weights had just swept (docs/benchmarks.md, session 34). */
int decode_step_at(const Model *m, const int64_t *token_ids, const int64_t *positions,
                   const uint16_t *cos_table, const uint16_t *sin_table, int table_rows,
                   const int64_t *slots, uint16_t *k_pool, uint16_t *v_pool, const Group *groups,
                   int num_groups, int rows, uint16_t *scratch, uint16_t *logits, int64_t *tokens) {
    const int dim = m->dim;
    uint16_t *cos = scratch, *sin = cos + (int64_t)rows * dim;
    for (int r = 0; r < rows; r++) {
        if (positions[r] < 0 || positions[r] >= table_rows) return -5;
        memcpy(cos + (int64_t)r * dim, cos_table + positions[r] * dim, (size_t)dim * 2);
        memcpy(sin + (int64_t)r * dim, sin_table + positions[r] * dim, (size_t)dim * 2);
    }
    const int status = decode_step(m, token_ids, cos, sin, slots, k_pool, v_pool, groups,
                                   num_groups, rows, sin + (int64_t)rows * dim, logits);
    if (status == 0 && tokens) argmax_rows(logits, tokens, rows, m->vocab, 1);
    return status;
}
