/* Integer dot products over ggml's block formats, row-invariant:
 * Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, MXFP4, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS.
 *
 *     y[m, n] = sum over blocks b of  (dw[n, b] * dx[m, b]) * isum[m, n, b]  (+ mw[n, b] * sx[m, b] where a block has a min)
 *
 * Every format is read as blocks of 32 weights, weight = dw * q (+ mw), q an integer
 * (fastdecode/kernels/gguf_types.py's table): Q8_0 = d * q, Q4_0 = d * (q - 8), Q4_1 = d * q + m,
 * Q5_0 = d * (q - 16), Q5_1 = d * q + m (q 0..31), IQ4_NL = d * v[q] (v ggml's 16 int8
 * levels), with d and m fp16; MXFP4 = d * v'[q] (v' E2M1's 16 values doubled, kvalues_mxfp4)
 * with d = 2^(e - 128) from its E8M0 byte e (ggml's GGML_E8M0_TO_FP32_HALF: exact in float32);
 * the super-block formats (256 weights, eight blocks) with float32 scales that ggml forms from
 * the super-block's stored ones: Q4_K / Q5_K = dw * q + mw with q in 0..15 / 0..31, dw = d * sc and mw = -(dmin * m) (fp16 d and dmin, 6-bit sc and m a block);
 * IQ4_XS = dw * v[q], dw = d * (sc - 32); Q6_K and Q3_K = dw * q with two scales a block,
 * dw = d * sc for weights 0..15 and dw' = d * sc' for 16..31 (q - 32 in -32..31 and int8 sc;
 * q in -4..3 and sc - 32 of 6 bits); Q2_K = dw * q + mw, q in 0..3, with two of each a block
 * (dw = d * sc, mw = -(dmin * m), 4-bit sc and m a 16 weights). Each row of activations is
 * quantized here, per block of 32, to 8 bits the way ggml makes Q8_0 / Q8_1 (dx = max|x| / 127,
 * q = round-to-nearest-even(x / dx)), keeping dx, the block's sum of q and sx = dx * sum q (Q8_1's
 * s) in float32 where ggml rounds them to fp16, and for Q2_K's two mins a block each half's
 * sx' = dx * (sum of its 16 q). isum is the exact int32 sum of the 32 products of a block.
 *
 * Row invariance by construction: every output is accumulated alone, block by
 * block in increasing b, each block's term in float32 operations never fused
 * into FMAs -
 *
 *     t = dw * dx;  term = t * (float)isum;  [term = term + mw * sx;]  acc = acc + term
 *
 * (Q6_K, Q3_K, Q2_K: isum and isum' the two halves' sums, weights 0..15 and 16..31,
 *
 *     t = dw * dx;  term = t * (float)isum;  t' = dw' * dx;  term = term + t' * (float)isum';
 *     [Q2_K: term = term + mw * sx'0;  term = term + mw' * sx'1;]  acc = acc + term)
 *
 * - whatever the number of rows, the row tiles, the thread count or the
 * implementation: the ymm loop (quant_ymm.c: AVX2, or AVX-VNNI's vpdpbusd), the zmm one
 * (quant_avx512.c: AVX-512 VNNI), the portable scalar one, and the torch reference
 * (fastdecode/kernels/quant.py) give the same bits; each CPU runs the widest it has. A
 * super-block format's dw, dw' and mw are each one float32 product of its stored values
 * (d * (float)sc, mw's sign then flipped): the bits ggml dequantizes with.
 *
 * Weight layout (built by kernels/quant.py's pack, 64-byte aligned): outputs in
 * groups of eight (the last group padded with zero rows), one group after
 * another; a group holds its nb blocks in units - a pair of blocks (MXFP4: four; the
 * last unit's missing blocks padded with zero ones, never read), or a super-block of 8 -
 * each unit its blocks' scales, then their quants, so a pass reads one stream
 * (with the scales of all nb blocks first, as before, their second stream cost
 * Q4_1 a third of its one-row time: 4.1-4.7 -> 2.8-3.3 ms over SmolLM2's shapes,
 * one thread, CPU time, a loaded 2-core Zen 5):
 *   scales: per block d[8] fp16 (16 bytes), then m[8] fp16 for Q4_1 / Q5_1 (MXFP4: e[8], its
 *   E8M0 bytes, 8 a block, in units of four blocks: a unit's scales 32 bytes); per super-block
 *   the stored values, the products formed as each block is used (float32 dw and mw a block
 *   would make Q4_K 0.75 bytes a weight to stream, not 0.58, and Q6_K 1.25, not 0.83):
 *     Q4_K, Q5_K: d[8] fp16, dmin[8] fp16, sc[8 blocks][8 rows] u8, m[8 blocks][8 rows] u8 (160 bytes);
 *     Q6_K: d[8] fp16, sc[16 halves][8 rows] int8 (144 bytes, padded to 160);
 *     Q3_K: d[8] fp16, (sc - 32)[16 halves][8 rows] int8 (144, padded to 160);
 *     Q2_K: d[8] fp16, dmin[8] fp16, (sc | m << 4)[16 halves][8 rows] u8 (160);
 *     IQ4_XS: d[8] fp16, (sc - 32)[8 blocks][8 rows] int8 (80, padded to 96);
 *   every unit's scales a multiple of 32 bytes, so every quant vector below
 *   is 32-aligned (a 32-byte load across a cache line costs two);
 *   quants: per block, the eight rows' quants interleaved four at a time so that
 *   one 32-byte vector holds, for each of the eight outputs j, the same four
 *   consecutive weights ("chunk" c = weights 4c .. 4c + 3): byte 4 j + i of chunk
 *   c is row j's weight 4 c + i. The code u of a weight (q, or Q6_K's q + 32, Q3_K's q + 4,
 *   IQ4's and MXFP4's level index) is stored in planes, each plane's byte 4 j + i holding row j's
 *   weight 4 c + i's bits for every chunk c it covers:
 *     int8 (Q8_0): chunks 0..7 as int8, 256 bytes;
 *     nibbles (Q4_*, Q5_*, Q6_K, IQ4_*, MXFP4: u's low 4 bits), 128 bytes: vector p (p = 0..3)
 *     holds weight 4 p + i in its low nibble and weight 16 + 4 p + i in its high one, so the low
 *     nibbles of vector p are chunk p and the high nibbles chunk p + 4;
 *     one bit (Q5_*: u's bit 4; Q3_K: bit 2), 32 bytes: bit c of byte 4 j + i is chunk c's;
 *     two bits (Q6_K: u's bits 4, 5; Q2_K, Q3_K: bits 0, 1), 64 bytes: vector h (h = 0, 1) holds
 *     chunk 4 h + c' in bits 2 c', 2 c' + 1;
 *   in that order: Q8_0 256 bytes, Q4_* / IQ4_* / MXFP4 128, Q5_* 160, Q6_K 192, Q3_K (two bits,
 *   then one) 96, Q2_K 64. Bytes a weight (scales and quants): Q8_0 1.0625, Q4_0 / IQ4_NL 0.5625,
 *   Q4_1 0.625, Q5_0 0.6875, Q5_1 0.75, Q2_K 0.328, Q3_K 0.453, Q4_K 0.578, Q5_K 0.703,
 *   Q6_K 0.828, IQ4_XS 0.547, MXFP4 0.531 - the file's own bytes but for the padding of the scales.
 * A block's planes become its eight chunks of integers once for all the rows of a tile
 * (quant_decode.c: a few shifts and masks a chunk, IQ4's and MXFP4's levels one vpshufb); then a
 * chunk times the activations' four bytes broadcast to every lane is one vpmaddubsw + vpmaddwd
 * giving each output's partial sum in its own int32 lane: no horizontal sums (the idea of
 * llama.cpp's repacked Q4_0_8x8 layout, with four-byte chunks).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define QK 32               /* weights per block */
