/* What the paged KV cache holds, one row (a position's D values of one KV head) at a time:
 *
 *     KV_F32   D float32                              4 D bytes
 *     KV_F16   D float16                              2 D bytes (llama.cpp's default cache)
 *     KV_Q8_0  D / 32 blocks: fp16 d, 32 int8 q       34 D / 32 bytes   value = d * q
 *     KV_Q4_0  D / 32 blocks: fp16 d, 16 nibble bytes 18 D / 32 bytes   value = d * (q - 8)
 *
 * The quantized rows are ggml's block_q8_0 / block_q4_0, byte for byte (in a nibble byte i
 * the low nibble is value i of the block, the high one value 16 + i), quantized with ggml's
 * reference rounding (quantize_row_q8_0_ref / _q4_0_ref; fastdecode.kernels.gguf_blocks does the
 * same in torch, and a test holds the two to the same bytes) - the cache llama.cpp keeps
 * with -ctk / -ctv q8_0 or q4_0.
 *
 * Row invariance is untouched, as with float16: a row is quantized once, by the pass that
 * computes its key and value (those bits are the same in every pass), and every reader
 * reads it the same way. Attention over a quantized cache is attention over its dequantized
 * values to float32's rounding, in integers where it pays: scores run on the exact integer
 * sums of each key block against the query rounded once to int8 blocks (kv_quantize_query,
 * below: llama.cpp's vec_dot_q8_0_q8_0 / q4_0_q8_0), and a value block's scale is folded into
 * the weight, (p d) * q. Each score and each output lane is still one fixed chain over the
 * blocks and positions, whatever the pass, so a row's bits are the same in any pass.
 *
 * A quantized type may carry KV_ROTATED (kv_rotate): the row is stored as the blocks of H x,
 * H an orthonormal Walsh-Hadamard transform (QuaRot's rotation), which spreads an outlier
 * channel over its group so a 4-bit block scale fits the other channels better. Attention
 * then takes q.k = (H q).(H k) and sum_t p_t v_t = H (sum_t p_t H v_t) (H = H^T = H^-1):
 * fd_attention_f32 rotates its queries when the keys are rotated and its outputs when the
 * values are, so the rotation never leaves this format (the readers see a plain q4_0 row).
 * It is deterministic per row, so row invariance holds as before.
 *
 * The types are compile-time constants in the inlined helpers (each reader is built once
 * per type); the codes are fastdecode.kernels.abi's KV_FORMATS (and KV_ROTATED). */
#define KV_F32 0
#define KV_F16 1
#define KV_Q8_0 2
#define KV_Q4_0 3
#define KV_ROTATED 4
#define KV_TYPE(T) ((T) & 3) /* the row layout, without KV_ROTATED */
#define KV_QK 32

/* In place over x[0 .. D): x <- H x, H block-diagonal of normalized Walsh-Hadamard matrices of
 * G = the largest power of two dividing D (all of D = 64 or 128; 32 at D = 96), each a
 * radix-2 butterfly (a + b, a - b) over strides 1, 2, .. G / 2, then a multiply by
 * 1 / sqrt(G) in float32. H is symmetric and orthonormal, so it is its own inverse (in exact
 * arithmetic). kv_formats.hadamard is this in torch, the same operations in the same order:
 * the same bits. */
static void kv_rotate(float *x, int64_t D) {
    const int64_t G = D & -D;
    const float s = (float)(1.0 / sqrt((double)G));
    for (int64_t g0 = 0; g0 < D; g0 += G) {
        float *y = x + g0;
        for (int64_t h = 1; h < G; h *= 2)
            for (int64_t i = 0; i < G; i += 2 * h)
                for (int64_t j = i; j < i + h; j++) {
                    const float a = y[j], b = y[j + h];
                    y[j] = a + b;
                    y[j + h] = a - b;
                }
        for (int64_t j = 0; j < G; j++) y[j] *= s;
    }
}

/* A key affine (fastdecode.backends.kv_calibration): per KV head, A = [mu | inv_s | s | F], KV_AFFINE_FLOATS(D) floats
 * (F below, at KV_AFFINE_F). A key row x
 * is stored as (x - mu) * inv_s (before KV_ROTATED's rotation and the rounding), and every query that meets it is
 * taken as q * s (fd_attention_f32), so (q s).((x - mu) inv_s) = q.x - q.mu in exact arithmetic: one constant per
 * query, which softmax ignores. mu centers the keys (their mean over a calibration text), s (SmoothAttention's
 * per-channel scale, QServe) gives the channels where keys are large against their queries a finer grid. Each
 * element is one float32 operation on that row alone: row invariance holds, and every implementation gets the
 * same bits. kv_formats.KVFormat.store does the same in torch. */
