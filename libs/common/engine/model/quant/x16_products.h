/* Part of kernels.c (one translation unit; included there, never compiled alone).
 * Needs blocks.h and vectors.h; defines TQ_QX where the build has AVX2, FMA and F16C, or
 * NEON (the ARM64 neon and neon-dotprod builds). */

/* ---- products with 16-bit activations (Q4_0, Q4_1, Q8_0 weights) -----------------------
 *
 * Each 32-value block of a row of x is quantized to int16 with its own scale (dx = max |x|
 * / 32767), and a block's dot product is taken in integers: dw * dx * sum(qw * qx), plus
 * Q4_1's min (Q4_0's -8 dw) times the block's sum dx * sum(qx). The integer products run
 * 32 at a time (vpmaddwd, or VNNI's vpdpwssd) where fp32 takes 16, and a weight's nibbles
 * need no conversion to float. x's rounding to 16 bits is ~1.5e-5 of a block's largest
 * |x| per value: last-position logits stay within ~1e-4 of the fp32 product's. (8-bit
 * activations, llama.cpp's choice for these formats, were measured on the default model
 * at 8.6e-2 relative logit error with greedy flips at a top-2 margin of 0.13:
 * docs/engine.md.)
 *
 * Every row of x goes through the same sequence of operations whatever the number of
 * rows beside it (a decode step of 1 stream or of 100): a row's result has the same bits
 * in any batch. On x86, 1-16 rows (gemv_cols_qx) take a block's exact integer sum
 * through the int16 panels' fp32 steps (5 rows or more): the same bits in both. */
/* out = x rounded as quantize_x (below) rounds it, in fp32 (q * d per value): the wide products
 * (a prefill, dequantized weights times x through oneDNN) take this x, so that a row's
 * result differs between the wide and the integer paths by fp32 summation order only,
 * as before x was quantized, and a chunked prefill agrees with an unchunked one. */
int tq_round_x16(const float *x, int m, int k, float *out) {
    if (k % 32) return -1;
#pragma omp parallel for schedule(static) if (m > 16)
    for (int t = 0; t < m; t++)
        for (int b = 0; b < k / 32; b++) {
            const float *xb = x + (size_t)t * k + (size_t)b * 32;
            float *ob = out + (size_t)t * k + (size_t)b * 32, amax = 0.0f;
            for (int i = 0; i < 32; i++) amax = fabsf(xb[i]) > amax ? fabsf(xb[i]) : amax;
            const float d = amax / 32767.0f, id = amax > 0.0f ? 32767.0f / amax : 0.0f;
            for (int i = 0; i < 32; i++) ob[i] = nearbyintf(xb[i] * id) * d;
        }
    return 0;
}

#if (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)) || defined(TQ_NEON)
#define TQ_QX 1

/* x rows quantized: `q` [m][kp] int16 (kp = k rounded up to 64), each block's scale d
 * and the block sum of its quantized values, s = d * sum(q) (not of x itself:
 * the min's term then carries x's rounding as the nibbles' term does, and the two cancel
 * as they do in fp32); nbp = kp / 32, padding blocks zero. In builds with ARM's dot
 * products (neon-dotprod) each block's 64 bytes of q hold its two int8 planes instead
 * (split_block below): a reader of q there takes them as planes. */
typedef struct {
    int16_t *q;
    float *ds; /* [m][nbp][2]: d, s of each block side by side (one 8-byte load) */
    int kp, nbp;
} tq_xq_t;

#ifdef __ARM_FEATURE_DOTPROD
/* For sdot (int8 x int8), a block's 32 int16 values are stored in place as two int8
 * planes: hi = q >> 8 (arithmetic), then lo = (q & 0xFF) - 128, so that q = 256 hi + lo
 * + 128 exactly (|q| <= 32767 keeps hi within -128..127). */
static inline void split_block(int16_t *at) {
    int16_t q[32];
    memcpy(q, at, sizeof(q));
    int8_t *hi = (int8_t *)at, *lo = hi + 32;
    for (int i = 0; i < 32; i++) {
        hi[i] = (int8_t)(q[i] >> 8);
        lo[i] = (int8_t)((q[i] & 0xFF) - 128);
    }
}
#endif