#define QGROUP 8            /* outputs per group */
#define QROW_TILE 8         /* rows that share one unpacked weight block */
#define FD_MAX_PARTS 4

/* Weight formats of a projection part (kernels/quant.py's WEIGHT_FORMATS). */
#define FD_W_F32 0
#define FD_W_I8 1
#define FD_W_Q8_0 2
#define FD_W_Q4_0 3
#define FD_W_Q4_1 4
#define FD_W_Q4_K 5
#define FD_W_Q6_K 6
#define FD_W_S24_Q8 7 /* 2:4 sparse Q8_0: sparse.c */
#define FD_W_W8A8 8   /* int8 per output channel x int8 per token: w8a8.c */
#define FD_W_S24_F32 9 /* 2:4 sparse float32: sparse_f32.c (the float GEMM's bits, no activation blocks) */
#define FD_W_Q5_0 10
#define FD_W_Q5_1 11
#define FD_W_Q5_K 12
#define FD_W_Q3_K 13
#define FD_W_Q2_K 14
#define FD_W_IQ4_NL 15
#define FD_W_IQ4_XS 16
#define FD_W_BF16 17 /* bf16 weights [n, K] on the float GEMM (cpu.c's rowgemm_bf16: the float32 GEMM's bits) */
#define FD_W_F16 18  /* fp16 weights [n, K], likewise */
#define FD_W_MXFP4 19

