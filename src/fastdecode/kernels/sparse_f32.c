/* 2:4 sparse float32 weights (FD_W_S24_F32), row-invariant: included by cpu.c after its float
 * GEMM (rowgemm_f32), whose blocks it reuses, and reached through quant.c's fd_project.
 *
 * The weights are float32 [N, K] in which every group of four consecutive weights of a row holds
 * at most two non-zeros (2:4 sparsity along the input). Only two values a group are stored, with
 * one bit a weight saying which: 17 bytes a row's eight weights where float32 takes 32.
 *
 * Every output is bit for bit what cpu.c's dense float32 GEMM gives over the same weights (the
 * pruned ones +0.0), at every row count: each chunk of eight weights is expanded into a dense
 * register, zeros in the pruned lanes, and multiplied in exactly the dense kernel's operations -
 * lane l accumulating x[k] * w[k] for k = l, l + 8, ... by one FMA each (zeros included), then
 * hsum8's tree, then the K % 8 tail by fmaf in increasing k. One row runs that fused here
 * (s24f_row_*); more rows expand the eight outputs of a work item into a dense scratch of 8 x K
 * floats and run cpu.c's own row blocks and 3x4 tiles on it (s24f_group_rows), so the order is
 * the dense kernel's by construction. The expansion: a vpermps whose indices come from a
 * 256-entry table by the chunk's 8-bit mask (pruned lanes index a zero lane: the four values are
 * loaded into lanes 0..3 of a zeroed register); AVX-512 (F + VL) does two outputs a zmm, AVX2 one
 * a ymm; the portable scalar loop computes the same operations one lane at a time.
 *
 * Layout (kernels/sparse.py's pack_s24_f32), outputs in groups of eight as quant.c's, a group
 * nc = ceil(K / 8) chunks of eight weights: first the codes, 8 bytes a chunk (byte j: output j's
 * mask, bit l set where weight 8c + l is kept; a K % 8 == 4 tail chunk uses bits 0..3), the
 * region padded to 64 bytes; then the values, 128 bytes a chunk: output j's kept values at
 * 16 j, in increasing position (two from each group of four; a padded output's are zeros).
 */

#define S24F_VALUES 128 /* bytes of one chunk's values for the eight outputs of a group */
#ifndef S24F_PREFETCH_BYTES
/* How far ahead the kernels fetch the values (0: not at all), into L2 (prefetcht1): one stream the
 * hardware prefetcher does not run far enough ahead of. 30 SmolLM2 layers, one thread, CPU time on
 * the 2-core Zen 4, dense float32 / AVX-512 / AVX2 at one row: none 28.7 / 30.3 / 28.8 ms, 4 KB into
 * L1 26 / 20 / 21, 4 KB into L2 27 / 16 / 16, 8 KB into L2 29 / 13.4 / 15.8 (8 rows 43 / 36 / 42),
 * 16 KB into L2 34 / 16 / 19. */
#define S24F_PREFETCH_BYTES 8192
#endif

static inline int64_t s24f_chunks(int64_t K) { return (K + 7) / 8; }
static inline int64_t s24f_codes_region(int64_t K) { return (s24f_chunks(K) * 8 + 63) & ~(int64_t)63; }
static inline int64_t s24f_group_bytes(int64_t K) { return s24f_codes_region(K) + s24f_chunks(K) * S24F_VALUES; }

/* Output j's weight k of group wg (+0.0 where it is pruned). */
static inline float s24f_weight(const uint8_t *wg, int64_t K, int j, int64_t k) {
    const int64_t c = k / 8;
    const unsigned code = wg[c * 8 + j], l = (unsigned)(k % 8);
    if (!(code >> l & 1)) return 0.0f;
    const float *v = (const float *)(wg + s24f_codes_region(K) + c * S24F_VALUES) + 4 * j;
    return v[__builtin_popcount(code & ((1u << l) - 1))];
}