static inline void kv_key_affine(float *x, const float *A, int64_t D) {
    for (int64_t d = 0; d < D; d++) x[d] = (x[d] - A[d]) * A[D + d];
}

/* A head's affine is KV_AFFINE_FLOATS(D) floats: mu, inv_s, s (D each), then F, D x D, the rounding's error
 * feedback (GPTQ's, Frantar et al. 2022, over one key row): the stored row's elements are rounded in order, and
 * element j's error e_j = x_j - d l_j is taken off each later element, x_i -= e_j F[j][i] (i > j; F = 0: plain
 * rounding), F[j][i] = U[j][i] / U[j][j] with U the upper Cholesky factor of C^-1, C the second moment of the
 * queries that meet the row in its stored domain. The rounding then leaves the error the queries see least. */
#define KV_AFFINE_FLOATS(D) ((3 + (D)) * (D))
#define KV_AFFINE_F(A, D) ((A) + 3 * (D)) /* a head's F in its affine A */

/* bytes of one block of KV_QK values (quantized types), and of one row of D values */
#define KV_QBLOCK_BYTES(T) ((T) == KV_Q8_0 ? 2 + KV_QK : 2 + KV_QK / 2)
static inline int64_t kv_row_bytes(int64_t T, int64_t D) {
    T = KV_TYPE(T);
    return T == KV_F32 ? 4 * D : T == KV_F16 ? 2 * D : D / KV_QK * KV_QBLOCK_BYTES(T);
}

/* values a reader takes at once: a whole block for the quantized types (one scale) */
#define KV_STEP(T) ((T) >= KV_Q8_0 ? KV_QK : 8)

static inline float kv_half(const char *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* The scale of the block holding values d0 .. d0 + KV_QK - 1 of a quantized row (d0 a multiple
 * of KV_QK), broadcast. */
static inline __attribute__((always_inline)) __m256 kv_scale8(const char *row, int64_t d0, const int T) {
    return _mm256_set1_ps(kv_half(row + d0 / KV_QK * KV_QBLOCK_BYTES(T)));
}

/* The integers q (q8_0) or q - 8 (q4_0) of values d0 + dd .. d0 + dd + 7 of a quantized row, as
 * float32 (exact), unscaled (dd in 0, 8, 16, 24; d0 a multiple of KV_QK). */
static inline __attribute__((always_inline)) __m256 kv_levels8(const char *row, int64_t d0, const int dd, const int T) {
    const char *qs = row + d0 / KV_QK * KV_QBLOCK_BYTES(T) + 2;
    __m256i q;
    if (T == KV_Q8_0) {
        q = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(qs + dd)));
    } else {
        q = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qs + (dd & 15))));
        q = dd < 16 ? _mm256_and_si256(q, _mm256_set1_epi32(15)) : _mm256_srli_epi32(q, 4);
        q = _mm256_sub_epi32(q, _mm256_set1_epi32(8));
    }
    return _mm256_cvtepi32_ps(q);
}

/* Values d .. d + 7 of a float32 or float16 row as float32 (d a multiple of 8). */
static inline __attribute__((always_inline)) __m256 kv_load8(const char *row, int64_t d, const int T) {
    if (T == KV_F32) return _mm256_loadu_ps((const float *)row + d);
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)row + d)));
}

/* One row x[0 .. D) as blocks of quantized type T (KV_Q8_0 or KV_Q4_0, without KV_ROTATED): ggml's reference
 * rounding (q8_0: d = amax / 127, levels rounded half away from zero; q4_0: d = the first value of the largest
 * magnitude / -8, levels floor(x / d + 8.5) - 8), scales stored as float16. F: NULL, or the error feedback
 * (KV_AFFINE_FLOATS' F, D x D): each block's scale is then taken from its values as the earlier elements' errors
 * left them, and each value's error is taken off the later ones before they are rounded (x is overwritten). The
 * guards (a scale whose inverse is not finite, a level or an error that is not a number) are
 * kv_formats._store_feedback_torch's too. */
