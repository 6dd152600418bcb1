/* What the paged KV cache holds, one row (a position's D values of one KV head) at a time:
 *
 *     KV_F32   D float32                              4 D bytes
 *     KV_F16   D float16                              2 D bytes (llama.cpp's default cache)
 *     KV_Q8_0  D / 32 blocks: fp16 d, 32 int8 q       34 D / 32 bytes   value = d * q
 *     KV_Q4_0  D / 32 blocks: fp16 d, 16 nibble bytes 18 D / 32 bytes   value = d * (q - 8)
 *
 * The quantized rows are ggml's block_q8_0 / block_q4_0, byte for byte (in a nibble byte i
 * the low nibble is value i of the block, the high one value 16 + i), quantized with ggml's
 * reference rounding (quantize_row_q8_0_ref / _q4_0_ref; fastdecode.gguf_blocks does the
 * same in torch, and a test holds the two to the same bytes) - the cache llama.cpp keeps
 * with -ctk / -ctv q8_0 or q4_0.
 *
 * Row invariance is untouched, as with float16: a row is quantized once, by the pass that
 * computes its key and value (those bits are the same in every pass), and every reader
 * widens it the same way. A widened value d * q is exact in float32 (an 11-bit mantissa
 * times an integer of at most 8 bits), so attention over a quantized cache gives the very
 * bits attention over a float32 cache holding the dequantized values gives: the scale is
 * applied to each loaded value, not folded into the scores.
 *
 * The types are compile-time constants in the inlined helpers (each reader is built once
 * per type); the codes are fastdecode.kernels.abi's KV_FORMATS. */
#define KV_F32 0
#define KV_F16 1
#define KV_Q8_0 2
#define KV_Q4_0 3
#define KV_QK 32

/* bytes of one block of KV_QK values (quantized types), and of one row of D values */
#define KV_QBLOCK_BYTES(T) ((T) == KV_Q8_0 ? 2 + KV_QK : 2 + KV_QK / 2)
static inline int64_t kv_row_bytes(int64_t T, int64_t D) {
    return T == KV_F32 ? 4 * D : T == KV_F16 ? 2 * D : D / KV_QK * KV_QBLOCK_BYTES(T);
}

/* values a reader takes at once: a whole block for the quantized types (one scale) */
#define KV_STEP(T) ((T) >= KV_Q8_0 ? KV_QK : 8)

static inline float kv_half(const char *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* The scale of the block holding values d0 .. d0 + KV_QK - 1 of a row (d0 a multiple of KV_QK),
 * broadcast; 1 for the float types (unused). */
static inline __attribute__((always_inline)) __m256 kv_scale8(const char *row, int64_t d0, const int T) {
    if (T < KV_Q8_0) return _mm256_set1_ps(1.0f);
    return _mm256_set1_ps(kv_half(row + d0 / KV_QK * KV_QBLOCK_BYTES(T)));
}

/* Values d0 + dd .. d0 + dd + 7 of a row as float32 (dd in 0, 8, 16, 24 for the quantized
 * types, 0 otherwise; d0 a multiple of KV_STEP), sc its block's kv_scale8. */
static inline __attribute__((always_inline)) __m256 kv_load8(const char *row, int64_t d0, const int dd, __m256 sc,
                                                             const int T) {
    if (T == KV_F32) return _mm256_loadu_ps((const float *)row + d0 + dd);
    if (T == KV_F16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)row + d0 + dd)));
    const char *qs = row + d0 / KV_QK * KV_QBLOCK_BYTES(T) + 2;
    __m256i q;
    if (T == KV_Q8_0) {
        q = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(qs + dd)));
    } else {
        q = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qs + (dd & 15))));
        q = dd < 16 ? _mm256_and_si256(q, _mm256_set1_epi32(15)) : _mm256_srli_epi32(q, 4);
        q = _mm256_sub_epi32(q, _mm256_set1_epi32(8));
    }
    return _mm256_mul_ps(_mm256_cvtepi32_ps(q), sc); /* exact: see above */
}

/* Write one row: x[0 .. D) (float32) into row, in type T (float16: rounded to nearest even). */
static void kv_store_row(char *row, const float *x, int64_t D, int64_t T) {
    if (T == KV_F32) {
        memcpy(row, x, 4 * D);
        return;
    }
    if (T == KV_F16) {
        for (int64_t d = 0; d < D; d++) ((uint16_t *)row)[d] = _cvtss_sh(x[d], _MM_FROUND_TO_NEAREST_INT);
        return;
    }
    for (int64_t b = 0; b < D / KV_QK; b++, x += KV_QK, row += KV_QBLOCK_BYTES(T)) {
        float amax = 0.0f, max = 0.0f; /* the largest magnitude, and (q4_0) the first value that has it */
        for (int j = 0; j < KV_QK; j++)
            if (amax < fabsf(x[j])) {
                amax = fabsf(x[j]);
                max = x[j];
            }
        const float d = T == KV_Q8_0 ? amax / 127 : max / -8;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        const uint16_t h = _cvtss_sh(d, _MM_FROUND_TO_NEAREST_INT);
        memcpy(row, &h, 2);
        if (T == KV_Q8_0) {
            for (int j = 0; j < KV_QK; j++) ((int8_t *)row)[2 + j] = (int8_t)roundf(x[j] * id);
        } else {
            for (int j = 0; j < KV_QK / 2; j++) {
                const int8_t lo = (int8_t)(x[j] * id + 8.5f), hi = (int8_t)(x[j + KV_QK / 2] * id + 8.5f);
                row[2 + j] = (char)((lo < 15 ? lo : 15) | ((hi < 15 ? hi : 15) << 4));
            }
        }
    }
}
