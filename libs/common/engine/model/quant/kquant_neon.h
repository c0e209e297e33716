/* Part of kernels.c (one translation unit; included there, never compiled alone).
 * Needs x16_products.h; in the NEON builds (TQ_NEON) defines what kquant_products.h's
 * gemm_kx calls: rows_dot_k and dequant_k. */
#if defined(TQ_QX) && defined(TQ_NEON)
/* The K-quants' integer dots of kquant_products.h (read its comment first) for ARM64's
 * NEON builds: each 32-value piece's dot exact in integers, then its scales in fp32. A
 * block's weights are unpacked to one int8 each (k_ints: plain C the compiler vectorizes)
 * and dotted 16 at a time with x (dot16: smlal on int16, or sdot on x's two int8 planes
 * in neon-dotprod builds, the same integers). Scales are applied with fmaf and TQ_PIN, so
 * that -fassociative-math cannot regroup them differently per group size: a row's bits
 * do not depend on the rows beside it, and neon and neon-dotprod agree to the bit.
 * Correctness only, under qemu (tests/engine/model/test_kernels_arm64.py): not timed on
 * an ARM64 core. */
#define TQ_PIN(v) __asm__("" : "+w"(v))

/* A K-quant block's 256 integer weights: q (0..31) of Q4_K / Q5_K, whose value in
 * 32-value piece s is d sc_s q - dmin m_s, or q - 32 of Q6_K, whose value in 16-value
 * group h is d sc_h (q - 32); dequant_block's order of values. */
static inline void k_ints(int type, const uint8_t *blk, int8_t *q) {
    if (type == TQ_Q6_K) {
        const uint8_t *ql = blk, *qh = blk + 128;
        for (int n = 0; n < 2; n++, ql += 64, qh += 32, q += 128)
            for (int l = 0; l < 32; l++) {
                q[l] = (int8_t)(((ql[l] & 0xF) | ((qh[l] & 3) << 4)) - 32);
                q[l + 32] = (int8_t)(((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32);
                q[l + 64] = (int8_t)(((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
                q[l + 96] = (int8_t)(((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
            }
        return;
    }
    const uint8_t *qs = blk + (type == TQ_Q5_K ? 48 : 16), *qh = blk + 16;
    for (int j = 0; j < 4; j++, qs += 32, q += 64)
        for (int l = 0; l < 32; l++) {
            const int five = type == TQ_Q5_K;
            q[l] = (int8_t)((qs[l] & 0xF) | (five ? ((qh[l] >> (2 * j)) & 1) << 4 : 0));
            q[l + 32] = (int8_t)((qs[l] >> 4) | (five ? ((qh[l] >> (2 * j + 1)) & 1) << 4 : 0));
        }
}

/* sum(w[i] x[at + i]) for i < 16, x a 32-value block of quantized x (at 0 or 16). */
static inline int32_t dot16(const int8_t *w, const int16_t *xblk, int at) {
    const int8x16_t wv = vld1q_s8(w);
#ifdef __ARM_FEATURE_DOTPROD
    const int8_t *hi = (const int8_t *)xblk + at, *lo = hi + 32; /* split_block's planes */
    const int32x4_t sh = vdotq_s32(vdupq_n_s32(0), wv, vld1q_s8(hi));
    const int32x4_t sl = vdotq_s32(vdupq_n_s32(0), wv, vld1q_s8(lo));
    return vaddvq_s32(vmlaq_n_s32(sl, sh, 256)) + 128 * vaddlvq_s8(wv);
#else
    const int16x8_t w0 = vmovl_s8(vget_low_s8(wv)), w1 = vmovl_high_s8(wv);
    const int16x8_t x0 = vld1q_s16(xblk + at), x1 = vld1q_s16(xblk + at + 8);
    int32x4_t p = vmull_s16(vget_low_s16(w0), vget_low_s16(x0));
    p = vmlal_high_s16(p, w0, x0);
    p = vmlal_s16(p, vget_low_s16(w1), vget_low_s16(x1));
    return vaddvq_s32(vmlal_high_s16(p, w1, x1));
#endif
}

/* out[t] = row . x_t for g <= TQ_GROUP rows of quantized x (t0 .. t0 + g - 1), a Q4_K,
 * Q5_K or Q6_K row of nb blocks; xs: x's scales planar (x_scales_planar). */
static inline __attribute__((always_inline)) void rows_dot_k(
    int type, const uint8_t *row, int nb, const tq_xq_t *xq, const float *xs, int t0, int g, float *out) {
    const int bb = tq_block_bytes(type);
    float acc[TQ_GROUP], accm[TQ_GROUP];
    for (int t = 0; t < g; t++) acc[t] = accm[t] = 0.0f;
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = row + (size_t)b * bb;
        int8_t q[256];
        k_ints(type, blk, q);
        float dsc[8], dmn[8]; /* a piece's d sc and dmin m (Q6_K: d, and no min) */
        for (int s = 0; s < 8; s++) {
            float sc = 1.0f, mn = 0.0f;
            if (type != TQ_Q6_K) scale_min_k4(s, blk + 4, &sc, &mn);
            dsc[s] = h2f(type == TQ_Q6_K ? blk + 208 : blk) * sc;
            dmn[s] = type == TQ_Q6_K ? 0.0f : h2f(blk + 2) * mn;
            TQ_PIN(dsc[s]); /* (d sc) dx, never d (sc dx), whatever the group size */
            TQ_PIN(dmn[s]);
        }
        const int8_t *sc6 = (const int8_t *)(blk + 192);
        for (int s = 0; s < 8; s++)
            for (int t = 0; t < g; t++) {
                const int16_t *xp = xq->q + (size_t)(t0 + t) * xq->kp + (size_t)b * 256 + 32 * s;
                const float *dx = xs + (size_t)(t0 + t) * 2 * xq->nbp + (size_t)b * 8 + s;
                const int32_t lo = dot16(q + 32 * s, xp, 0), hi = dot16(q + 32 * s + 16, xp, 16);
                /* Q6_K: a scale per 16 values; int64, since sc (q - 32) x can pass 2^31 over 32 */
                const int64_t dot = type == TQ_Q6_K ? (int64_t)sc6[2 * s] * lo + (int64_t)sc6[2 * s + 1] * hi
                                                    : (int64_t)lo + hi;
                float scale = dsc[s] * dx[0];
                TQ_PIN(scale);
                acc[t] = fmaf((float)dot, scale, acc[t]);
                accm[t] = fmaf(-dmn[s], dx[xq->nbp], accm[t]);
            }
    }
    for (int t = 0; t < g; t++) out[t] = acc[t] + accm[t];
}

/* One block -> 256 fp32 values: dequant_block's (the wide products' slices, embeddings). */
static inline void dequant_k(int type, const uint8_t *blk, float *y) { dequant_block(type, blk, y); }
#endif
