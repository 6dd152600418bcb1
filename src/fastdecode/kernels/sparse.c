/* 2:4 sparse Q8_0 weights (FD_W_S24_Q8), row-invariant: included by cpu.c after quant.c, whose
 * activations (qact), constants and helpers it uses, and reached through quant.c's block_gemm.
 *
 * The weights are Q8_0 blocks (d fp16, 32 int8 q; fastdecode/gguf_blocks.py) in which every
 * group of four consecutive weights of a row holds at most two non-zero q (2:4 sparsity along
 * the input). Only two q a group are stored, with their 2-bit positions in the group: a block
 * of a row is 2 + 16 + 4 = 22 bytes where Q8_0 takes 34. A block's integer sum over the kept
 * weights is the dense block's sum exactly (the others are 0), and its float term is formed and
 * added as quant.c forms Q8_0's,
 *
 *     t = dw * dx;  term = t * (float)isum;  acc = acc + term      (blocks in increasing order)
 *
 * so every output is bit for bit what the dense Q8_0 kernel gives over the same weights, whatever
 * the row count, the tiles, the thread count or the implementation (AVX2 below, or the portable
 * scalar loop).
 *
 * Layout (kernels/sparse.py's pack_s24), outputs in groups of eight as quant.c's: a group holds
 * its nb blocks in units of two (quant.c's units: one stream, read in order), each unit the two
 * blocks' d[8] fp16 (32 bytes), then per block 160 bytes: four 8-byte position words, then four
 * 32-byte value vectors (an odd last block: its d, 16 bytes of padding, its 160 bytes). Vector v
 * covers weights 8v .. 8v + 7 (groups 2v, 2v + 1 of four): its byte t = 4j + s is row j's kept
 * value s (s = 0, 1: group 2v; s = 2, 3: group 2v + 1), and word v holds that value's position
 * p in its group (0..3) at bits 8 (t % 8) + 2 (t / 8). Broadcast to the four 64-bit lanes of a
 * vector and shifted right by 0, 2, 4, 6, byte t of the result then holds p in its two low bits:
 * with 4 added for s >= 2 it is the vpshufb index that picks the activation byte that value
 * multiplies out of the eight activations 8v .. 8v + 7 broadcast to both 128-bit lanes. Each
 * row's four products of a vector sum in one vpmaddubsw + vpmaddwd lane, as quant.c's Q8_0 does
 * with four consecutive weights.
 */

#define S24_BLOCK 160   /* bytes of one block's positions (32) and values (128) */
#define S24_SCALES 16   /* bytes of one block's d[8] */
#define S24_UNIT (2 * S24_SCALES + 2 * S24_BLOCK) /* two blocks: their d[8]s, then their positions and values */

/* Every vector of a unit stays 32-aligned (352 = 11 * 32); an odd last block's unit is 32 + 160 bytes. */
static inline int64_t s24_group_bytes(int64_t nb) { return nb / 2 * S24_UNIT + nb % 2 * (2 * S24_SCALES + S24_BLOCK); }
static inline const uint8_t *s24_unit(const uint8_t *wg, int64_t b) { return wg + b / 2 * S24_UNIT; }
/* Block b's d[8] and its positions and values in group wg. */
static inline const uint8_t *s24_scales(const uint8_t *wg, int64_t b) { return s24_unit(wg, b) + b % 2 * S24_SCALES; }
static inline const uint8_t *s24_block(const uint8_t *wg, int64_t b) { return s24_unit(wg, b) + 2 * S24_SCALES + b % 2 * S24_BLOCK; }
/* The stream QPREFETCH_BYTES (or ZPREFETCH_BYTES) ahead of block b: its half of the unit, lines at most 64 bytes apart */
#define S24_SHARE (S24_UNIT / 2)

static inline int64_t load_i64(const void *p) {
    int64_t v;
    memcpy(&v, p, 8);
    return v;
}

/* The activation index (within the block) that byte t of vector v multiplies. */
static inline int s24_index(const uint8_t *blk, int v, int t) {
    const uint64_t word = (uint64_t)load_i64(blk + 8 * v);
    const int p = (int)((word >> (8 * (t % 8) + 2 * (t / 8))) & 3);
    return 8 * v + 4 * ((t % 4) >= 2) + p;
}

