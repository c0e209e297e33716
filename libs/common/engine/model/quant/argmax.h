/* Part of kernels.c (one translation unit; included there, never compiled alone).
 * The greedy pick over the logits. */

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
