/* W8A8 (FD_W_W8A8): int8 weights with one float32 scale per output channel, times int8
 * activations with one scale per row (token), row-invariant. Included by cpu.c after quant.c and
 * sparse.c, whose constants and helpers it uses, and reached through quant.c's fd_project.
 *
 *     y[m, n] = (dw[n] * dx[m]) * (float)isum[m, n],   isum[m, n] = sum over k of qw[n, k] * qx[m, k]
 *
 * Each row of activations is quantized alone, over its whole length, to 8 bits the way quant.c
 * quantizes a block (dx = max|x| / 127, qx = round-to-nearest-even(x * (1 / dx)) clamped to
 * +-127: the AVX2 sign trick below needs |qx| <= 127), and meets the weights in one int32 sum
 * over the whole input dimension. Integer sums are exact (|isum| <= K * 128 * 127: any K below
 * 132,000), so any order, tiling or instruction (vpmaddubsw / vpmaddwd, vpdpbusd) gives the same
 * integer, and the float epilogue above is the same two float32 products for every output
 * whatever the row count, the tiles, the thread count or the implementation: AVX-512 VNNI
 * (two groups a zmm, as quant_avx512.c), AVX-VNNI (ymm vpdpbusd), AVX2 (vpmaddubsw / vpmaddwd)
 * or the portable scalar loop, which kernels/w8a8.py's torch reference reproduces bit for bit.
 * One float epilogue an output where q8_0 has one a block of 32, and 32 bytes a 32 weights
 * where q8_0 streams 34.
 *
 * Weight layout (kernels/w8a8.py's pack_w8a8, 64-byte aligned): outputs in groups of eight (the
 * last padded with zero rows), one group after another; a group holds dw[8] float32 (32 bytes),
 * then the input dimension padded with zero weights to kp, a multiple of 32, as kp / 4 chunks
 * of 32 bytes: byte 4 j + i of chunk c is row j's weight 4 c + i (quant.c's Q8_0 chunks, one
 * after another over the whole row). A chunk times a row's four activations broadcast to every
 * lane is each output's partial sum in its own int32 lane, no horizontal sums.
 *
 * Activations (fd_w8a8_act_bytes(M, K) bytes): qx int8 [M, kp] (zero past K), dx float32 [M],
 * sx int32 [M] (the sum of a row's qx: the VNNI paths take the weights as the unsigned w + 128
 * and 128 * sx back off).
 */

#define W8A8_SCALE_BYTES 32 /* a group's dw[8] */

static inline int64_t w8a8_kp(int64_t K) { return (K + QK - 1) / QK * QK; }
static inline int64_t w8a8_group_bytes(int64_t K) { return W8A8_SCALE_BYTES + QGROUP * w8a8_kp(K); }

int64_t fd_w8a8_act_bytes(int64_t M, int64_t K) { return M * (w8a8_kp(K) + 8); }

typedef struct {
    int8_t *qs; /* [M, kp] */
    float *d;   /* [M] */
    int32_t *s; /* [M] */
    int64_t kp;
} tact;

static tact tact_at(void *buf, int64_t M, int64_t K) {
    const int64_t kp = w8a8_kp(K);
    tact a = {(int8_t *)buf, NULL, NULL, kp};
    a.d = (float *)(a.qs + M * kp);
    a.s = (int32_t *)(a.d + M);
    return a;
}

/* ---- activations: one scale a row ---- */

/* quant.c's amax_* and quantize_span_* quantize each row, its blocks' code with one scale a row. */

/* x: [M, K] float32 -> the per-token quantized activations at buf (fd_w8a8_act_bytes(M, K) bytes). */
void fd_w8a8_quantize_rows(const float *x, int64_t M, int64_t K, int64_t impl, void *buf) {
    const tact a = tact_at(buf, M, K);
    const int avx2 = impl_of(impl) != FD_IMPL_SCALAR;
#pragma omp parallel for schedule(static) if (M >= 16)
    for (int64_t m = 0; m < M; m++) {
        const float *xm = x + m * K;
        const float d = (avx2 ? amax_avx2(xm, K) : amax_scalar(xm, K)) / 127.0f, id = inv_scale(d);
        int32_t s = 0;
        for (int64_t k0 = 0; k0 < a.kp; k0 += QK) {
            const int64_t len = K - k0 < QK ? K - k0 : QK;
            int8_t *q = a.qs + m * a.kp + k0;
            s += avx2 && len == QK ? quantize_span_avx2(xm + k0, id, q) : quantize_span_scalar(xm + k0, len, id, q);
        }
        a.d[m] = d, a.s[m] = s;
    }
}

