/* Products with weights kept in GGUF's block formats (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K).
 *
 * A weight is [n rows][row_bytes]: each row is its blocks, as stored in the file. Nothing
 * is dequantized ahead of time: `tq_gemv` dequantizes one block at a time into a buffer on
 * the stack and takes its dot products with every row of x; `tq_dequant_rows` writes fp32
 * rows for the wide products (a prefill), which the caller feeds to a GEMM a slice at a
 * time, and for embedding lookups. Values are computed in fp32 as GGUF's reference
 * dequantizers define them (gguf-py's `gguf.quants`), so results differ from a product
 * with the dequantized fp32 weight only by summation order.
 *
 * Compiled at start-up for the host's own instruction set (-march=native, see native.py);
 * parallel over output rows with the OpenMP runtime torch itself uses, so the two share
 * one pool of threads.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <math.h>
#include <stdlib.h>
#if defined(__AVX2__) || defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

enum { TQ_Q4_0 = 2, TQ_Q4_1 = 3, TQ_Q8_0 = 8, TQ_Q4_K = 12, TQ_Q5_K = 13, TQ_Q6_K = 14 };

static inline float h2f(const uint8_t *p) {
    uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
#if defined(__F16C__)
    return _cvtsh_ss(h);
#endif
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal: normalize */
            int e = -1;
            do { man <<= 1; e++; } while (!(man & 0x400));
            bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ff) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* Bits of x in the Q4_0 / Q4_1 / Q8_0 products of this build: 16 (quantized per block,
 * see the 16-bit activation products below) or 32 (fp32, the generic build). */
int tq_activation_bits(void);

int tq_block_size(int type) {
    return (type == TQ_Q4_K || type == TQ_Q5_K || type == TQ_Q6_K) ? 256 : 32;
}

int tq_block_bytes(int type) {
    switch (type) {
    case TQ_Q4_0: return 18;
    case TQ_Q4_1: return 20;
    case TQ_Q8_0: return 34;
    case TQ_Q4_K: return 144;
    case TQ_Q5_K: return 176;
    case TQ_Q6_K: return 210;
    default: return 0;
    }
}

