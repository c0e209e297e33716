/* Part of kernels.c (one translation unit; included there, never compiled alone). */

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

/* One row of K or V (D values of type kv_type: 0 fp32, 1 bf16, 2 fp16) as fp32: an fp32
 * row where it lies (a copy of each was ~6% of a 32-stream decode step), else converted
 * into out. */
static inline const float *kv_row(const void *base, int64_t offset, int kv_type, int d, float *out) {
    if (kv_type == 0) return (const float *)base + offset;
    if (kv_type == 1) {
        const uint16_t *src = (const uint16_t *)base + offset;
        for (int i = 0; i < d; i++) {
            const uint32_t u = (uint32_t)src[i] << 16;
            memcpy(out + i, &u, 4);
        }
    } else {
        const _Float16 *src = (const _Float16 *)base + offset;
        for (int i = 0; i < d; i++) out[i] = (float)src[i];
    }
    return out;
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
        float buf[512];
        for (int t = t0; t < t1; t++) {
            const float *row = kv_row(k, base + (int64_t)t * D, kv_type, D, buf);
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
            const float *restrict row = kv_row(v, base + (int64_t)t * D, kv_type, D, buf);
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
