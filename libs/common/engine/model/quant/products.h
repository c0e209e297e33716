/* Part of kernels.c (one translation unit; included there, never compiled alone).
 * The products' entry points: tq_gemv (up to TQ_MAX_ROWS rows of x), tq_gemm (any number
 * of rows) and tq_dequant_rows (fp32 rows for the wide products and embedding lookups).
 * Each takes the integer paths of x16_products.h / kquant_products.h / panel_products.h
 * where the build has them, else fp32 with blocks dequantized on the fly. */

/* y[t, n] = sum_k x[t, k] * W[n, k] for t < m (m <= TQ_MAX_ROWS), n < n_out; x is [m][k],
 * y is [m][ldy] (columns n_out written). k is a multiple of the block size. */
int tq_gemv(int type, const uint8_t *w, size_t row_bytes, int n_out, int k, const float *x,
            int m, float *y, int ldy) {
    const int bs = tq_block_size(type), bb = tq_block_bytes(type), nb = k / bs;
    if (bb == 0 || k % bs != 0 || m < 1 || m > TQ_MAX_ROWS) return -1;
#if defined(TQ_QX) && !defined(TQ_NEON)
    if (small_block(type)) return gemv_cols_qx(type, w, row_bytes, n_out, k, x, m, y, ldy);
#elif defined(TQ_QX)
    if (small_block(type)) return gemm_qx(type, w, row_bytes, n_out, k, x, m, y, ldy);
#endif
#ifdef TQ_KX
    if (k_block(type)) return gemm_kx(type, w, row_bytes, n_out, k, x, m, y, ldy);
#endif
#pragma omp parallel for schedule(static)
    for (int n = 0; n < n_out; n++) {
        const uint8_t *row = w + (size_t)n * row_bytes;
        for (int t0 = 0; t0 < m; t0 += TQ_GROUP) {
            const int g = m - t0 < TQ_GROUP ? m - t0 : TQ_GROUP;
            const float *xg = x + (size_t)t0 * k;
            float out[TQ_GROUP];
#ifdef L
            vf acc[TQ_GROUP];
            for (int t = 0; t < TQ_GROUP; t++) acc[t] = v_zero();
            if (small_block(type)) {
                /* Per-vector accumulators, summed in the one-row path's order: a row's
                 * result has the same bits whatever rows share its pass. */
                vf part[TQ_GROUP][VN];
                for (int t = 0; t < TQ_GROUP; t++)
                    for (int j = 0; j < VN; j++) part[t][j] = v_zero();
                for (int b = 0; b < nb; b++) {
                    vf wv[VN];
                    unpack32(type, row + (size_t)b * bb, wv);
                    for (int t = 0; t < g; t++)
                        for (int j = 0; j < VN; j++)
                            part[t][j] = v_fma(wv[j], v_load(xg + (size_t)t * k + b * 32 + j * L), part[t][j]);
                }
                for (int t = 0; t < g; t++) {
                    acc[t] = part[t][0];
                    for (int j = 1; j < VN; j++) acc[t] = v_add(acc[t], part[t][j]);
                }
            } else {
                float buf[256];
                for (int b = 0; b < nb; b++) {
                    dequant_block(type, row + (size_t)b * bb, buf);
                    for (int t = 0; t < g; t++)
                        for (int j = 0; j < 256; j += L)
                            acc[t] = v_fma(v_load(buf + j), v_load(xg + (size_t)t * k + b * 256 + j), acc[t]);
                }
            }
            for (int t = 0; t < g; t++) out[t] = v_sum(acc[t]);
#else
            float buf[256];
            for (int t = 0; t < g; t++) out[t] = 0.0f;
            for (int b = 0; b < nb; b++) {
                dequant_block(type, row + (size_t)b * bb, buf);
                for (int t = 0; t < g; t++) {
                    const float *xb = xg + (size_t)t * k + (size_t)b * bs;
                    float s = 0.0f;
                    for (int i = 0; i < bs; i++) s += buf[i] * xb[i];
                    out[t] += s;
                }
            }
#endif
            for (int t = 0; t < g; t++) y[(size_t)(t0 + t) * ldy + n] = out[t];
        }
    }
    return 0;
}

/* One weight row -> k fp32 values. */
static inline void dequant_row(int type, const uint8_t *row, int k, float *out) {
    const int bs = tq_block_size(type), bb = tq_block_bytes(type), nb = k / bs;
#ifdef L
    if (small_block(type)) {
        for (int b = 0; b < nb; b++) {
            vf wv[VN];
            unpack32(type, row + (size_t)b * bb, wv);
            for (int j = 0; j < VN; j++) v_store(out + (size_t)b * 32 + j * L, wv[j]);
        }
        return;
    }
#endif
#ifdef TQ_KX
    if (k_block(type)) {
        for (int b = 0; b < nb; b++) dequant_k(type, row + (size_t)b * bb, out + (size_t)b * bs);
        return;
    }
#endif
    for (int b = 0; b < nb; b++) dequant_block(type, row + (size_t)b * bb, out + (size_t)b * bs);
}

/* y = x W^T for any m through the int16 panels, the K-quants' too (their 32-value pieces,
 * kquant_pieces.h): the wide product of a prefill chunk. A row's bits do not depend on
 * the rows beside it. -1 where the build has no panels (generic, NEON). */