/* ---- the portable scalar GEMM: the definition of the arithmetic ---- */

static inline float load_f32(const uint8_t *p) {
    float v;
    memcpy(&v, p, 4);
    return v;
}

static void w8a8_gemm_scalar(const tact *a, int64_t M, const uint8_t *w, int64_t N, float *y, int64_t ldy) {
    const int64_t kp = a->kp, G = (N + QGROUP - 1) / QGROUP, gbytes = w8a8_group_bytes(kp);
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < G; g++)
        for (int64_t m = 0; m < M; m++)
            for (int j = 0; j < QGROUP && g * QGROUP + j < N; j++) {
                const uint8_t *wg = w + g * gbytes, *qs = wg + W8A8_SCALE_BYTES;
                const int8_t *yq = a->qs + m * kp;
                int32_t isum = 0;
                for (int64_t k = 0; k < kp; k++) isum += (int8_t)qs[(k / 4) * 32 + 4 * j + k % 4] * yq[k];
                const float t = load_f32(wg + 4 * j) * a->d[m];
                y[m * ldy + g * QGROUP + j] = t * (float)isum;
            }
}

/* ---- the ymm loops: AVX2 and AVX-VNNI, eight outputs a vector ---- */

/* The float epilogue of RT rows' integer sums against one group, stored (valid of its 8 outputs exist). */
QAINLINE void w8a8_store_ymm(const int RT, const uint8_t *wg, const tact *a, int64_t m0, const __m256i *isum, float *y,
                             int64_t ldy, int64_t valid) {
    const __m256 dw = _mm256_loadu_ps((const float *)wg);
    _Pragma("GCC unroll 8") for (int r = 0; r < RT; r++) {
        const __m256 t = _mm256_mul_ps(dw, _mm256_set1_ps(a->d[m0 + r]));
        const __m256 out = _mm256_mul_ps(t, _mm256_cvtepi32_ps(isum[r]));
        if (valid == QGROUP) {
            _mm256_storeu_ps(y + r * ldy, out);
        } else {
            float tmp[QGROUP];
            _mm256_storeu_ps(tmp, out);
            for (int64_t j = 0; j < valid; j++) y[r * ldy + j] = tmp[j];
        }
    }
}

/* RT rows (m0 ..) against one group on AVX2: vpmaddubsw takes one unsigned operand, so |w| times
 * y with w's sign (quant_ymm.c's q8_dot); a lane reaches at most 2 * 128 * 127, so each chunk
 * widens alone. */
QAINLINE void w8a8_tile_avx2(const int RT, const uint8_t *wg, const tact *a, int64_t m0, float *y, int64_t ldy, int64_t valid) {
    const int64_t kp = a->kp;
    const uint8_t *qs = wg + W8A8_SCALE_BYTES;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i acc[QROW_TILE];
    _Pragma("GCC unroll 8") for (int r = 0; r < RT; r++) acc[r] = _mm256_setzero_si256();
    for (int64_t c = 0; c < kp / 4; c++) {
        if (!(c & 1)) _mm_prefetch((const char *)qs + 32 * c + QPREFETCH_BYTES, _MM_HINT_T0);
        const __m256i W = _mm256_loadu_si256((const __m256i *)(qs + 32 * c)), AW = _mm256_abs_epi8(W);
        _Pragma("GCC unroll 8") for (int r = 0; r < RT; r++) {
            const __m256i sy = _mm256_sign_epi8(_mm256_set1_epi32(load_i32(a->qs + (m0 + r) * kp + 4 * c)), W);
            acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(_mm256_maddubs_epi16(AW, sy), ones));
        }
    }
    w8a8_store_ymm(RT, wg, a, m0, acc, y, ldy, valid);
}

__attribute__((noinline)) static void w8a8_rows_avx2(const uint8_t *wg, const tact *a, int64_t m0, int64_t rt, float *y,
                                                     int64_t ldy, int64_t valid) {
    switch (rt) { /* every row count its own tile, the loops over rows unrolled */
    case 8: w8a8_tile_avx2(8, wg, a, m0, y, ldy, valid); break;
    case 7: w8a8_tile_avx2(7, wg, a, m0, y, ldy, valid); break;
    case 6: w8a8_tile_avx2(6, wg, a, m0, y, ldy, valid); break;
    case 5: w8a8_tile_avx2(5, wg, a, m0, y, ldy, valid); break;
    case 4: w8a8_tile_avx2(4, wg, a, m0, y, ldy, valid); break;
    case 3: w8a8_tile_avx2(3, wg, a, m0, y, ldy, valid); break;
    case 2: w8a8_tile_avx2(2, wg, a, m0, y, ldy, valid); break;
    default: w8a8_tile_avx2(1, wg, a, m0, y, ldy, valid); break;
    }
}

