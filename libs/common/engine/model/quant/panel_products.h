/* Part of kernels.c (one translation unit; included there, never compiled alone).
 * Needs x16_products.h (x quantized to int16) and panel_avx2.h; defines TQ_PANEL where the
 * build has AVX-512BW, and gemm_panel over either build's panels (PN, PM, build_panel,
 * panel_tile). */

/* ---- integer panel products for a batch (5 or more rows of x; AVX-512BW) ---------------
 *
 * The weight is unpacked, 32 output columns at a time, into a panel of 16-bit integers
 * that stays in cache and serves every row of x: panel[block][pair p][column] holds the
 * column's two weights (2p, 2p + 1) of that block side by side, so that one `vpdpwssd`
 * (VNNI; vpmaddwd + vpaddd without it) multiplies x's pair p, broadcast, with 16 columns
 * at once: 32 multiply-adds an instruction, where fp32 FMAs take 16. A block's integer
 * sums then take the block's scales in fp32: y += dw * (dx * sum), plus Q4_1's min term
 * mw * (dx * sum(qx)). Q4_0's nibbles are centred (q - 8) in the panel.
 *
 * A row of x takes the same sequence of operations whatever the rows beside it: a row's
 * result has the same bits in a batch of 5 or of 2,000 (a chunked prefill equals an
 * unchunked one), and in tq_gemv's 1-16 rows, which take the same exact integer block
 * sums through the same fp32 steps (x16_products.h, gemv_cols_qx): a decode stream's
 * tokens do not depend on the streams beside it. */
#if defined(TQ_QX) && defined(__AVX512BW__)
#define TQ_PANEL 1
#define PN 32 /* columns a panel: two vectors of 16 */
#define PM 4  /* rows of x a tile (6 and 8 were slower at 32 rows: registers run out) */

static inline __m512i dot_pairs(__m512i acc, __m512i w, __m512i x) {
#ifdef __AVX512VNNI__
    return _mm512_dpwssd_epi32(acc, w, x);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(w, x));
#endif
}

/* A block of one weight row -> its 32 weights as int16 in order (lane p of the 16 int32
 * lanes: weights 2p and 2p + 1). */
static inline __m512i block_i16(int type, const uint8_t *blk) {
    if (type == TQ_Q8_0) return _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(blk + 2)));
    const __m128i q = _mm_loadu_si128((const __m128i *)(blk + (type == TQ_Q4_1 ? 4 : 2)));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m256i nib = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), mask), _mm_and_si128(q, mask));
    const __m512i v = _mm512_cvtepu8_epi16(nib);
    return type == TQ_Q4_0 ? _mm512_sub_epi16(v, _mm512_set1_epi16(8)) : v;
}

/* r[i] lane j -> r[j] lane i, for 16 vectors of 16 int32. */
static inline void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
        t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
        r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
        r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xdd);
    }
}

/* Unpack columns n0 .. n0 + 31 of W (a short last group repeats its last column) into
 * `panel` [nb][16][PN] int32 and their scales into `dw`, `mw` [nb][PN]. */
static void build_panel(int type, const uint8_t *w, size_t row_bytes, int n_out, int nb, int n0,
                        int32_t *panel, float *dw, float *mw) {
    const int bb = tq_block_bytes(type);
    for (int b = 0; b < nb; b++)
        for (int half = 0; half < PN / 16; half++) {
            __m512i r[16];
            for (int c = 0; c < 16; c++) {
                const int col = n0 + half * 16 + c, n = col < n_out ? col : n_out - 1;
                float *d = dw + b * PN + half * 16 + c, *mn = mw + b * PN + half * 16 + c;
                if (k_block(type)) { /* a K-quant's piece b (kquant_pieces.h) */
                    __m256i lo, hi;
                    k_panel_block(type, w + (size_t)n * row_bytes, b, &lo, &hi, d, mn);
                    r[c] = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
                    continue;
                }
                const uint8_t *blk = w + (size_t)n * row_bytes + (size_t)b * bb;
                tq_prefetch_ahead(blk, 1);
                r[c] = block_i16(type, blk);
                *d = h2f(blk);
                *mn = type == TQ_Q4_1 ? h2f(blk + 2) : 0.0f;
            }
            transpose16(r);
            for (int p = 0; p < 16; p++) _mm512_storeu_si512(panel + ((size_t)b * 16 + p) * PN + half * 16, r[p]);
        }
}