static inline void scale_min_k4(int j, const uint8_t *q, float *sc, float *m) {
    if (j < 4) {
        *sc = (float)(q[j] & 63);
        *m = (float)(q[j + 4] & 63);
    } else {
        *sc = (float)((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
        *m = (float)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
    }
}

/* One block -> tq_block_size(type) fp32 values. */
static inline void dequant_block(int type, const uint8_t *b, float *restrict y) {
    switch (type) {
    case TQ_Q4_0: {
        const float d = h2f(b);
        const uint8_t *qs = b + 2;
        for (int i = 0; i < 16; i++) {
            y[i] = (float)((qs[i] & 0xF) - 8) * d;
            y[i + 16] = (float)((qs[i] >> 4) - 8) * d;
        }
        break;
    }
    case TQ_Q4_1: {
        const float d = h2f(b), m = h2f(b + 2);
        const uint8_t *qs = b + 4;
        for (int i = 0; i < 16; i++) {
            y[i] = (float)(qs[i] & 0xF) * d + m;
            y[i + 16] = (float)(qs[i] >> 4) * d + m;
        }
        break;
    }
    case TQ_Q8_0: {
        const float d = h2f(b);
        const int8_t *qs = (const int8_t *)(b + 2);
        for (int i = 0; i < 32; i++) y[i] = (float)qs[i] * d;
        break;
    }
    case TQ_Q4_K: {
        const float d = h2f(b), dmin = h2f(b + 2);
        const uint8_t *scales = b + 4, *q = b + 16;
        for (int j = 0; j < 4; j++, q += 32, y += 64) {
            float sc1, m1, sc2, m2;
            scale_min_k4(2 * j, scales, &sc1, &m1);
            scale_min_k4(2 * j + 1, scales, &sc2, &m2);
            const float d1 = d * sc1, mm1 = dmin * m1, d2 = d * sc2, mm2 = dmin * m2;
            for (int l = 0; l < 32; l++) {
                y[l] = d1 * (float)(q[l] & 0xF) - mm1;
                y[l + 32] = d2 * (float)(q[l] >> 4) - mm2;
            }
        }
        break;
    }
    case TQ_Q5_K: {
        const float d = h2f(b), dmin = h2f(b + 2);
        const uint8_t *scales = b + 4, *qh = b + 16, *ql = b + 48;
        for (int j = 0; j < 4; j++, ql += 32, y += 64) {
            float sc1, m1, sc2, m2;
            scale_min_k4(2 * j, scales, &sc1, &m1);
            scale_min_k4(2 * j + 1, scales, &sc2, &m2);
            const float d1 = d * sc1, mm1 = dmin * m1, d2 = d * sc2, mm2 = dmin * m2;
            const int s1 = 2 * j, s2 = 2 * j + 1;
            for (int l = 0; l < 32; l++) {
                y[l] = d1 * (float)((ql[l] & 0xF) + (((qh[l] >> s1) & 1) << 4)) - mm1;
                y[l + 32] = d2 * (float)((ql[l] >> 4) + (((qh[l] >> s2) & 1) << 4)) - mm2;
            }
        }
        break;
    }
    case TQ_Q6_K: {
        const uint8_t *ql = b, *qh = b + 128;
        const int8_t *sc = (const int8_t *)(b + 192);
        const float d = h2f(b + 208);
        for (int n = 0; n < 2; n++, ql += 64, qh += 32, sc += 8, y += 128) {
            for (int l = 0; l < 32; l++) {
                const int is = l / 16;
                const int q1 = (int)((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
                const int q2 = (int)((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
                const int q3 = (int)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                const int q4 = (int)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                y[l] = d * (float)sc[is + 0] * (float)q1;
                y[l + 32] = d * (float)sc[is + 2] * (float)q2;
                y[l + 64] = d * (float)sc[is + 4] * (float)q3;
                y[l + 96] = d * (float)sc[is + 6] * (float)q4;
            }
        }
        break;
    }
    }
}

/* Vectors of L floats for the host's instruction set (AVX-512, AVX2, or plain C). */
#if defined(__AVX512F__)
#define L 16
typedef __m512 vf;
static inline vf v_load(const float *p) { return _mm512_loadu_ps(p); }
static inline vf v_set1(float f) { return _mm512_set1_ps(f); }
static inline void v_store(float *p, vf v) { _mm512_storeu_ps(p, v); }
static inline vf v_zero(void) { return _mm512_setzero_ps(); }
static inline vf v_add(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf v_fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline float v_sum(vf a) { return _mm512_reduce_add_ps(a); }
/* 16 bytes -> 16 floats (unsigned / signed) in 16 / L vectors. */
static inline void u8_to_f(__m128i b, vf *out) { out[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b)); }
static inline void i8_to_f(__m128i b, vf *out) { out[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)); }
#elif defined(__AVX2__) && defined(__FMA__)
#define L 8
typedef __m256 vf;
static inline vf v_load(const float *p) { return _mm256_loadu_ps(p); }
static inline vf v_set1(float f) { return _mm256_set1_ps(f); }
static inline void v_store(float *p, vf v) { _mm256_storeu_ps(p, v); }
static inline vf v_zero(void) { return _mm256_setzero_ps(); }
static inline vf v_add(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf v_fma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline float v_sum(vf a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
static inline void u8_to_f(__m128i b, vf *out) {
    out[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b));
    out[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(b, 8)));
}
static inline void i8_to_f(__m128i b, vf *out) {
    out[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
    out[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
}
#endif

#define TQ_MAX_ROWS 16
#define TQ_GROUP 4 /* rows of x sharing one pass over a weight row */

#ifdef L
#define VN (32 / L) /* vectors in a 32-value block */
/* A Q4_0, Q4_1 or Q8_0 block -> 32 dequantized floats in VN vectors. */
static inline void unpack32(int type, const uint8_t *b, vf *w) {
    const float d = h2f(b);
    if (type == TQ_Q8_0) {
        i8_to_f(_mm_loadu_si128((const __m128i *)(b + 2)), w);
        i8_to_f(_mm_loadu_si128((const __m128i *)(b + 18)), w + VN / 2);
        const vf vd = v_set1(d);
        for (int j = 0; j < VN; j++) w[j] = w[j] * vd;
        return;
    }
    const __m128i q = _mm_loadu_si128((const __m128i *)(b + (type == TQ_Q4_1 ? 4 : 2)));
    const __m128i mask = _mm_set1_epi8(0x0F);
    u8_to_f(_mm_and_si128(q, mask), w);
    u8_to_f(_mm_and_si128(_mm_srli_epi16(q, 4), mask), w + VN / 2);
    const vf vd = v_set1(d), vm = v_set1(type == TQ_Q4_1 ? h2f(b + 2) : -8.0f * d);
    for (int j = 0; j < VN; j++) w[j] = v_fma(w[j], vd, vm);
}
#endif


static inline int small_block(int type) { return type == TQ_Q4_0 || type == TQ_Q4_1 || type == TQ_Q8_0; }

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
 * in any batch. */
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

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define TQ_QX 1

/* x rows quantized: `q` [m][kp] int16 (kp = k rounded up to 64), each block's scale d
 * and the block sum of its quantized values, s = d * sum(q) (not of x itself:
 * the min's term then carries x's rounding as the nibbles' term does, and the two cancel
 * as they do in fp32); nbp = kp / 32, padding blocks zero. */
typedef struct {
    int16_t *q;
    float *ds; /* [m][nbp][2]: d, s of each block side by side (one 8-byte load) */
    int kp, nbp;
} tq_xq_t;

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
        }
    }
    return 0;
}

/* out[t] = row . x_t for g <= TQ_GROUP rows of quantized x (rows t0 .. t0 + g - 1): a
 * block at a time, its 32 weights as two 256-bit vectors of 16 int16. The block's two
 * fp16 scales convert in one instruction and multiply x's (d, s) pair in one: lane 0 is
 * the scale of the integer dot, lane 1 the min's term, summed in a vector. (On AVX-512
 * too: a loop taking two blocks per 512-bit register, their scales gathered, ran 30%
 * slower on the AMD EPYC host, whose 512-bit operations take two 256-bit slots.) */
static inline __attribute__((always_inline)) void rows_dot_qx(
    int type, const uint8_t *row, int nb, int bb, const tq_xq_t *xq, int t0, int g, float *out) {
    __m256 acc[TQ_GROUP];
    __m128 accm[TQ_GROUP];
    for (int t = 0; t < g; t++) {
        acc[t] = _mm256_setzero_ps();
        accm[t] = _mm_setzero_ps();
    }
    /* (d, m) from the block's first 4 bytes; Q4_0's "min" is -8 d, Q8_0 has none */
    const __m128 mul = type == TQ_Q4_0 ? _mm_setr_ps(1.0f, -8.0f, 0.0f, 0.0f)
                                       : _mm_setr_ps(1.0f, type == TQ_Q4_1 ? 1.0f : 0.0f, 0.0f, 0.0f);
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = row + (size_t)b * bb;
        int32_t head;
        memcpy(&head, blk, 4);
        __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128(head));
        if (type != TQ_Q4_1) dm = _mm_shuffle_ps(dm, dm, 0); /* (d, d): quants follow d */
        dm = _mm_mul_ps(dm, mul);
        __m256i lo, hi;
        if (type == TQ_Q8_0) {
            lo = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 2)));
            hi = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 18)));
        } else {
            const __m256i bytes = _mm256_cvtepu8_epi16(
                _mm_loadu_si128((const __m128i *)(blk + (type == TQ_Q4_1 ? 4 : 2))));
            lo = _mm256_and_si256(bytes, _mm256_set1_epi16(0x0F));
            hi = _mm256_srli_epi16(bytes, 4);
        }
        for (int t = 0; t < g; t++) {
            const float *ds = xq->ds + ((size_t)(t0 + t) * xq->nbp + b) * 2;
            const int16_t *xp = xq->q + (size_t)(t0 + t) * xq->kp + (size_t)b * 32;
            const __m256i p = _mm256_add_epi32(
                _mm256_madd_epi16(lo, _mm256_loadu_si256((const __m256i *)xp)),
                _mm256_madd_epi16(hi, _mm256_loadu_si256((const __m256i *)(xp + 16))));
            const __m128 sm = _mm_mul_ps(dm, _mm_castpd_ps(_mm_load_sd((const double *)ds)));
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_broadcastss_ps(sm), acc[t]);
            accm[t] = _mm_add_ps(accm[t], sm);
        }
    }
    for (int t = 0; t < g; t++) {
        __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc[t]), _mm256_extractf128_ps(acc[t], 1));
        h = _mm_add_ps(h, _mm_movehl_ps(h, h));
        h = _mm_add_ss(h, _mm_movehdup_ps(h));
        out[t] = _mm_cvtss_f32(h) + _mm_cvtss_f32(_mm_shuffle_ps(accm[t], accm[t], 1));
    }
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
#endif

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
 * unchunked one). Against tq_gemv's products (up to 4 rows) it differs by fp32 summation
 * order only: both take x rounded to 16 bits a block and exact integer block sums. */
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
                const uint8_t *blk = w + (size_t)n * row_bytes + (size_t)b * bb;
                r[c] = block_i16(type, blk);
                dw[b * PN + half * 16 + c] = h2f(blk);
                mw[b * PN + half * 16 + c] = type == TQ_Q4_1 ? h2f(blk + 2) : 0.0f;
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
                if (type == TQ_Q4_1) panel_tile(TQ_Q4_1, panel, dw, mw, nb, &xq, t0, m, out);
                else panel_tile(TQ_Q8_0, panel, dw, mw, nb, &xq, t0, m, out); /* Q4_0: no min term either */
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

