/* Part of kernels.c (one translation unit; included there, never compiled alone).
 * Needs x16_products.h (x quantized to int16); defines TQ_PANEL (and TQ_PANEL_256) where the build has
 * AVX2 (with FMA and F16C) but not AVX-512BW, whose 512-bit panels panel_products.h defines;
 * panel_products.h multiplies with what this defines (gemm_panel). */

/* ---- 256-bit integer panel products for a batch (5 or more rows of x; AVX2 builds) ------
 *
 * The same scheme as the AVX-512 panels (panel_products.h): the weight is unpacked, PN
 * output columns at a time, into a panel of 16-bit integers that stays in cache,
 * panel[block][pair p][column] holding the column's weights 2p and 2p + 1 side by side;
 * x's pair p, broadcast, multiplies 8 columns a `vpmaddwd` (16 multiply-adds; AVX2 has no
 * vpdpwssd, so a vpaddd follows). A tile is PM rows of x by the panel's 16 columns, two
 * vectors a row: its 2 PM int32 block sums and 2 PM fp32 accumulators, two weight
 * vectors and x's broadcast pair fill the 16 ymm registers at PM = 3. A block's integer
 * sums take its scales in fp32: y += dw * (dx * sum), plus Q4_1's min term
 * mw * (dx * sum(qx)); Q4_0's nibbles are centred (q - 8) in the panel.
 *
 * A row of x takes the same sequence of operations whatever the rows beside it: its
 * result has the same bits in a batch of 5 or of 2,000 (a chunked prefill equals an
 * unchunked one), and in tq_gemv's 1-16 rows, whose fp32 steps per block are these
 * (x16_products.h, gemv_cols_qx). */
#if defined(TQ_QX) && defined(__AVX2__) && !defined(__AVX512BW__)
#define TQ_PANEL 1
#define TQ_PANEL_256 1
#ifndef PM
#define PM 3 /* rows of x a tile */
#endif
#define PN 16 /* columns a panel and a tile: two vectors of 8 */

/* r[i] lane j -> r[j] lane i, for 8 vectors of 8 int32. */
static inline void transpose8(__m256i r[8]) {
    __m256i t[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        r[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm256_permute2x128_si256(r[i], r[i + 4], 0x20);
        t[i + 4] = _mm256_permute2x128_si256(r[i], r[i + 4], 0x31);
    }
    for (int i = 0; i < 8; i++) r[i] = t[i];
}

/* Unpack columns n0 .. n0 + 15 of W (a short last group repeats its last column) into
 * `panel` [nb][16][PN] int32 and their scales into `dw`, `mw` [nb][PN]. */
static void build_panel(int type, const uint8_t *w, size_t row_bytes, int n_out, int nb,
                             int n0, int32_t *panel, float *dw, float *mw) {
    const int bb = tq_block_bytes(type);
    for (int b = 0; b < nb; b++)
        for (int half = 0; half < PN / 8; half++) {
            __m256i lo[8], hi[8];
            for (int c = 0; c < 8; c++) {
                const int col = n0 + half * 8 + c, n = col < n_out ? col : n_out - 1;
                float *d = dw + b * PN + half * 8 + c, *mn = mw + b * PN + half * 8 + c;
                if (k_block(type)) { /* a K-quant's piece b (kquant_pieces.h) */
                    k_panel_block(type, w + (size_t)n * row_bytes, b, &lo[c], &hi[c], d, mn);
                    continue;
                }
                const uint8_t *blk = w + (size_t)n * row_bytes + (size_t)b * bb;
                tq_prefetch_ahead(blk, 1);
                block_i16_avx2(type, blk, &lo[c], &hi[c]);
                *d = h2f(blk);
                *mn = type == TQ_Q4_1 ? h2f(blk + 2) : 0.0f;
            }
            transpose8(lo);
            transpose8(hi);
            int32_t *pb = panel + (size_t)b * 16 * PN + half * 8;
            for (int p = 0; p < 8; p++) {
                _mm256_storeu_si256((__m256i *)(pb + p * PN), lo[p]);
                _mm256_storeu_si256((__m256i *)(pb + (p + 8) * PN), hi[p]);
            }
        }
}

/* y[t0 .. t0 + PM - 1][16 columns] from one panel; rows past m repeat row m - 1 (the
 * caller keeps only the rows it has). */
static inline __attribute__((always_inline)) void panel_tile(
    int type, const int32_t *panel, const float *dw, const float *mw, int nb, const tq_xq_t *xq,
    int t0, int m, float *out /* [PM][PN] */) {
    const int32_t *xp[PM];
    const float *ds[PM];
    for (int i = 0; i < PM; i++) {
        const int t = t0 + i < m ? t0 + i : m - 1;
        xp[i] = (const int32_t *)(xq->q + (size_t)t * xq->kp);
        ds[i] = xq->ds + (size_t)t * xq->nbp * 2;
    }
    __m256 acc[PM][2];
    for (int i = 0; i < PM; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        __m256i s[PM][2];
        for (int i = 0; i < PM; i++) s[i][0] = s[i][1] = _mm256_setzero_si256();
        const int32_t *pb = panel + (size_t)b * 16 * PN;
        /* unrolled 4 times: rolled, gcc moved every sum between registers each pass (the
         * loop was bound by instruction issue); fully unrolled, it spilled the products */
#pragma GCC unroll 4
        for (int p = 0; p < 16; p++) {
            const __m256i w0 = _mm256_loadu_si256((const __m256i *)(pb + p * PN));
            const __m256i w1 = _mm256_loadu_si256((const __m256i *)(pb + p * PN + 8));
            for (int i = 0; i < PM; i++) {
                const __m256i xv = _mm256_set1_epi32(xp[i][b * 16 + p]);
                s[i][0] = _mm256_add_epi32(s[i][0], _mm256_madd_epi16(w0, xv));
                s[i][1] = _mm256_add_epi32(s[i][1], _mm256_madd_epi16(w1, xv));
            }
        }
        const __m256 d0 = _mm256_loadu_ps(dw + b * PN), d1 = _mm256_loadu_ps(dw + b * PN + 8);
        for (int i = 0; i < PM; i++) {
            const __m256 dx = _mm256_set1_ps(ds[i][2 * b]);
            acc[i][0] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(s[i][0]), dx), d0, acc[i][0]);
            acc[i][1] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(s[i][1]), dx), d1, acc[i][1]);
        }
        if (type == TQ_Q4_1) { /* Q4_K, Q5_K: called as Q4_1 (gemm_panel) */
            const __m256 m0 = _mm256_loadu_ps(mw + b * PN), m1 = _mm256_loadu_ps(mw + b * PN + 8);
            for (int i = 0; i < PM; i++) {
                const __m256 sx = _mm256_set1_ps(ds[i][2 * b + 1]);
                acc[i][0] = _mm256_fmadd_ps(m0, sx, acc[i][0]);
                acc[i][1] = _mm256_fmadd_ps(m1, sx, acc[i][1]);
            }
        }
    }
    for (int i = 0; i < PM; i++) {
        _mm256_storeu_ps(out + i * PN, acc[i][0]);
        _mm256_storeu_ps(out + i * PN + 8, acc[i][1]);
    }
}
#endif
