/* The attention's loops over a quantized cache on AVX-512 VNNI: included by cpu.c (after kv.c),
 * compiled for these instructions by function attributes (quant_avx512.c's Z512_TARGET) and taken
 * only where the CPU has them (fd_attention_f32's impl, quant.c's impl_of), so one library serves
 * an AVX2-only CPU too. The same integers and the same float32 operations in the same order, per
 * position and per output lane, as kv.c's and cpu.c's ymm loops: the same bits.
 *
 * Scores (kvz_scores): sixteen positions at a time. One zmm holds a key block of two positions (the
 * low half position t, the high t + 1), each vpdpbusd 64 byte products. vpdpbusd multiplies
 * unsigned by signed bytes: a q8_0 key level k is taken as the unsigned byte k + 128 (its sign bit
 * flipped) and a q4_0 one as its stored nibble (k + 8), and 128 (8) times the query block's sum
 * taken back off once the sixteen positions' lanes are reduced: the exact sum of k * q, as quant.c's
 * Q8_0 weights on this path. The dk of sixteen rows are gathered once for all QB queries.
 *
 * Values (kvz_values): QB queries of one KV group over the same positions at once, so each value
 * level is widened to float32 once for them all, not once a query (the ymm loop widens it per
 * query); sixteen lanes an instruction, up to 4 x 4 zmm accumulators. Each output lane is still
 * acc = fma(p_t d_t, q_t, acc) in increasing t from zero, then one division: cpu.c's values_query
 * chain, bit for bit.
 */

#ifdef FD_HAVE_VNNI
#define KVZ_TARGET __attribute__((target(Z512_TARGET)))
#define KVZ_INLINE static inline __attribute__((always_inline, target(Z512_TARGET)))

/* The key levels of block b of rows r0 and r1 as unsigned bytes k + 128 (q8_0) or k + 8 (q4_0):
 * r0's 32 in the low half, r1's in the high (the block's value order, as kv_key_levels). */
KVZ_INLINE __m512i kvz_key_pair(const char *r0, const char *r1, int64_t b, const int T) {
    const char *q0 = r0 + b * KV_QBLOCK_BYTES(T) + 2, *q1 = r1 + b * KV_QBLOCK_BYTES(T) + 2;
    if (T == KV_Q8_0) {
        const __m512i k = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)q0)),
                                             _mm256_loadu_si256((const __m256i *)q1), 1);
        return _mm512_xor_si512(k, _mm512_set1_epi8((char)0x80));
    }
    const __m256i x = _mm256_loadu2_m128i((const __m128i *)q1, (const __m128i *)q0), m = _mm256_set1_epi8(15);
    const __m256i lo = _mm256_and_si256(x, m), hi = _mm256_and_si256(_mm256_srli_epi16(x, 4), m);
    /* qwords: r0's low nibbles, r0's high, r1's low, r1's high */
    return _mm512_permutex2var_epi64(_mm512_castsi256_si512(lo), _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11),
                                     _mm512_castsi256_si512(hi));
}

/* Lane p: the sum of position p's eight lanes, p < 16, from m[i] holding positions 2i (low half) and
 * 2i + 1 (exact int32). */
KVZ_INLINE __m512i kvz_hsum16(const __m512i *m) {
    __m512i s[4]; /* s[i]: positions 4i .. 4i + 3, four partial sums each (a 128-bit lane a position) */
    for (int i = 0; i < 4; i++)
        s[i] = _mm512_add_epi32(_mm512_shuffle_i32x4(m[2 * i], m[2 * i + 1], 0x88),
                                _mm512_shuffle_i32x4(m[2 * i], m[2 * i + 1], 0xDD));
    const __m512i t01 = _mm512_add_epi32(_mm512_unpacklo_epi32(s[0], s[1]), _mm512_unpackhi_epi32(s[0], s[1]));
    const __m512i t23 = _mm512_add_epi32(_mm512_unpacklo_epi32(s[2], s[3]), _mm512_unpackhi_epi32(s[2], s[3]));
    /* lane 4c + k: position 4k + c */
    const __m512i u = _mm512_add_epi32(_mm512_unpacklo_epi64(t01, t23), _mm512_unpackhi_epi64(t01, t23));
    return _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), u);
}