/* y[t, n] = sum_k x[t, k] * W[n, k] for t < m (m <= TQ_MAX_ROWS), n < n_out; x is [m][k],
 * y is [m][ldy] (columns n_out written). k is a multiple of the block size. */
int tq_gemv(int type, const uint8_t *w, size_t row_bytes, int n_out, int k, const float *x,
            int m, float *y, int ldy) {
    const int bs = tq_block_size(type), bb = tq_block_bytes(type), nb = k / bs;
    if (bb == 0 || k % bs != 0 || m < 1 || m > TQ_MAX_ROWS) return -1;
#ifdef TQ_QX
    if (small_block(type)) return gemm_qx(type, w, row_bytes, n_out, k, x, m, y, ldy);
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
    for (int b = 0; b < nb; b++) dequant_block(type, row + (size_t)b * bb, out + (size_t)b * bs);
}

#define TQ_NR 4 /* weight rows a tile */
#define TQ_MR 4 /* rows of x a tile */

/* y = x W^T for any m (meant for a decode batch: 5 to a few dozen rows). Each thread
 * dequantizes TQ_NR weight rows at a time into a buffer that stays in cache, then
 * multiplies them with every row of x, TQ_MR x TQ_NR dot products side by side. */
int tq_gemm(int type, const uint8_t *w, size_t row_bytes, int n_out, int k, const float *x,
            int m, float *y, int ldy) {
    const int bs = tq_block_size(type);
    if (tq_block_bytes(type) == 0 || k % bs != 0 || m < 1) return -1;
    float *rounded = NULL;
#ifdef TQ_PANEL
    if (small_block(type)) return gemm_panel(type, w, row_bytes, n_out, k, x, m, y, ldy);
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

/* RMSNorm of each of `rows` rows of x [rows][cols]: out = x / sqrt(mean(x^2) + eps) * w.
 * With `delta` (not NULL), x += delta first (the residual add), written back to x. */
int tq_rms_norm(float *x, const float *delta, const float *w, float eps, int rows, int cols,
                float *out) {
#pragma omp parallel for schedule(static) if (rows > 8)
    for (int r = 0; r < rows; r++) {
        float *xr = x + (size_t)r * cols, *o = out + (size_t)r * cols;
        float ss = 0.0f;
        if (delta) {
            const float *dr = delta + (size_t)r * cols;
            for (int i = 0; i < cols; i++) {
                const float v = xr[i] + dr[i];
                xr[i] = v;
                ss += v * v;
            }
        } else {
            for (int i = 0; i < cols; i++) ss += xr[i] * xr[i];
        }
        const float scale = 1.0f / sqrtf(ss / (float)cols + eps);
        for (int i = 0; i < cols; i++) o[i] = xr[i] * scale * w[i];
    }
    return 0;
}

/* ---- decode attention over the decode mirror ------------------------------------------ */

/* exp(x) for x <= 0 (scores minus their max), branch-free so loops vectorize: 2^n * p(r),
 * r = x - n ln2, |r| <= ln2 / 2; relative error ~2e-7. */
static inline float exp_nonpos(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float n = __builtin_roundf(x * 1.44269504f);
    const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return p * scale;
}

/* One row of K or V (D values of type kv_type: 0 fp32, 1 bf16, 2 fp16) -> fp32. */
static inline void kv_row(const void *base, int64_t offset, int kv_type, int d, float *out) {
    if (kv_type == 0) {
        memcpy(out, (const float *)base + offset, (size_t)d * 4);
    } else if (kv_type == 1) {
        const uint16_t *src = (const uint16_t *)base + offset;
        for (int i = 0; i < d; i++) {
            const uint32_t u = (uint32_t)src[i] << 16;
            memcpy(out + i, &u, 4);
        }
    } else {
        const _Float16 *src = (const _Float16 *)base + offset;
        for (int i = 0; i < d; i++) out[i] = (float)src[i];
    }
}

#define TQ_ATTN_CHUNK 256 /* context tokens per work item */
#define TQ_MAX_GROUP 16

/* out[b, h, :] = softmax(q[b, h] . K[slot_b, h / G, t] * scale over t < lens[b]) . V[...]
 * for B decode rows, Hq query heads sharing Hk KV heads (G = Hq / Hk). K and V are the
 * layer's mirror: element (slot, kv head, t, i) at slot * s_slot + head * s_head + t * D + i.
 * Work items are (row, KV head, chunk of context), each a partial softmax; they are merged
 * per row and head at the end (no result depends on the thread count). */
static int decode_attention(const float *q, int64_t ldq, const void *k, const void *v,
                            int kv_type, int64_t s_slot, int64_t s_head, const int64_t *slots,
                            const int32_t *lens, int B, int Hq, int Hk, int D, float scale,
                            float *out) {
    if (Hk < 1 || Hq % Hk || Hq / Hk > TQ_MAX_GROUP || D > 512 || B < 1) return -1;
    const int G = Hq / Hk;
    int max_len = 0;
    for (int b = 0; b < B; b++) max_len = lens[b] > max_len ? lens[b] : max_len;
    const int nch = (max_len + TQ_ATTN_CHUNK - 1) / TQ_ATTN_CHUNK;
    const int items = B * Hk * nch;
    float *pm = malloc(sizeof(float) * (size_t)items * G * (2 + D));
    if (!pm) return -2;
    float *pl = pm + (size_t)items * G, *po = pl + (size_t)items * G;
#pragma omp parallel for schedule(dynamic, 1)
    for (int it = 0; it < items; it++) {
        const int b = it / (Hk * nch), h = (it / nch) % Hk, c = it % nch;
        const int t0 = c * TQ_ATTN_CHUNK, t1 = lens[b] < t0 + TQ_ATTN_CHUNK ? lens[b] : t0 + TQ_ATTN_CHUNK;
        float *m = pm + (size_t)it * G, *l = pl + (size_t)it * G, *o = po + (size_t)it * G * D;
        if (t0 >= t1) {
            for (int g = 0; g < G; g++) { m[g] = -3.0e38f; l[g] = 0.0f; }
            memset(o, 0, sizeof(float) * (size_t)G * D);
            continue;
        }
        const int64_t base = slots[b] * s_slot + h * s_head;
        const float *qh = q + (size_t)b * ldq + (size_t)h * G * D;
        float s[TQ_MAX_GROUP][TQ_ATTN_CHUNK];
        float row[512];
        for (int t = t0; t < t1; t++) {
            kv_row(k, base + (int64_t)t * D, kv_type, D, row);
            for (int g = 0; g < G; g++) {
                const float *qg = qh + (size_t)g * D;
                float acc = 0.0f;
                for (int i = 0; i < D; i++) acc += qg[i] * row[i];
                s[g][t - t0] = acc * scale;
            }
        }
        const int n = t1 - t0;
        for (int g = 0; g < G; g++) {
            float mx = s[g][0];
            for (int t = 1; t < n; t++) mx = s[g][t] > mx ? s[g][t] : mx;
            float sum = 0.0f;
            for (int t = 0; t < n; t++) {
                const float e = exp_nonpos(s[g][t] - mx);
                s[g][t] = e;
                sum += e;
            }
            m[g] = mx;
            l[g] = sum;
        }
        memset(o, 0, sizeof(float) * (size_t)G * D);
        for (int t = t0; t < t1; t++) {
            kv_row(v, base + (int64_t)t * D, kv_type, D, row);
            for (int g = 0; g < G; g++) {
                const float p = s[g][t - t0];
                float *og = o + (size_t)g * D;
                for (int i = 0; i < D; i++) og[i] += p * row[i];
            }
        }
    }
#pragma omp parallel for schedule(static) if (B * Hq > 8)
    for (int bh = 0; bh < B * Hq; bh++) {
        const int b = bh / Hq, hq = bh % Hq, h = hq / G, g = hq % G;
        const size_t first = ((size_t)b * Hk + h) * nch;
        float mx = -3.0e38f;
        for (int c = 0; c < nch; c++) {
            const float mc = pm[(first + c) * G + g];
            mx = mc > mx ? mc : mx;
        }
        float *dst = out + (size_t)bh * D, total = 0.0f;
        for (int i = 0; i < D; i++) dst[i] = 0.0f;
        for (int c = 0; c < nch; c++) {
            const size_t at = (first + c) * G + g;
            if (pl[at] == 0.0f) continue;
            const float w = exp_nonpos(pm[at] - mx);
            total += w * pl[at];
            const float *oc = po + at * D;
            for (int i = 0; i < D; i++) dst[i] += w * oc[i];
        }
        const float inv = total > 0.0f ? 1.0f / total : 0.0f;
        for (int i = 0; i < D; i++) dst[i] *= inv;
    }
    free(pm);
    return 0;
}

/* q [B][Hq][D] dense: see decode_attention. */
int tq_decode_attention(const float *q, const void *k, const void *v, int kv_type,
                        int64_t s_slot, int64_t s_head, const int64_t *slots,
                        const int32_t *lens, int B, int Hq, int Hk, int D, float scale,
                        float *out) {
    return decode_attention(q, (int64_t)Hq * D, k, v, kv_type, s_slot, s_head, slots, lens, B,
                            Hq, Hk, D, scale, out);
}

/* ---- element-wise parts of a layer ------------------------------------------------------ */

/* Rotate-half RoPE of `heads` heads of width d for T tokens: x row t starts at x + t * ldx
 * (heads contiguous in it), cos/sin are [T][d]; out is [T][heads][d]. */
int tq_rope(const float *x, int64_t ldx, int heads, int d, const float *cos_t,
            const float *sin_t, int T, float *out) {
    const int half = d / 2;
#pragma omp parallel for schedule(static) if (T > 16)
    for (int t = 0; t < T; t++) {
        const float *c = cos_t + (size_t)t * d, *s = sin_t + (size_t)t * d;
        for (int h = 0; h < heads; h++) {
            const float *xi = x + (size_t)t * ldx + (size_t)h * d;
            float *o = out + ((size_t)t * heads + h) * d;
            for (int i = 0; i < half; i++) {
                o[i] = xi[i] * c[i] + (-xi[i + half]) * s[i];
                o[i + half] = xi[i + half] * c[i + half] + xi[i] * s[i + half];
            }
        }
    }
    return 0;
}

/* SwiGLU: out[t][i] = silu(gu[t][i]) * gu[t][f + i], gu = [T][2f] (gate | up). */
int tq_swiglu(const float *gu, int f, int T, float *out) {
#pragma omp parallel for schedule(static) if (T > 16)
    for (int t = 0; t < T; t++) {
        const float *g = gu + (size_t)t * 2 * f, *u = g + f;
        float *o = out + (size_t)t * f;
        for (int i = 0; i < f; i++) {
            const float e = exp_nonpos(g[i] > 0.0f ? -g[i] : g[i]); /* exp(-|g|) */
            const float sig = g[i] > 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);
            o[i] = g[i] * sig * u[i];
        }
    }
    return 0;
}

