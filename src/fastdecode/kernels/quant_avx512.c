/* The block GEMM on AVX-512 VNNI (FD_IMPL_AVX512_VNNI): included by quant.c, compiled for these
 * instructions by function attributes and taken only where the CPU has them (quant.c's impl_of),
 * so one library serves an AVX2-only CPU too. Same packed weights, same integer block sums, same
 * float operations in the same order as the ymm loops (quant_ymm.c) and gemm_scalar: the same bits.
 *
 * Why a path of its own: an 8-row pass is bound by instructions, not bytes (on a 2-core Zen 5,
 * one thread, SmolLM2's shapes: 1 row 2.5 ms at ~38 GB/s, 8 rows 8.2 ms with ymm vpdpbusd).
 * Here one zmm holds the same chunk of two adjacent groups (16 outputs: group g in the low
 * half, g + 1 in the high), so each vpdpbusd does 512 byte products where the ymm loop does
 * 256 and the float terms cover 16 outputs an instruction; 32 vector registers hold the eight
 * unpacked chunks and eight rows' accumulators without spilling. Measured the same way
 * (scripts/block_gemm_cpu_time.py --head q8_0 --impls avx_vnni,avx512_vnni, a loaded host):
 * 8 rows of Q4_1 layers + Q8_0 head 8.4 -> 5.8 ms, Q8_0 11.4 -> 7.8, 2:4 sparse 9.2 -> 5.5.
 * (Tried and dropped: one dpbusd chain at 4+ rows, the offset as the chain's start: no gain.)
 *
 * Q8_0 on vpdpbusd (unsigned times signed bytes): each weight w is taken as the unsigned byte
 * w + 128 (its sign bit flipped, once per block for all rows) and 128 times the block's sum of
 * the activations (qact's s) taken back off - the exact sum of w * y, as Q4_0's w - 8 is formed.
 *
 * IQ4_NL, IQ4_XS and MXFP4 (their levels signed) are taken as Q8_0's are. Q6_K and Q3_K keep their signed
 * weights and take the activations as unsigned y + 128 instead (once a row and block), taking back
 * 128 times each half-block's sum of weights (once a block). The formats other than Q8_0 and Q4_*
 * have each group's block decoded by the ymm loop's code (quant_decode.c's decode_block_to), the two
 * joined.
 *
 * Every block format but Q2_K and 2:4 sparse Q8_0 (its tile is sparse.c's zs24_tile) run here; a group
 * without a partner (an odd group count's last) and passes of fewer than ZMIN_ROWS rows run
 * the ymm loop (quant_ymm.c's, AVX-VNNI's copy where the CPU has it); 2:4 sparse Q8_0's short
 * passes run sparse.c's ys24_gemm (this path's vpdpbusd on ymm, one group at a time).
 */

#ifdef FD_HAVE_VNNI
#define Z512_TARGET "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c"
#define ZINLINE static inline __attribute__((always_inline, target(Z512_TARGET)))

#ifndef ZPREFETCH_BYTES
#define ZPREFETCH_BYTES QPREFETCH_BYTES
#endif

/* Q2_K (rare in the files people run, and its own rows' arithmetic) stays on the ymm loop. */
static int zfmt_supported(int64_t fmt) {
    return fmt == FD_W_Q8_0 || fmt == FD_W_Q4_0 || fmt == FD_W_Q4_1 || fmt == FD_W_Q4_K || fmt == FD_W_S24_Q8 ||
           loop_kind(fmt) < 0;
}

/* Two groups' 32-byte vectors at the same offset, as one zmm (group g low, g + 1 high). */
ZINLINE __m512i zpair(const uint8_t *p0, const uint8_t *p1) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)p0)),
                              _mm256_loadu_si256((const __m256i *)p1), 1);
}

/* Sixteen fp16 scales: eight of each group's block. */
ZINLINE __m512 zscales(const uint8_t *p0, const uint8_t *p1) {
    const __m256i h = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)p0)),
                                              _mm_loadu_si128((const __m128i *)p1), 1);
    return _mm512_cvtph_ps(h);
}

/* Two groups' eight float32 scales as one zmm. */
ZINLINE __m512 zjoin(__m256 lo, __m256 hi) {
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(lo)), _mm256_castps_pd(hi), 1));
}