/* Implementations of the block formats' GEMM (kernels/quant.py's IMPLS). */
#define FD_IMPL_AUTO (-1)
#define FD_IMPL_AVX2 0
#define FD_IMPL_SCALAR 1
#define FD_IMPL_AVX512_VNNI 2 /* quant_avx512.c */
#define FD_IMPL_AVX_VNNI 3     /* quant_ymm.c's vpdpbusd copy */
/* FD_NO_VNNI: a compiler that knows neither AVX-VNNI nor AVX-512 VNNI targets (kernels/build.py) */
#if defined(__x86_64__) && !defined(FD_NO_VNNI)
#define FD_HAVE_VNNI 1
#endif

/* One part of a projection: n outputs of weights in one format. */
typedef struct {
    int64_t fmt;        /* FD_W_* */
    int64_t n;          /* outputs */
    const void *w;      /* float32 [n, K], int8 [n, K], packed blocks (layout above), or sparse_f32.c's layout */
    const float *scale; /* FD_W_I8: per-output scales [n]; else NULL */
} fd_part;

/* A projection: parts stacked by output (a fused QKV whose q, k and v differ in
 * format), then a bias over all of them. Float and int8 weights come as one part. */
typedef struct {
    int64_t n_parts;
    fd_part part[FD_MAX_PARTS];
    const float *bias; /* [sum of n] or NULL */
    int64_t impl;      /* FD_IMPL_* for the block formats */
} fd_proj;

static inline int64_t qblocks(int64_t K) { return (K + QK - 1) / QK; }

#define QSUPER 8 /* blocks of a super-block */

/* A super-block format: its scales come a super-block at a time. */
static inline int is_kquant(int64_t fmt) {
    return fmt == FD_W_Q4_K || fmt == FD_W_Q6_K || fmt == FD_W_Q5_K || fmt == FD_W_Q3_K || fmt == FD_W_Q2_K ||
           fmt == FD_W_IQ4_XS;
}
static inline int has_min(int64_t fmt) {
    return fmt == FD_W_Q4_1 || fmt == FD_W_Q4_K || fmt == FD_W_Q5_1 || fmt == FD_W_Q5_K || fmt == FD_W_Q2_K;
}
/* Two scales a block: one for weights 0..15, one for 16..31 (Q2_K: and two mins). */
static inline int has_halves(int64_t fmt) { return fmt == FD_W_Q6_K || fmt == FD_W_Q3_K || fmt == FD_W_Q2_K; }
/* Signed integers (the ymm loop multiplies them by the sign trick); the others are unsigned codes. */
static inline int has_signed_codes(int64_t fmt) {
    return fmt == FD_W_Q8_0 || fmt == FD_W_Q6_K || fmt == FD_W_Q3_K || fmt == FD_W_IQ4_NL || fmt == FD_W_IQ4_XS ||
           fmt == FD_W_MXFP4;
}
/* What a code less its scale multiplies: Q4_0's q - 8 and Q5_0's q - 16, taken off a block's sum as 8 or 16
 * times the activations' sum. */
static inline int32_t code_offset(int64_t fmt) { return fmt == FD_W_Q4_0 ? 8 : fmt == FD_W_Q5_0 ? 16 : 0; }

/* Bytes of a group's scales for one block of 32 (the blocks-of-32 formats), and of one block's quants. */
static inline int64_t scale_bytes(int64_t fmt) { return fmt == FD_W_Q4_1 || fmt == FD_W_Q5_1 ? 32 : fmt == FD_W_MXFP4 ? 8 : 16; }
static inline int64_t quant_bytes(int64_t fmt) {
    switch (fmt) {
    case FD_W_Q8_0: return 256;
    case FD_W_Q6_K: return 192;
    case FD_W_Q5_0: case FD_W_Q5_1: case FD_W_Q5_K: return 160;
    case FD_W_Q3_K: return 96;
    case FD_W_Q2_K: return 64;
    default: return 128; /* Q4_*, IQ4_*, MXFP4 */
    }
}
/* A group's blocks come in units, each unit's scales then its quants: a pair of blocks (MXFP4: four,
 * its one-byte scales 32 bytes), or a super-block (its scales padded to 160 bytes, IQ4_XS's to 96), so
 * every quant vector is 32-aligned. */
