/* The quantized kernels' entry points on fixed inputs, and a greedy decode of a tiny random
 * model through them, printed one result a line ("name v1 v2 ...") for
 * tests/engine/model/test_kernels_arm64.py, which builds this file for x86-64 and for ARM64
 * (neon, neon-dotprod, generic; run under qemu-aarch64-static) and compares the outputs.
 *
 * It #includes kernels.c (the include path names the kernels' folder) and is compiled
 * with that build's flags. Inputs come from a 32-bit xorshift and integer bit patterns,
 * so every machine starts from the same numbers. A test, not a second engine: the model
 * is the kernels' own structs (tq_layer_t, tq_step_t) filled by hand for one stream. */
#include "kernels.c"

#include <stdio.h>

static uint32_t rng = 2463534242u;

static uint32_t next_u32(void) {
    rng ^= rng << 13;
    rng ^= rng >> 17;
    rng ^= rng << 5;
    return rng;
}

/* A float in [-1, 1): a multiple of 2^-23, exact on every machine. */
static float uniform(void) { return (float)((int32_t)(next_u32() >> 8) - (1 << 23)) / (float)(1 << 23); }

static float *floats(size_t n, float scale) {
    float *x = malloc(sizeof(float) * n);
    for (size_t i = 0; i < n; i++) x[i] = uniform() * scale;
    return x;
}

/* fp16 bits of a positive number 2^(e - 15) * (1 + mantissa / 1024), e in [e0, e0 + 2]. */
static uint16_t f16_scale(int e0) { return (uint16_t)(((e0 + next_u32() % 3) << 10) | (next_u32() & 0x3FF)); }

static void put16(uint8_t *p, uint16_t v) {
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
}

/* rows x k of random blocks of `type`, with fp16 scales that keep products near 1. */
static uint8_t *random_weight(int type, int rows, int k) {
    const int bb = tq_block_bytes(type), nb = k / tq_block_size(type);
    uint8_t *w = malloc((size_t)rows * nb * bb);
    for (size_t i = 0; i < (size_t)rows * nb * bb; i++) w[i] = (uint8_t)(next_u32() >> 24);
    for (int b = 0; b < rows * nb; b++) {
        uint8_t *blk = w + (size_t)b * bb;
        switch (type) {
        case TQ_Q4_0: case TQ_Q8_0: put16(blk, f16_scale(7)); break;
        case TQ_Q4_1: put16(blk, f16_scale(7)); put16(blk + 2, 0x8000 | f16_scale(10)); break;
        case TQ_Q4_K: case TQ_Q5_K: put16(blk, f16_scale(1)); put16(blk + 2, f16_scale(1)); break;
        case TQ_Q6_K: put16(blk + 208, f16_scale(0)); break;
        }
    }
    return w;
}

static void print_row(const char *name, const float *v, size_t n) {
    printf("%s", name);
    for (size_t i = 0; i < n; i++) printf(" %.9g", v[i]);
    printf("\n");
}

static const int TYPES[] = {TQ_Q4_0, TQ_Q4_1, TQ_Q8_0, TQ_Q4_K, TQ_Q5_K, TQ_Q6_K};

/* tq_gemv (1 and 3 rows), tq_gemm (5 and 7 rows), tq_dequant_rows for every format. */
static void products(void) {
    const int n = 37, k = 512;
    char name[64];
    for (int f = 0; f < 6; f++) {
        const int type = TYPES[f];
        const size_t rb = (size_t)tq_block_bytes(type) * (k / tq_block_size(type));
        uint8_t *w = random_weight(type, n, k);
        float *x = floats((size_t)7 * k, 2.0f), y[7 * 37], rows_out[3 * 512];
        x[5] = 40.0f; /* an outlier, as real activations have */
        for (int m = 1; m <= 3; m += 2) {
            snprintf(name, sizeof(name), "gemv.%d.m%d", type, m);
            if (tq_gemv(type, w, rb, n, k, x, m, y, n) == 0) print_row(name, y, (size_t)m * n);
        }
        for (int m = 5; m <= 7; m += 2) {
            snprintf(name, sizeof(name), "gemm.%d.m%d", type, m);
            if (tq_gemm(type, w, rb, n, k, x, m, y, n) == 0) print_row(name, y, (size_t)m * n);
        }
        const int64_t pick[3] = {36, 0, 17};
        snprintf(name, sizeof(name), "dequant.%d", type);
        if (tq_dequant_rows(type, w, rb, k, pick, 0, 3, rows_out) == 0) print_row(name, rows_out, 3 * 512);
        free(w);
        free(x);
    }
}