/* y[t0 .. t0 + PM - 1][n0 .. n0 + 31] from one panel; rows past m repeat row m - 1 (the
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
    __m512 acc[PM][2];
    for (int i = 0; i < PM; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        __m512i s[PM][2];
        for (int i = 0; i < PM; i++) s[i][0] = s[i][1] = _mm512_setzero_si512();
        const int32_t *pb = panel + (size_t)b * 16 * PN;
        for (int p = 0; p < 16; p++) {
            const __m512i w0 = _mm512_loadu_si512(pb + p * PN), w1 = _mm512_loadu_si512(pb + p * PN + 16);
            for (int i = 0; i < PM; i++) {
                const __m512i xv = _mm512_set1_epi32(xp[i][b * 16 + p]);
                s[i][0] = dot_pairs(s[i][0], w0, xv);
                s[i][1] = dot_pairs(s[i][1], w1, xv);
            }
        }
        const __m512 d0 = _mm512_loadu_ps(dw + b * PN), d1 = _mm512_loadu_ps(dw + b * PN + 16);
        for (int i = 0; i < PM; i++) {
            const __m512 dx = _mm512_set1_ps(ds[i][2 * b]);
            acc[i][0] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(s[i][0]), dx), d0, acc[i][0]);
            acc[i][1] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(s[i][1]), dx), d1, acc[i][1]);
        }
        if (type == TQ_Q4_1) {
            const __m512 m0 = _mm512_loadu_ps(mw + b * PN), m1 = _mm512_loadu_ps(mw + b * PN + 16);
            for (int i = 0; i < PM; i++) {
                const __m512 sx = _mm512_set1_ps(ds[i][2 * b + 1]);
                acc[i][0] = _mm512_fmadd_ps(m0, sx, acc[i][0]);
                acc[i][1] = _mm512_fmadd_ps(m1, sx, acc[i][1]);
            }
        }
    }
    for (int i = 0; i < PM; i++) {
        _mm512_storeu_ps(out + i * PN, acc[i][0]);
        _mm512_storeu_ps(out + i * PN + 16, acc[i][1]);
    }
}

#endif

#ifdef TQ_PANEL
static int gemm_panel(int type, const uint8_t *w, size_t row_bytes, int n_out, int k,
                      const float *x, int m, float *y, int ldy) {
    tq_xq_t xq;
    if (quantize_x(x, m, k, &xq) != 0) return -2;
    const int nb = k / 32, groups = (n_out + PN - 1) / PN;
    int failed = 0;
#pragma omp parallel
    {
        int32_t *panel = malloc(sizeof(int32_t) * (size_t)nb * 16 * PN + sizeof(float) * 2 * (size_t)nb * PN);
        if (!panel) {
#pragma omp atomic write
            failed = 1;
        }
        float *dw = (float *)(panel + (size_t)nb * 16 * PN), *mw = dw + (size_t)nb * PN;
#pragma omp for schedule(static)
        for (int g = 0; g < groups; g++) {
            if (!panel) continue;
            const int n0 = g * PN, nc = n_out - n0 < PN ? n_out - n0 : PN;
            build_panel(type, w, row_bytes, n_out, nb, n0, panel, dw, mw);
            for (int t0 = 0; t0 < m; t0 += PM) {
                float out[PM * PN];
                /* Q4_K and Q5_K have Q4_1's min term; Q4_0 and Q6_K, as Q8_0, none */
                if (panel_has_min(type)) panel_tile(TQ_Q4_1, panel, dw, mw, nb, &xq, t0, m, out);
                else panel_tile(TQ_Q8_0, panel, dw, mw, nb, &xq, t0, m, out);
                const int mr = m - t0 < PM ? m - t0 : PM;
                for (int i = 0; i < mr; i++) memcpy(y + (size_t)(t0 + i) * ldy + n0, out + i * PN, sizeof(float) * nc);
            }
        }
        free(panel);
    }
    free(xq.q);
    return failed ? -2 : 0;
}
#endif
