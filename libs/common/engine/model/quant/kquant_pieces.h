/* Part of kernels.c (one translation unit; included there, never compiled alone).
 * Needs blocks.h and kquant_products.h (TQ_KX); x86 builds only (AVX2 and up). */

/* ---- the K-quants as 32-value pieces, for the int16 panels (panel_avx2.h, panel_products.h)
 *
 * A 256-value K-quant block is 8 pieces of 32 values, and each piece fits the panels'
 * block form y += dw * (dx * sum(w qx)) + mw * (dx * sum(qx)) with its own scales:
 *   Q4_K, Q5_K: w = q (0..15, 0..31), dw = d sc_s, mw = -dmin m_s (Q4_1's form);
 *   Q6_K:       w = sc (q - 32) (its two int8 scales, one per 16 values, folded into the
 *               integers: |w| <= 4096 fits int16, as in kquant_products.h), dw = d, mw = 0.
 * So a K-quant weight is multiplied in the panels as a Q4_1 / Q8_0 weight of 8 times as
 * many blocks: the panel is built from the pieces, the tiles run unchanged. */
#if defined(TQ_KX) && !defined(TQ_NEON)

/* Piece s (values 32 s .. 32 s + 31) of a K-quant block as int16 in order: `lo` values
 * 0-15, `hi` 16-31. A byte's low bits are taken after 16-bit shifts: the bits a shift
 * brings in from the lane's other byte are masked off. */
static inline void k_piece_i16(int type, const uint8_t *blk, int s, __m256i *lo, __m256i *hi) {
    const __m128i nibble = _mm_set1_epi8(0x0F);
    if (type == TQ_Q6_K) {
        const int half = s >> 2, r = s & 3;
        const uint8_t *ql = blk + 64 * half + 32 * (r & 1), *qh = blk + 128 + 32 * half;
        const int8_t *sc = (const int8_t *)(blk + 192) + 8 * half + 2 * r;
        __m128i a = _mm_loadu_si128((const __m128i *)ql), b = _mm_loadu_si128((const __m128i *)(ql + 16));
        if (r >= 2) {
            a = _mm_srli_epi16(a, 4);
            b = _mm_srli_epi16(b, 4);
        }
        const __m128i two = _mm_set1_epi8(3), shift = _mm_cvtsi32_si128(2 * r);
        const __m128i ha = _mm_and_si128(_mm_srl_epi16(_mm_loadu_si128((const __m128i *)qh), shift), two);
        const __m128i hb = _mm_and_si128(_mm_srl_epi16(_mm_loadu_si128((const __m128i *)(qh + 16)), shift), two);
        a = _mm_or_si128(_mm_and_si128(a, nibble), _mm_slli_epi16(ha, 4));
        b = _mm_or_si128(_mm_and_si128(b, nibble), _mm_slli_epi16(hb, 4));
        const __m256i centre = _mm256_set1_epi16(32);
        *lo = _mm256_mullo_epi16(_mm256_sub_epi16(_mm256_cvtepu8_epi16(a), centre), _mm256_set1_epi16(sc[0]));
        *hi = _mm256_mullo_epi16(_mm256_sub_epi16(_mm256_cvtepu8_epi16(b), centre), _mm256_set1_epi16(sc[1]));
        return;
    }
    const uint8_t *qs = blk + (type == TQ_Q5_K ? 48 : 16) + 32 * (s >> 1);
    __m128i a = _mm_loadu_si128((const __m128i *)qs), b = _mm_loadu_si128((const __m128i *)(qs + 16));
    if (s & 1) {
        a = _mm_srli_epi16(a, 4);
        b = _mm_srli_epi16(b, 4);
    }
    a = _mm_and_si128(a, nibble);
    b = _mm_and_si128(b, nibble);
    if (type == TQ_Q5_K) { /* the fifth bit: bit s of each of qh's 32 bytes */
        const __m128i one = _mm_set1_epi8(1), shift = _mm_cvtsi32_si128(s);
        const __m128i ha = _mm_and_si128(_mm_srl_epi16(_mm_loadu_si128((const __m128i *)(blk + 16)), shift), one);
        const __m128i hb = _mm_and_si128(_mm_srl_epi16(_mm_loadu_si128((const __m128i *)(blk + 32)), shift), one);
        a = _mm_or_si128(a, _mm_slli_epi16(ha, 4));
        b = _mm_or_si128(b, _mm_slli_epi16(hb, 4));
    }
    *lo = _mm256_cvtepu8_epi16(a);
    *hi = _mm256_cvtepu8_epi16(b);
}

/* The scales of piece s: dw and mw as above (Q4_K / Q5_K's 6-bit sc_s, m_s packed in 12
 * bytes as k4_scales reads them). */
static inline void k_piece_scales(int type, const uint8_t *blk, int s, float *dw, float *mw) {
    if (type == TQ_Q6_K) {
        *dw = h2f(blk + 208);
        *mw = 0.0f;
        return;
    }
    const uint8_t *q = blk + 4;
    int sc, m;
    if (s < 4) {
        sc = q[s] & 63;
        m = q[s + 4] & 63;
    } else {
        sc = (q[s + 4] & 0x0F) | ((q[s - 4] >> 6) << 4);
        m = (q[s + 4] >> 4) | ((q[s] >> 6) << 4);
    }
    *dw = h2f(blk) * (float)sc;
    *mw = -(h2f(blk + 2) * (float)m);
}

/* Panel block b (values 32 b .. 32 b + 31) of a K-quant weight row: its int16 weights (two
 * vectors of 16, in order) and scales. */
static inline void k_panel_block(int type, const uint8_t *row, int b, __m256i *lo, __m256i *hi,
                                 float *dw, float *mw) {
    const uint8_t *blk = row + (size_t)(b >> 3) * tq_block_bytes(type);
    k_piece_i16(type, blk, b & 7, lo, hi);
    k_piece_scales(type, blk, b & 7, dw, mw);
}

/* Whether a panel format's blocks carry a min term (Q4_1's form). */
static inline int panel_has_min(int type) {
    return type == TQ_Q4_1 || type == TQ_Q4_K || type == TQ_Q5_K;
}
#endif