static int quantize_x(const float *x, int m, int k, tq_xq_t *xq) {
    const int nb = k / 32;
    xq->kp = (k + 63) / 64 * 64;
    xq->nbp = xq->kp / 32;
    xq->q = malloc(sizeof(int16_t) * (size_t)m * xq->kp + sizeof(float) * 2 * (size_t)m * xq->nbp);
    if (!xq->q) return -2;
    xq->ds = (float *)(xq->q + (size_t)m * xq->kp);
#pragma omp parallel for schedule(static) if (m > 16)
    for (int t = 0; t < m; t++) {
        int16_t *qt = xq->q + (size_t)t * xq->kp;
        float *ds = xq->ds + (size_t)t * xq->nbp * 2;
        memset(qt, 0, sizeof(int16_t) * (size_t)xq->kp);
        for (int b = nb; b < xq->nbp; b++) ds[2 * b] = ds[2 * b + 1] = 0.0f;
        for (int b = 0; b < nb; b++) {
            const float *xb = x + (size_t)t * k + (size_t)b * 32;
            float amax = 0.0f;
            for (int i = 0; i < 32; i++) amax = fabsf(xb[i]) > amax ? fabsf(xb[i]) : amax;
            const float d = amax / 32767.0f, id = amax > 0.0f ? 32767.0f / amax : 0.0f;
            int16_t *at = qt + (size_t)b * 32;
            int32_t sum = 0;
            for (int i = 0; i < 32; i++) {
                const int32_t v = (int32_t)nearbyintf(xb[i] * id);
                at[i] = (int16_t)v;
                sum += v;
            }
            ds[2 * b] = d;
            ds[2 * b + 1] = d * (float)sum;
#ifdef __ARM_FEATURE_DOTPROD
            split_block(at);
#endif
        }
    }
    return 0;
}

#if defined(TQ_NEON)
/* out[t] = row . x_t for g <= TQ_GROUP rows of quantized x (rows t0 .. t0 + g - 1), as the
 * AVX2 loop below computes it: a block's exact integer dot sum(qw * qx), then its scales
 * in fp32, dw * dx * sum plus the min's term mw * s (Q4_0: mw = -8 dw; Q8_0: none). The
 * integer dot: with dotprod, `sdot` on the weights as int8 and x's two int8 planes
 * (split_block: 16 multiply-adds an instruction), sum(qw * qx) = 256 sum(qw * hi) +
 * sum(qw * lo) + 128 sum(qw); without, `smull`/`smlal` on int16 (4 an instruction).
 * Both give the same integers, so the neon and neon-dotprod builds agree to the bit. */
static inline __attribute__((always_inline)) void rows_dot_qx(
    int type, const uint8_t *row, int nb, int bb, const tq_xq_t *xq, int t0, int g, float *out) {
    float acc[TQ_GROUP], accm[TQ_GROUP];
    for (int t = 0; t < g; t++) acc[t] = accm[t] = 0.0f;
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = row + (size_t)b * bb;
        const float dw = h2f(blk);
        const float mw = type == TQ_Q4_1 ? h2f(blk + 2) : type == TQ_Q4_0 ? -8.0f * dw : 0.0f;
        int8x16_t w8[2]; /* the block's 32 weights in order: Q4's nibbles are 0..15 */
        if (type == TQ_Q8_0) {
            w8[0] = vld1q_s8((const int8_t *)(blk + 2));
            w8[1] = vld1q_s8((const int8_t *)(blk + 18));
        } else {
            const uint8x16_t q = vld1q_u8(blk + (type == TQ_Q4_1 ? 4 : 2));
            w8[0] = vreinterpretq_s8_u8(vandq_u8(q, vdupq_n_u8(0x0F)));
            w8[1] = vreinterpretq_s8_u8(vshrq_n_u8(q, 4));
        }
#ifdef __ARM_FEATURE_DOTPROD
        const int32_t wsum128 = 128 * (vaddlvq_s8(w8[0]) + vaddlvq_s8(w8[1]));
#else
        int16x8_t w[4];
        for (int j = 0; j < 2; j++) {
            w[2 * j] = vmovl_s8(vget_low_s8(w8[j]));
            w[2 * j + 1] = vmovl_high_s8(w8[j]);
        }
#endif
        for (int t = 0; t < g; t++) {
            const float *ds = xq->ds + ((size_t)(t0 + t) * xq->nbp + b) * 2;
            const int16_t *xp = xq->q + (size_t)(t0 + t) * xq->kp + (size_t)b * 32;
#ifdef __ARM_FEATURE_DOTPROD
            const int8_t *hi = (const int8_t *)xp, *lo = hi + 32;
            int32x4_t sh = vdotq_s32(vdupq_n_s32(0), w8[0], vld1q_s8(hi));
            sh = vdotq_s32(sh, w8[1], vld1q_s8(hi + 16));
            int32x4_t sl = vdotq_s32(vdupq_n_s32(0), w8[0], vld1q_s8(lo));
            sl = vdotq_s32(sl, w8[1], vld1q_s8(lo + 16));
            const int32_t dot = vaddvq_s32(vmlaq_n_s32(sl, sh, 256)) + wsum128;
#else
            int32x4_t p0 = vdupq_n_s32(0), p1 = vdupq_n_s32(0);
            for (int j = 0; j < 4; j += 2) {
                const int16x8_t x0 = vld1q_s16(xp + 8 * j), x1 = vld1q_s16(xp + 8 * j + 8);
                p0 = vmlal_s16(p0, vget_low_s16(w[j]), vget_low_s16(x0));
                p1 = vmlal_high_s16(p1, w[j], x0);
                p0 = vmlal_s16(p0, vget_low_s16(w[j + 1]), vget_low_s16(x1));
                p1 = vmlal_high_s16(p1, w[j + 1], x1);
            }
            const int32_t dot = vaddvq_s32(vaddq_s32(p0, p1));
#endif
            /* fmaf, not * and +: -fassociative-math may not regroup these (it would,
             * differently for each group size, and a row's bits would depend on g) */
            acc[t] = fmaf((float)dot, dw * ds[0], acc[t]);
            accm[t] = fmaf(mw, ds[1], accm[t]);
        }
    }
    for (int t = 0; t < g; t++) out[t] = acc[t] + accm[t];
}