/* The portable loop: the dense kernel's operations one lane at a time (the definition). */
static void s24f_gemm_scalar(const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, float *y) {
    const int64_t G = (N + 7) / 8, gbytes = s24f_group_bytes(K), K8 = K & ~(int64_t)7;
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < G; g++)
        for (int64_t m = 0; m < M; m++)
            for (int j = 0; j < 8 && g * 8 + j < N; j++) {
                const uint8_t *wg = w + g * gbytes;
                const float *xm = x + m * K;
                float lane[8] = {0};
                for (int64_t k = 0; k < K8; k += 8)
                    for (int l = 0; l < 8; l++) lane[l] = fmaf(xm[k + l], s24f_weight(wg, K, j, k + l), lane[l]);
                float s = ((lane[0] + lane[4]) + (lane[2] + lane[6])) + ((lane[1] + lane[5]) + (lane[3] + lane[7]));
                for (int64_t t = K8; t < K; t++) s = fmaf(xm[t], s24f_weight(wg, K, j, t), s);
                y[m * N + g * 8 + j] = s;
            }
}

/* vpermps indices by mask: lane l of a kept weight takes value rank(l) (lanes 0..3), a pruned
 * lane lane 4 (a zero). s24f_zlut: the same for AVX-512's pairs of outputs, whose eight values
 * sit in lanes 0..7 of a register zeroed above: the first output's indices rank(l) or 8 (a
 * zero), the second's 4 + rank(l) or 8. Filled once, before any call (a constructor). */
static int32_t s24f_lut[256][8] __attribute__((aligned(32)));
static int32_t s24f_zlut[2][256][8] __attribute__((aligned(32)));

__attribute__((constructor)) static void s24f_fill_lut(void) {
    for (int code = 0; code < 256; code++) {
        int rank = 0;
        for (int l = 0; l < 8; l++) {
            const int kept = code >> l & 1, r = rank & 3;
            s24f_lut[code][l] = kept ? r : 4;
            s24f_zlut[0][code][l] = kept ? r : 8;
            s24f_zlut[1][code][l] = kept ? 4 + r : 8;
            rank += kept;
        }
    }
}

QAINLINE __m256 s24f_chunk_avx2(const uint8_t *vals, unsigned code) {
    const __m256i idx = _mm256_load_si256((const __m256i *)s24f_lut[code]);
    return _mm256_permutevar8x32_ps(_mm256_zextps128_ps256(_mm_load_ps((const float *)vals)), idx);
}

/* AVX2, one output a ymm. y[0 .. 8) = one row x against group wg: block_f32_8x1's operations. */
static void s24f_row_avx2(const float *x, int64_t K, const uint8_t *wg, float *y) {
    const int64_t K8 = K & ~(int64_t)7;
    const uint8_t *vals = wg + s24f_codes_region(K);
    __m256 acc[8];
    _Pragma("GCC unroll 8") for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();
    for (int64_t c = 0; c < K8 / 8; c++) {
        const uint8_t *v = vals + c * S24F_VALUES;
        if (S24F_PREFETCH_BYTES) {
            _mm_prefetch((const char *)v + S24F_PREFETCH_BYTES, _MM_HINT_T1);
            _mm_prefetch((const char *)v + S24F_PREFETCH_BYTES + 64, _MM_HINT_T1);
        }
        const __m256 xv = _mm256_loadu_ps(x + 8 * c);
        _Pragma("GCC unroll 8") for (int j = 0; j < 8; j++)
            acc[j] = _mm256_fmadd_ps(xv, s24f_chunk_avx2(v + 16 * j, wg[c * 8 + j]), acc[j]);
    }
    _Pragma("GCC unroll 8") for (int j = 0; j < 8; j++) {
        float s = hsum8(acc[j]);
        for (int64_t t = K8; t < K; t++) s = fmaf(x[t], s24f_weight(wg, K, j, t), s);
        y[j] = s;
    }
}

/* How many chunks of K a multi-row tile takes at a time: all of them while RB rows of x fit in L1,
 * else X_CHUNK_BYTES of x (rows_chunked's reason; each output's accumulators are carried in memory
 * from piece to piece, a store and a load being exact). */
static inline int64_t s24f_piece(int RB, int64_t K) {
    return RB * K * 4 > X_L1_BYTES ? X_CHUNK_BYTES / (32 * RB) : (K + 7) / 8;
}

/* rows 0 .. RB of x (2 <= RB <= 8) against group wg's outputs 0 .. nout: block_f32_1xRB's operations,
 * an output at a time within each piece of K (the group's values stay in L1 / L2 after the first) */
