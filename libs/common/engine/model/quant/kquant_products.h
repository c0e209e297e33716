/* Part of kernels.c (one translation unit; included there, never compiled alone).
 * Needs x16_products.h (x quantized to int16 a 32-value block) and, in NEON builds,
 * kquant_neon.h (their rows_dot_k); defines TQ_KX where x16_products.h has TQ_QX (AVX2,
 * FMA and F16C, or NEON). */

/* ---- products with 16-bit activations for the K-quants (Q4_K, Q5_K, Q6_K) ---------------
 *
 * x is rounded exactly as for Q4_0 (quantize_x: int16 with a scale dx per 32 values), and
 * a K-quant's structure fits that rounding: a 256-value block is 8 sub-blocks of 32
 * values with 6-bit integer scales and mins (Q4_K, Q5_K: w = d sc q - dmin m) or 16
 * sub-blocks of 16 with int8 scales (Q6_K: w = d sc (q - 32)). So each 32-value piece of
 * a block has one integer dot with x's int16 values, taken with vpmaddwd:
 *   Q4_K / Q5_K:  d sc_s dx_s sum(q qx) - dmin m_s (dx_s sum(qx))
 *   Q6_K:         d dx_s sum(sc (q - 32) qx)    ((q - 32) sc fits int16: |.| <= 4096)
 * the scales of a block's 8 pieces computed in one vector (d sc_s dx_s), the min terms in
 * another, summed at the end. Against the fp32 product of the dequantized weight, only x's
 * rounding differs (as for Q4_0), and the wide products take x rounded the same way.
 *
 * Every row of x goes through the same operations whatever the rows beside it: a row's
 * result has the same bits alone or in a group. */
#ifdef TQ_QX
#define TQ_KX 1
#ifndef TQ_NEON

/* The compiler may reassociate fp32 sums (-fassociative-math) and would do so differently
 * in the copies of a loop for 1 and for 4 rows; pinning each step of a row's accumulation
 * keeps one order, so a row's bits do not depend on the rows beside it. No instruction. */
#define TQ_PIN(v) __asm__("" : "+x"(v))

static inline float v8_sum(__m256 a) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}

/* The 8 six-bit scales and mins of a Q4_K / Q5_K block (12 bytes: sc0-3 and m0-3 in the low
 * 6 bits of bytes 0-7, sc4-7 / m4-7 in the nibbles of bytes 8-11 with their top 2 bits in
 * the top 2 bits of bytes 0-3 / 4-7), as 8 floats each. */
static inline void k4_scales(const uint8_t *s, __m256 *sc, __m256 *mn) {
    uint64_t a;
    uint32_t c;
    memcpy(&a, s, 8);
    memcpy(&c, s + 8, 4);
    const uint64_t lo = a & 0x3f3f3f3f3f3f3f3full; /* sc0-3, m0-3 */
    const uint64_t hi = ((uint64_t)(c & 0x0f0f0f0fu) | ((uint64_t)((c >> 4) & 0x0f0f0f0fu) << 32)) |
                        ((a >> 2) & 0x3030303030303030ull); /* sc4-7, m4-7 */
    /* (sc0-3, sc4-7, m0-3, m4-7) */
    const __m128i both = _mm_unpacklo_epi32(_mm_cvtsi64_si128((long long)lo), _mm_cvtsi64_si128((long long)hi));
    *sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(both));
    *mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(both, 8)));
}

/* The integer dot of 32 int16 weights (two vectors) with 32 int16 values of x, in 8 lanes. */
static inline __m256i dot32(__m256i w0, __m256i w1, const int16_t *xp) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    const __m256i p = _mm256_madd_epi16(w0, _mm256_loadu_si256((const __m256i *)xp));
    return _mm256_dpwssd_epi32(p, w1, _mm256_loadu_si256((const __m256i *)(xp + 16)));
#endif
    return _mm256_add_epi32(_mm256_madd_epi16(w0, _mm256_loadu_si256((const __m256i *)xp)),
                            _mm256_madd_epi16(w1, _mm256_loadu_si256((const __m256i *)(xp + 16))));
}

/* Sub-block pair j (values 64j .. 64j + 63) of a Q4_K / Q5_K block as int16: w[0], w[1] the
 * low nibbles (sub-block 2j), w[2], w[3] the high ones (2j + 1), Q5_K's fifth bits added
 * from qh (the bits 2j and 2j + 1 of each of its 32 bytes, widened in h[2] and shifted
 * right by 2j: pairs are taken in order). */