/* y = x W^T for a Q4_0 / Q4_1 / Q8_0 weight, any m, x quantized as above. */
static int gemm_qx(int type, const uint8_t *w, size_t row_bytes, int n_out, int k, const float *x,
                   int m, float *y, int ldy) {
    tq_xq_t xq;
    if (quantize_x(x, m, k, &xq) != 0) return -2;
    const int nb = k / 32, bb = tq_block_bytes(type);
#pragma omp parallel for schedule(static)
    for (int n = 0; n < n_out; n++) {
        const uint8_t *row = w + (size_t)n * row_bytes;
        for (int t0 = 0; t0 < m; t0 += TQ_GROUP) {
            const int g = m - t0 < TQ_GROUP ? m - t0 : TQ_GROUP;
            float out[TQ_GROUP];
            switch (g) { /* one copy of the loop per group size, its accumulators in registers */
            case 1: rows_dot_qx(type, row, nb, bb, &xq, t0, 1, out); break;
            case 2: rows_dot_qx(type, row, nb, bb, &xq, t0, 2, out); break;
            case 3: rows_dot_qx(type, row, nb, bb, &xq, t0, 3, out); break;
            default: rows_dot_qx(type, row, nb, bb, &xq, t0, 4, out); break;
            }
            for (int t = 0; t < g; t++) y[(size_t)(t0 + t) * ldy + n] = out[t];
        }
    }
    free(xq.q);
    return 0;
}
#else
/* A block of one weight row -> its 32 weights as int16 in two vectors: pairs 0-7 and
 * pairs 8-15 (lane p of the 8 int32 lanes: weights 2p and 2p + 1). */
static inline void block_i16_avx2(int type, const uint8_t *blk, __m256i *lo, __m256i *hi) {
    if (type == TQ_Q8_0) {
        *lo = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 2)));
        *hi = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 18)));
        return;
    }
    const __m128i q = _mm_loadu_si128((const __m128i *)(blk + (type == TQ_Q4_1 ? 4 : 2)));
    const __m128i mask = _mm_set1_epi8(0x0F);
    *lo = _mm256_cvtepu8_epi16(_mm_and_si128(q, mask));
    *hi = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(q, 4), mask));
    if (type == TQ_Q4_0) {
        *lo = _mm256_sub_epi16(*lo, _mm256_set1_epi16(8));
        *hi = _mm256_sub_epi16(*hi, _mm256_set1_epi16(8));
    }
}

/* 8 vectors of 8 int32 -> one: lane c holds the sum of p[c]'s lanes (exact). */
static inline __m256i hsum8x8(const __m256i p[8]) {
    const __m256i t0 = _mm256_hadd_epi32(p[0], p[1]), t1 = _mm256_hadd_epi32(p[2], p[3]);
    const __m256i t2 = _mm256_hadd_epi32(p[4], p[5]), t3 = _mm256_hadd_epi32(p[6], p[7]);
    const __m256i u0 = _mm256_hadd_epi32(t0, t1), u1 = _mm256_hadd_epi32(t2, t3);
    return _mm256_add_epi32(_mm256_permute2x128_si256(u0, u1, 0x20),
                            _mm256_permute2x128_si256(u0, u1, 0x31));
}