/* ---- KV writes ---------------------------------------------------------------------------- */

/* Copies n x heads rows of d fp32 values into a K/V buffer of type dst_type (0 fp32, 1 bf16
 * by rounding to nearest even, 2 fp16): row (i, h) is read at src + r * src_stride + h * d
 * with r = src_rows[i] (or i when src_rows is NULL) and written at dst + dst_index[i * heads
 * + h] * d. The paged cache and the decode mirror both take the step's new K/V this way. */
int tq_scatter_heads(const float *src, int64_t src_stride, int n, int heads, int d,
                     const int64_t *src_rows, const int64_t *dst_index, void *dst, int dst_type) {
    for (int i = 0; i < n; i++) {
        const float *row = src + (src_rows ? src_rows[i] : i) * src_stride;
        for (int h = 0; h < heads; h++) {
            const float *s = row + (size_t)h * d;
            const int64_t at = dst_index[(size_t)i * heads + h] * d;
            if (dst_type == 0) {
                memcpy((float *)dst + at, s, sizeof(float) * (size_t)d);
            } else if (dst_type == 1) {
                uint16_t *o = (uint16_t *)dst + at;
                for (int j = 0; j < d; j++) {
                    uint32_t u;
                    memcpy(&u, s + j, 4);
                    if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x7fffffu)) {
                        o[j] = (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
                    } else {
                        o[j] = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
                    }
                }
            } else {
                _Float16 *o = (_Float16 *)dst + at;
                for (int j = 0; j < d; j++) o[j] = (_Float16)s[j];
            }
        }
    }
    return 0;
}

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