#ifdef FD_HAVE_VNNI
/* FD_AVX_VNNI_AS_EVEX (a test build only, tests/kernels/test_w8a8_kernel.py): the AVX-VNNI loop's
 * vpdpbusd in its AVX-512 VL encoding, the same operation, so a CPU with AVX-512 VNNI but not
 * AVX-VNNI checks this loop's arithmetic: the AVX-512 VNNI implementation then runs every pass on
 * it (w8a8_ymm_vnni_runs, W8A8_ZMIN_ROWS); nothing outside this file changes (the block formats'
 * AVX-VNNI loops keep their VEX encoding and quant.c reports AVX-VNNI as the CPU has it). */
#ifdef FD_AVX_VNNI_AS_EVEX
#define W8A8_YMM_VNNI "avx512f,avx512bw,avx512vl,avx512vnni"
#define w8a8_dpbusd_ymm _mm256_dpbusd_epi32
#define W8A8_ZMIN_ROWS INT64_MAX
static int w8a8_ymm_vnni_runs(void) { return cpu_has_avx512_vnni(); }
#else
static int w8a8_ymm_vnni_runs(void) { return (int)fd_impl_supported(FD_IMPL_AVX_VNNI); }
#define W8A8_YMM_VNNI "avxvnni"
#define w8a8_dpbusd_ymm _mm256_dpbusd_avx_epi32
#endif
#define W8A8_VNNI_INLINE static inline __attribute__((always_inline, target(W8A8_YMM_VNNI)))

/* AVX-VNNI: vpdpbusd multiplies unsigned by signed bytes, so each weight is taken as the unsigned
 * w + 128 (its sign bit flipped, once a chunk for all rows) and 128 * sx taken back off: the
 * exact sum of w * y again. Up to four rows, two accumulator chains a row (vpdpbusd's latency). */
W8A8_VNNI_INLINE void w8a8_tile_avx_vnni(const int RT, const uint8_t *wg, const tact *a, int64_t m0, float *y, int64_t ldy,
                                         int64_t valid) {
    const int64_t kp = a->kp;
    const int chains = RT <= 4 ? 2 : 1;
    const uint8_t *qs = wg + W8A8_SCALE_BYTES;
    const __m256i flip = _mm256_set1_epi8((char)0x80);
    __m256i acc[2][QROW_TILE];
    _Pragma("GCC unroll 8") for (int r = 0; r < RT; r++) acc[0][r] = acc[1][r] = _mm256_setzero_si256();
    for (int64_t c = 0; c < kp / 4; c++) {
        if (!(c & 1)) _mm_prefetch((const char *)qs + 32 * c + QPREFETCH_BYTES, _MM_HINT_T0);
        const __m256i W = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(qs + 32 * c)), flip);
        const int h = chains == 2 ? (int)(c & 1) : 0;
        _Pragma("GCC unroll 8") for (int r = 0; r < RT; r++)
            acc[h][r] = w8a8_dpbusd_ymm(acc[h][r], W, _mm256_set1_epi32(load_i32(a->qs + (m0 + r) * kp + 4 * c)));
    }
    __m256i isum[QROW_TILE];
    _Pragma("GCC unroll 8") for (int r = 0; r < RT; r++) isum[r] =
        _mm256_sub_epi32(_mm256_add_epi32(acc[0][r], acc[1][r]), _mm256_set1_epi32(128 * a->s[m0 + r]));
    w8a8_store_ymm(RT, wg, a, m0, isum, y, ldy, valid);
}