static inline int64_t unit_blocks(int64_t fmt) { return is_kquant(fmt) ? QSUPER : fmt == FD_W_MXFP4 ? 4 : 2; }
static inline int64_t unit_scale_bytes(int64_t fmt) {
    return fmt == FD_W_IQ4_XS ? 96 : is_kquant(fmt) ? 160 : unit_blocks(fmt) * scale_bytes(fmt);
}
static inline int64_t unit_bytes(int64_t fmt) { return unit_scale_bytes(fmt) + unit_blocks(fmt) * quant_bytes(fmt); }
static inline int64_t group_bytes(int64_t fmt, int64_t nb) { return (nb + unit_blocks(fmt) - 1) / unit_blocks(fmt) * unit_bytes(fmt); }
static inline const uint8_t *unit_of(int64_t fmt, const uint8_t *wg, int64_t b) { return wg + b / unit_blocks(fmt) * unit_bytes(fmt); }
/* Block b's scales (a super-block format: its super-block's) and quants in group wg. */
static inline const uint8_t *block_scales_at(int64_t fmt, const uint8_t *wg, int64_t b) {
    return unit_of(fmt, wg, b) + (is_kquant(fmt) ? 0 : b % unit_blocks(fmt) * scale_bytes(fmt));
}
static inline const uint8_t *block_quants_at(int64_t fmt, const uint8_t *wg, int64_t b) {
    return unit_of(fmt, wg, b) + unit_scale_bytes(fmt) + b % unit_blocks(fmt) * quant_bytes(fmt);
}

/* Bytes of the quantized activations of M rows of K: qs int8 [M, nb, 32], then
 * d float [M, nb], s int32 [M, nb] (sum of the block's qs), sx float [M, nb] (d * s),
 * sxh float [M, nb, 2] (d * the sum of qs 0..15, of 16..31: Q2_K's two mins a block). */
int64_t fd_qact_bytes(int64_t M, int64_t K) { return M * qblocks(K) * (QK + 20); }

typedef struct {
    int8_t *qs;
    float *d;
    int32_t *s;
    float *sx;
    float *sxh;
    int64_t nb;
} qact;

static qact qact_at(void *buf, int64_t M, int64_t K) {
    const int64_t nb = qblocks(K);
    qact a = {(int8_t *)buf, NULL, NULL, NULL, NULL, nb};
    a.d = (float *)(a.qs + M * nb * QK);
    a.s = (int32_t *)(a.d + M * nb);
    a.sx = (float *)(a.s + M * nb);
    a.sxh = a.sx + M * nb;
    return a;
}

static int cpu_has_avx512_vnni(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512vnni");
}

/* Whether this library and CPU run implementation impl (FD_IMPL_*); FD_IMPL_AUTO always runs. */
int64_t fd_impl_supported(int64_t impl) {
    if (impl == FD_IMPL_AUTO || impl == FD_IMPL_SCALAR) return 1;
    __builtin_cpu_init();
    const int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
    if (impl == FD_IMPL_AVX2) return avx2;
#ifdef FD_HAVE_VNNI
    if (impl == FD_IMPL_AVX512_VNNI) return avx2 && cpu_has_avx512_vnni();
    if (impl == FD_IMPL_AVX_VNNI) return avx2 && __builtin_cpu_supports("avxvnni");
#endif
    return 0;
}

/* FD_IMPL_AUTO: AVX-512 VNNI where this CPU has it, else AVX-VNNI, else the AVX2 kernel where it has AVX2 and
 * F16C, else the scalar one; an implementation the CPU lacks runs as AUTO would. (This library
 * is compiled with -mavx2, so the AVX2 check only matters once the scalar path is built on its
 * own; the portable path off x86 is the torch reference.) */
static int impl_of(int64_t impl) {
    static int detected = -1;
    if (impl != FD_IMPL_AUTO && fd_impl_supported(impl)) return (int)impl;
    if (detected < 0)
        detected = fd_impl_supported(FD_IMPL_AVX512_VNNI) ? FD_IMPL_AVX512_VNNI
                   : fd_impl_supported(FD_IMPL_AVX_VNNI)  ? FD_IMPL_AVX_VNNI
                   : fd_impl_supported(FD_IMPL_AVX2)      ? FD_IMPL_AVX2
                                                          : FD_IMPL_SCALAR;
    return detected;
}

/* ---- activations: per row, per block of 32 (the tail block padded with zeros) ---- */

/* 1 / d, or 0 where that is no finite float (d = 0, or d below ~2.9e-39 whose inverse overflows):
 * x * inf would be NaN and break the rows' invariance (AVX2 would pack it as -128). */
static inline float inv_scale(float d) {
    const float inv = 1.0f / d;
    return d != 0.0f && inv < INFINITY ? inv : 0.0f;
}