int tq_gemm_panel(int type, const uint8_t *w, size_t row_bytes, int n_out, int k, const float *x,
                  int m, float *y, int ldy) {
    if (tq_block_bytes(type) == 0 || k % tq_block_size(type) != 0 || m < 1) return -1;
#if defined(TQ_PANEL) && defined(TQ_KX) && !defined(TQ_NEON)
    if (small_block(type) || k_block(type)) return gemm_panel(type, w, row_bytes, n_out, k, x, m, y, ldy);
#else
    (void)w, (void)row_bytes, (void)n_out, (void)x, (void)y, (void)ldy;
#endif
    return -1;
}

#define TQ_NR 4 /* weight rows a tile */
#define TQ_MR 4 /* rows of x a tile */

/* y = x W^T for any m (meant for a decode batch: 5 to a few dozen rows). The int16 panels
 * where the build has them (Q4_0 / Q4_1 / Q8_0), the K-quants' integer sub-block dots
 * (kquant_products.h: rows of x 4 at a time against each weight row; at 32 rows ~2x the
 * fp32 tiles, which pay a K-quant block's scalar dequantization, and as fast at 128),
 * else each thread dequantizes TQ_NR weight rows at a time into a buffer that stays in
 * cache and multiplies them with every row of x, TQ_MR x TQ_NR dot products side by side. */
int tq_gemm(int type, const uint8_t *w, size_t row_bytes, int n_out, int k, const float *x,
            int m, float *y, int ldy) {
    const int bs = tq_block_size(type);
    if (tq_block_bytes(type) == 0 || k % bs != 0 || m < 1) return -1;
    float *rounded = NULL;
#ifdef TQ_PANEL
    if (small_block(type)) return gemm_panel(type, w, row_bytes, n_out, k, x, m, y, ldy);
#endif
#ifdef TQ_KX
    if (k_block(type)) return gemm_kx(type, w, row_bytes, n_out, k, x, m, y, ldy);
#endif
#ifdef TQ_QX
    /* x rounded as tq_gemv's integer products round it, then fp32 tiles: with 5 or more
     * rows the tiles' fp32 FMAs beat per-block integer dots (~1.5x at 32 rows), and the
     * results differ from the integer path's by summation order only */
    if (small_block(type)) {
        rounded = malloc(sizeof(float) * (size_t)m * k);
        if (!rounded) return -2;
        tq_round_x16(x, m, k, rounded);
        x = rounded;
    }
#endif
    const int tiles = (n_out + TQ_NR - 1) / TQ_NR;
    int failed = 0;
#pragma omp parallel
    {
        float *buf = malloc(sizeof(float) * (size_t)TQ_NR * k);
        if (!buf) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int tile = 0; tile < tiles; tile++) {
            if (!buf) continue;
            const int n0 = tile * TQ_NR, nr = n_out - n0 < TQ_NR ? n_out - n0 : TQ_NR;
            for (int r = 0; r < TQ_NR; r++) /* a short last tile repeats its last row */
                dequant_row(type, w + (size_t)(n0 + (r < nr ? r : nr - 1)) * row_bytes, k,
                            buf + (size_t)r * k);
            for (int t0 = 0; t0 < m; t0 += TQ_MR) {
                const int mr = m - t0 < TQ_MR ? m - t0 : TQ_MR;
                const float *xs[TQ_MR];
                for (int i = 0; i < TQ_MR; i++) xs[i] = x + (size_t)(t0 + (i < mr ? i : mr - 1)) * k;
#ifdef L
                vf acc[TQ_MR][TQ_NR];
                for (int i = 0; i < TQ_MR; i++)
                    for (int r = 0; r < TQ_NR; r++) acc[i][r] = v_zero();
                for (int kk = 0; kk < k; kk += L) {
                    vf wv[TQ_NR];
                    for (int r = 0; r < TQ_NR; r++) wv[r] = v_load(buf + (size_t)r * k + kk);
                    for (int i = 0; i < TQ_MR; i++) {
                        const vf xv = v_load(xs[i] + kk);
                        for (int r = 0; r < TQ_NR; r++) acc[i][r] = v_fma(xv, wv[r], acc[i][r]);
                    }
                }
                for (int i = 0; i < mr; i++)
                    for (int r = 0; r < nr; r++)
                        y[(size_t)(t0 + i) * ldy + n0 + r] = v_sum(acc[i][r]);
#else
                for (int i = 0; i < mr; i++)
                    for (int r = 0; r < nr; r++) {
                        float acc = 0.0f;
                        for (int kk = 0; kk < k; kk++) acc += xs[i][kk] * buf[(size_t)r * k + kk];
                        y[(size_t)(t0 + i) * ldy + n0 + r] = acc;
                    }
#endif
            }
        }
        free(buf);
    }
    free(rounded);
    return failed ? -2 : 0;
}

/* out[i] = fp32 row rows[i] of W (or row n0 + i when rows is NULL), i < count. */
int tq_dequant_rows(int type, const uint8_t *w, size_t row_bytes, int k, const int64_t *rows,
                    int64_t n0, int count, float *out) {
    const int bs = tq_block_size(type), bb = tq_block_bytes(type);
    if (bb == 0 || k % bs != 0) return -1;
#pragma omp parallel for schedule(static) if (count > 1)
    for (int i = 0; i < count; i++) {
        const int64_t r = rows ? rows[i] : n0 + i;
        const uint8_t *row = w + (size_t)r * row_bytes;
        dequant_row(type, row, k, out + (size_t)i * k);
    }
    return 0;
}