__attribute__((noinline, target(W8A8_YMM_VNNI))) static void w8a8_rows_avx_vnni(const uint8_t *wg, const tact *a, int64_t m0,
                                                                            int64_t rt, float *y, int64_t ldy, int64_t valid) {
    switch (rt) {
    case 8: w8a8_tile_avx_vnni(8, wg, a, m0, y, ldy, valid); break;
    case 7: w8a8_tile_avx_vnni(7, wg, a, m0, y, ldy, valid); break;
    case 6: w8a8_tile_avx_vnni(6, wg, a, m0, y, ldy, valid); break;
    case 5: w8a8_tile_avx_vnni(5, wg, a, m0, y, ldy, valid); break;
    case 4: w8a8_tile_avx_vnni(4, wg, a, m0, y, ldy, valid); break;
    case 3: w8a8_tile_avx_vnni(3, wg, a, m0, y, ldy, valid); break;
    case 2: w8a8_tile_avx_vnni(2, wg, a, m0, y, ldy, valid); break;
    default: w8a8_tile_avx_vnni(1, wg, a, m0, y, ldy, valid); break;
    }
}
#endif

/* rt <= QROW_TILE rows (m0 ..) against the group at wg; y points at row m0's first output of the group. */
typedef void (*w8a8_rows_fn)(const uint8_t *wg, const tact *a, int64_t m0, int64_t rt, float *y, int64_t ldy, int64_t valid);

/* Rows in blocks of QROW_BLOCK (their activations stay in L2 while every group streams past), each
 * in tiles of QROW_TILE; threads split the groups (quant_ymm.c's loop). */
static void w8a8_gemm_ymm(w8a8_rows_fn rows, const tact *a, int64_t M, const uint8_t *w, int64_t N, float *y, int64_t ldy) {
    const int64_t G = (N + QGROUP - 1) / QGROUP, gbytes = w8a8_group_bytes(a->kp);
#pragma omp parallel
    for (int64_t mb = 0; mb < M; mb += QROW_BLOCK) {
        const int64_t m_end = M - mb < QROW_BLOCK ? M : mb + QROW_BLOCK;
#pragma omp for schedule(static) nowait
        for (int64_t g = 0; g < G; g++) {
            const int64_t n0 = g * QGROUP, valid = N - n0 < QGROUP ? N - n0 : QGROUP;
            for (int64_t m0 = mb; m0 < m_end; m0 += QROW_TILE) {
                const int64_t rt = m_end - m0 < QROW_TILE ? m_end - m0 : QROW_TILE;
                rows(w + g * gbytes, a, m0, rt, y + m0 * ldy + n0, ldy, valid);
            }
        }
    }
}

/* ---- AVX-512 VNNI: two groups a zmm (group g low, g + 1 high), as quant_avx512.c ---- */

#ifdef FD_HAVE_VNNI
ZINLINE void w8a8_ztile(const int RT, const uint8_t *wg0, int64_t gbytes, const tact *a, int64_t m0, float *y, int64_t ldy,
                        int64_t valid) {
    const int64_t kp = a->kp;
    const int chains = RT <= 4 ? 2 : 1;
    const uint8_t *q0 = wg0 + W8A8_SCALE_BYTES, *q1 = q0 + gbytes;
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m512i acc[2][QROW_TILE];
    _Pragma("GCC unroll 8") for (int r = 0; r < RT; r++) acc[0][r] = acc[1][r] = _mm512_setzero_si512();
    for (int64_t c = 0; c < kp / 4; c++) {
        if (!(c & 1)) {
            _mm_prefetch((const char *)q0 + 32 * c + ZPREFETCH_BYTES, _MM_HINT_T0);
            _mm_prefetch((const char *)q1 + 32 * c + ZPREFETCH_BYTES, _MM_HINT_T0);
        }
        const __m512i W = _mm512_xor_si512(zpair(q0 + 32 * c, q1 + 32 * c), flip);
        const int h = chains == 2 ? (int)(c & 1) : 0;
        _Pragma("GCC unroll 8") for (int r = 0; r < RT; r++)
            acc[h][r] = _mm512_dpbusd_epi32(acc[h][r], W, _mm512_set1_epi32(load_i32(a->qs + (m0 + r) * kp + 4 * c)));
    }
    const __m512 dw = zjoin(_mm256_loadu_ps((const float *)wg0), _mm256_loadu_ps((const float *)(wg0 + gbytes)));
    const __mmask16 keep = valid >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << valid) - 1);
    _Pragma("GCC unroll 8") for (int r = 0; r < RT; r++) {
        const __m512i isum = _mm512_sub_epi32(_mm512_add_epi32(acc[0][r], acc[1][r]), _mm512_set1_epi32(128 * a->s[m0 + r]));
        const __m512 t = _mm512_mul_ps(dw, _mm512_set1_ps(a->d[m0 + r]));
        _mm512_mask_storeu_ps(y + r * ldy, keep, _mm512_mul_ps(t, _mm512_cvtepi32_ps(isum)));
    }
}