QAINLINE void s24f_tile_avx2(const int RB, const float *x, int64_t K, const uint8_t *wg, float *y, int64_t N,
                             int64_t nout) {
    const int64_t nc8 = K / 8, kc = s24f_piece(RB, K);
    const uint8_t *vals = wg + s24f_codes_region(K);
    __m256 acc[8][8];
    for (int j = 0; j < 8; j++)
        for (int r = 0; r < RB; r++) acc[j][r] = _mm256_setzero_ps();
    for (int64_t c0 = 0; c0 < nc8; c0 += kc) {
        const int64_t c1 = c0 + kc < nc8 ? c0 + kc : nc8;
        for (int j = 0; j < nout; j++) {
            __m256 a[8];
            _Pragma("GCC unroll 8") for (int r = 0; r < RB; r++) a[r] = acc[j][r];
            for (int64_t c = c0; c < c1; c++) {
                const uint8_t *v = vals + c * S24F_VALUES;
                if (S24F_PREFETCH_BYTES && j == 0) {
                    _mm_prefetch((const char *)v + S24F_PREFETCH_BYTES, _MM_HINT_T1);
                    _mm_prefetch((const char *)v + S24F_PREFETCH_BYTES + 64, _MM_HINT_T1);
                }
                const __m256 wv = s24f_chunk_avx2(v + 16 * j, wg[c * 8 + j]);
                _Pragma("GCC unroll 8") for (int r = 0; r < RB; r++)
                    a[r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * K + 8 * c), wv, a[r]);
            }
            _Pragma("GCC unroll 8") for (int r = 0; r < RB; r++) acc[j][r] = a[r];
        }
    }
    for (int j = 0; j < nout; j++)
        for (int r = 0; r < RB; r++) {
            float s = hsum8(acc[j][r]);
            for (int64_t t = nc8 * 8; t < K; t++) s = fmaf(x[r * K + t], s24f_weight(wg, K, j, t), s);
            y[r * N + j] = s;
        }
}

static void s24f_rows_avx2(int64_t rb, const float *x, int64_t K, const uint8_t *wg, float *y, int64_t N, int64_t nout) {
    switch (rb) {
    case 2: s24f_tile_avx2(2, x, K, wg, y, N, nout); break;
    case 3: s24f_tile_avx2(3, x, K, wg, y, N, nout); break;
    case 4: s24f_tile_avx2(4, x, K, wg, y, N, nout); break;
    case 5: s24f_tile_avx2(5, x, K, wg, y, N, nout); break;
    case 6: s24f_tile_avx2(6, x, K, wg, y, N, nout); break;
    case 7: s24f_tile_avx2(7, x, K, wg, y, N, nout); break;
    default: s24f_tile_avx2(8, x, K, wg, y, N, nout); break;
    }
}

/* buf [8, K] = group wg's weights, dense, for one expansion (more than eight rows) */
#define S24F_DENSE(SUFFIX, EXPAND, TARGET)                                                                 \
    TARGET static void s24f_dense_##SUFFIX(const uint8_t *wg, int64_t K, float *buf) {                     \
        const int64_t K8 = K & ~(int64_t)7;                                                                \
        const uint8_t *vals = wg + s24f_codes_region(K);                                                   \
        for (int64_t c = 0; c < K8 / 8; c++)                                                               \
            _Pragma("GCC unroll 8") for (int j = 0; j < 8; j++)                                            \
                _mm256_storeu_ps(buf + j * K + 8 * c, EXPAND(vals + c * S24F_VALUES + 16 * j, wg[c * 8 + j])); \
        for (int j = 0; j < 8; j++)                                                                        \
            for (int64_t t = K8; t < K; t++) buf[j * K + t] = s24f_weight(wg, K, j, t);                    \
    }
S24F_DENSE(avx2, s24f_chunk_avx2, )

#ifdef FD_HAVE_VNNI
#define S24F_Z_TARGET __attribute__((target("avx512f,avx512vl,avx2,fma,f16c")))
#define S24F_ZINLINE static inline __attribute__((always_inline)) S24F_Z_TARGET

/* AVX-512 takes two outputs a zmm, lanes 0..7 output j and 8..15 output j + 1, each lane's FMA the one
 * the ymm kernel does (so the same bits, with half the instructions): the pair's eight values are
 * contiguous, and one vpermps over them picks both outputs' lanes (s24f_zlut). (vexpandps under
 * the 16-bit mask was 2.5x slower than AVX2's vpermps here, a Zen 4.) */