/* out[r] = the index of row r's largest value, the first one where several are equal; a
 * NaN counts as larger than any number (torch.argmax's contract, which on these hosts
 * takes ~8 ms for 4-32 rows of a 49,152-token vocabulary: a reduction it does not
 * vectorize across a row; here ~0.1 ms). */
int tq_argmax_rows(const float *x, int rows, int cols, int64_t ld, int64_t *out) {
    if (rows < 0 || cols < 1) return -1;
#pragma omp parallel for schedule(static) if (rows > 1)
    for (int r = 0; r < rows; r++) {
        const float *row = x + (size_t)r * ld;
        int i = 0, nan = 0;
        float best = row[0];
#if defined(__AVX512F__)
        __m512 vmax = _mm512_set1_ps(-INFINITY);
        for (; i + 16 <= cols; i += 16) {
            const __m512 v = _mm512_loadu_ps(row + i);
            if (_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q)) { nan = 1; break; }
            vmax = _mm512_max_ps(vmax, v);
        }
        best = _mm512_reduce_max_ps(vmax);
#else
        best = -INFINITY;
#endif
        for (; i < cols && !nan; i++) {
            if (row[i] != row[i]) nan = 1;
            else if (row[i] > best) best = row[i];
        }
        int at = 0;
        if (nan) { /* the first NaN */
            while (row[at] == row[at]) at++;
        } else {
            at = 0;
#if defined(__AVX512F__)
            const __m512 vb = _mm512_set1_ps(best);
            for (; at + 16 <= cols; at += 16) {
                const __mmask16 eq = _mm512_cmp_ps_mask(_mm512_loadu_ps(row + at), vb, _CMP_EQ_OQ);
                if (eq) { at += __builtin_ctz(eq); break; }
            }
#endif
            while (at < cols && row[at] != best) at++;
        }
        out[r] = at;
    }
    return 0;
}

/* How this build multiplies a batch of 5 or more rows with a Q4_0 / Q4_1 / Q8_0 weight:
 * 2 int16 panels with VNNI, 1 int16 panels (vpmaddwd), 0 fp32 tiles (x rounded to 16
 * bits) or the dequantized slices of the caller above 128 rows. */
int tq_panel_products(void) {
#if defined(TQ_PANEL) && defined(__AVX512VNNI__)
    return 2;
#elif defined(TQ_PANEL)
    return 1;
#else
    return 0;
#endif
}

int tq_activation_bits(void) {
#ifdef TQ_QX
    return 16;
#else
    return 32;
#endif
}