/* kv_score1 of the sixteen rows rows + p RB (p < 16) for QB queries: out[j][0 .. 16). qz[j]: query
 * j's int8 blocks, each broadcast to both halves; qoff[j][b]: 128 (q8_0) or 8 (q4_0) times its sum. */
KVZ_INLINE void kvz_scores16(const int QB, const int T, const char *const *qs, const __m512i *qz, const int32_t (*qoff)[8],
                             const char *rows, int64_t RB, int64_t D, float scale, float *const *out) {
    const __m512i offsets = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                               _mm512_set1_epi32((int)RB));
    const int64_t nb = D / KV_QK;
    __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()}; /* set at b = 0 */
    for (int64_t b = 0; b < nb; b++) {
        const __m512i h = _mm512_i32gather_epi32(offsets, rows + b * KV_QBLOCK_BYTES(T), 1);
        const __m512 dk = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(h));
        __m512i k[8];
        _Pragma("GCC unroll 8") for (int i = 0; i < 8; i++) k[i] = kvz_key_pair(rows + 2 * i * RB, rows + (2 * i + 1) * RB, b, T);
        _Pragma("GCC unroll 4") for (int j = 0; j < QB; j++) {
            __m512i m[8];
            _Pragma("GCC unroll 8") for (int i = 0; i < 8; i++) m[i] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), k[i], qz[j * 8 + b]);
            const __m512i isum = _mm512_sub_epi32(kvz_hsum16(m), _mm512_set1_epi32(qoff[j][b]));
            const __m512 s = _mm512_mul_ps(_mm512_set1_ps(kv_query_d(qs[j] + b * KV_QBLOCK_Q_BYTES)), dk);
            const __m512 i = _mm512_cvtepi32_ps(isum);
            a[j] = b == 0 ? _mm512_mul_ps(s, i) : _mm512_fmadd_ps(s, i, a[j]);
        }
    }
    _Pragma("GCC unroll 4") for (int j = 0; j < QB; j++) _mm512_storeu_ps(out[j], _mm512_mul_ps(a[j], _mm512_set1_ps(scale)));
}

/* scores_block_int over [t0, len) of the rows at kb (RB apart), sixteen positions at a time on
 * zmm, the rest on kv.c's ymm loop and tail. */
KVZ_INLINE void kvz_scores_block(const int QB, const int T, const char *const *qs, const __m512i *qz,
                                 const int32_t (*qoff)[8], const char *kb, int64_t RB, int64_t D, int64_t t0,
                                 int64_t len, float scale, float *const *ss) {
    int64_t t = t0;
    float *out[4];
    for (; t + 16 <= len; t += 16) {
        for (int j = 0; j < QB; j++) out[j] = ss[j] + t;
        kvz_scores16(QB, T, qs, qz, qoff, kb + t * RB, RB, D, scale, out);
    }
    for (; t + 8 <= len; t += 8) {
        for (int j = 0; j < QB; j++) out[j] = ss[j] + t;
        kv_scores8(QB, T, qs, kb + t * RB, RB, D, scale, out);
    }
    for (; t < len; t++)
        for (int j = 0; j < QB; j++) ss[j][t] = kv_score1(kb + t * RB, qs[j], D, scale, T);
}

/* cpu.c's scores_paged over quantized keys on zmm: QB queries (int8 blocks qs[j]), positions [t0, t1)
 * of the paged rows (table, group g), ss[j] indexed by absolute position. D <= 8 KV_QK. */