/* RT rows (m0 ..) against groups wg0 and wg1 = wg0 + gbytes: out[r] lanes 0..7 = group g's outputs
 * of row m0 + r, lanes 8..15 group g + 1's (quant_ymm.c's group_tile, two groups wide; kind and fmt
 * as there). */
ZINLINE void zgroup_tile(const int64_t kind, const int RT, int64_t fmt, const uint8_t *wg0, int64_t gbytes, const qact *a,
                         int64_t m0, __m512 *out) {
    if (kind >= 0) fmt = kind; /* a constant */
    const int64_t nb = a->nb, stride = unit_bytes(fmt) / unit_blocks(fmt);
    const int flipped = kind == FD_W_Q8_0 || kind == QKIND_S1; /* signed weights taken as w + 128 */
    const uint8_t *wg1 = wg0 + gbytes;
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m512 acc[QROW_TILE];
    _Pragma("GCC unroll 8") for (int r = 0; r < RT; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *q0 = block_quants_at(fmt, wg0, b), *q1 = block_quants_at(fmt, wg1, b);
        const int64_t at = (const uint8_t *)unit_of(fmt, wg0, b) - wg0 + b % unit_blocks(fmt) * stride + ZPREFETCH_BYTES;
        for (int64_t line = 0; line < stride; line += 64) {
            _mm_prefetch((const char *)wg0 + at + line, _MM_HINT_T0);
            _mm_prefetch((const char *)wg1 + at + line, _MM_HINT_T0);
        }
        __m512 sc[4]; /* quant_decode.c's: sc[1] the second half's scale (Q6_K, Q3_K), sc[2] the min */
        __m512i W[8], corr[2];
        if (kind < 0) { /* each group's block decoded out of line by the ymm loop's code, the two joined */
            int8_t tiles[2][8 * 32] __attribute__((aligned(32)));
            __m256 s0[4], s1[4];
            decode_block_to(fmt, wg0, b, tiles[0], s0);
            decode_block_to(fmt, wg1, b, tiles[1], s1);
            for (int k = 0; k < 4; k++) sc[k] = zjoin(s0[k], s1[k]);
            for (int c = 0; c < 8; c++) W[c] = zpair((const uint8_t *)tiles[0] + 32 * c, (const uint8_t *)tiles[1] + 32 * c);
            if (kind == QKIND_S2) { /* signed as they are; 128 * each half's sum, to take back */
                corr[0] = corr[1] = _mm512_setzero_si512();
                for (int c = 0; c < 8; c++) corr[c >= 4] = _mm512_dpbusd_epi32(corr[c >= 4], flip, W[c]);
            } else if (flipped) {
                for (int c = 0; c < 8; c++) W[c] = _mm512_xor_si512(W[c], flip);
            }
        } else {
            if (is_kquant(fmt)) { /* formed by the ymm loop's code, a group at a time */
                __m256 s0[4], s1[4];
                block_scales_avx2(fmt, wg0, b, s0);
                block_scales_avx2(fmt, wg1, b, s1);
                for (int k = 0; k < 4; k++) sc[k] = zjoin(s0[k], s1[k]);
            } else {
                const uint8_t *p0 = block_scales_at(fmt, wg0, b), *p1 = block_scales_at(fmt, wg1, b);
                sc[0] = sc[1] = sc[3] = zscales(p0, p1);
                sc[2] = has_min(fmt) ? zscales(p0 + 16, p1 + 16) : sc[0];
            }
            if (kind == FD_W_Q8_0) {
                for (int c = 0; c < 8; c++) W[c] = _mm512_xor_si512(zpair(q0 + 32 * c, q1 + 32 * c), flip);
            } else { /* Q4_0, Q4_1, Q4_K */
                const __m512i low = _mm512_set1_epi8(0x0F);
                for (int p = 0; p < 4; p++) {
                    const __m512i v = zpair(q0 + 32 * p, q1 + 32 * p);
                    W[p] = _mm512_and_si512(v, low);
                    W[p + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
                }
            }
        }
        _Pragma("GCC unroll 8") for (int r = 0; r < RT; r++) {
            const int64_t i = (m0 + r) * nb + b;
            const int8_t *yq = a->qs + i * QK;
            if (kind == QKIND_S2) {
                /* the activations as unsigned y + 128 (sign bits flipped), so the weights can stay signed */
                int8_t yu[QK] __attribute__((aligned(32)));
                _mm256_store_si256((__m256i *)yu, _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)yq),
                                                                   _mm256_set1_epi8((char)0x80)));
                __m512i h[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
                for (int c = 0; c < 8; c++) h[c >= 4] = _mm512_dpbusd_epi32(h[c >= 4], _mm512_set1_epi32(load_i32(yu + 4 * c)), W[c]);
                const __m512 dx = _mm512_set1_ps(a->d[i]);
                __m512 term = _mm512_mul_ps(_mm512_mul_ps(sc[0], dx), _mm512_cvtepi32_ps(_mm512_sub_epi32(h[0], corr[0])));
                term = _mm512_add_ps(term, _mm512_mul_ps(_mm512_mul_ps(sc[1], dx), _mm512_cvtepi32_ps(_mm512_sub_epi32(h[1], corr[1]))));
                acc[r] = _mm512_add_ps(acc[r], term);
                continue;
            }
            __m512i s2[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()}; /* two chains of four */
            for (int c = 0; c < 8; c++)
                s2[c & 1] = _mm512_dpbusd_epi32(s2[c & 1], W[c], _mm512_set1_epi32(load_i32(yq + 4 * c)));
            __m512i s = _mm512_add_epi32(s2[0], s2[1]);
            if (code_offset(fmt)) s = _mm512_sub_epi32(s, _mm512_set1_epi32(code_offset(fmt) * a->s[i]));
            if (flipped) s = _mm512_sub_epi32(s, _mm512_set1_epi32(128 * a->s[i]));
            __m512 term = _mm512_mul_ps(_mm512_mul_ps(sc[0], _mm512_set1_ps(a->d[i])), _mm512_cvtepi32_ps(s));
            if (has_min(fmt)) term = _mm512_add_ps(term, _mm512_mul_ps(sc[2], _mm512_set1_ps(a->sx[i])));
            acc[r] = _mm512_add_ps(acc[r], term);
        }
    }
    _Pragma("GCC unroll 8") for (int r = 0; r < RT; r++) out[r] = acc[r];
}