/* x[0 .. len) (len <= 32, zeros after) -> q[32] at 1 / d = id; returns the sum of the q. A NaN
 * becomes -127 (the comparisons below fail for it), as in quantize_span_avx2. */
static int32_t quantize_span_scalar(const float *x, int64_t len, float id, int8_t *q) {
    int32_t s = 0;
    for (int64_t k = 0; k < QK; k++) {
        float v = k < len ? rintf(x[k] * id) : 0.0f; /* rintf: to nearest, ties to even */
        v = v >= -127.0f ? v : -127.0f;
        v = v <= 127.0f ? v : 127.0f;
        q[k] = (int8_t)v;
        s += q[k];
    }
    return s;
}

/* quantize_span_scalar's bits for a whole span of 32 (max_ps returns its second operand where
 * either is NaN: a NaN becomes -127). */
static int32_t quantize_span_avx2(const float *x, float id, int8_t *q) {
    const __m256 idv = _mm256_set1_ps(id), hi = _mm256_set1_ps(127.0f), lo = _mm256_set1_ps(-127.0f);
    __m256i qi[4];
    for (int i = 0; i < 4; i++) {
        const __m256 r = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * i), idv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        qi[i] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi));
    }
    /* int32 -> int8 in order: packs interleave 128-bit lanes, the permute restores it */
    const __m256i p16a = _mm256_packs_epi32(qi[0], qi[1]), p16b = _mm256_packs_epi32(qi[2], qi[3]);
    const __m256i p8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p16a, p16b), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)q, p8);
    const __m256i s32 = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), p8), _mm256_set1_epi16(1));
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(s32), _mm256_extracti128_si256(s32, 1));
    t = _mm_add_epi32(t, _mm_unpackhi_epi64(t, t));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 1));
    return _mm_cvtsi128_si32(t);
}

/* max |x[k]| over k < len, NaNs skipped (a maximum is exact in any order). */
static float amax_scalar(const float *x, int64_t len) {
    float amax = 0.0f;
    for (int64_t k = 0; k < len; k++) amax = fabsf(x[k]) > amax ? fabsf(x[k]) : amax;
    return amax;
}

/* amax_scalar's value: max_ps(v, m) keeps m where v is NaN. */
static float amax_avx2(const float *x, int64_t len) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 m = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= len; k += 8) m = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + k)), m);
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1)); /* no NaN lanes: any order */
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 0x1));
    const float amax = _mm_cvtss_f32(m4), tail = amax_scalar(x + k, len - k);
    return tail > amax ? tail : amax;
}

static void quantize_block_scalar(const float *x, int64_t len, int8_t *q, float *d_out, int32_t *s_out, float *sx_out) {
    const float d = amax_scalar(x, len) / 127.0f;
    const int32_t s = quantize_span_scalar(x, len, inv_scale(d), q);
    *d_out = d, *s_out = s, *sx_out = d * (float)s;
}

static void quantize_block_avx2(const float *x, int8_t *q, float *d_out, int32_t *s_out, float *sx_out) {
    const float d = amax_avx2(x, QK) / 127.0f;
    const int32_t s = quantize_span_avx2(x, inv_scale(d), q);
    *d_out = d, *s_out = s, *sx_out = d * (float)s;
}

/* A block's two halves' sums of q times its d (an exact integer sum, then one float32 product). */
static inline void half_sums(const int8_t *q, float d, float *sxh) {
    for (int h = 0; h < 2; h++) {
        int32_t s = 0;
        for (int k = 16 * h; k < 16 * h + 16; k++) s += q[k];
        sxh[h] = d * (float)s;
    }
}

/* One row, x [K], as row m of the quantized activations a (experts.c quantizes rows one at a time). */
static void quantize_row(const float *x, int64_t K, int avx2, const qact *a, int64_t m) {
    for (int64_t b = 0; b < a->nb; b++) {
        const int64_t i = m * a->nb + b, k0 = b * QK, len = K - k0 < QK ? K - k0 : QK;
        if (avx2 && len == QK)
            quantize_block_avx2(x + k0, a->qs + i * QK, a->d + i, a->s + i, a->sx + i);
        else
            quantize_block_scalar(x + k0, len, a->qs + i * QK, a->d + i, a->s + i, a->sx + i);
        half_sums(a->qs + i * QK, a->d[i], a->sxh + 2 * i);
    }
}

/* x: [M, K] float32 -> the quantized activations at buf (fd_qact_bytes(M, K) bytes). */
void fd_quantize_rows(const float *x, int64_t M, int64_t K, int64_t impl, void *buf) {
    const qact a = qact_at(buf, M, K);
    const int avx2 = impl_of(impl) != FD_IMPL_SCALAR;
#pragma omp parallel for schedule(static) if (M >= 16)
    for (int64_t m = 0; m < M; m++) quantize_row(x + m * K, K, avx2, &a, m);
}