S24F_ZINLINE __m512 s24f_pair_avx512(const uint8_t *v, const uint8_t *codes) {
    const __m512i idx = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_load_si256((const __m256i *)s24f_zlut[0][codes[0]])),
                                           _mm256_load_si256((const __m256i *)s24f_zlut[1][codes[1]]), 1);
    return _mm512_permutexvar_ps(idx, _mm512_zextps256_ps512(_mm256_load_ps((const float *)v)));
}
S24F_ZINLINE __m512 s24f_xx_avx512(const float *x) { /* eight activations in both halves */
    return _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(_mm256_loadu_ps(x))));
}
S24F_ZINLINE __m256 s24f_half_avx512(__m512 a, int hi) {
    return hi ? _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)) : _mm512_castps512_ps256(a);
}
/* hsum8 and the tail of output j (lanes of half hi of acc) */
S24F_ZINLINE float s24f_finish_avx512(__m512 acc, int hi, const float *x, int64_t K, const uint8_t *wg, int j) {
    float s = hsum8(s24f_half_avx512(acc, hi));
    for (int64_t t = K & ~(int64_t)7; t < K; t++) s = fmaf(x[t], s24f_weight(wg, K, j, t), s);
    return s;
}

/* y[0 .. 8) = one row x against group wg */
S24F_Z_TARGET static void s24f_zrow(const float *x, int64_t K, const uint8_t *wg, float *y) {
    const int64_t K8 = K & ~(int64_t)7;
    const uint8_t *vals = wg + s24f_codes_region(K);
    __m512 acc[4];
    for (int p = 0; p < 4; p++) acc[p] = _mm512_setzero_ps();
    for (int64_t c = 0; c < K8 / 8; c++) {
        const uint8_t *v = vals + c * S24F_VALUES;
        if (S24F_PREFETCH_BYTES) {
            _mm_prefetch((const char *)v + S24F_PREFETCH_BYTES, _MM_HINT_T1);
            _mm_prefetch((const char *)v + S24F_PREFETCH_BYTES + 64, _MM_HINT_T1);
        }
        const __m512 xv = s24f_xx_avx512(x + 8 * c);
        _Pragma("GCC unroll 4") for (int p = 0; p < 4; p++)
            acc[p] = _mm512_fmadd_ps(xv, s24f_pair_avx512(v + 32 * p, wg + c * 8 + 2 * p), acc[p]);
    }
    for (int j = 0; j < 8; j++) y[j] = s24f_finish_avx512(acc[j / 2], j % 2, x, K, wg, j);
}

/* rows 0 .. RB of x against group wg's outputs 0 .. nout, a pair of outputs at a time within each
 * piece of K (s24f_piece) */
S24F_ZINLINE void s24f_ztile(const int RB, const float *x, int64_t K, const uint8_t *wg, float *y, int64_t N,
                             int64_t nout) {
    const int64_t nc8 = K / 8, kc = s24f_piece(RB, K);
    const uint8_t *vals = wg + s24f_codes_region(K);
    __m512 acc[4][8];
    for (int p = 0; p < 4; p++)
        for (int r = 0; r < RB; r++) acc[p][r] = _mm512_setzero_ps();
    for (int64_t c0 = 0; c0 < nc8; c0 += kc) {
        const int64_t c1 = c0 + kc < nc8 ? c0 + kc : nc8;
        for (int p = 0; 2 * p < nout; p++) {
            __m512 a[8];
            _Pragma("GCC unroll 8") for (int r = 0; r < RB; r++) a[r] = acc[p][r];
            for (int64_t c = c0; c < c1; c++) {
                const uint8_t *v = vals + c * S24F_VALUES;
                if (S24F_PREFETCH_BYTES && p == 0) {
                    _mm_prefetch((const char *)v + S24F_PREFETCH_BYTES, _MM_HINT_T1);
                    _mm_prefetch((const char *)v + S24F_PREFETCH_BYTES + 64, _MM_HINT_T1);
                }
                const __m512 wv = s24f_pair_avx512(v + 32 * p, wg + c * 8 + 2 * p);
                _Pragma("GCC unroll 8") for (int r = 0; r < RB; r++)
                    a[r] = _mm512_fmadd_ps(s24f_xx_avx512(x + r * K + 8 * c), wv, a[r]);
            }
            _Pragma("GCC unroll 8") for (int r = 0; r < RB; r++) acc[p][r] = a[r];
        }
    }
    for (int p = 0; 2 * p < nout; p++)
        for (int r = 0; r < RB; r++)
            for (int h = 0; h < 2 && 2 * p + h < nout; h++)
                y[r * N + 2 * p + h] = s24f_finish_avx512(acc[p][r], h, x + r * K, K, wg, 2 * p + h);
}

