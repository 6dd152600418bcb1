/* How a packed block of each format (quant.c's layout) becomes the integers its scales multiply
 * and those scales: one row's weight at a time for the portable scalar GEMM (weight_code,
 * block_scales_scalar: the definition), a whole block of eight rows at a time in ymm registers
 * for the AVX2, AVX-VNNI and AVX-512 loops (decode_block_avx2, block_scales_avx2: the same
 * integers and the same float32 products). Included by quant.c after its layout helpers.
 *
 * Scales come as sc[4]: sc[0] the scale of weights 0..15 (of all 32 where a block has one; MXFP4's
 * from its E8M0 byte), sc[1] of weights 16..31 (Q6_K, Q3_K, Q2_K), sc[2] the min (of weights 0..15 for Q2_K),
 * sc[3] Q2_K's min of weights 16..31.
 */

/* IQ4_NL's and IQ4_XS's 16 levels (ggml-common.h's kvalues_iq4nl), indexed by a nibble */
static const int8_t IQ4_LEVELS[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
/* MXFP4's 16 levels (ggml-common.h's kvalues_mxfp4: E2M1's values doubled; 8 is -0), indexed by a nibble */
static const int8_t MXFP4_LEVELS[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/* An E8M0 scale byte as the float32 that multiplies MXFP4's doubled levels: 2^(e - 128), exactly
 * (ggml-impl.h's GGML_E8M0_TO_FP32_HALF; e = 0 and 1 subnormal). */
static inline float e8m0_half(uint8_t e) {
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* Row j's weight k's bits in a block's planes: its nibble, its bit of a one-bit plane, its two bits
 * of a two-bit plane. */
static inline int nibble_at(const uint8_t *qs, int j, int k) {
    const int kk = k % 16, byte = qs[(kk / 4) * 32 + j * 4 + kk % 4];
    return k < 16 ? byte & 15 : byte >> 4;
}
static inline int bit_at(const uint8_t *plane, int j, int k) { return (plane[4 * j + k % 4] >> (k / 4)) & 1; }
static inline int pair_at(const uint8_t *plane, int j, int k) {
    const int c = k / 4;
    return (plane[32 * (c / 4) + 4 * j + k % 4] >> (2 * (c % 4))) & 3;
}

/* Row j's weight k of a block's quants, as the integer its scale multiplies (before Q4_0's and
 * Q5_0's code_offset). */
static inline int32_t weight_code(int64_t fmt, const uint8_t *qs, int j, int k) {
    switch (fmt) {
    case FD_W_Q8_0: return (int8_t)qs[(k / 4) * 32 + j * 4 + k % 4];
    case FD_W_Q5_0: case FD_W_Q5_1: case FD_W_Q5_K: return nibble_at(qs, j, k) | bit_at(qs + 128, j, k) << 4;
    case FD_W_Q6_K: return (nibble_at(qs, j, k) | pair_at(qs + 128, j, k) << 4) - 32;
    case FD_W_Q3_K: return (pair_at(qs, j, k) | bit_at(qs + 64, j, k) << 2) - 4;
    case FD_W_Q2_K: return pair_at(qs, j, k);
    case FD_W_IQ4_NL: case FD_W_IQ4_XS: return IQ4_LEVELS[nibble_at(qs, j, k)];
    case FD_W_MXFP4: return MXFP4_LEVELS[nibble_at(qs, j, k)];
    default: return nibble_at(qs, j, k); /* Q4_0, Q4_1, Q4_K */
    }
}

static inline float f16_at(const uint8_t *p) { return fp16_to_f32(load_u16(p)); }

/* Row j's scales of block b in group wg (sc[4] as above; those a format lacks are 0). */
static void block_scales_scalar(int64_t fmt, const uint8_t *wg, int64_t b, int j, float sc[4]) {
    const uint8_t *sb = block_scales_at(fmt, wg, b);
    const int64_t sub = b % QSUPER, h = 2 * sub; /* a super-block's block, and its first half */
    sc[1] = sc[2] = sc[3] = 0.0f;
    switch (fmt) {
    case FD_W_Q4_K: case FD_W_Q5_K:
        sc[0] = f16_at(sb + 2 * j) * (float)sb[32 + 8 * sub + j];
        sc[2] = -(f16_at(sb + 16 + 2 * j) * (float)sb[96 + 8 * sub + j]);
        break;
    case FD_W_Q6_K: case FD_W_Q3_K: {
        const float d = f16_at(sb + 2 * j);
        sc[0] = d * (float)(int8_t)sb[16 + 8 * h + j];
        sc[1] = d * (float)(int8_t)sb[16 + 8 * (h + 1) + j];
        break;
    }
    case FD_W_Q2_K: {
        const float d = f16_at(sb + 2 * j), dmin = f16_at(sb + 16 + 2 * j);
        const int v0 = sb[32 + 8 * h + j], v1 = sb[32 + 8 * (h + 1) + j]; /* sc | m << 4 */
        sc[0] = d * (float)(v0 & 15);
        sc[1] = d * (float)(v1 & 15);
        sc[2] = -(dmin * (float)(v0 >> 4));
        sc[3] = -(dmin * (float)(v1 >> 4));
        break;
    }
    case FD_W_IQ4_XS: sc[0] = f16_at(sb + 2 * j) * (float)(int8_t)sb[16 + 8 * sub + j]; break;
    case FD_W_MXFP4: sc[0] = e8m0_half(sb[j]); break; /* e[8] */
    default: /* blocks of 32: fp16 d[8], then Q4_1's and Q5_1's m[8] */
        sc[0] = f16_at(sb + 2 * j);
        if (has_min(fmt)) sc[2] = f16_at(sb + 16 + 2 * j);
    }
}

/* ---- AVX2: a block of eight rows at once ---- */

/* The eight chunks of a nibble plane, as unsigned bytes 0..15. */
QAINLINE void q4_unpack(const uint8_t *qs, __m256i W[8]) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (int p = 0; p < 4; p++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * p));
        W[p] = _mm256_and_si256(v, low);
        W[p + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
    }
}

/* Each byte's bits from .. (under mask >> to) moved to bits to ..: a 16-bit shift moves a byte's field
 * within that byte (from and to both leave it inside bits 0..7), and the mask drops what the other
 * byte of the pair shifted in. */
QAINLINE __m256i bits_to(__m256i v, int from, int to, int mask) {
    const __m256i s = from > to ? _mm256_srli_epi16(v, from - to) : _mm256_slli_epi16(v, to - from);
    return _mm256_and_si256(s, _mm256_set1_epi8((char)mask));
}

/* Block qs's eight chunks as the integers weight_code gives (lane 4 j + i of chunk c: row j's weight
 * 4 c + i): signed bytes for the has_signed_codes formats, unsigned ones for the others. */
QAINLINE void decode_block_avx2(const int64_t fmt, const uint8_t *qs, __m256i W[8]) {
    if (fmt == FD_W_Q8_0) {
        for (int c = 0; c < 8; c++) W[c] = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
        return;
    }
    if (fmt == FD_W_Q3_K || fmt == FD_W_Q2_K) { /* a two-bit plane of the low bits */
        for (int h = 0; h < 2; h++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * h));
            for (int c = 0; c < 4; c++) W[4 * h + c] = bits_to(v, 2 * c, 0, 0x03);
        }
    } else {
        q4_unpack(qs, W);
    }
    if (fmt == FD_W_Q5_0 || fmt == FD_W_Q5_1 || fmt == FD_W_Q5_K) { /* bit 4 from the one-bit plane */
        const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 128));
        for (int c = 0; c < 8; c++) W[c] = _mm256_or_si256(W[c], bits_to(v, c, 4, 0x10));
    } else if (fmt == FD_W_Q6_K) { /* bits 4, 5 from the two-bit plane; q = u - 32 */
        for (int h = 0; h < 2; h++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 128 + 32 * h));
            for (int c = 0; c < 4; c++)
                W[4 * h + c] = _mm256_sub_epi8(_mm256_or_si256(W[4 * h + c], bits_to(v, 2 * c, 4, 0x30)), _mm256_set1_epi8(32));
        }
    } else if (fmt == FD_W_Q3_K) { /* bit 2 from the one-bit plane; q = u - 4 */
        const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 64));
        for (int c = 0; c < 8; c++) W[c] = _mm256_sub_epi8(_mm256_or_si256(W[c], bits_to(v, c, 2, 0x04)), _mm256_set1_epi8(4));
    } else if (fmt == FD_W_IQ4_NL || fmt == FD_W_IQ4_XS || fmt == FD_W_MXFP4) { /* the nibble picks its level */
        const int8_t *table = fmt == FD_W_MXFP4 ? MXFP4_LEVELS : IQ4_LEVELS;
        const __m256i levels = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)table));
        for (int c = 0; c < 8; c++) W[c] = _mm256_shuffle_epi8(levels, W[c]);
    }
}