KVZ_INLINE void kvz_scores_paged_t(const int QB, const int T, const float *const *q, const char *k, const int64_t *table,
                                   int64_t g, int64_t KV, int64_t B, int64_t D, int64_t t0, int64_t t1, float scale,
                                   float *const *ss) {
    const int64_t RB = kv_row_bytes(T, D), nb = D / KV_QK;
    const char *qs[4];
    __m512i qz[4 * 8];
    int32_t qoff[4][8];
    for (int j = 0; j < QB; j++) {
        qs[j] = (const char *)q[j];
        for (int64_t b = 0; b < nb; b++) {
            const char *qb = qs[j] + b * KV_QBLOCK_Q_BYTES;
            qoff[j][b] = kv_query_sum(qb) * (T == KV_Q8_0 ? 128 : 8);
            qz[j * 8 + b] = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(qb + 8)));
        }
    }
    for (int64_t blk = t0 / B; blk * B < t1; blk++) {
        const int64_t base = blk * B, s0 = t0 > base ? t0 - base : 0, s1 = t1 - base < B ? t1 - base : B;
        float *sb[4];
        for (int j = 0; j < QB; j++) sb[j] = ss[j] + base;
        kvz_scores_block(QB, T, qs, qz, qoff, k + (table[blk] * KV + g) * B * RB, RB, D, s0, s1, scale, sb);
    }
}

static KVZ_TARGET void kvz_scores_paged(int64_t qn, int64_t T, const float *const *q, const char *k, const int64_t *table,
                                        int64_t g, int64_t KV, int64_t B, int64_t D, int64_t t0, int64_t t1, float scale,
                                        float *const *ss) {
#define KVZ_SCORES_CASE(QB, TT) \
    case (QB) + 4 * (TT): kvz_scores_paged_t(QB, TT, q, k, table, g, KV, B, D, t0, t1, scale, ss); break;
    switch (qn + 4 * T) {
        KVZ_SCORES_CASE(1, KV_Q8_0) KVZ_SCORES_CASE(2, KV_Q8_0) KVZ_SCORES_CASE(3, KV_Q8_0) KVZ_SCORES_CASE(4, KV_Q8_0)
        KVZ_SCORES_CASE(1, KV_Q4_0) KVZ_SCORES_CASE(2, KV_Q4_0) KVZ_SCORES_CASE(3, KV_Q4_0) KVZ_SCORES_CASE(4, KV_Q4_0)
    }
#undef KVZ_SCORES_CASE
}

/* Values 32 b' .. 32 b' + 31 of a quantized row (b' = d0 / KV_QK: a whole block) as float32 levels,
 * unscaled: lo holds 0 .. 15, hi 16 .. 31 (kv_levels8's, sixteen at a time). */
KVZ_INLINE void kvz_levels32(const char *row, int64_t d0, const int T, __m512 *lo, __m512 *hi) {
    const char *qs = row + d0 / KV_QK * KV_QBLOCK_BYTES(T) + 2;
    if (T == KV_Q8_0) {
        *lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)qs)));
        *hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(qs + 16))));
        return;
    }
    const __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)qs)), eight = _mm512_set1_epi32(8);
    *lo = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_and_si512(x, _mm512_set1_epi32(15)), eight));
    *hi = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_srli_epi32(x, 4), eight));
}

/* acc[j] (lanes d0 .. d0 + 16 W of query j, float32 in memory) += sum over t in [t0, t1) of
 * (s_j[t] d_t) q_t, for QB queries in increasing t: cpu.c's values_query chain, lane by lane. W: 2 or
 * 4 zmm (one or two blocks); d0 a multiple of KV_QK. */
KVZ_INLINE void kvz_values_acc(const int QB, const int W, const int T, const float *const *s, int64_t t0, int64_t t1,
                               const char *v, const int64_t *table, int64_t g, int64_t KV, int64_t B, int64_t D,
                               int64_t d0, float *const *acc_mem) {
    const int64_t RB = kv_row_bytes(T, D);
    __m512 acc[4][4];
    _Pragma("GCC unroll 4") for (int j = 0; j < QB; j++)
        _Pragma("GCC unroll 4") for (int w = 0; w < W; w++) acc[j][w] = _mm512_loadu_ps(acc_mem[j] + d0 + 16 * w);
    for (int64_t b = t0 / B; b * B < t1; b++) {
        const int64_t base = b * B, u0 = t0 > base ? t0 : base, u1 = t1 < base + B ? t1 : base + B;
        const char *vb = v + (table[b] * KV + g) * B * RB;
        for (int64_t t = u0; t < u1; t++) {
            const char *vt = vb + (t - base) * RB;
            _Pragma("GCC unroll 2") for (int w = 0; w < W; w += 2) {
                __m512 lo, hi;
                kvz_levels32(vt, d0 + 16 * w, T, &lo, &hi);
                const __m512 dv = _mm512_set1_ps(kv_half(vt + (d0 + 16 * w) / KV_QK * KV_QBLOCK_BYTES(T)));
                _Pragma("GCC unroll 4") for (int j = 0; j < QB; j++) {
                    const __m512 pd = _mm512_mul_ps(_mm512_set1_ps(s[j][t]), dv); /* the weight times the scale, once */
                    acc[j][w] = _mm512_fmadd_ps(pd, lo, acc[j][w]);
                    acc[j][w + 1] = _mm512_fmadd_ps(pd, hi, acc[j][w + 1]);
                }
            }
        }
    }
    _Pragma("GCC unroll 4") for (int j = 0; j < QB; j++)
        _Pragma("GCC unroll 4") for (int w = 0; w < W; w++) _mm512_storeu_ps(acc_mem[j] + d0 + 16 * w, acc[j][w]);
}

