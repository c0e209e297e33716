/* Part of kernels.c (one translation unit; included there, never compiled alone).
 * The parts of a layer besides its products and attention: RMSNorm, RoPE, SwiGLU and the
 * K/V writes. */

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
            /* one division, the numerator chosen (1 or e): the bits of the two-sided form,
             * whose both divisions the vectorized loop computed and then blended */
            const float sig = (g[i] > 0.0f ? 1.0f : e) / (1.0f + e);
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