static inline void k45_pair(int type, const uint8_t *qs, __m256i *h, __m256i w[4]) {
    const __m256i nib = _mm256_set1_epi16(0x0F);
    const __m256i a = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)qs));
    const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(qs + 16)));
    w[0] = _mm256_and_si256(a, nib);
    w[1] = _mm256_and_si256(b, nib);
    w[2] = _mm256_srli_epi16(a, 4);
    w[3] = _mm256_srli_epi16(b, 4);
    if (type == TQ_Q5_K) {
        /* h holds qh shifted right by 2j: its bits 0 and 1 (sub-blocks 2j, 2j + 1) go to
         * bit 4; then h moves on to the next pair */
        const __m256i bit = _mm256_set1_epi16(0x10);
        w[0] = _mm256_or_si256(w[0], _mm256_and_si256(_mm256_slli_epi16(h[0], 4), bit));
        w[1] = _mm256_or_si256(w[1], _mm256_and_si256(_mm256_slli_epi16(h[1], 4), bit));
        w[2] = _mm256_or_si256(w[2], _mm256_and_si256(_mm256_slli_epi16(h[0], 3), bit));
        w[3] = _mm256_or_si256(w[3], _mm256_and_si256(_mm256_slli_epi16(h[1], 3), bit));
        h[0] = _mm256_srli_epi16(h[0], 2);
        h[1] = _mm256_srli_epi16(h[1], 2);
    }
}

/* out[t] = row . x_t for g <= TQ_GROUP rows of quantized x (t0 .. t0 + g - 1), a Q4_K or
 * Q5_K row of nb blocks. */
static inline __attribute__((always_inline)) void rows_dot_k45(
    int type, const uint8_t *row, int nb, const tq_xq_t *xq, const float *xs, int t0, int g, float *out) {
    const int bb = tq_block_bytes(type), qs_at = type == TQ_Q5_K ? 48 : 16;
    /* two accumulators a row, even and odd pieces (with the min terms): one chain of 8
     * dependent FMAs a block would bound the loop by their latency */
    __m256 acc[TQ_GROUP][2];
    for (int t = 0; t < g; t++) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = row + (size_t)b * bb;
        tq_prefetch_ahead(blk, bb);
        __m256 sc, mn;
        k4_scales(blk + 4, &sc, &mn);
        int32_t head; /* d and dmin, converted in one instruction: (d, dmin, d, dmin, ...) */
        memcpy(&head, blk, 4);
        const __m256 dd = _mm256_cvtph_ps(_mm_set1_epi32(head));
        __m256 dsc = _mm256_mul_ps(_mm256_moveldup_ps(dd), sc);
        __m256 dmn = _mm256_mul_ps(_mm256_movehdup_ps(dd), mn);
        TQ_PIN(dsc); /* (d sc) dx, never d (sc dx): the order of the products shared by rows */
        TQ_PIN(dmn);
        float scale[TQ_GROUP][8]; /* d sc_s dx_s of each row's 8 pieces, broadcast from here */
        for (int t = 0; t < g; t++) {
            const float *dx = xs + (size_t)(t0 + t) * 2 * xq->nbp + (size_t)b * 8, *sx = dx + xq->nbp;
            _mm256_storeu_ps(scale[t], _mm256_mul_ps(dsc, _mm256_loadu_ps(dx)));
            acc[t][1] = _mm256_fnmadd_ps(dmn, _mm256_loadu_ps(sx), acc[t][1]);
            TQ_PIN(acc[t][1]);
        }
        __m256i h[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
        if (type == TQ_Q5_K) {
            h[0] = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(blk + 16)));
            h[1] = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(blk + 32)));
        }
        for (int j = 0; j < 4; j++) {
            __m256i w[4];
            k45_pair(type, blk + qs_at + 32 * j, h, w);
            for (int t = 0; t < g; t++) {
                const int16_t *xp = xq->q + (size_t)(t0 + t) * xq->kp + (size_t)b * 256 + 64 * j;
                const __m256i p0 = dot32(w[0], w[1], xp), p1 = dot32(w[2], w[3], xp + 32);
                acc[t][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_broadcast_ss(&scale[t][2 * j]), acc[t][0]);
                acc[t][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1), _mm256_broadcast_ss(&scale[t][2 * j + 1]), acc[t][1]);
                TQ_PIN(acc[t][0]);
                TQ_PIN(acc[t][1]);
            }
        }
    }
    for (int t = 0; t < g; t++) out[t] = v8_sum(_mm256_add_ps(acc[t][0], acc[t][1]));
}

/* out[t] = row . x_t as above for a Q6_K row: 128 values at a time from 64 bytes of low
 * nibbles (ql), 32 of high bit pairs (qh) and 8 int8 scales, one per 16 values. */
