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

/* Unsigned codes up to 31 (Q5_*): vpdpbusd's int32 sums hold any byte's products */
QAINLINE QYMM_TARGET __m256i QYMM(q5_dot)(const __m256i W[8], const int8_t *y) { return QYMM(q4_dot)(W, y); }

/* Unsigned codes, each half's sum (Q2_K) */
QAINLINE QYMM_TARGET void QYMM(u_halves)(const __m256i W[8], const int8_t *y, __m256i *lo, __m256i *hi) {
    __m256i s[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
    for (int c = 0; c < 8; c++) s[c >= 4] = _mm256_dpbusd_avx_epi32(s[c >= 4], W[c], _mm256_set1_epi32(load_i32(y + 4 * c)));
    *lo = s[0], *hi = s[1];
}

/* Signed weights SW (AW their magnitudes): |w| times y with w's sign, as the AVX2 loop does */
QAINLINE QYMM_TARGET __m256i QYMM(s_dot)(const __m256i AW[8], const __m256i SW[8], const int8_t *y) {
    __m256i s[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
    for (int c = 0; c < 8; c++) {
        const __m256i sy = _mm256_sign_epi8(_mm256_set1_epi32(load_i32(y + 4 * c)), SW[c]);
        s[c & 1] = _mm256_dpbusd_avx_epi32(s[c & 1], AW[c], sy);
    }
    return _mm256_add_epi32(s[0], s[1]);
}

QAINLINE QYMM_TARGET void QYMM(q6_dot)(const __m256i AW[8], const __m256i SW[8], const int8_t *y, __m256i *lo, __m256i *hi) {
    __m256i s[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
    for (int c = 0; c < 8; c++) {
        const __m256i sy = _mm256_sign_epi8(_mm256_set1_epi32(load_i32(y + 4 * c)), SW[c]);
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

/* Unsigned codes up to 31, each half's sum (chunks 0..3, 4..7): a vpmaddubsw lane is at most
 * 2 * 31 * 127 = 7874, and a half's four add up in int16 (<= 31496) before one widening vpmaddwd. */
QAINLINE QYMM_TARGET void QYMM(u_halves)(const __m256i W[8], const int8_t *y, __m256i *lo, __m256i *hi) {
    __m256i s[2];
    for (int h = 0; h < 2; h++) {
        s[h] = _mm256_maddubs_epi16(W[4 * h], _mm256_set1_epi32(load_i32(y + 16 * h)));
        for (int c = 4 * h + 1; c < 4 * h + 4; c++) s[h] = _mm256_add_epi16(s[h], _mm256_maddubs_epi16(W[c], _mm256_set1_epi32(load_i32(y + 4 * c))));
    }
    *lo = _mm256_madd_epi16(s[0], _mm256_set1_epi16(1));
    *hi = _mm256_madd_epi16(s[1], _mm256_set1_epi16(1));
}

QAINLINE QYMM_TARGET __m256i QYMM(q5_dot)(const __m256i W[8], const int8_t *y) {
    __m256i lo, hi;
    QYMM(u_halves)(W, y, &lo, &hi);
    return _mm256_add_epi32(lo, hi);
}

/* Signed weights SW (AW their magnitudes): vpmaddubsw takes one unsigned operand, so |w| times y with
 * w's sign (ggml's trick); a Q8_0 lane can reach 2 * 128 * 127, so each chunk widens alone. */
QAINLINE QYMM_TARGET __m256i QYMM(s_dot)(const __m256i AW[8], const __m256i SW[8], const int8_t *y) {
    __m256i s = _mm256_setzero_si256();
    for (int c = 0; c < 8; c++) {
        const __m256i sy = _mm256_sign_epi8(_mm256_set1_epi32(load_i32(y + 4 * c)), SW[c]);
        s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(AW[c], sy), _mm256_set1_epi16(1)));
    }
    return s;
}

/* Q6_K, Q3_K: the two halves' sums (chunks 0..3, 4..7), as s_dot with the signed integers SW in
 * registers (AW their magnitudes); |w| <= 32, so a
 * vpmaddubsw lane is at most 2 * 32 * 127 = 8128 and a half's four chunks add
 * up in int16 (<= 32512) before one widening vpmaddwd each. */
QAINLINE QYMM_TARGET void QYMM(q6_dot)(const __m256i AW[8], const __m256i SW[8], const int8_t *y, __m256i *lo, __m256i *hi) {
    __m256i s[2];
    for (int h = 0; h < 2; h++) {
        s[h] = _mm256_setzero_si256();
        for (int c = 4 * h; c < 4 * h + 4; c++) {
            const __m256i sy = _mm256_sign_epi8(_mm256_set1_epi32(load_i32(y + 4 * c)), SW[c]);
            s[h] = _mm256_add_epi16(s[h], _mm256_maddubs_epi16(AW[c], sy));
        }
    }
    *lo = _mm256_madd_epi16(s[0], _mm256_set1_epi16(1));
    *hi = _mm256_madd_epi16(s[1], _mm256_set1_epi16(1));
}
#endif

/* s_dot with the signed integers read from qs (Q8_0's quants, or a kind's decoded tile) */
QAINLINE QYMM_TARGET __m256i QYMM(q8_dot)(const __m256i AW[8], const uint8_t *qs, const int8_t *y) {
    __m256i SW[8];
    for (int c = 0; c < 8; c++) SW[c] = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
    return QYMM(s_dot)(AW, SW, y);
}

/* RT rows (m0 ..) against one group: acc[r] lane j = output j of row m0 + r.
 * RT is a compile-time constant (group_rows below dispatches), so the loops over
 * rows unroll and the accumulators stay in registers: measured on the 2-core
 * Zen 3, one thread, 3072 x 576 Q4_1, 7.5 -> 5.3 ns a block at one row and
 * 4.0 -> 3.7 ns a block-row at eight, against a runtime row count. kind (quant.c's
 * loop_kind, a constant too) picks the rows' arithmetic; fmt, the format within the
 * kind, how a block is decoded and its scales formed (the kind itself where it is one format). */
QAINLINE QYMM_TARGET void QYMM(group_tile)(const int64_t kind, const int RT, int64_t fmt, const uint8_t *wg, const qact *a,
                                           int64_t m0, __m256 *out) {
    if (kind >= 0) fmt = kind; /* a constant */
    const int64_t nb = a->nb, stride = unit_bytes(fmt) / unit_blocks(fmt); /* a block's share of the stream */
    /* a format of a kind on a loop of its own (QOWN_LOOP): its block decoded in registers */
    const int lut4 = kind == FD_W_IQ4_NL || kind == FD_W_IQ4_XS || kind == FD_W_MXFP4;
    const int u5 = kind == QKIND_U5 || kind == FD_W_Q5_0 || kind == FD_W_Q5_1 || kind == FD_W_Q5_K;
    const int s2 = kind == FD_W_Q6_K || kind == FD_W_Q3_K; /* two scales, signed integers in registers */
    const int sign_trick = kind == FD_W_Q8_0 || kind == QKIND_S1 || kind == QKIND_S2 || s2 || lut4; /* signed integers */
    const int halves = kind == QKIND_S2 || s2 || kind == FD_W_Q2_K;
    __m256 acc[QROW_TILE];
    _Pragma("GCC unroll 8") for (int r = 0; r < RT; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *qs = block_quants_at(fmt, wg, b);
        /* points at most 64 bytes apart over the block's share of the stream: every line ahead is touched */
        const char *ahead = (const char *)unit_of(fmt, wg, b) + b % unit_blocks(fmt) * stride + QPREFETCH_BYTES;
        for (int64_t line = 0; line < stride; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
        __m256 sc[4];
        __m256i W[8], SW[8]; /* SW: the signed integers of the two-scale kinds, W their magnitudes */
        int8_t tile[8 * 32] __attribute__((aligned(32))); /* a decoded block's integers */
        const uint8_t *signs = qs; /* the signed integers q8_dot's sign trick reads */
        if (kind < 0) { /* a kind of several formats: decoded out of line, once a block */
            decode_block_to(fmt, wg, b, tile, sc);
            for (int c = 0; c < 8; c++) {
                SW[c] = W[c] = _mm256_load_si256((const __m256i *)(tile + 32 * c));
                if (sign_trick) W[c] = _mm256_abs_epi8(W[c]);
            }
            signs = (const uint8_t *)tile;
        } else {
            block_scales_avx2(fmt, wg, b, sc);
            if (kind == FD_W_Q8_0) {
                for (int c = 0; c < 8; c++) W[c] = _mm256_abs_epi8(_mm256_loadu_si256((const __m256i *)(qs + 32 * c)));
            } else {
                decode_block_avx2(fmt, qs, W);
                if (s2 || lut4)
                    for (int c = 0; c < 8; c++) SW[c] = W[c], W[c] = _mm256_abs_epi8(W[c]);
            }
        }
        _Pragma("GCC unroll 8") for (int r = 0; r < RT; r++) {
            const int64_t i = (m0 + r) * nb + b;
            const int8_t *yq = a->qs + i * QK;
            const __m256 dx = _mm256_set1_ps(a->d[i]);
            __m256 term;
            if (halves) {
                __m256i lo, hi;
                if (kind == FD_W_Q2_K)
                    QYMM(u_halves)(W, yq, &lo, &hi);
                else
                    QYMM(q6_dot)(W, SW, yq, &lo, &hi);
                term = _mm256_mul_ps(_mm256_mul_ps(sc[0], dx), _mm256_cvtepi32_ps(lo));
                term = _mm256_add_ps(term, _mm256_mul_ps(_mm256_mul_ps(sc[1], dx), _mm256_cvtepi32_ps(hi)));
                if (kind == FD_W_Q2_K) {
                    term = _mm256_add_ps(term, _mm256_mul_ps(sc[2], _mm256_set1_ps(a->sxh[2 * i])));
                    term = _mm256_add_ps(term, _mm256_mul_ps(sc[3], _mm256_set1_ps(a->sxh[2 * i + 1])));
                }
            } else {
                __m256i s = lut4         ? QYMM(s_dot)(W, SW, yq)
                            : sign_trick ? QYMM(q8_dot)(W, signs, yq)
                            : u5         ? QYMM(q5_dot)(W, yq)
                                         : QYMM(q4_dot)(W, yq);
                if (code_offset(fmt)) s = _mm256_sub_epi32(s, _mm256_set1_epi32(code_offset(fmt) * a->s[i]));
                term = _mm256_mul_ps(_mm256_mul_ps(sc[0], dx), _mm256_cvtepi32_ps(s));
                if (has_min(fmt)) term = _mm256_add_ps(term, _mm256_mul_ps(sc[2], _mm256_set1_ps(a->sx[i])));
            }
            acc[r] = _mm256_add_ps(acc[r], term);
        }
    }
    _Pragma("GCC unroll 8") for (int r = 0; r < RT; r++) out[r] = acc[r];
}

/* rt <= QROW_TILE rows against one group, one tile (which rows share an unpack changes no
 * operation on any row). */
QAINLINE QYMM_TARGET void QYMM(group_rows)(const int64_t kind, int64_t fmt, const uint8_t *wg, const qact *a, int64_t m0, int64_t rt,
                                           __m256 *acc) {
    switch (rt) { /* every row count its own tile (it beat tiles of 4, 2, 1 at 3, 5 and 7 rows by 7-14%:
                     AVX2 and AVX-VNNI, one thread, CPU time, SmolLM2's shapes, a loaded Zen 5) */
    case 8: QYMM(group_tile)(kind, 8, fmt, wg, a, m0, acc); break;
    case 7: QYMM(group_tile)(kind, 7, fmt, wg, a, m0, acc); break;
    case 6: QYMM(group_tile)(kind, 6, fmt, wg, a, m0, acc); break;
    case 5: QYMM(group_tile)(kind, 5, fmt, wg, a, m0, acc); break;
    case 4: QYMM(group_tile)(kind, 4, fmt, wg, a, m0, acc); break;
    case 3: QYMM(group_tile)(kind, 3, fmt, wg, a, m0, acc); break;
    case 2: QYMM(group_tile)(kind, 2, fmt, wg, a, m0, acc); break;
    default: QYMM(group_tile)(kind, 1, fmt, wg, a, m0, acc); break;
    }
}

#if !QYMM_VNNI
#include <omp.h>
/* Thread t of T's static share [*lo, *hi) of count items: OpenMP's schedule(static) split. */
static inline void static_share(int64_t count, int64_t t, int64_t T, int64_t *lo, int64_t *hi) {
    const int64_t q = count / T, r = count % T;
    *lo = t * q + (t < r ? t : r);
    *hi = *lo + q + (t < r);
}
#endif

/* Rows 0 .. M - 1 against groups g0 .. g1 - 1 of w (outputs 8 g0 .. min(N, 8 g1) - 1), on the calling
 * thread alone: QYMM(gemm)'s work, of which each of its threads takes a static share; experts.c's
 * threads take tiles of groups of their own (no nested parallel region a tile). */
QYMM_TARGET static void QYMM(gemm_groups)(const qact *a, int64_t M, int64_t fmt, const uint8_t *w, int64_t N, int64_t g0,
                                          int64_t g1, float *y, int64_t ldy) {
    const int64_t gbytes = loop_group_bytes(fmt, a->nb);
    for (int64_t mb = 0; mb < M; mb += QROW_BLOCK) {
        const int64_t m_end = M - mb < QROW_BLOCK ? M : mb + QROW_BLOCK;
        for (int64_t g = g0; g < g1; g++) {
            const int64_t n0 = g * QGROUP, valid = N - n0 < QGROUP ? N - n0 : QGROUP;
            for (int64_t m0 = mb; m0 < m_end; m0 += QROW_TILE) {
                const int64_t rt = m_end - m0 < QROW_TILE ? m_end - m0 : QROW_TILE;
                __m256 acc[QROW_TILE];
                const uint8_t *wg = w + g * gbytes;
                switch (loop_kind(fmt)) { /* constant kinds: one specialized loop each */
                case FD_W_Q8_0: QYMM(group_rows)(FD_W_Q8_0, fmt, wg, a, m0, rt, acc); break;
                case FD_W_Q4_0: QYMM(group_rows)(FD_W_Q4_0, fmt, wg, a, m0, rt, acc); break;
                case FD_W_Q4_1: QYMM(group_rows)(FD_W_Q4_1, fmt, wg, a, m0, rt, acc); break;
                case FD_W_Q4_K: QYMM(group_rows)(FD_W_Q4_K, fmt, wg, a, m0, rt, acc); break;
                case FD_W_Q2_K: QYMM(group_rows)(FD_W_Q2_K, fmt, wg, a, m0, rt, acc); break;
                case QKIND_U5: case QKIND_S1: case QKIND_S2: /* kinds of several formats: each format on a
                    loop of its own, its blocks decoded in registers (QOWN_LOOP), else the kind's shared loop,
                    each block decoded out of line through a stored tile */
                    if (!QOWN_LOOP && loop_kind(fmt) == QKIND_U5) QYMM(group_rows)(QKIND_U5, fmt, wg, a, m0, rt, acc);
                    else if (!QOWN_LOOP && loop_kind(fmt) == QKIND_S1) QYMM(group_rows)(QKIND_S1, fmt, wg, a, m0, rt, acc);
                    else if (!QOWN_LOOP) QYMM(group_rows)(QKIND_S2, fmt, wg, a, m0, rt, acc);
                    else if (fmt == FD_W_Q5_0) QYMM(group_rows)(FD_W_Q5_0, fmt, wg, a, m0, rt, acc);
                    else if (fmt == FD_W_Q5_1) QYMM(group_rows)(FD_W_Q5_1, fmt, wg, a, m0, rt, acc);
                    else if (fmt == FD_W_Q5_K) QYMM(group_rows)(FD_W_Q5_K, fmt, wg, a, m0, rt, acc);
                    else if (fmt == FD_W_MXFP4) QYMM(group_rows)(FD_W_MXFP4, fmt, wg, a, m0, rt, acc);
                    else if (fmt == FD_W_IQ4_XS) QYMM(group_rows)(FD_W_IQ4_XS, fmt, wg, a, m0, rt, acc);
                    else if (fmt == FD_W_IQ4_NL) QYMM(group_rows)(FD_W_IQ4_NL, fmt, wg, a, m0, rt, acc);
                    else if (fmt == FD_W_Q6_K) QYMM(group_rows)(FD_W_Q6_K, fmt, wg, a, m0, rt, acc);
                    else QYMM(group_rows)(FD_W_Q3_K, fmt, wg, a, m0, rt, acc);
                    break;
                default: s24_rows(wg, a, m0, rt, acc); break; /* FD_W_S24_Q8 */
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

QYMM_TARGET static void QYMM(gemm)(const qact *a, int64_t M, int64_t fmt, const uint8_t *w, int64_t N, float *y, int64_t ldy) {
    const int64_t G = (N + QGROUP - 1) / QGROUP;
#pragma omp parallel
    {
        int64_t g0, g1; /* the share omp for schedule(static) gave each thread, the same for every row block */
        static_share(G, omp_get_thread_num(), omp_get_num_threads(), &g0, &g1);
        QYMM(gemm_groups)(a, M, fmt, w, N, g0, g1, y, ldy);
    }
}
