/* Part of kernels.c (one translation unit; included there, never compiled alone).
 * Needs products.h, attention.h and layer_parts.h: one call runs a whole layer. */

/* ---- one whole decoder layer for a decode step -------------------------------------------- */

/* A quantized matrix: GGUF type id, rows of blocks, bytes a row. */
typedef struct {
    int type;
    const uint8_t *w;
    int64_t row_bytes;
} tq_matrix_t;

/* What does not change between steps: a dense Llama-family layer's weights and shape. */
typedef struct {
    tq_matrix_t qkv, o, gate_up, down;
    const float *attn_norm, *ffn_norm;
    float eps;
    int hidden, hq, hk, d, inter;
} tq_layer_t;

/* What a decode step shares across its layers: RoPE tables [m][d], where the new K/V go
 * (layer l's paged K at k_pages + l * layer_stride, its mirror K at mirror_k + l *
 * mirror_layer_stride, V likewise), the attention plan over the mirror, and scratch. */
typedef struct {
    const float *cos, *sin;
    char *k_pages, *v_pages;
    int64_t layer_stride; /* bytes */
    int kv_type;
    const int64_t *paged_index; /* [m * hk] */
    char *mirror_k, *mirror_v;
    int64_t mirror_layer_stride; /* bytes */
    int n_mirror;
    const int64_t *mirror_src, *mirror_dst;
    int64_t slot_stride, head_stride; /* elements */
    const int64_t *slots;
    const int32_t *lens;
    float scale;
    float *h, *qkv, *qk, *attn, *gu, *act, *tmp; /* scratch, each m x its width */
} tq_step_t;

static int gemv_m(const tq_matrix_t *mat, int n_out, int k, const float *x, int m, float *y) {
    return tq_gemv(mat->type, mat->w, (size_t)mat->row_bytes, n_out, k, x, m, y, n_out);
}

/* x [m][hidden] <- the layer applied to x (m <= TQ_MAX_ROWS decode rows, every row's
 * K/V continuing its mirror slot). The same kernels, in the same order, as the Python
 * path of model.py with the torch attention backend: results are equal. */
int tq_decode_layer(const tq_layer_t *ly, const tq_step_t *S, int layer, float *x, int m) {
    const int hq = ly->hq, hk = ly->hk, d = ly->d, width = (hq + 2 * hk) * d;
    int rc = 0;
    rc |= tq_rms_norm(x, NULL, ly->attn_norm, ly->eps, m, ly->hidden, S->h);
    rc |= gemv_m(&ly->qkv, width, ly->hidden, S->h, m, S->qkv);
    rc |= tq_rope(S->qkv, width, hq + hk, d, S->cos, S->sin, m, S->qk);
    const float *k = S->qk + (size_t)hq * d, *v = S->qkv + (size_t)(hq + hk) * d;
    const int64_t kstride = (int64_t)(hq + hk) * d;
    char *kc = S->k_pages + layer * S->layer_stride, *vc = S->v_pages + layer * S->layer_stride;
    rc |= tq_scatter_heads(k, kstride, m, hk, d, NULL, S->paged_index, kc, S->kv_type);
    rc |= tq_scatter_heads(v, width, m, hk, d, NULL, S->paged_index, vc, S->kv_type);
    char *mk = S->mirror_k + layer * S->mirror_layer_stride;
    char *mv = S->mirror_v + layer * S->mirror_layer_stride;
    if (S->n_mirror) {
        rc |= tq_scatter_heads(k, kstride, S->n_mirror, hk, d, S->mirror_src, S->mirror_dst, mk, S->kv_type);
        rc |= tq_scatter_heads(v, width, S->n_mirror, hk, d, S->mirror_src, S->mirror_dst, mv, S->kv_type);
    }
    rc |= decode_attention(S->qk, kstride, mk, mv, S->kv_type, S->slot_stride, S->head_stride,
                           S->slots, S->lens, m, hq, hk, d, S->scale, S->attn);
    rc |= gemv_m(&ly->o, ly->hidden, hq * d, S->attn, m, S->tmp);
    rc |= tq_rms_norm(x, S->tmp, ly->ffn_norm, ly->eps, m, ly->hidden, S->h);
    rc |= gemv_m(&ly->gate_up, 2 * ly->inter, ly->hidden, S->h, m, S->gu);
    rc |= tq_swiglu(S->gu, ly->inter, m, S->act);
    rc |= gemv_m(&ly->down, ly->hidden, ly->inter, S->act, m, S->tmp);
    for (int t = 0; t < m; t++)
        for (int i = 0; i < ly->hidden; i++) x[(size_t)t * ly->hidden + i] += S->tmp[(size_t)t * ly->hidden + i];
    return rc;
}