/* The level of value x / d (r = x * (1 / d)) in a block of type T: q8_0 round(r) in -127 .. 127 (halves away
 * from zero), q4_0 floor(r + 8.5) - 8 in -8 .. 7; a level that is not a number is 0 (q8_0) or -8 (q4_0). */
static inline int8_t kv_level(float r, int64_t T) {
    if (T == KV_Q8_0) {
        const float q = roundf(r);
        return (int8_t)(q != q ? 0 : q > 127.0f ? 127 : q < -127.0f ? -127 : (int)q);
    }
    const float q = r + 8.5f;
    return (int8_t)((!(q >= 0.0f) ? 0 : q >= 15.0f ? 15 : (int)q) - 8);
}

static void kv_store_blocks(char *row, float *x, int64_t D, int64_t T, const float *F) {
    for (int64_t b = 0; b < D / KV_QK; b++, row += KV_QBLOCK_BYTES(T)) {
        float *xb = x + b * KV_QK, amax = 0.0f, max = 0.0f;
        for (int j = 0; j < KV_QK; j++)
            if (amax < fabsf(xb[j])) {
                amax = fabsf(xb[j]);
                max = xb[j];
            }
        const float d = T == KV_Q8_0 ? amax / 127 : max / -8;
        const float id = d != 0.0f && isfinite(1.0f / d) ? 1.0f / d : 0.0f;
        const uint16_t h = _cvtss_sh(d, _MM_FROUND_TO_NEAREST_INT);
        const float dh = _cvtsh_ss(h);
        int8_t levels[KV_QK];
        memcpy(row, &h, 2);
        if (!F && T == KV_Q8_0) { /* a plain row's levels are in range by the scale: ggml's loop, vectorized */
            for (int j = 0; j < KV_QK; j++) levels[j] = (int8_t)roundf(xb[j] * id);
        } else if (!F) {
            for (int j = 0; j < KV_QK; j++) levels[j] = kv_level(xb[j] * id, T);
        } else {
            for (int j = 0; j < KV_QK; j++) {
                levels[j] = kv_level(xb[j] * id, T);
                const int64_t at = b * KV_QK + j;
                float e = xb[j] - dh * (float)levels[j];
                if (!isfinite(e)) e = 0.0f; /* a scale past float16's range: the error stays in its block */
                const float *f = F + at * D;
                for (int64_t i = at + 1; i < D; i++) x[i] -= e * f[i];
            }
        }
        if (T == KV_Q8_0)
            memcpy(row + 2, levels, KV_QK);
        else
            for (int j = 0; j < KV_QK / 2; j++) row[2 + j] = (char)((levels[j] + 8) | ((levels[j + KV_QK / 2] + 8) << 4));
    }
}

/* Write one row: x[0 .. D) (float32, D <= MAX_HEAD_DIM) into row, in type T (float16: rounded to
 * nearest even; KV_ROTATED: the blocks of kv_rotate(x)); F: NULL, or a quantized type's error feedback
 * (kv_store_blocks). */
static void kv_store_row(char *row, const float *x, int64_t D, int64_t T, const float *F) {
    if (KV_TYPE(T) == KV_F32) {
        memcpy(row, x, 4 * D);
        return;
    }
    if (KV_TYPE(T) == KV_F16) {
        for (int64_t d = 0; d < D; d++) ((uint16_t *)row)[d] = _cvtss_sh(x[d], _MM_FROUND_TO_NEAREST_INT);
        return;
    }
    float w[MAX_HEAD_DIM]; /* the row as rounded: rotated where T says, and overwritten by the feedback */
    memcpy(w, x, sizeof(float) * D);
    if (T & KV_ROTATED) kv_rotate(w, D);
    kv_store_blocks(row, w, D, KV_TYPE(T), F);
}

/* Scores against q8_0 and q4_0 keys run on integers, as llama.cpp's vec_dot_q8_0_q8_0 and
 * vec_dot_q4_0_q8_0: the query is quantized once per (row, head) to blocks of KV_QK int8 with a
 * float32 scale (kv_quantize_query; ggml's q8_0 rounding, the scale kept in float32). Block b of
 * key row t against the query gives the exact integer i_b = sum k q (|i_b| <= 32 * 127^2 < 2^24:
 * exact in float32 too), and the score is one fixed chain over the blocks,
 *
 *     s_b = dq_b * dk_b;  a = s_0 * i_0;  a = fma(s_b, i_b, a) for b = 1 ..;  score = a * scale
 *
 * in float32 - per position, so the ymm loop's lanes (kv_scores8: eight positions), the zmm loop's
 * (kv_avx512.c: sixteen) and the one-position tail (kv_score1) give the same bits however a pass
 * splits its positions. The query's rounding changes the numbers a little (docs/benchmarks.md §11
 * measures it) but not row invariance: a query's blocks depend on that query alone, and the
 * integer sums are exact in any order. (Before, each block's eight partial sums were widened and
 * scaled lane by lane, then summed across the lanes in float32: per score two chains of eight
 * lanes and a horizontal float sum, where the integers now reduce exactly, eight positions at
 * once, and the scales are applied once a position.) */