ZINLINE void zgroup_rows(const int64_t kind, int64_t fmt, const uint8_t *wg0, int64_t gbytes, const qact *a, int64_t m0,
                         int64_t rt, __m512 *acc) {
    switch (rt) { /* every row count its own tile: 32 registers hold eight rows (a verification pass of
                     5 to 7 rows unpacks each block once, not in tiles of 4, 2 and 1) */
    case 8: zgroup_tile(kind, 8, fmt, wg0, gbytes, a, m0, acc); break;
    case 7: zgroup_tile(kind, 7, fmt, wg0, gbytes, a, m0, acc); break;
    case 6: zgroup_tile(kind, 6, fmt, wg0, gbytes, a, m0, acc); break;
    case 5: zgroup_tile(kind, 5, fmt, wg0, gbytes, a, m0, acc); break;
    case 4: zgroup_tile(kind, 4, fmt, wg0, gbytes, a, m0, acc); break;
    case 3: zgroup_tile(kind, 3, fmt, wg0, gbytes, a, m0, acc); break;
    case 2: zgroup_tile(kind, 2, fmt, wg0, gbytes, a, m0, acc); break;
    default: zgroup_tile(kind, 1, fmt, wg0, gbytes, a, m0, acc); break;
    }
}

/* 2:4 sparse Q8_0 (sparse.c): its rows' tile on this loop, over activations flipped once a pass */
ZINLINE void zs24_rows(const uint8_t *wg0, int64_t gbytes, const qact *a, int64_t m0, int64_t rt, __m512 *acc);
__attribute__((target(Z512_TARGET))) static int8_t *zs24_flip(const qact *a, int64_t M, qact *flipped);
__attribute__((target(Z512_TARGET))) static void ys24_gemm(const qact *a, int64_t M, const uint8_t *w, int64_t N, float *y,
                                                          int64_t ldy);

