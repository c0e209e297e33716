/* Part of kernels.c (one translation unit; included there, never compiled alone).
 * GGUF's block formats: the type ids, fp16 scales, a block's size in values and bytes, one
 * block dequantized to fp32. */

enum { TQ_Q4_0 = 2, TQ_Q4_1 = 3, TQ_Q8_0 = 8, TQ_Q4_K = 12, TQ_Q5_K = 13, TQ_Q6_K = 14 };

static inline float h2f(const uint8_t *p) {
    uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
#if defined(__F16C__)
    return _cvtsh_ss(h);
#elif defined(TQ_NEON)
    __fp16 f16;
    memcpy(&f16, &h, 2);
    return (float)f16;
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

/* A decode step reads every weight once, in row order, from memory: a 1B model's 630 MB
 * fit no cache. On the VMs measured (docs/engine.md, "Reading the weights") the hardware
 * prefetcher alone left the one-row products waiting on memory (Q4_K: 7.6 GB/s of a
 * 24 GB/s read bandwidth), so the row loops ask for the bytes TQ_AHEAD past the block
 * they read: the cache lines of [p + TQ_AHEAD, p + TQ_AHEAD + n). A prefetch never faults,
 * past the end of the weight too. */
#ifndef TQ_AHEAD
#define TQ_AHEAD 1536
#endif
static inline void tq_prefetch_ahead(const uint8_t *p, int n) {
    for (int i = 0; i < n; i += 64) __builtin_prefetch(p + TQ_AHEAD + i, 0, 3);
}

/* Bits of x in the products of this build: 16 (quantized per 32 values, see
 * x16_products.h and kquant_products.h) or 32 (fp32, the generic build). */
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

static inline int small_block(int type) { return type == TQ_Q4_0 || type == TQ_Q4_1 || type == TQ_Q8_0; }
static inline int k_block(int type) { return type == TQ_Q4_K || type == TQ_Q5_K || type == TQ_Q6_K; }

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