S24F_Z_TARGET static void s24f_zrows(int64_t rb, const float *x, int64_t K, const uint8_t *wg, float *y, int64_t N,
                                     int64_t nout) {
    switch (rb) {
    case 2: s24f_ztile(2, x, K, wg, y, N, nout); break;
    case 3: s24f_ztile(3, x, K, wg, y, N, nout); break;
    case 4: s24f_ztile(4, x, K, wg, y, N, nout); break;
    case 5: s24f_ztile(5, x, K, wg, y, N, nout); break;
    case 6: s24f_ztile(6, x, K, wg, y, N, nout); break;
    case 7: s24f_ztile(7, x, K, wg, y, N, nout); break;
    default: s24f_ztile(8, x, K, wg, y, N, nout); break;
    }
}
#endif

/* M rows against the dense expansion buf [8, K] of outputs n0 .. n0 + nout: rowgemm_f32's
 * work item, its blocks and tiles (scale NULL). */
static void s24f_group_rows(const float *x, int64_t M, int64_t K, const float *buf, float *y, int64_t N, int64_t n0,
                            int64_t nout) {
    if (nout < 8) { /* rowgemm_f32's N % 8 leftover outputs */
        for (int64_t j = 0; j < nout; j++)
            for (int64_t m = 0; m < M; m++) block_f32_1x1(x + m * K, K, buf + j * K, K, y + m * N + n0 + j, N);
        return;
    }
    int64_t m = 0;
    if (M >= TILE_MIN_ROWS)
        for (; m + 3 <= M; m += 3) {
            tile_f32_3x4(x + m * K, K, buf, y + m * N + n0, N);
            tile_f32_3x4(x + m * K, K, buf + 4 * K, y + m * N + n0 + 4, N);
        }
    for (; m < M; m += 8) rows_block_f32(x + m * K, K, buf, y + m * N + n0, N, M - m < 8 ? M - m : 8);
}

/* This thread's scratch of at least `floats` floats (kept between calls; NULL if none could be had). */
static float *s24f_scratch(int64_t floats) {
    static __thread float *buf;
    static __thread int64_t cap;
    if (cap < floats) {
        free(buf);
        buf = aligned_alloc(64, (size_t)((floats * 4 + 63) & ~(int64_t)63));
        cap = buf ? floats : 0;
    }
    return buf;
}

/* y [M, N] = x [M, K] times the packed weights w; impl: quant.c's FD_IMPL_* as impl_of gives it
 * (AVX-512 VNNI's CPUs take the vexpandps expansion, AVX2 and AVX-VNNI the vpermps one). */
static void s24f_gemm(const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, float *y, int impl) {
    const int64_t G = (N + 7) / 8, gbytes = s24f_group_bytes(K);
    int alloc_failed = 0;
    if (impl == FD_IMPL_SCALAR) {
        s24f_gemm_scalar(x, M, K, w, N, y);
        return;
    }
#pragma omp parallel for schedule(static) reduction(| : alloc_failed)
    for (int64_t g = 0; g < G; g++) {
        const uint8_t *wg = w + g * gbytes;
        const int64_t n0 = g * 8, nout = N - n0 < 8 ? N - n0 : 8;
        const int wide = impl == FD_IMPL_AVX512_VNNI;
        if (M == 1) {
            float out[8];
#ifdef FD_HAVE_VNNI
            if (wide)
                s24f_zrow(x, K, wg, out);
            else
#endif
                s24f_row_avx2(x, K, wg, out);
            for (int64_t j = 0; j < nout; j++) y[n0 + j] = out[j];
            continue;
        }
        if (M <= 8) {
#ifdef FD_HAVE_VNNI
            if (wide)
                s24f_zrows(M, x, K, wg, y + n0, N, nout);
            else
#endif
                s24f_rows_avx2(M, x, K, wg, y + n0, N, nout);
            continue;
        }
        float *buf = s24f_scratch(8 * K);
        if (!buf) {
            alloc_failed = 1;
            continue;
        }
        s24f_dense_avx2(wg, K, buf); /* (AVX-512's vpermps pairs gain nothing on a one-off expansion) */
        s24f_group_rows(x, M, K, buf, y, N, n0, nout);
    }
    if (alloc_failed) s24f_gemm_scalar(x, M, K, w, N, y); /* the same bits, without scratch */
}