/* Rows m0 .. m0 + rt - 1 against the group pair at wg0 (outputs n0 ..; valid of its 16 exist). */
__attribute__((noinline, target(Z512_TARGET))) static void zpair_rows(int64_t fmt, const uint8_t *wg0, int64_t gbytes,
                                                                     const qact *a, int64_t m0, int64_t rt,
                                                                     float *y, int64_t ldy, int64_t n0, int64_t valid) {
    __m512 acc[QROW_TILE];
    switch (loop_kind(fmt)) { /* constant kinds: one specialized loop each (zfmt_supported's) */
    case FD_W_Q8_0: zgroup_rows(FD_W_Q8_0, fmt, wg0, gbytes, a, m0, rt, acc); break;
    case FD_W_Q4_0: zgroup_rows(FD_W_Q4_0, fmt, wg0, gbytes, a, m0, rt, acc); break;
    case FD_W_Q4_1: zgroup_rows(FD_W_Q4_1, fmt, wg0, gbytes, a, m0, rt, acc); break;
    case FD_W_Q4_K: zgroup_rows(FD_W_Q4_K, fmt, wg0, gbytes, a, m0, rt, acc); break;
    case QKIND_U5: zgroup_rows(QKIND_U5, fmt, wg0, gbytes, a, m0, rt, acc); break;
    case QKIND_S1: zgroup_rows(QKIND_S1, fmt, wg0, gbytes, a, m0, rt, acc); break;
    case QKIND_S2: zgroup_rows(QKIND_S2, fmt, wg0, gbytes, a, m0, rt, acc); break;
    default: zs24_rows(wg0, gbytes, a, m0, rt, acc); break; /* FD_W_S24_Q8 */
    }
    const __mmask16 keep = valid >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << valid) - 1);
    for (int64_t r = 0; r < rt; r++) _mm512_mask_storeu_ps(y + (m0 + r) * ldy + n0, keep, acc[r]);
}

/* Below this many rows a pass streams its weights faster on the ymm loop's one stream than on the two
 * streams of a group pair (the same bits either way): measured on the 2-core Zen 5, one thread,
 * SmolLM2's shapes from memory (Q4_1, Q8_0 head), ymm / zmm ms: 1 row 2.61 / 3.13, 2 rows
 * 2.96 / 3.44, 3 rows 4.30 / 3.71, 4 rows 4.53 / 3.62. */
#ifndef ZMIN_ROWS
#define ZMIN_ROWS 3
#endif

/* The ymm loop over row blocks and groups, two groups a step; an odd last group on the ymm loop. */
static void gemm_avx512(const qact *a, int64_t M, int64_t fmt, const uint8_t *w, int64_t N, float *y, int64_t ldy) {
    qact za = *a; /* 2:4 sparse Q8_0: the activations as y + 128 (sparse.c's zs24_tile, ys24_tile) */
    int8_t *flipped = NULL;
    if (fmt == FD_W_S24_Q8 && !(flipped = zs24_flip(a, M, &za))) {
        gemm_ymm(a, M, fmt, w, N, y, ldy); /* no memory for the copy: the same bits on the ymm loop */
        return;
    }
    if (M < ZMIN_ROWS) {
        if (fmt == FD_W_S24_Q8)
            ys24_gemm(&za, M, w, N, y, ldy);
        else
            gemm_ymm(a, M, fmt, w, N, y, ldy);
        free(flipped);
        return;
    }
    const int64_t G = (N + QGROUP - 1) / QGROUP, pairs = G / 2;
    const int64_t gbytes = loop_group_bytes(fmt, a->nb);
#pragma omp parallel
    for (int64_t mb = 0; mb < M; mb += QROW_BLOCK) {
        const int64_t m_end = M - mb < QROW_BLOCK ? M : mb + QROW_BLOCK;
#pragma omp for schedule(static) nowait
        for (int64_t gp = 0; gp < pairs; gp++) {
            const int64_t n0 = 2 * gp * QGROUP, valid = N - n0 < 2 * QGROUP ? N - n0 : 2 * QGROUP;
            for (int64_t m0 = mb; m0 < m_end; m0 += QROW_TILE) {
                const int64_t rt = m_end - m0 < QROW_TILE ? m_end - m0 : QROW_TILE;
                zpair_rows(fmt, w + 2 * gp * gbytes, gbytes, &za, m0, rt, y, ldy, n0, valid);
            }
        }
    }
    free(flipped);
    if (G % 2) { /* the last group: its outputs only, on the ymm loop (the same bits) */
        const int64_t n0 = (G - 1) * QGROUP;
        gemm_ymm(a, M, fmt, w + (G - 1) * gbytes, N - n0, y + n0, ldy);
    }
}
#endif
