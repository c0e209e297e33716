/* Part of kernels.c (one translation unit; included there, never compiled alone).
 * The greedy pick over the logits. */

/* out[r] = the index of row r's largest value, the first one where several are equal; a
 * NaN counts as larger than any number (torch.argmax's contract, which on these hosts
 * takes ~8 ms for 4-32 rows of a 49,152-token vocabulary: a reduction it does not
 * vectorize across a row; here ~0.1 ms). A vector loop for AVX-512 and one for AVX2 (the
 * scalar loop alone took 13x the AVX-512 build's time). */
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
#elif defined(__AVX2__)
        /* 32 values a pass in 4 maxima; a NaN anywhere is noted (one unordered compare per
         * two vectors) and looked for after the loop, not tested each pass */
        __m256 m0 = _mm256_set1_ps(-INFINITY), m1 = m0, m2 = m0, m3 = m0;
        __m256 bad = _mm256_setzero_ps();
        for (; i + 32 <= cols; i += 32) {
            const __m256 a = _mm256_loadu_ps(row + i), b = _mm256_loadu_ps(row + i + 8);
            const __m256 c = _mm256_loadu_ps(row + i + 16), d = _mm256_loadu_ps(row + i + 24);
            bad = _mm256_or_ps(bad, _mm256_or_ps(_mm256_cmp_ps(a, b, _CMP_UNORD_Q),
                                                 _mm256_cmp_ps(c, d, _CMP_UNORD_Q)));
            m0 = _mm256_max_ps(m0, a);
            m1 = _mm256_max_ps(m1, b);
            m2 = _mm256_max_ps(m2, c);
            m3 = _mm256_max_ps(m3, d);
        }
        nan = _mm256_movemask_ps(bad) != 0;
        const __m256 vmax = _mm256_max_ps(_mm256_max_ps(m0, m1), _mm256_max_ps(m2, m3));
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_movehdup_ps(h));
        best = _mm_cvtss_f32(h);
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
#elif defined(__AVX2__)
            const __m256 vb = _mm256_set1_ps(best);
            for (; at + 8 <= cols; at += 8) {
                const int eq = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + at), vb, _CMP_EQ_OQ));
                if (eq) { at += __builtin_ctz((unsigned)eq); break; }
            }
#endif
            while (at < cols && row[at] != best) at++;
        }
        out[r] = at;
    }
    return 0;
}