/* RMSNorm (with the residual add), RoPE, SwiGLU, argmax, 16-bit rounding of x. */
static void elementwise(void) {
    float *x = floats(3 * 100, 3.0f), *delta = floats(3 * 100, 1.0f), *w = floats(100, 1.0f);
    float out[3 * 100];
    tq_rms_norm(x, delta, w, 1e-5f, 3, 100, out);
    print_row("rms_norm", out, 300);
    print_row("rms_norm.residual", x, 300);
    float *qk = floats(2 * 3 * 16, 2.0f), *cs = floats(2 * 16, 1.0f), *sn = floats(2 * 16, 1.0f);
    float rot[2 * 3 * 16];
    tq_rope(qk, 3 * 16, 3, 16, cs, sn, 2, rot);
    print_row("rope", rot, 96);
    float *gu = floats(2 * 2 * 50, 30.0f), act[2 * 50];
    tq_swiglu(gu, 50, 2, act);
    print_row("swiglu", act, 100);
    float *logits = floats(4 * 300, 5.0f), idx[4];
    logits[1 * 300 + 7] = logits[1 * 300 + 200] = 9.0f; /* a tie: the first wins */
    logits[2 * 300 + 100] = NAN;                         /* a NaN wins */
    int64_t at[4];
    tq_argmax_rows(logits, 4, 300, 300, at);
    for (int r = 0; r < 4; r++) idx[r] = (float)at[r];
    print_row("argmax", idx, 4);
    float r16[2 * 64];
    tq_round_x16(gu, 2, 64, r16);
    print_row("round_x16", r16, 128);
    free(x); free(delta); free(w); free(qk); free(cs); free(sn); free(gu); free(logits);
}

/* Decode attention over a mirror of 3 slots, contexts across the 256-token chunks, for
 * fp32, bf16 and fp16 K/V. */
static void attention(void) {
    enum { B = 3, HQ = 4, HK = 2, D = 32, CAP = 300, SLOTS = 3 };
    const size_t n = (size_t)SLOTS * HK * CAP * D;
    float *k = floats(n, 1.0f), *v = floats(n, 1.0f), *q = floats(B * HQ * D, 2.0f), out[B * HQ * D];
    const int64_t slots[B] = {2, 0, 1}, all[1] = {0};
    const int32_t lens[B] = {1, 300, 256};
    for (int kv_type = 0; kv_type < 3; kv_type++) {
        void *kc = malloc(n * 4), *vc = malloc(n * 4);
        int64_t *dst = malloc(sizeof(int64_t) * (n / D));
        for (size_t i = 0; i < n / D; i++) dst[i] = (int64_t)i;
        tq_scatter_heads(k, 0, 1, (int)(n / D), D, all, dst, kc, kv_type); /* K as kv_type */
        tq_scatter_heads(v, 0, 1, (int)(n / D), D, all, dst, vc, kv_type);
        tq_decode_attention(q, kc, vc, kv_type, (int64_t)HK * CAP * D, (int64_t)CAP * D, slots, lens, B,
                            HQ, HK, D, 0.17f, out);
        char name[32];
        snprintf(name, sizeof(name), "attention.kv%d", kv_type);
        print_row(name, out, B * HQ * D);
        free(kc); free(vc); free(dst);
    }
    free(k); free(v); free(q);
}

/* ---- a greedy decode of a tiny random Llama, one stream, through the C entry points ---- */

enum { V = 512, H = 256, HQ = 4, HK = 2, HD = 64, F = 512, LAYERS = 2, CTX = 32 };

static tq_matrix_t matrix(int type, int rows, int k) {
    const tq_matrix_t m = {type, random_weight(type, rows, k),
                           (int64_t)tq_block_bytes(type) * (k / tq_block_size(type))};
    return m;
}