#define KV_QBLOCK_Q_BYTES (8 + KV_QK) /* a query block: float32 d, int32 sum of its q, KV_QK int8 q */
static inline int64_t kv_query_floats(int64_t D) { return D / KV_QK * KV_QBLOCK_Q_BYTES / 4; }

static void kv_quantize_query(const float *x, int64_t D, char *out) {
    for (int64_t b = 0; b < D / KV_QK; b++, x += KV_QK, out += KV_QBLOCK_Q_BYTES) {
        float amax = 0.0f;
        for (int j = 0; j < KV_QK; j++) amax = fabsf(x[j]) > amax ? fabsf(x[j]) : amax;
        const float d = amax / 127, id = d != 0.0f ? 1.0f / d : 0.0f;
        int32_t sum = 0;
        for (int j = 0; j < KV_QK; j++) sum += ((int8_t *)out)[8 + j] = (int8_t)roundf(x[j] * id);
        memcpy(out, &d, 4);
        memcpy(out + 4, &sum, 4);
    }
}

/* A query block's scale dq, and the offset its integer sums carry over q4_0 keys (kv_isum_parts). */
static inline __attribute__((always_inline)) float kv_query_d(const char *qb) {
    float d;
    memcpy(&d, qb, 4);
    return d;
}
static inline __attribute__((always_inline)) int32_t kv_query_sum(const char *qb) {
    int32_t s;
    memcpy(&s, qb + 4, 4);
    return s;
}

/* Block b of a quantized key row as 32 int8 (q8_0: q; q4_0: the nibbles - 8, low nibbles of bytes
 * 0..15 then their high nibbles, the block's value order). */
static inline __attribute__((always_inline)) __m256i kv_key_levels(const char *row, int64_t b, const int T) {
    const char *qs = row + b * KV_QBLOCK_BYTES(T) + 2;
    if (T == KV_Q8_0) return _mm256_loadu_si256((const __m256i *)qs);
    const __m128i x = _mm_loadu_si128((const __m128i *)qs), m = _mm_set1_epi8(15);
    const __m256i q = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(x, 4), m), _mm_and_si128(x, m));
    return _mm256_sub_epi8(q, _mm256_set1_epi8(8));
}

/* i_b of a key row's block b against query block q (its 32 int8) as eight int32 partial sums, over
 * q4_0 keys plus 8 times q's sum (kv_query_sum: taken off once the lanes are reduced): maddubs +
 * madd over |k| and q signed as k (q8_0), or over the stored nibbles k + 8 and q (q4_0); no
 * saturation, a pair of products stays under 2^15 (|k| <= 127 or k + 8 <= 15, |q| <= 127). */
static inline __attribute__((always_inline)) __m256i kv_isum_parts(const char *row, int64_t b, const int8_t *q, const int T) {
    const __m256i qv = _mm256_loadu_si256((const __m256i *)q), ones = _mm256_set1_epi16(1);
    if (T == KV_Q4_0) {
        const __m128i x = _mm_loadu_si128((const __m128i *)(row + b * KV_QBLOCK_BYTES(T) + 2)), m = _mm_set1_epi8(15);
        const __m256i n = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(x, 4), m), _mm_and_si128(x, m));
        return _mm256_madd_epi16(_mm256_maddubs_epi16(n, qv), ones);
    }
    const __m256i k = kv_key_levels(row, b, T);
    return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(k, k), _mm256_sign_epi8(qv, k)), ones);
}

/* What kv_isum_parts' lanes carry beyond i_b: 8 times the query block's sum over q4_0 keys, else 0. */
static inline __attribute__((always_inline)) int32_t kv_isum_offset(const char *qb, const int T) {
    return T == KV_Q4_0 ? 8 * kv_query_sum(qb) : 0;
}