/* kvz_values_acc over lanes [d0, d1) (multiples of KV_QK) in pieces of 64 and 32. */
KVZ_INLINE void kvz_values_range(const int QB, const int T, const float *const *s, int64_t t0, int64_t t1, const char *v,
                                 const int64_t *table, int64_t g, int64_t KV, int64_t B, int64_t D, int64_t d0,
                                 int64_t d1, float *const *acc) {
    for (; d0 + 64 <= d1; d0 += 64) kvz_values_acc(QB, 4, T, s, t0, t1, v, table, g, KV, B, D, d0, acc);
    for (; d0 < d1; d0 += 32) kvz_values_acc(QB, 2, T, s, t0, t1, v, table, g, KV, B, D, d0, acc);
}

/* cpu.c's values_query for qn (1..4) queries of one KV group at once, lanes [d0, d1): out_j = (sum over
 * [lo_j, hi_j) of s_j[t] v_t) / sums[j]. Queries that start together run together up to the first end,
 * then each on alone (its chain continued); queries that start apart (a sliding window) run alone. */
static KVZ_TARGET void kvz_values(int64_t qn, int64_t T, const float *const *s, const int64_t *lo, const int64_t *hi,
                                  const char *v, const int64_t *table, int64_t g, int64_t KV, int64_t B, int64_t D,
                                  int64_t d0, int64_t d1, const float *sums, float *const *outs) {
    int64_t same = 1, hi_min = hi[0];
    for (int64_t j = 0; j < qn; j++) {
        same &= lo[j] == lo[0];
        hi_min = hi[j] < hi_min ? hi[j] : hi_min;
        memset(outs[j] + d0, 0, sizeof(float) * (d1 - d0));
    }
    int64_t done = lo[0];
    if (same && qn > 1) {
#define KVZ_VALUES_CASE(QB, TT) \
    case (QB) + 4 * (TT): kvz_values_range(QB, TT, s, lo[0], hi_min, v, table, g, KV, B, D, d0, d1, outs); break;
        switch (qn + 4 * T) {
            KVZ_VALUES_CASE(2, KV_Q8_0) KVZ_VALUES_CASE(3, KV_Q8_0) KVZ_VALUES_CASE(4, KV_Q8_0)
            KVZ_VALUES_CASE(2, KV_Q4_0) KVZ_VALUES_CASE(3, KV_Q4_0) KVZ_VALUES_CASE(4, KV_Q4_0)
        }
#undef KVZ_VALUES_CASE
        done = hi_min;
    }
    for (int64_t j = 0; j < qn; j++) {
        const int64_t t0 = same && qn > 1 ? done : lo[j];
        if (T == KV_Q8_0) kvz_values_range(1, KV_Q8_0, s + j, t0, hi[j], v, table, g, KV, B, D, d0, d1, outs + j);
        else kvz_values_range(1, KV_Q4_0, s + j, t0, hi[j], v, table, g, KV, B, D, d0, d1, outs + j);
        const __m512 total = _mm512_set1_ps(sums[j]);
        for (int64_t d = d0; d < d1; d += 16) _mm512_storeu_ps(outs[j] + d, _mm512_div_ps(_mm512_loadu_ps(outs[j] + d), total));
    }
}
#endif