static inline __attribute__((always_inline)) void rows_dot_q6k(
    const uint8_t *row, int nb, const tq_xq_t *xq, const float *xs, int t0, int g, float *out) {
    __m256 acc[TQ_GROUP][2]; /* even and odd pieces: two chains of FMAs, as for Q4_K */
    for (int t = 0; t < g; t++) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
    const __m256i nib = _mm256_set1_epi8(0x0F), pair = _mm256_set1_epi8(0x30), centre = _mm256_set1_epi8(32);
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = row + (size_t)b * 210;
        tq_prefetch_ahead(blk, 210);
        const __m256 d = _mm256_set1_ps(h2f(blk + 208));
        float scale[TQ_GROUP][8]; /* d dx of each row's 8 pieces of 32 */
        for (int t = 0; t < g; t++)
            _mm256_storeu_ps(scale[t], _mm256_mul_ps(d, _mm256_loadu_ps(xs + (size_t)(t0 + t) * 2 * xq->nbp + (size_t)b * 8)));
        for (int n = 0; n < 2; n++) {
            const uint8_t *ql = blk + 64 * n, *qh = blk + 128 + 32 * n;
            const __m256i l0 = _mm256_loadu_si256((const __m256i *)ql);
            const __m256i l1 = _mm256_loadu_si256((const __m256i *)(ql + 32));
            const __m256i hb = _mm256_loadu_si256((const __m256i *)qh);
            /* the four 32-value pieces (values 32i .. 32i + 31 of these 128), as q - 32 bytes;
             * 16-bit shifts are safe: the mask keeps each byte's own bits */
            __m256i q[4];
            q[0] = _mm256_or_si256(_mm256_and_si256(l0, nib), _mm256_and_si256(_mm256_slli_epi16(hb, 4), pair));
            q[1] = _mm256_or_si256(_mm256_and_si256(l1, nib), _mm256_and_si256(_mm256_slli_epi16(hb, 2), pair));
            q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), nib), _mm256_and_si256(hb, pair));
            q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), nib),
                                   _mm256_and_si256(_mm256_srli_epi16(hb, 2), pair));
            const int8_t *sc = (const int8_t *)(blk + 192 + 8 * n);
            for (int i = 0; i < 4; i++) {
                const __m256i c = _mm256_sub_epi8(q[i], centre);
                const __m256i w0 = _mm256_mullo_epi16(_mm256_cvtepi8_epi16(_mm256_castsi256_si128(c)),
                                                      _mm256_set1_epi16(sc[2 * i]));
                const __m256i w1 = _mm256_mullo_epi16(_mm256_cvtepi8_epi16(_mm256_extracti128_si256(c, 1)),
                                                      _mm256_set1_epi16(sc[2 * i + 1]));
                for (int t = 0; t < g; t++) {
                    const int16_t *xp = xq->q + (size_t)(t0 + t) * xq->kp + (size_t)b * 256 + 128 * n + 32 * i;
                    const __m256i p = dot32(w0, w1, xp);
                    acc[t][i & 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_broadcast_ss(&scale[t][4 * n + i]),
                                                    acc[t][i & 1]);
                    TQ_PIN(acc[t][i & 1]);
                }
            }
        }
    }
    for (int t = 0; t < g; t++) out[t] = v8_sum(_mm256_add_ps(acc[t][0], acc[t][1]));
}

static inline __attribute__((always_inline)) void rows_dot_k(
    int type, const uint8_t *row, int nb, const tq_xq_t *xq, const float *xs, int t0, int g, float *out) {
    if (type == TQ_Q6_K) rows_dot_q6k(row, nb, xq, xs, t0, g, out);
    else if (type == TQ_Q5_K) rows_dot_k45(TQ_Q5_K, row, nb, xq, xs, t0, g, out);
    else rows_dot_k45(TQ_Q4_K, row, nb, xq, xs, t0, g, out);
}

/* One Q4_K / Q5_K / Q6_K block -> 256 fp32 values, 8 at a time (dequant_block's values, d sc
 * q - dmin m with one rounding less where the FMA fuses it): for the wide products'
 * slices and embedding rows. */