static void s24_gemm_scalar(const qact *a, int64_t M, const uint8_t *w, int64_t N, float *y, int64_t ldy) {
    const int64_t nb = a->nb, G = (N + QGROUP - 1) / QGROUP, gbytes = s24_group_bytes(nb);
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < G; g++)
        for (int64_t m = 0; m < M; m++) {
            const uint8_t *wg = w + g * gbytes;
            float acc[QGROUP] = {0};
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *blk = s24_block(wg, b);
                const int64_t i = m * nb + b;
                const int8_t *yq = a->qs + i * QK;
                for (int j = 0; j < QGROUP; j++) {
                    int32_t isum = 0;
                    for (int v = 0; v < 4; v++)
                        for (int s = 0; s < 4; s++) {
                            const int t = 4 * j + s;
                            isum += (int8_t)blk[32 + 32 * v + t] * yq[s24_index(blk, v, t)];
                        }
                    const float t = fp16_to_f32(load_u16(s24_scales(wg, b) + 2 * j)) * a->d[i];
                    const float term = t * (float)isum;
                    acc[j] = acc[j] + term;
                }
            }
            for (int j = 0; j < QGROUP && g * QGROUP + j < N; j++) y[m * ldy + g * QGROUP + j] = acc[j];
        }
}

/* RT rows (m0 ..) against one group: acc[r] lane j = output j of row m0 + r (quant.c's group_tile). */
QAINLINE void s24_tile(const int RT, const uint8_t *wg, const qact *a, int64_t m0, __m256 *out) {
    const int64_t nb = a->nb;
    const __m256i shifts = _mm256_setr_epi64x(0, 2, 4, 6), three = _mm256_set1_epi8(3);
    const __m256i second = _mm256_set1_epi32(0x04040000), ones = _mm256_set1_epi16(1);
    __m256 acc[QROW_TILE];
    _Pragma("GCC unroll 8") for (int r = 0; r < RT; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = s24_block(wg, b);
        const char *ahead = (const char *)s24_unit(wg, b) + b % 2 * S24_SHARE + QPREFETCH_BYTES;
        for (int64_t line = 0; line < S24_SHARE; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)s24_scales(wg, b)));
        __m256i idx[4], AW[4];
        for (int v = 0; v < 4; v++) {
            const __m256i word = _mm256_set1_epi64x(load_i64(blk + 8 * v));
            idx[v] = _mm256_or_si256(_mm256_and_si256(_mm256_srlv_epi64(word, shifts), three), second);
            AW[v] = _mm256_abs_epi8(_mm256_loadu_si256((const __m256i *)(blk + 32 + 32 * v)));
        }
        _Pragma("GCC unroll 8") for (int r = 0; r < RT; r++) {
            const int64_t i = (m0 + r) * nb + b;
            const int8_t *yq = a->qs + i * QK;
            __m256i s = _mm256_setzero_si256();
            for (int v = 0; v < 4; v++) {
                const __m256i x = _mm256_shuffle_epi8(_mm256_set1_epi64x(load_i64(yq + 8 * v)), idx[v]);
                const __m256i sx = _mm256_sign_epi8(x, _mm256_loadu_si256((const __m256i *)(blk + 32 + 32 * v)));
                s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(AW[v], sx), ones));
            }
            const __m256 term = _mm256_mul_ps(_mm256_mul_ps(dw, _mm256_set1_ps(a->d[i])), _mm256_cvtepi32_ps(s));
            acc[r] = _mm256_add_ps(acc[r], term);
        }
    }
    _Pragma("GCC unroll 8") for (int r = 0; r < RT; r++) out[r] = acc[r];
}

QAINLINE void s24_rows(const uint8_t *wg, const qact *a, int64_t m0, int64_t rt, __m256 *acc) {
    switch (rt) { /* every row count its own tile, as quant_ymm.c's group_rows */
    case 8: s24_tile(8, wg, a, m0, acc); break;
    case 7: s24_tile(7, wg, a, m0, acc); break;
    case 6: s24_tile(6, wg, a, m0, acc); break;
    case 5: s24_tile(5, wg, a, m0, acc); break;
    case 4: s24_tile(4, wg, a, m0, acc); break;
    case 3: s24_tile(3, wg, a, m0, acc); break;
    case 2: s24_tile(2, wg, a, m0, acc); break;
    default: s24_tile(1, wg, a, m0, acc); break;
    }
}

#ifdef FD_HAVE_VNNI
/* AVX-512 VNNI (quant_avx512.c): two groups a zmm, as there. vpdpbusd multiplies unsigned by
 * signed bytes, so the activations are taken as the unsigned y + 128 (sign bit flipped once a pass
 * by zs24_flip, not again for every group pair: 2.19 -> 2.04 ns a block-row at 8 rows, one thread,
 * a SmolLM2 layer in cache, Zen 4) and 128 times each output's sum of kept weights (once a block, for all rows)
 * taken back off: the exact sum of w * y again. Each 128-bit lane holds activations 0..15
 * (vectors 0, 1) or 16..31 (vectors 2, 3), so odd vectors' indices are 8 higher. */
