/* Part of kernels.c (one translation unit; included there, never compiled alone).
 * Vectors of L floats for the host's instruction set, the row counts the products tile by,
 * and a 32-value block unpacked into vectors (needs blocks.h). */

/* Vectors of L floats for the host's instruction set (AVX-512, AVX2, NEON, or plain C). */
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
#elif defined(TQ_NEON)
/* ARM64 Advanced SIMD: the neon and neon-dotprod builds (-DTQ_NEON; every ARM64 CPU has
 * NEON, so the generic build leaves it out by not defining TQ_NEON). */
#define L 4
typedef float32x4_t vf;
static inline vf v_load(const float *p) { return vld1q_f32(p); }
static inline vf v_set1(float f) { return vdupq_n_f32(f); }
static inline void v_store(float *p, vf v) { vst1q_f32(p, v); }
static inline vf v_zero(void) { return vdupq_n_f32(0.0f); }
static inline vf v_add(vf a, vf b) { return vaddq_f32(a, b); }
static inline vf v_fma(vf a, vf b, vf c) { return vfmaq_f32(c, a, b); }
static inline float v_sum(vf a) { return vaddvq_f32(a); }
/* 16 bytes -> 16 floats in 4 vectors (unsigned / signed). */
static inline void u8_to_f(uint8x16_t b, vf *out) {
    const uint16x8_t lo = vmovl_u8(vget_low_u8(b)), hi = vmovl_high_u8(b);
    out[0] = vcvtq_f32_u32(vmovl_u16(vget_low_u16(lo)));
    out[1] = vcvtq_f32_u32(vmovl_high_u16(lo));
    out[2] = vcvtq_f32_u32(vmovl_u16(vget_low_u16(hi)));
    out[3] = vcvtq_f32_u32(vmovl_high_u16(hi));
}
static inline void i8_to_f(int8x16_t b, vf *out) {
    const int16x8_t lo = vmovl_s8(vget_low_s8(b)), hi = vmovl_high_s8(b);
    out[0] = vcvtq_f32_s32(vmovl_s16(vget_low_s16(lo)));
    out[1] = vcvtq_f32_s32(vmovl_high_s16(lo));
    out[2] = vcvtq_f32_s32(vmovl_s16(vget_low_s16(hi)));
    out[3] = vcvtq_f32_s32(vmovl_high_s16(hi));
}
#endif

#define TQ_MAX_ROWS 16
#define TQ_GROUP 4 /* rows of x sharing one pass over a weight row */

#ifdef L
#define VN (32 / L) /* vectors in a 32-value block */
/* A Q4_0, Q4_1 or Q8_0 block -> 32 dequantized floats in VN vectors. */
static inline void unpack32(int type, const uint8_t *b, vf *w) {
    const float d = h2f(b);
#ifdef TQ_NEON
    if (type == TQ_Q8_0) {
        i8_to_f(vld1q_s8((const int8_t *)(b + 2)), w);
        i8_to_f(vld1q_s8((const int8_t *)(b + 18)), w + VN / 2);
        for (int j = 0; j < VN; j++) w[j] = vmulq_n_f32(w[j], d);
        return;
    }
    const uint8x16_t q = vld1q_u8(b + (type == TQ_Q4_1 ? 4 : 2));
    u8_to_f(vandq_u8(q, vdupq_n_u8(0x0F)), w);
    u8_to_f(vshrq_n_u8(q, 4), w + VN / 2);
#else
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
#endif
    const vf vd = v_set1(d), vm = v_set1(type == TQ_Q4_1 ? h2f(b + 2) : -8.0f * d);
    for (int j = 0; j < VN; j++) w[j] = v_fma(w[j], vd, vm);
}
#endif