static void decode(void) {
    tq_layer_t ly[LAYERS];
    for (int l = 0; l < LAYERS; l++) { /* every format in a layer's products */
        ly[l] = (tq_layer_t){.qkv = matrix(TQ_Q4_0, (HQ + 2 * HK) * HD, H), .o = matrix(TQ_Q4_1, H, HQ * HD),
                             .gate_up = matrix(l ? TQ_Q5_K : TQ_Q4_K, 2 * F, H), .down = matrix(TQ_Q6_K, H, F),
                             .eps = 1e-5f, .hidden = H, .hq = HQ, .hk = HK, .d = HD, .inter = F};
        float *attn_norm = floats(H, 0.5f), *ffn_norm = floats(H, 0.5f);
        for (int i = 0; i < H; i++) attn_norm[i] += 1.0f, ffn_norm[i] += 1.0f;
        ly[l].attn_norm = attn_norm;
        ly[l].ffn_norm = ffn_norm;
    }
    const tq_matrix_t embed = matrix(TQ_Q8_0, V, H), output = matrix(TQ_Q8_0, V, H);
    float *out_norm = floats(H, 0.5f);
    for (int i = 0; i < H; i++) out_norm[i] += 1.0f;

    /* bf16 K/V: paged (position p, head h at row p * HK + h) and a one-slot mirror */
    const size_t kv_bytes = (size_t)CTX * HK * HD * 2;
    tq_step_t S = {.k_pages = calloc(LAYERS, kv_bytes), .v_pages = calloc(LAYERS, kv_bytes),
                   .layer_stride = (int64_t)kv_bytes, .kv_type = 1,
                   .mirror_k = calloc(LAYERS, kv_bytes), .mirror_v = calloc(LAYERS, kv_bytes),
                   .mirror_layer_stride = (int64_t)kv_bytes, .n_mirror = 1,
                   .slot_stride = (int64_t)HK * CTX * HD, .head_stride = (int64_t)CTX * HD,
                   .scale = 1.0f / sqrtf((float)HD)};
    int64_t paged[HK], mirror_dst[HK], zero = 0;
    int32_t len;
    float cos_t[HD], sin_t[HD], x[H], h[H], logits[V];
    float qkv[(HQ + 2 * HK) * HD], qk[(HQ + HK) * HD], attn[HQ * HD], gu[2 * F], act[F], tmp[H];
    S.paged_index = paged, S.mirror_src = &zero, S.mirror_dst = mirror_dst, S.slots = &zero, S.lens = &len;
    S.cos = cos_t, S.sin = sin_t, S.h = h, S.qkv = qkv, S.qk = qk, S.attn = attn, S.gu = gu, S.act = act,
    S.tmp = tmp;

    const int prompt[4] = {3, 100, 200, 300}; /* top-2 margins >= 0.3 (x16 vs fp32: ~0.01) */
    float tokens[CTX], margins[CTX];
    int64_t token = prompt[0];
    int made = 0;
    for (int pos = 0; pos < 20; pos++) {
        for (int i = 0; i < HD / 2; i++) { /* rotate-half RoPE tables, theta 10000 */
            const double angle = pos * pow(10000.0, -2.0 * i / HD);
            cos_t[i] = cos_t[i + HD / 2] = (float)cos(angle);
            sin_t[i] = sin_t[i + HD / 2] = (float)sin(angle);
        }
        for (int hh = 0; hh < HK; hh++) {
            paged[hh] = (int64_t)pos * HK + hh;
            mirror_dst[hh] = (int64_t)hh * CTX + pos;
        }
        len = pos + 1;
        tq_dequant_rows(embed.type, embed.w, (size_t)embed.row_bytes, H, &token, 0, 1, x);
        for (int l = 0; l < LAYERS; l++) tq_decode_layer(&ly[l], &S, l, x, 1);
        tq_rms_norm(x, NULL, out_norm, 1e-5f, 1, H, h);
        tq_gemv(output.type, output.w, (size_t)output.row_bytes, V, H, h, 1, logits, V);
        int64_t best;
        tq_argmax_rows(logits, 1, V, V, &best);
        if (pos + 1 < 4) {
            token = prompt[pos + 1];
            continue;
        }
        float second = -INFINITY;
        for (int i = 0; i < V; i++) second = i != best && logits[i] > second ? logits[i] : second;
        margins[made] = logits[best] - second;
        tokens[made++] = (float)best;
        token = best;
        if (pos == 19) print_row("logits.last", logits, V);
    }
    print_row("tokens", tokens, (size_t)made);
    print_row("margins", margins, (size_t)made);
}

int main(void) {
    products();
    elementwise();
    attention();
    decode();
    return 0;
}