ZINLINE void zs24_tile(const int RT, const uint8_t *wg0, int64_t gbytes, const qact *a, int64_t m0, __m512 *out) {
    /* a: zs24_flip's copy, qs holding y + 128 */
    const int64_t nb = a->nb;
    const uint8_t *wg1 = wg0 + gbytes;
    const __m512i shifts = _mm512_setr_epi64(0, 2, 4, 6, 0, 2, 4, 6), three = _mm512_set1_epi8(3);
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m512 acc[QROW_TILE];
    _Pragma("GCC unroll 8") for (int r = 0; r < RT; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk0 = s24_block(wg0, b), *blk1 = s24_block(wg1, b);
        const int64_t at = s24_unit(wg0, b) - wg0 + b % 2 * S24_SHARE + ZPREFETCH_BYTES;
        for (int64_t line = 0; line < S24_SHARE; line += 64) {
            _mm_prefetch((const char *)wg0 + at + line, _MM_HINT_T0);
            _mm_prefetch((const char *)wg1 + at + line, _MM_HINT_T0);
        }
        const __m512 dw = zscales(s24_scales(wg0, b), s24_scales(wg1, b));
        __m512i idx[4], V[4], corr = _mm512_setzero_si512();
        for (int v = 0; v < 4; v++) {
            const __m512i word = _mm512_inserti64x4(_mm512_set1_epi64(load_i64(blk0 + 8 * v)),
                                                    _mm256_set1_epi64x(load_i64(blk1 + 8 * v)), 1);
            const __m512i second = _mm512_set1_epi32(v & 1 ? 0x0C0C0808 : 0x04040000);
            idx[v] = _mm512_or_si512(_mm512_and_si512(_mm512_srlv_epi64(word, shifts), three), second);
            V[v] = zpair(blk0 + 32 + 32 * v, blk1 + 32 + 32 * v);
            corr = _mm512_dpbusd_epi32(corr, flip, V[v]); /* 128 * the kept weights' sum, a lane an output */
        }
        /* one dpbusd chain a row, started at -128 * the kept sum: no add of two chains and no subtraction
           a row (a layer in cache, one thread, 8 rows 2.04 -> 1.91-1.98 ns a block-row, 3 rows 2.96 -> 2.86) */
        const __m512i negcorr = _mm512_sub_epi32(_mm512_setzero_si512(), corr);
        _Pragma("GCC unroll 8") for (int r = 0; r < RT; r++) {
            const int64_t i = (m0 + r) * nb + b;
            const int8_t *yq = a->qs + i * QK;
            const __m512i ylo = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)yq));
            const __m512i yhi = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(yq + 16)));
            __m512i s = negcorr; /* one chain from -128 * the kept sum (rows give the parallelism) */
            for (int v = 0; v < 4; v++) s = _mm512_dpbusd_epi32(s, _mm512_shuffle_epi8(v < 2 ? ylo : yhi, idx[v]), V[v]);
            const __m512 term = _mm512_mul_ps(_mm512_mul_ps(dw, _mm512_set1_ps(a->d[i])), _mm512_cvtepi32_ps(s));
            acc[r] = _mm512_add_ps(acc[r], term);
        }
    }
    _Pragma("GCC unroll 8") for (int r = 0; r < RT; r++) out[r] = acc[r];
}

/* The pass's activations as the unsigned y + 128 (sign bits flipped), once for every group pair:
 * a copy of a with qs at the flipped bytes (to free), or NULL where they cannot be had. */
__attribute__((target(Z512_TARGET))) static int8_t *zs24_flip(const qact *a, int64_t M, qact *flipped) {
    const int64_t n = M * a->nb * QK;
    int8_t *qs = aligned_alloc(64, (size_t)((n + 63) & ~(int64_t)63));
    if (!qs) return NULL;
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    for (int64_t k = 0; k < n; k += 32) /* n is a multiple of 32 */
        _mm256_store_si256((__m256i *)(qs + k), _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(a->qs + k)), _mm512_castsi512_si256(flip)));
    *flipped = *a;
    flipped->qs = qs;
    return qs;
}

/* Fewer than ZMIN_ROWS rows on AVX-512 VNNI: the zmm tile's arithmetic a group at a time on ymm
 * (EVEX vpdpbusd), one stream as the ymm loop reads it. Each row's four products of a vector are one
 * vpdpbusd where AVX2 takes vpsignb, vpmaddubsw, vpmaddwd and vpaddd; a is zs24_flip's copy.
 * A SmolLM2 layer in cache, one thread, Zen 4: 1 row 5.3-5.5 ns a block-row (AVX2 loop 6.9-10.2,
 * dense Q8_0 on this path 7.6), 2 rows 3.35-3.44 (AVX2 6.4-9.1). */