static inline void dequant_k(int type, const uint8_t *blk, float *y) {
    if (type == TQ_Q6_K) {
        const __m256 d = _mm256_set1_ps(h2f(blk + 208));
        const __m256i low = _mm256_set1_epi32(0x0F), two = _mm256_set1_epi32(3), centre = _mm256_set1_epi32(32);
        for (int n = 0; n < 2; n++, y += 128) {
            const uint8_t *ql = blk + 64 * n, *qh = blk + 128 + 32 * n;
            const int8_t *sc = (const int8_t *)(blk + 192 + 8 * n);
            for (int l = 0; l < 32; l += 8) {
                const __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(ql + l)));
                const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(ql + l + 32)));
                const __m256i h = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qh + l)));
                const __m256i q[4] = {
                    _mm256_or_si256(_mm256_and_si256(a, low), _mm256_slli_epi32(_mm256_and_si256(h, two), 4)),
                    _mm256_or_si256(_mm256_and_si256(b, low),
                                    _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(h, 2), two), 4)),
                    _mm256_or_si256(_mm256_srli_epi32(a, 4),
                                    _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(h, 4), two), 4)),
                    _mm256_or_si256(_mm256_srli_epi32(b, 4), _mm256_slli_epi32(_mm256_srli_epi32(h, 6), 4)),
                };
                for (int i = 0; i < 4; i++) {
                    const __m256 ds = _mm256_mul_ps(d, _mm256_set1_ps((float)sc[l / 16 + 2 * i]));
                    const __m256 v = _mm256_cvtepi32_ps(_mm256_sub_epi32(q[i], centre));
                    _mm256_storeu_ps(y + 32 * i + l, _mm256_mul_ps(ds, v));
                }
            }
        }
        return;
    }
    __m256 sc, mn;
    k4_scales(blk + 4, &sc, &mn);
    float dsc[8], dmn[8];
    _mm256_storeu_ps(dsc, _mm256_mul_ps(_mm256_set1_ps(h2f(blk)), sc));
    _mm256_storeu_ps(dmn, _mm256_mul_ps(_mm256_set1_ps(h2f(blk + 2)), mn));
    const uint8_t *qs = blk + (type == TQ_Q5_K ? 48 : 16), *qh = blk + 16;
    const __m256i low = _mm256_set1_epi32(0x0F), one = _mm256_set1_epi32(1);
    for (int j = 0; j < 4; j++, qs += 32, y += 64)
        for (int l = 0; l < 32; l += 8) {
            const __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qs + l)));
            __m256i q0 = _mm256_and_si256(a, low), q1 = _mm256_srli_epi32(a, 4);
            if (type == TQ_Q5_K) {
                const __m256i h = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qh + l)));
                q0 = _mm256_or_si256(q0, _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(h, 2 * j), one), 4));
                q1 = _mm256_or_si256(q1, _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(h, 2 * j + 1), one), 4));
            }
            _mm256_storeu_ps(y + l, _mm256_fmsub_ps(_mm256_set1_ps(dsc[2 * j]), _mm256_cvtepi32_ps(q0),
                                                    _mm256_set1_ps(dmn[2 * j])));
            _mm256_storeu_ps(y + 32 + l, _mm256_fmsub_ps(_mm256_set1_ps(dsc[2 * j + 1]), _mm256_cvtepi32_ps(q1),
                                                         _mm256_set1_ps(dmn[2 * j + 1])));
        }
}

#endif /* not TQ_NEON */

/* x's block scales side by side per row, [m][2][nbp]: dx of each block, then its
 * dx sum(qx) (quantize_x keeps them as pairs, for the 32-value formats). */
static float *x_scales_planar(const tq_xq_t *xq, int m) {
    float *p = malloc(sizeof(float) * 2 * (size_t)m * xq->nbp);
    if (!p) return NULL;
    for (int t = 0; t < m; t++)
        for (int b = 0; b < xq->nbp; b++) {
            p[(size_t)t * 2 * xq->nbp + b] = xq->ds[((size_t)t * xq->nbp + b) * 2];
            p[((size_t)t * 2 + 1) * xq->nbp + b] = xq->ds[((size_t)t * xq->nbp + b) * 2 + 1];
        }
    return p;
}

/* y = x W^T for a Q4_K / Q5_K / Q6_K weight, any m, x quantized as for Q4_0. */
static int gemm_kx(int type, const uint8_t *w, size_t row_bytes, int n_out, int k, const float *x,
                   int m, float *y, int ldy) {
    tq_xq_t xq;
    if (quantize_x(x, m, k, &xq) != 0) return -2;
    float *xs = x_scales_planar(&xq, m);
    if (!xs) {
        free(xq.q);
        return -2;
    }
    const int nb = k / 256;
#pragma omp parallel for schedule(static)
    for (int n = 0; n < n_out; n++) {
        const uint8_t *row = w + (size_t)n * row_bytes;
        for (int t0 = 0; t0 < m; t0 += TQ_GROUP) {
            const int g = m - t0 < TQ_GROUP ? m - t0 : TQ_GROUP;
            float out[TQ_GROUP];
            switch (g) { /* one copy of the loop per group size, its accumulators in registers */
            case 1: rows_dot_k(type, row, nb, &xq, xs, t0, 1, out); break;
            case 2: rows_dot_k(type, row, nb, &xq, xs, t0, 2, out); break;
            case 3: rows_dot_k(type, row, nb, &xq, xs, t0, 3, out); break;
            default: rows_dot_k(type, row, nb, &xq, xs, t0, 4, out); break;
            }
            for (int t = 0; t < g; t++) y[(size_t)(t0 + t) * ldy + n] = out[t];
        }
    }
    free(xs);
    free(xq.q);
    return 0;
}
#endif
