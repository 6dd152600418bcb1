/* The block GEMM's ymm loop, included twice by quant.c: QYMM(name) names this copy's functions,
 * QYMM_TARGET their target attribute, QYMM_VNNI whether its block dot products use AVX-VNNI's
 * vpdpbusd or AVX2's vpmaddubsw / vpmaddwd (the same exact integer sums: the same bits). */

#if QYMM_VNNI
/* AVX-VNNI (these functions' target attribute; taken where the CPU has it): vpdpbusd multiplies
 * unsigned by signed bytes and adds each lane's four products to an int32 lane, exactly, in one
 * instruction - the same integer sums as the vpmaddubsw / vpmaddwd pairs below, so the same bits.
 * Two accumulators a block, so one row's chain is four deep, not eight. */
QAINLINE QYMM_TARGET __m256i QYMM(q4_dot)(const __m256i W[8], const int8_t *y) {
    __m256i s[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
    for (int c = 0; c < 8; c++) s[c & 1] = _mm256_dpbusd_avx_epi32(s[c & 1], W[c], _mm256_set1_epi32(load_i32(y + 4 * c)));
    return _mm256_add_epi32(s[0], s[1]);
}

QAINLINE QYMM_TARGET __m256i QYMM(q8_dot)(const __m256i AW[8], const uint8_t *qs, const int8_t *y) {
    __m256i s[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
    for (int c = 0; c < 8; c++) {
        const __m256i sy = _mm256_sign_epi8(_mm256_set1_epi32(load_i32(y + 4 * c)), _mm256_loadu_si256((const __m256i *)(qs + 32 * c)));
        s[c & 1] = _mm256_dpbusd_avx_epi32(s[c & 1], AW[c], sy);
    }
    return _mm256_add_epi32(s[0], s[1]);
}

QAINLINE QYMM_TARGET void QYMM(q6_dot)(const __m256i AW[8], const uint8_t *qs, const int8_t *y, __m256i *lo, __m256i *hi) {
    __m256i s[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
    for (int c = 0; c < 8; c++) {
        const __m256i sy = _mm256_sign_epi8(_mm256_set1_epi32(load_i32(y + 4 * c)), _mm256_loadu_si256((const __m256i *)(qs + 32 * c)));
        s[c >= 4] = _mm256_dpbusd_avx_epi32(s[c >= 4], AW[c], sy);
    }
    *lo = s[0], *hi = s[1];
}
#else
/* Each output's sum of q * y over the block, one int32 lane per output. Weights
 * are 0..15 and |y| <= 127, so a vpmaddubsw lane is at most 3810 in magnitude and
 * eight of them add up in int16 (<= 30480) before the one widening vpmaddwd. */
QAINLINE QYMM_TARGET __m256i QYMM(q4_dot)(const __m256i W[8], const int8_t *y) {
    __m256i s = _mm256_maddubs_epi16(W[0], _mm256_set1_epi32(load_i32(y)));
    for (int c = 1; c < 8; c++) s = _mm256_add_epi16(s, _mm256_maddubs_epi16(W[c], _mm256_set1_epi32(load_i32(y + 4 * c))));
    return _mm256_madd_epi16(s, _mm256_set1_epi16(1));
}

/* Q8_0: vpmaddubsw takes one unsigned operand, so |w| times y with w's sign
 * (ggml's trick); a lane can reach 2 * 128 * 127, so each chunk widens alone. */
QAINLINE QYMM_TARGET __m256i QYMM(q8_dot)(const __m256i AW[8], const uint8_t *qs, const int8_t *y) {
    __m256i s = _mm256_setzero_si256();
    for (int c = 0; c < 8; c++) {
        const __m256i sy = _mm256_sign_epi8(_mm256_set1_epi32(load_i32(y + 4 * c)), _mm256_loadu_si256((const __m256i *)(qs + 32 * c)));
        s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(AW[c], sy), _mm256_set1_epi16(1)));
    }
    return s;
}

/* Q6_K: the two halves' sums (chunks 0..3, 4..7), as q8_dot; |w| <= 32, so a
 * vpmaddubsw lane is at most 2 * 32 * 127 = 8128 and a half's four chunks add
 * up in int16 (<= 32512) before one widening vpmaddwd each. */
QAINLINE QYMM_TARGET void QYMM(q6_dot)(const __m256i AW[8], const uint8_t *qs, const int8_t *y, __m256i *lo, __m256i *hi) {
    __m256i s[2];
    for (int h = 0; h < 2; h++) {
        s[h] = _mm256_setzero_si256();
        for (int c = 4 * h; c < 4 * h + 4; c++) {
            const __m256i sy = _mm256_sign_epi8(_mm256_set1_epi32(load_i32(y + 4 * c)), _mm256_loadu_si256((const __m256i *)(qs + 32 * c)));
            s[h] = _mm256_add_epi16(s[h], _mm256_maddubs_epi16(AW[c], sy));
        }
    }
    *lo = _mm256_madd_epi16(s[0], _mm256_set1_epi16(1));
    *hi = _mm256_madd_epi16(s[1], _mm256_set1_epi16(1));
}
#endif

/* RT rows (m0 ..) against one group: acc[r] lane j = output j of row m0 + r.
 * RT is a compile-time constant (group_rows below dispatches), so the loops over
 * rows unroll and the accumulators stay in registers: measured on the 2-core
 * Zen 3, one thread, 3072 x 576 Q4_1, 7.5 -> 5.3 ns a block at one row and
 * 4.0 -> 3.7 ns a block-row at eight, against a runtime row count. */
QAINLINE QYMM_TARGET void QYMM(group_tile)(const int64_t fmt, const int RT, const uint8_t *wg, const qact *a, int64_t m0, __m256 *out) {
    const int64_t nb = a->nb, stride = unit_bytes(fmt) / unit_blocks(fmt); /* a block's share of the stream */
    __m256 acc[QROW_TILE];
    _Pragma("GCC unroll 8") for (int r = 0; r < RT; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *qs = block_quants_at(fmt, wg, b);
        /* points at most 64 bytes apart over the block's share of the stream: every line ahead is touched */
        const char *ahead = (const char *)unit_of(fmt, wg, b) + b % unit_blocks(fmt) * stride + QPREFETCH_BYTES;
        for (int64_t line = 0; line < stride; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
        __m256 dw, s1; /* s1: mw (Q4_1, Q4_K) or dw' (Q6_K) */
        block_scales_avx2(fmt, wg, b, &dw, &s1);
        __m256i W[8];
        if (fmt == FD_W_Q8_0 || fmt == FD_W_Q6_K)
            for (int c = 0; c < 8; c++) W[c] = _mm256_abs_epi8(_mm256_loadu_si256((const __m256i *)(qs + 32 * c)));
        else
            q4_unpack(qs, W);
        _Pragma("GCC unroll 8") for (int r = 0; r < RT; r++) {
            const int64_t i = (m0 + r) * nb + b;
            const int8_t *yq = a->qs + i * QK;
            const __m256 dx = _mm256_set1_ps(a->d[i]);
            __m256 term;
            if (fmt == FD_W_Q6_K) {
                __m256i lo, hi;
                QYMM(q6_dot)(W, qs, yq, &lo, &hi);
                term = _mm256_mul_ps(_mm256_mul_ps(dw, dx), _mm256_cvtepi32_ps(lo));
                term = _mm256_add_ps(term, _mm256_mul_ps(_mm256_mul_ps(s1, dx), _mm256_cvtepi32_ps(hi)));
            } else {
                __m256i s = fmt == FD_W_Q8_0 ? QYMM(q8_dot)(W, qs, yq) : QYMM(q4_dot)(W, yq);
                if (fmt == FD_W_Q4_0) s = _mm256_sub_epi32(s, _mm256_set1_epi32(8 * a->s[i]));
                term = _mm256_mul_ps(_mm256_mul_ps(dw, dx), _mm256_cvtepi32_ps(s));
                if (has_min(fmt)) term = _mm256_add_ps(term, _mm256_mul_ps(s1, _mm256_set1_ps(a->sx[i])));
            }
            acc[r] = _mm256_add_ps(acc[r], term);
        }
    }
    _Pragma("GCC unroll 8") for (int r = 0; r < RT; r++) out[r] = acc[r];
}

/* rt <= QROW_TILE rows against one group, one tile (which rows share an unpack changes no
 * operation on any row). */
QAINLINE QYMM_TARGET void QYMM(group_rows)(const int64_t fmt, const uint8_t *wg, const qact *a, int64_t m0, int64_t rt, __m256 *acc) {
    switch (rt) { /* every row count its own tile (it beat tiles of 4, 2, 1 at 3, 5 and 7 rows by 7-14%:
                     AVX2 and AVX-VNNI, one thread, CPU time, SmolLM2's shapes, a loaded Zen 5) */
    case 8: QYMM(group_tile)(fmt, 8, wg, a, m0, acc); break;
    case 7: QYMM(group_tile)(fmt, 7, wg, a, m0, acc); break;
    case 6: QYMM(group_tile)(fmt, 6, wg, a, m0, acc); break;
    case 5: QYMM(group_tile)(fmt, 5, wg, a, m0, acc); break;
    case 4: QYMM(group_tile)(fmt, 4, wg, a, m0, acc); break;
    case 3: QYMM(group_tile)(fmt, 3, wg, a, m0, acc); break;
    case 2: QYMM(group_tile)(fmt, 2, wg, a, m0, acc); break;
    default: QYMM(group_tile)(fmt, 1, wg, a, m0, acc); break;
    }
}

QYMM_TARGET static void QYMM(gemm)(const qact *a, int64_t M, int64_t fmt, const uint8_t *w, int64_t N, float *y, int64_t ldy) {
    const int64_t G = (N + QGROUP - 1) / QGROUP;
    const int64_t gbytes = loop_group_bytes(fmt, a->nb);
#pragma omp parallel
    for (int64_t mb = 0; mb < M; mb += QROW_BLOCK) {
        const int64_t m_end = M - mb < QROW_BLOCK ? M : mb + QROW_BLOCK;
#pragma omp for schedule(static) nowait
        for (int64_t g = 0; g < G; g++) {
            const int64_t n0 = g * QGROUP, valid = N - n0 < QGROUP ? N - n0 : QGROUP;
            for (int64_t m0 = mb; m0 < m_end; m0 += QROW_TILE) {
                const int64_t rt = m_end - m0 < QROW_TILE ? m_end - m0 : QROW_TILE;
                __m256 acc[QROW_TILE];
                switch (fmt) { /* constant formats: one specialized loop each */
                case FD_W_Q8_0: QYMM(group_rows)(FD_W_Q8_0, w + g * gbytes, a, m0, rt, acc); break;
                case FD_W_Q4_0: QYMM(group_rows)(FD_W_Q4_0, w + g * gbytes, a, m0, rt, acc); break;
                case FD_W_Q4_K: QYMM(group_rows)(FD_W_Q4_K, w + g * gbytes, a, m0, rt, acc); break;
                case FD_W_Q6_K: QYMM(group_rows)(FD_W_Q6_K, w + g * gbytes, a, m0, rt, acc); break;
                case FD_W_S24_Q8: s24_rows(w + g * gbytes, a, m0, rt, acc); break;
                default: QYMM(group_rows)(FD_W_Q4_1, w + g * gbytes, a, m0, rt, acc); break;
                }
                for (int64_t r = 0; r < rt; r++) {
                    float *out = y + (m0 + r) * ldy + n0;
                    if (valid == QGROUP) {
                        _mm256_storeu_ps(out, acc[r]);
                    } else {
                        float tmp[QGROUP];
                        _mm256_storeu_ps(tmp, acc[r]);
                        for (int64_t j = 0; j < valid; j++) out[j] = tmp[j];
                    }
                }
            }
        }
    }
}