ZINLINE void ys24_tile(const int RT, const uint8_t *wg, const qact *a, int64_t m0, __m256 *out) {
    const int64_t nb = a->nb;
    const __m256i shifts = _mm256_setr_epi64x(0, 2, 4, 6), three = _mm256_set1_epi8(3);
    const __m256i flip = _mm256_set1_epi8((char)0x80);
    __m256 acc[2];
    _Pragma("GCC unroll 2") for (int r = 0; r < RT; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = s24_block(wg, b);
        const char *ahead = (const char *)s24_unit(wg, b) + b % 2 * S24_SHARE + QPREFETCH_BYTES;
        for (int64_t line = 0; line < S24_SHARE; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)s24_scales(wg, b)));
        __m256i idx[4], V[4], corr = _mm256_setzero_si256();
        for (int v = 0; v < 4; v++) {
            const __m256i word = _mm256_set1_epi64x(load_i64(blk + 8 * v));
            const __m256i second = _mm256_set1_epi32(v & 1 ? 0x0C0C0808 : 0x04040000);
            idx[v] = _mm256_or_si256(_mm256_and_si256(_mm256_srlv_epi64(word, shifts), three), second);
            V[v] = _mm256_loadu_si256((const __m256i *)(blk + 32 + 32 * v));
            corr = _mm256_dpbusd_epi32(corr, flip, V[v]);
        }
        const __m256i negcorr = _mm256_sub_epi32(_mm256_setzero_si256(), corr);
        _Pragma("GCC unroll 2") for (int r = 0; r < RT; r++) {
            const int64_t i = (m0 + r) * nb + b;
            const int8_t *yq = a->qs + i * QK;
            const __m256i ylo = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)yq));
            const __m256i yhi = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(yq + 16)));
            __m256i s = negcorr;
            for (int v = 0; v < 4; v++) s = _mm256_dpbusd_epi32(s, _mm256_shuffle_epi8(v < 2 ? ylo : yhi, idx[v]), V[v]);
            const __m256 term = _mm256_mul_ps(_mm256_mul_ps(dw, _mm256_set1_ps(a->d[i])), _mm256_cvtepi32_ps(s));
            acc[r] = _mm256_add_ps(acc[r], term);
        }
    }
    _Pragma("GCC unroll 2") for (int r = 0; r < RT; r++) out[r] = acc[r];
}

/* M rows (few: gemm_avx512 sends fewer than ZMIN_ROWS) over every group, two rows a tile. */
__attribute__((target(Z512_TARGET))) static void ys24_gemm(const qact *a, int64_t M, const uint8_t *w, int64_t N, float *y,
                                                          int64_t ldy) {
    const int64_t G = (N + QGROUP - 1) / QGROUP, gbytes = s24_group_bytes(a->nb);
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < G; g++) {
        const int64_t n0 = g * QGROUP, valid = N - n0 < QGROUP ? N - n0 : QGROUP;
        const __mmask8 keep = (__mmask8)((1u << valid) - 1);
        for (int64_t m0 = 0; m0 < M; m0 += 2) {
            __m256 acc[2];
            if (M - m0 >= 2)
                ys24_tile(2, w + g * gbytes, a, m0, acc);
            else
                ys24_tile(1, w + g * gbytes, a, m0, acc);
            for (int64_t r = 0; r < 2 && m0 + r < M; r++) _mm256_mask_storeu_ps(y + (m0 + r) * ldy + n0, keep, acc[r]);
        }
    }
}

ZINLINE void zs24_rows(const uint8_t *wg0, int64_t gbytes, const qact *a, int64_t m0, int64_t rt, __m512 *acc) {
    switch (rt) { /* every row count its own tile, as quant_avx512.c's zgroup_rows */
    case 8: zs24_tile(8, wg0, gbytes, a, m0, acc); break;
    case 7: zs24_tile(7, wg0, gbytes, a, m0, acc); break;
    case 6: zs24_tile(6, wg0, gbytes, a, m0, acc); break;
    case 5: zs24_tile(5, wg0, gbytes, a, m0, acc); break;
    case 4: zs24_tile(4, wg0, gbytes, a, m0, acc); break;
    case 3: zs24_tile(3, wg0, gbytes, a, m0, acc); break;
    case 2: zs24_tile(2, wg0, gbytes, a, m0, acc); break;
    default: zs24_tile(1, wg0, gbytes, a, m0, acc); break;
    }
}
#endif