/* Lane p: the (exact) sum of v[p]'s eight int32 lanes, p < 8. */
static inline __attribute__((always_inline)) __m256i kv_hsum_epi32x8(const __m256i *v) {
    const __m256i a01 = _mm256_hadd_epi32(v[0], v[1]), a23 = _mm256_hadd_epi32(v[2], v[3]);
    const __m256i a45 = _mm256_hadd_epi32(v[4], v[5]), a67 = _mm256_hadd_epi32(v[6], v[7]);
    const __m256i b0 = _mm256_hadd_epi32(a01, a23), b1 = _mm256_hadd_epi32(a45, a67); /* [v0..v3 | v0..v3 high] */
    return _mm256_add_epi32(_mm256_permute2x128_si256(b0, b1, 0x20), _mm256_permute2x128_si256(b0, b1, 0x31));
}

/* The fp16 scales of block b of eight rows at rows + offsets[p] (RB apart) as float32. */
static inline __attribute__((always_inline)) __m256 kv_scales8(const char *rows, __m256i offsets, int64_t b, const int T) {
    const __m256i h = _mm256_i32gather_epi32((const int *)(rows + b * KV_QBLOCK_BYTES(T)), offsets, 1);
    const __m256i lo = _mm256_and_si256(h, _mm256_set1_epi32(0xFFFF));
    return _mm256_cvtph_ps(_mm_packus_epi32(_mm256_castsi256_si128(lo), _mm256_extracti128_si256(lo, 1)));
}

/* The score of one key row against query q (kv_quantize_query's blocks). */
static inline __attribute__((always_inline)) float kv_score1(const char *row, const char *q, int64_t D, float scale, const int T) {
    __m128 a = _mm_setzero_ps();
    for (int64_t b = 0; b < D / KV_QK; b++) {
        const char *qb = q + b * KV_QBLOCK_Q_BYTES;
        const __m256i parts = kv_isum_parts(row, b, (const int8_t *)qb + 8, T);
        __m128i i4 = _mm_add_epi32(_mm256_castsi256_si128(parts), _mm256_extracti128_si256(parts, 1));
        i4 = _mm_add_epi32(i4, _mm_shuffle_epi32(i4, 0x4E));
        i4 = _mm_sub_epi32(_mm_add_epi32(i4, _mm_shuffle_epi32(i4, 0xB1)), _mm_set1_epi32(kv_isum_offset(qb, T)));
        const __m128 s = _mm_set_ss(kv_query_d(qb) * kv_half(row + b * KV_QBLOCK_BYTES(T))), i = _mm_cvtepi32_ps(i4);
        a = b == 0 ? _mm_mul_ss(s, i) : _mm_fmadd_ss(s, i, a);
    }
    return _mm_cvtss_f32(_mm_mul_ss(a, _mm_set_ss(scale)));
}

/* kv_score1 of the eight rows rows + p RB (p < 8) for QB queries qs[j]: out[j][0 .. 8). */
static inline __attribute__((always_inline)) void kv_scores8(const int QB, const int T, const char *const *qs,
                                                             const char *rows, int64_t RB, int64_t D, float scale,
                                                             float *const *out) {
    const __m256i offsets = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32((int)RB));
    __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()}; /* set at b = 0 */
    for (int64_t b = 0; b < D / KV_QK; b++) {
        const __m256 dk = kv_scales8(rows, offsets, b, T);
        _Pragma("GCC unroll 4") for (int j = 0; j < QB; j++) {
            const char *qb = qs[j] + b * KV_QBLOCK_Q_BYTES;
            __m256i parts[8];
            _Pragma("GCC unroll 8") for (int p = 0; p < 8; p++) parts[p] = kv_isum_parts(rows + p * RB, b, (const int8_t *)qb + 8, T);
            const __m256i isum = _mm256_sub_epi32(kv_hsum_epi32x8(parts), _mm256_set1_epi32(kv_isum_offset(qb, T)));
            const __m256 s = _mm256_mul_ps(_mm256_set1_ps(kv_query_d(qb)), dk), i = _mm256_cvtepi32_ps(isum);
            a[j] = b == 0 ? _mm256_mul_ps(s, i) : _mm256_fmadd_ps(s, i, a[j]);
        }
    }
    _Pragma("GCC unroll 4") for (int j = 0; j < QB; j++) _mm256_storeu_ps(out[j], _mm256_mul_ps(a[j], _mm256_set1_ps(scale)));
}