/* ---- the portable scalar GEMM: the definition of the arithmetic ---- */

static float fp16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0 && man == 0) {
        bits = sign;
    } else if (exp == 0) { /* subnormal: normalize */
        exp = 113;
        while (!(man & 0x400)) man <<= 1, exp--;
        bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
    } else if (exp == 31) {
        bits = sign | 0x7f800000 | (man << 13);
    } else {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t load_u16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }

#define QAINLINE static inline __attribute__((always_inline))

static inline int32_t load_i32(const void *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

#include "quant_decode.c" /* a packed block's integers and scales, scalar and AVX2 */

static void gemm_scalar(const qact *a, int64_t M, int64_t fmt, const uint8_t *w, int64_t N, float *y, int64_t ldy) {
    const int64_t nb = a->nb, G = (N + QGROUP - 1) / QGROUP, gbytes = group_bytes(fmt, nb);
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < G; g++)
        for (int64_t m = 0; m < M; m++) {
            float acc[QGROUP] = {0};
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *qs = block_quants_at(fmt, w + g * gbytes, b);
                const int64_t i = m * nb + b;
                const int8_t *yq = a->qs + i * QK;
                for (int j = 0; j < QGROUP; j++) {
                    int32_t isum[2] = {0, 0}; /* two scales a block: weights 0..15, 16..31; else all in isum[0] */
                    for (int k = 0; k < QK; k++) isum[has_halves(fmt) && k >= 16] += weight_code(fmt, qs, j, k) * yq[k];
                    isum[0] -= code_offset(fmt) * a->s[i]; /* sum (q - 8) y, sum (q - 16) y */
                    float sc[4];
                    block_scales_scalar(fmt, w + g * gbytes, b, j, sc);
                    const float t = sc[0] * a->d[i];
                    float term = t * (float)isum[0];
                    if (has_halves(fmt)) {
                        const float t1 = sc[1] * a->d[i];
                        term = term + t1 * (float)isum[1];
                    }
                    if (has_min(fmt) && has_halves(fmt)) {
                        term = term + sc[2] * a->sxh[2 * i];
                        term = term + sc[3] * a->sxh[2 * i + 1];
                    } else if (has_min(fmt)) {
                        term = term + sc[2] * a->sx[i];
                    }
                    acc[j] = acc[j] + term;
                }
            }
            for (int j = 0; j < QGROUP && g * QGROUP + j < N; j++) y[m * ldy + g * QGROUP + j] = acc[j];
        }
}

/* ---- AVX2 ---- */

/* How far ahead of the weight stream to prefetch: measured on the 2-core Zen 3,
 * one row over a 49152 x 576 LM head ran at 9-13 GB/s on one thread without it,
 * 13-25 GB/s with 2-4 KB (prefetch never faults: running past the end is harmless).
 * 8 KB: on a (loaded) 2-core Zen 5, one thread, one row over SmolLM2's shapes from memory
 * (scripts/block_gemm_cpu_time.py's model, builds alternated, best CPU time of 9), 2 / 4 / 8 / 16 KB:
 * Q4_1 5.81 / 5.60 / 4.97 / 5.40 ms, Q4_0 3.17 / 2.84 / 2.62 / 2.70, Q8_0 5.20 / 4.99 / 4.85 / 4.94;
 * 8 rows unchanged (9.9, 8.5, 12.9 ms). */
#ifndef QPREFETCH_BYTES
#define QPREFETCH_BYTES 8192
#endif

/* Prefill: rows are taken QROW_BLOCK at a time (their activations, 64 x K bytes,
 * stay in L2 while every group of weights streams past them), each block in
 * tiles of QROW_TILE rows that share one unpack of a weight block. Blocking
 * changes which rows share an unpack, never an operation. */
#define QROW_BLOCK 64

/* 2:4 sparse Q8_0 (sparse.c): its group size and its rows' tile, on this same GEMM loop */
static inline int64_t s24_group_bytes(int64_t nb);
/* The bytes of one group of QGROUP output rows in either layout the ymm and zmm loops take. */
static inline int64_t loop_group_bytes(int64_t fmt, int64_t nb) { return fmt == FD_W_S24_Q8 ? s24_group_bytes(nb) : group_bytes(fmt, nb); }
QAINLINE void s24_rows(const uint8_t *wg, const qact *a, int64_t m0, int64_t rt, __m256 *acc);