/* out[t][c] = row c . x_t for 8 weight rows (`rows`) and g <= TQ_GROUP rows of quantized x
 * (t0 .. t0 + g - 1), the 8 weight rows in the 8 lanes. A block's exact integer dot per
 * lane, then its scales in fp32 exactly as the int16 panels (panel_avx2.h,
 * panel_products.h) take them, y = fma(sum * dx, dw, y), then Q4_1's min term
 * y = fma(mw, dx * sum(qx), y), Q4_0's nibbles centred: a row's result has the same bits
 * here (1-16 rows of x) as in the panels (5 or more), so a decode stream's tokens do not
 * depend on how many streams share its step, nor a prompt's on the prefix cache's split. */
static inline __attribute__((always_inline)) void cols_dot_qx(
    int type, const uint8_t *const rows[8], int nb, int bb, const tq_xq_t *xq, int t0, int g,
    __m256 *out) {
    __m256 acc[TQ_GROUP];
    for (int t = 0; t < g; t++) acc[t] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        __m256i lo[8], hi[8];
        uint16_t hd[8], hm[8];
        for (int c = 0; c < 8; c++) {
            const uint8_t *blk = rows[c] + (size_t)b * bb;
            tq_prefetch_ahead(blk, 1);
            block_i16_avx2(type, blk, &lo[c], &hi[c]);
            memcpy(&hd[c], blk, 2);
            memcpy(&hm[c], blk + 2, 2);
        }
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)hd));
        const __m256 mw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)hm));
        for (int t = 0; t < g; t++) {
            const int16_t *xp = xq->q + (size_t)(t0 + t) * xq->kp + (size_t)b * 32;
            const float *ds = xq->ds + ((size_t)(t0 + t) * xq->nbp + b) * 2;
            const __m256i x0 = _mm256_loadu_si256((const __m256i *)xp);
            const __m256i x1 = _mm256_loadu_si256((const __m256i *)(xp + 16));
            __m256i p[8];
            for (int c = 0; c < 8; c++)
                p[c] = _mm256_add_epi32(_mm256_madd_epi16(lo[c], x0), _mm256_madd_epi16(hi[c], x1));
            const __m256 sum = _mm256_cvtepi32_ps(hsum8x8(p));
            acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(sum, _mm256_set1_ps(ds[0])), dw, acc[t]);
            if (type == TQ_Q4_1) acc[t] = _mm256_fmadd_ps(mw, _mm256_set1_ps(ds[1]), acc[t]);
        }
    }
    for (int t = 0; t < g; t++) out[t] = acc[t];
}

/* y = x W^T for a Q4_0 / Q4_1 / Q8_0 weight, m <= TQ_MAX_ROWS, x quantized as above: 8
 * output columns at a time (a short last group repeats its last column). */
static int gemv_cols_qx(int type, const uint8_t *w, size_t row_bytes, int n_out, int k,
                        const float *x, int m, float *y, int ldy) {
    tq_xq_t xq;
    if (quantize_x(x, m, k, &xq) != 0) return -2;
    const int nb = k / 32, bb = tq_block_bytes(type), groups = (n_out + 7) / 8;
#pragma omp parallel for schedule(static)
    for (int gi = 0; gi < groups; gi++) {
        const int n0 = gi * 8, nc = n_out - n0 < 8 ? n_out - n0 : 8;
        const uint8_t *rows[8];
        for (int c = 0; c < 8; c++) rows[c] = w + (size_t)(c < nc ? n0 + c : n_out - 1) * row_bytes;
        for (int t0 = 0; t0 < m; t0 += TQ_GROUP) {
            const int g = m - t0 < TQ_GROUP ? m - t0 : TQ_GROUP;
            __m256 out[TQ_GROUP];
            switch (g) { /* one copy of the loop per group size, its accumulators in registers */
            case 1: cols_dot_qx(type, rows, nb, bb, &xq, t0, 1, out); break;
            case 2: cols_dot_qx(type, rows, nb, bb, &xq, t0, 2, out); break;
            case 3: cols_dot_qx(type, rows, nb, bb, &xq, t0, 3, out); break;
            default: cols_dot_qx(type, rows, nb, bb, &xq, t0, 4, out); break;
            }
            for (int t = 0; t < g; t++) {
                float lanes[8];
                _mm256_storeu_ps(lanes, out[t]);
                memcpy(y + (size_t)(t0 + t) * ldy + n0, lanes, sizeof(float) * nc);
            }
        }
    }
    free(xq.q);
    return 0;
}
#endif
#endif