__attribute__((noinline, target(Z512_TARGET))) static void w8a8_zrows(const uint8_t *wg0, int64_t gbytes, const tact *a,
                                                                     int64_t m0, int64_t rt, float *y, int64_t ldy,
                                                                     int64_t valid) {
    switch (rt) {
    case 8: w8a8_ztile(8, wg0, gbytes, a, m0, y, ldy, valid); break;
    case 7: w8a8_ztile(7, wg0, gbytes, a, m0, y, ldy, valid); break;
    case 6: w8a8_ztile(6, wg0, gbytes, a, m0, y, ldy, valid); break;
    case 5: w8a8_ztile(5, wg0, gbytes, a, m0, y, ldy, valid); break;
    case 4: w8a8_ztile(4, wg0, gbytes, a, m0, y, ldy, valid); break;
    case 3: w8a8_ztile(3, wg0, gbytes, a, m0, y, ldy, valid); break;
    case 2: w8a8_ztile(2, wg0, gbytes, a, m0, y, ldy, valid); break;
    default: w8a8_ztile(1, wg0, gbytes, a, m0, y, ldy, valid); break;
    }
}

#ifndef W8A8_ZMIN_ROWS
#define W8A8_ZMIN_ROWS ZMIN_ROWS
#endif

/* Group pairs on the zmm tile; passes of fewer than W8A8_ZMIN_ROWS rows, and an odd last group, on
 * the AVX-VNNI ymm loop where the CPU has it, else AVX2's (the same bits). */
static void w8a8_gemm_avx512(const tact *a, int64_t M, const uint8_t *w, int64_t N, float *y, int64_t ldy) {
    static int vnni = -1; /* cpuid once, not every GEMM (as quant.c's gemm_ymm) */
    if (vnni < 0) vnni = w8a8_ymm_vnni_runs();
    const w8a8_rows_fn ymm = vnni ? w8a8_rows_avx_vnni : w8a8_rows_avx2;
    if (M < W8A8_ZMIN_ROWS) {
        w8a8_gemm_ymm(ymm, a, M, w, N, y, ldy);
        return;
    }
    const int64_t G = (N + QGROUP - 1) / QGROUP, pairs = G / 2, gbytes = w8a8_group_bytes(a->kp);
#pragma omp parallel
    for (int64_t mb = 0; mb < M; mb += QROW_BLOCK) {
        const int64_t m_end = M - mb < QROW_BLOCK ? M : mb + QROW_BLOCK;
#pragma omp for schedule(static) nowait
        for (int64_t gp = 0; gp < pairs; gp++) {
            const int64_t n0 = 2 * gp * QGROUP, valid = N - n0 < 2 * QGROUP ? N - n0 : 2 * QGROUP;
            for (int64_t m0 = mb; m0 < m_end; m0 += QROW_TILE) {
                const int64_t rt = m_end - m0 < QROW_TILE ? m_end - m0 : QROW_TILE;
                w8a8_zrows(w + 2 * gp * gbytes, gbytes, a, m0, rt, y + m0 * ldy + n0, ldy, valid);
            }
        }
    }
    if (G % 2) { /* the last group, its outputs only */
        const int64_t n0 = (G - 1) * QGROUP;
        w8a8_gemm_ymm(ymm, a, M, w + (G - 1) * gbytes, N - n0, y + n0, ldy);
    }
}
#endif

/* y [M, ldy] columns 0 .. N - 1 = the W8A8 part at w times the rows quantized at act (K inputs). */
static void w8a8_gemm(const void *act, int64_t M, int64_t K, const uint8_t *w, int64_t N, int impl, float *y, int64_t ldy) {
    const tact a = tact_at((void *)act, M, K);
#ifdef FD_HAVE_VNNI
    if (impl == FD_IMPL_AVX512_VNNI) {
        w8a8_gemm_avx512(&a, M, w, N, y, ldy);
        return;
    }
    if (impl == FD_IMPL_AVX_VNNI) {
        w8a8_gemm_ymm(w8a8_rows_avx_vnni, &a, M, w, N, y, ldy);
        return;
    }
#endif
    if (impl == FD_IMPL_AVX2)
        w8a8_gemm_ymm(w8a8_rows_avx2, &a, M, w, N, y, ldy);
    else
        w8a8_gemm_scalar(&a, M, w, N, y, ldy);
}