/* The kinds of format the ymm and zmm loops specialize, one loop each: a format's own code (Q8_0,
 * Q4_0, Q4_1, Q4_K, Q2_K), or a kind of formats whose rows' arithmetic is the same, each of them
 * differing only in how a block is decoded and its scales formed (once a block, for all the rows
 * of a tile). */
#define QKIND_U5 (-2) /* Q5_0, Q5_1, Q5_K: unsigned codes 0..31, one scale a block */
#define QKIND_S1 (-3) /* IQ4_NL, IQ4_XS, MXFP4: signed integers, one scale a block */
#define QKIND_S2 (-4) /* Q6_K, Q3_K: signed integers, two scales a block */
static inline int64_t loop_kind(int64_t fmt) {
    switch (fmt) {
    case FD_W_Q5_0: case FD_W_Q5_1: case FD_W_Q5_K: return QKIND_U5;
    case FD_W_IQ4_NL: case FD_W_IQ4_XS: case FD_W_MXFP4: return QKIND_S1;
    case FD_W_Q6_K: case FD_W_Q3_K: return QKIND_S2;
    default: return fmt;
    }
}

/* Each format of a kind of several formats (QKIND_*) on a ymm loop of its own, its blocks decoded in
 * registers (1), or the kind's shared loop, each block decoded out of line through a stored tile (0):
 * a variant to time (scripts/block_gemm_cpu_time.py --variants) */
#ifndef QOWN_LOOP
#define QOWN_LOOP 1
#endif

/* The ymm loop, compiled twice: for AVX2 (vpmaddubsw / vpmaddwd: gemm_avx2) and, by function
 * attributes, for AVX-VNNI (vpdpbusd: gemm_avx_vnni), the one or the other taken at run time. */
#define QYMM(name) name##_avx2
#define QYMM_TARGET
#define QYMM_VNNI 0
#include "quant_ymm.c"
#undef QYMM
#undef QYMM_TARGET
#undef QYMM_VNNI
#ifdef FD_HAVE_VNNI
#define QYMM(name) name##_avx_vnni
#define QYMM_TARGET __attribute__((target("avxvnni")))
#define QYMM_VNNI 1
#include "quant_ymm.c"
#endif

/* The ymm loop that runs here: AVX-VNNI's where the CPU has it. */
static void gemm_ymm(const qact *a, int64_t M, int64_t fmt, const uint8_t *w, int64_t N, float *y, int64_t ldy) {
#ifdef FD_HAVE_VNNI
    static int vnni = -1;
    if (vnni < 0) vnni = fd_impl_supported(FD_IMPL_AVX_VNNI) != 0;
    if (vnni) {
        gemm_avx_vnni(a, M, fmt, w, N, y, ldy);
        return;
    }
#endif
    gemm_avx2(a, M, fmt, w, N, y, ldy);
}

#include "quant_avx512.c"

static void s24_gemm_scalar(const qact *a, int64_t M, const uint8_t *w, int64_t N, float *y, int64_t ldy); /* sparse.c */

/* y [M, ldy] columns 0 .. N - 1 = the block-format part at w times the quantized rows. */
static void block_gemm(const qact *a, int64_t M, int64_t fmt, const void *w, int64_t N, int impl, float *y, int64_t ldy) {
#ifdef FD_HAVE_VNNI
    if (impl == FD_IMPL_AVX512_VNNI && zfmt_supported(fmt)) {
        gemm_avx512(a, M, fmt, (const uint8_t *)w, N, y, ldy);
        return;
    }
    if (impl == FD_IMPL_AVX_VNNI) {
        gemm_avx_vnni(a, M, fmt, (const uint8_t *)w, N, y, ldy);
        return;
    }
    if (impl == FD_IMPL_AVX512_VNNI) { /* a format quant_avx512.c leaves to the ymm loop */
        gemm_ymm(a, M, fmt, (const uint8_t *)w, N, y, ldy);
        return;
    }
#endif
    if (impl == FD_IMPL_AVX2)
        gemm_avx2(a, M, fmt, (const uint8_t *)w, N, y, ldy);
    else if (fmt == FD_W_S24_Q8)
        s24_gemm_scalar(a, M, (const uint8_t *)w, N, y, ldy);
    else
        gemm_scalar(a, M, fmt, (const uint8_t *)w, N, y, ldy);
}

