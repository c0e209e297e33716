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
 * Compiled at start-up for the host's instruction set (one of native.py's VARIANTS);
 * parallel over output rows with the OpenMP runtime torch itself uses, so the two share
 * one pool of threads.
 *
 * One translation unit in parts of one concern each, included below in this order (a
 * part uses what the parts before it define, and the compiler sees every static helper
 * beside its callers, as when this was one file):
 *   blocks.h          GGUF's block formats, fp16 scales, one block dequantized
 *   vectors.h         vectors of L floats for the instruction set, a block unpacked to them
 *   x16_products.h    products with x rounded to 16 bits a block (AVX2 and up, NEON)
 *   kquant_neon.h     the K-quants' integer dots for NEON builds (kquant_products.h's)
 *   kquant_products.h the same for the K-quants, Q4_K / Q5_K / Q6_K (AVX2 and up, NEON)
 *   kquant_pieces.h   the K-quants as 32-value pieces, for the int16 panels (x86)
 *   panel_avx2.h      256-bit integer panels for a batch (AVX2 builds)
 *   panel_products.h  512-bit integer panels (AVX-512BW), the batch product over panels
 *   products.h        tq_gemv, tq_gemm, tq_dequant_rows: the entry points of the products
 *   attention.h       decode attention over the decode mirror
 *   layer_parts.h     RMSNorm, RoPE, SwiGLU, the K/V writes
 *   decode_layer.h    one whole decoder layer for a decode step
 *   argmax.h          the index of each row's largest value (greedy sampling)
 * and last, here, what this build chose (tq_panel_products, tq_activation_bits).
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <math.h>
#include <stdlib.h>
#if defined(__AVX2__) || defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif
#if defined(TQ_NEON)
#include <arm_neon.h>
#endif

#include "blocks.h"
#include "vectors.h"
#include "x16_products.h"
#include "kquant_neon.h"
#include "kquant_products.h"
#include "kquant_pieces.h"
#include "panel_avx2.h"
#include "panel_products.h"
#include "products.h"
#include "attention.h"
#include "layer_parts.h"
#include "decode_layer.h"
#include "argmax.h"

/* How this build multiplies a batch of 5 or more rows with a Q4_0 / Q4_1 / Q8_0 weight:
 * 2 int16 panels with VNNI, 1 int16 panels (vpmaddwd), 3 256-bit int16 panels (AVX2),
 * 0 fp32 tiles (x rounded to 16 bits) or the dequantized slices of the caller above 128
 * rows. */
int tq_panel_products(void) {
#if defined(TQ_PANEL_256)
    return 3;
#elif defined(TQ_PANEL) && defined(__AVX512VNNI__)
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