/* Eight unsigned / signed bytes (the eight rows' sc of one block) as float32. */
QAINLINE __m256i u8_to_epi32(const uint8_t *p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
QAINLINE __m256 u8_to_ps(const uint8_t *p) { return _mm256_cvtepi32_ps(u8_to_epi32(p)); }
QAINLINE __m256 i8_to_ps(const uint8_t *p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p))); }
QAINLINE __m256 f16x8(const uint8_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
QAINLINE __m256 negate_ps(__m256 v) { return _mm256_xor_ps(v, _mm256_set1_ps(-0.0f)); } /* -(v): the sign flipped, exactly */
/* Eight E8M0 bytes as e8m0_half's floats: (e - 1) << 23, or 0x00200000 << e where e < 2. */
QAINLINE __m256 e8m0_half_x8(const uint8_t *p) {
    const __m256i e = u8_to_epi32(p), one = _mm256_set1_epi32(1);
    const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, one), 23);
    const __m256i tiny = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
    return _mm256_castsi256_ps(_mm256_blendv_epi8(normal, tiny, _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e)));
}

/* The eight outputs' scales of block b in group wg: block_scales_scalar's values, lane j row j. */
QAINLINE void block_scales_avx2(const int64_t fmt, const uint8_t *wg, int64_t b, __m256 sc[4]) {
    const uint8_t *sb = block_scales_at(fmt, wg, b);
    const int64_t sub = b % QSUPER, h = 2 * sub;
    sc[1] = sc[2] = sc[3] = _mm256_setzero_ps();
    switch (fmt) {
    case FD_W_Q4_K: case FD_W_Q5_K:
        sc[0] = _mm256_mul_ps(f16x8(sb), u8_to_ps(sb + 32 + 8 * sub));
        sc[2] = negate_ps(_mm256_mul_ps(f16x8(sb + 16), u8_to_ps(sb + 96 + 8 * sub)));
        break;
    case FD_W_Q6_K: case FD_W_Q3_K: {
        const __m256 d = f16x8(sb);
        sc[0] = _mm256_mul_ps(d, i8_to_ps(sb + 16 + 8 * h));
        sc[1] = _mm256_mul_ps(d, i8_to_ps(sb + 16 + 8 * (h + 1)));
        break;
    }
    case FD_W_Q2_K: {
        const __m256 d = f16x8(sb), dmin = f16x8(sb + 16);
        const __m256i v0 = u8_to_epi32(sb + 32 + 8 * h), v1 = u8_to_epi32(sb + 32 + 8 * (h + 1)), low = _mm256_set1_epi32(15);
        sc[0] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_and_si256(v0, low)));
        sc[1] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_and_si256(v1, low)));
        sc[2] = negate_ps(_mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_srli_epi32(v0, 4))));
        sc[3] = negate_ps(_mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_srli_epi32(v1, 4))));
        break;
    }
    case FD_W_IQ4_XS: sc[0] = _mm256_mul_ps(f16x8(sb), i8_to_ps(sb + 16 + 8 * sub)); break;
    case FD_W_MXFP4: sc[0] = e8m0_half_x8(sb); break;
    default:
        sc[0] = f16x8(sb);
        if (has_min(fmt)) sc[2] = f16x8(sb + 16);
    }
}

/* A block of a format in one of the loops' kinds of several formats (quant.c's QKIND_*): its
 * integers stored to tile (32-aligned, chunk c at 32 c) and its scales, for all the rows of a tile.
 * Not inlined: one copy of every format's decoding, where inlining it into each kind's tile of
 * every row count (and each instruction set's loop) doubled the library's compile time. */
static __attribute__((noinline)) void decode_block_to(int64_t fmt, const uint8_t *wg, int64_t b, int8_t *tile, __m256 sc[4]) {
    __m256i W[8];
    decode_block_avx2(fmt, block_quants_at(fmt, wg, b), W);
    for (int c = 0; c < 8; c++) _mm256_store_si256((__m256i *)(tile + 32 * c), W[c]);
    block_scales_avx2(fmt, wg, b, sc);
}