/* Whether a part of projection p is in a block format (activations per block of 32), or W8A8 (per token). */
static int is_block_format(int64_t fmt) {
    return fmt >= FD_W_Q8_0 && fmt != FD_W_W8A8 && fmt != FD_W_S24_F32 && fmt != FD_W_BF16 && fmt != FD_W_F16;
}
static int proj_is_blocks(const fd_proj *p) {
    for (int64_t i = 0; i < p->n_parts; i++)
        if (is_block_format(p->part[i].fmt)) return 1;
    return 0;
}
static int proj_is_w8a8(const fd_proj *p) {
    for (int64_t i = 0; i < p->n_parts; i++)
        if (p->part[i].fmt == FD_W_W8A8) return 1;
    return 0;
}

/* W8A8 (w8a8.c): the per-token activations' bytes, their quantization, and the GEMM over them */
int64_t fd_w8a8_act_bytes(int64_t M, int64_t K);
void fd_w8a8_quantize_rows(const float *x, int64_t M, int64_t K, int64_t impl, void *buf);
static void w8a8_gemm(const void *act, int64_t M, int64_t K, const uint8_t *w, int64_t N, int impl, float *y, int64_t ldy);

/* Scratch a projection of M rows of K needs: the activations quantized per block for its block
 * parts, then per token for its W8A8 parts (0 for float / int8). */
int64_t fd_project_scratch_bytes(const fd_proj *p, int64_t M, int64_t K) {
    return (proj_is_blocks(p) ? fd_qact_bytes(M, K) : 0) + (proj_is_w8a8(p) ? fd_w8a8_act_bytes(M, K) : 0);
}

static void rowgemm_f32(const float *x, int64_t M, int64_t K, const float *w, const float *scale, int64_t N, float *y);
static void rowgemm_i8(const float *x, int64_t M, int64_t K, const int8_t *w, const float *scale, int64_t N, float *y);
static void rowgemm_bf16(const float *x, int64_t M, int64_t K, const uint16_t *w, const float *scale, int64_t N, float *y);
static void rowgemm_f16(const float *x, int64_t M, int64_t K, const uint16_t *w, const float *scale, int64_t N, float *y);
static void s24f_gemm(const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, float *y, int impl); /* sparse_f32.c */

/* y [M, N] = x [M, K] times the projection's weights (+ bias), N the parts' outputs
 * together. scratch: fd_project_scratch_bytes(p, M, K) bytes, or NULL to allocate. */
void fd_project(const float *x, int64_t M, int64_t K, const fd_proj *p, void *scratch, float *y) {
    int64_t N = 0;
    for (int64_t i = 0; i < p->n_parts; i++) N += p->part[i].n;
    const int blocks = proj_is_blocks(p), w8a8 = proj_is_w8a8(p);
    if (!blocks && !w8a8) { /* one float32, bf16, fp16, int8 or 2:4 sparse float32 part: the row-invariant float GEMM */
        if (p->part[0].fmt == FD_W_I8)
            rowgemm_i8(x, M, K, (const int8_t *)p->part[0].w, p->part[0].scale, N, y);
        else if (p->part[0].fmt == FD_W_BF16)
            rowgemm_bf16(x, M, K, (const uint16_t *)p->part[0].w, NULL, N, y);
        else if (p->part[0].fmt == FD_W_F16)
            rowgemm_f16(x, M, K, (const uint16_t *)p->part[0].w, NULL, N, y);
        else if (p->part[0].fmt == FD_W_S24_F32)
            s24f_gemm(x, M, K, (const uint8_t *)p->part[0].w, N, y, impl_of(p->impl));
        else
            rowgemm_f32(x, M, K, (const float *)p->part[0].w, NULL, N, y);
    } else {
        void *buf = scratch ? scratch : malloc((size_t)fd_project_scratch_bytes(p, M, K));
        void *tokens = (char *)buf + (blocks ? fd_qact_bytes(M, K) : 0);
        const int impl = impl_of(p->impl);
        if (blocks) fd_quantize_rows(x, M, K, impl, buf);
        if (w8a8) fd_w8a8_quantize_rows(x, M, K, impl, tokens);
        const qact a = qact_at(buf, M, K);
        int64_t n0 = 0;
        for (int64_t i = 0; i < p->n_parts; i++) {
            if (p->part[i].fmt == FD_W_W8A8)
                w8a8_gemm(tokens, M, K, (const uint8_t *)p->part[i].w, p->part[i].n, impl, y + n0, N);
            else
                block_gemm(&a, M, p->part[i].fmt, p->part[i].w, p->part[i].n, impl, y + n0, N);
            n0 += p->part[i].n;
        }
        if (!scratch) free(buf);
    }
    if (p->bias)
        for (int64_t m = 0; m < M; m++)
            for (int64_t j = 0; j < N; j++) y[m * N + j] += p->bias[j];
}
