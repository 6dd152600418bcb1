/* Row-invariant CPU kernels for the native decoder: a small-M GEMM over float32
 * or int8 weights, causal attention by query row, and the fused glue of a layer.
 *
 * The GEMM:
 *
 *     y[m, n] = sum_k x[m, k] * w[n, k]        x: [M, K], w: [N, K] (nn.Linear's layout), y: [M, N]
 *
 * Why it is hand-written (fastdecode/kernels/cpu.py says more): speculative
 * verification must give each row the very bits a one-token decode step gives
 * it, and a verification pass of K+1 <= 16 rows must cost little more than one
 * row. MKL's sgemm/sgemv (torch's F.linear) gives a row the same bits only within
 * row-count groups and costs 2-3x at 8 rows; oneDNN is invariant but slower at
 * one row. No library kernel we could find does both.
 *
 * The invariance is by construction: every output element is reduced in one
 * fixed order, whatever M is and however rows and columns are blocked --
 * eight lanes, lane l accumulating x[m, k] * w[n, k] for k = l, l + 8, l + 16, ...
 * with one fused multiply-add each, then one fixed horizontal-sum tree, then
 * the K % 8 tail in increasing k. Blocking only changes which accumulators live
 * in registers together; threads split the N outputs, never a reduction.
 *
 * Cost model: the weights are streamed from memory once per call (the eight
 * rows of w of one work item stay in L1/L2 while every block of up to eight
 * rows of x passes over them), so an M-row call is memory-bound like the
 * one-row call until the FMAs, M per weight, catch up with the memory stream.
 *
 * Needs AVX2 + FMA (x86-64 since Haswell / Zen); cpu.py checks before loading.
 */
#include <immintrin.h>
#include <omp.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "quant.c" /* the block formats' integer GEMM and fd_project (one library, one build) */
#include "sparse.c" /* 2:4 sparse Q8_0 weights, reached through quant.c's block_gemm */
#include "w8a8.c"   /* int8 per-channel weights x int8 per-token activations, reached through fd_project */
#include "quant_pack.c" /* stored GGUF blocks into quant.c's layout, at load */
#include "experts.c"    /* a mixture of experts' FFN in one call, over quant.c's block GEMM */

static inline float hsum8(__m256 v) {
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 0x1));
    return _mm_cvtss_f32(lo);
}

static inline float hmax8(__m256 v) {
    __m128 lo = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    lo = _mm_max_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_max_ss(lo, _mm_shuffle_ps(lo, lo, 0x1));
    return _mm_cvtss_f32(lo);
}

/* e^x in eight lanes: Cephes' expf (range reduction by ln 2 in two parts, a
 * degree-5 polynomial, scaling by 2^n), ~1 ulp on [-87, 88]; inputs are
 * clamped there (so e^-inf is 1.2e-38, not 0, and e^inf is 2.4e38 - harmless
 * in softmax weights and SiLU; NaN stays NaN). Hand-written because C has no
 * vector exp: torch's SLEEF is linked inside libtorch, not exported, and
 * scalar expf cost ~15 ns an element
 * here (4 ms of an 8-row pass in SwiGLU alone). One function for every lane
 * and position, so it keeps the kernels row-invariant. */
static inline __m256 exp8(__m256 x) {
    /* x as the second operand: max/min return it when it is NaN, so NaN propagates */
    x = _mm256_min_ps(_mm256_set1_ps(88.37626f), _mm256_max_ps(_mm256_set1_ps(-87.33654f), x));
    __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(scale));
}

/* Several rows make the kernel compute enough that the hardware prefetcher
 * falls behind the weight stream: fetching 4 KB ahead took 8 rows from 1.45x
 * to 1.23-1.27x one row (prefetch never faults, so running past the end of w
 * is harmless). One row needs no help. */
#define PREFETCH_BYTES 4096

/* Weights as float32, or as int8 converted to float32 in registers (exact: every
 * int8 value is a float32); the accumulation is the same float32 FMA either way. */
#define LOAD_F32(p) _mm256_loadu_ps(p)
#define LOAD_I8(p) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
/* bf16 and fp16 weights (a GGUF file's BF16 / F16 tensors, --weights bf16) widened in registers the same
 * way: exact, so they give the bits the float32 GEMM gives over their float32 values, at half the bytes. */
#define LOAD_BF16(p) _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
#define LOAD_F16(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
/* One weight as float32, for the K % 8 tail (the same values as the loads above). */
#define WCVT_f32(v) (v)
#define WCVT_i8(v) ((float)(v))
#define WCVT_bf16(v) bf16_to_f32(v)
#define WCVT_f16(v) fp16_to_f32(v)
static inline float bf16_to_f32(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* y[r, j] for RB rows of x (stride ldx) and NB rows of w (stride K); y stride ldy.
 * The unroll pragmas keep the RB x NB accumulators in registers: without them
 * gcc leaves the constant-bound loops rolled and the accumulators on the stack
 * (measured: 1.6x slower at eight rows). */
#define ROWGEMM_BLOCK(T, WT, LOADW, NB, RB, INTERLEAVE)                                       \
    static inline void block_##T##_##NB##x##RB(const float *x, int64_t ldx, const WT *w,      \
                                               int64_t K, float *y, int64_t ldy) {            \
        __m256 acc[RB][NB];                                                                  \
        _Pragma("GCC unroll 8") for (int r = 0; r < RB; r++)                                 \
            _Pragma("GCC unroll 8") for (int j = 0; j < NB; j++) acc[r][j] = _mm256_setzero_ps(); \
        int64_t k = 0;                                                                       \
        for (; k + 8 <= K; k += 8) {                                                         \
            if (RB == 1 && INTERLEAVE) { /* int8, one row: each weight vector loaded   \
                and converted where it is used; converting all eight first needs 17     \
                registers and spilled an accumulator (measured: float32 is 8% faster    \
                the other way, int8 needs this) */                                      \
                /* and the next work item's rows (contiguous, 8 K bytes), a line a step:  \
                   int8 rows of a few hundred bytes are too short for the hardware         \
                   prefetcher to get going on its own */                                   \
                _mm_prefetch((const char *)(w + 8 * K) + k * 8, _MM_HINT_T0);                \
                const __m256 xv = _mm256_loadu_ps(x + k);                                    \
                _Pragma("GCC unroll 8") for (int j = 0; j < NB; j++)                         \
                    acc[0][j] = _mm256_fmadd_ps(xv, LOADW(w + j * K + k), acc[0][j]);        \
                continue;                                                                    \
            }                                                                                \
            if (RB > 1) _mm_prefetch((const char *)(w + k) + PREFETCH_BYTES, _MM_HINT_T0);   \
            __m256 wv[NB];                                                                   \
            _Pragma("GCC unroll 8") for (int j = 0; j < NB; j++) wv[j] = LOADW(w + j * K + k); \
            _Pragma("GCC unroll 8") for (int r = 0; r < RB; r++) {                           \
                __m256 xv = _mm256_loadu_ps(x + r * ldx + k);                                \
                _Pragma("GCC unroll 8") for (int j = 0; j < NB; j++)                         \
                    acc[r][j] = _mm256_fmadd_ps(xv, wv[j], acc[r][j]);                       \
            }                                                                                \
        }                                                                                    \
        _Pragma("GCC unroll 8") for (int r = 0; r < RB; r++)                                 \
            _Pragma("GCC unroll 8") for (int j = 0; j < NB; j++) {                           \
                float s = hsum8(acc[r][j]);                                                  \
                for (int64_t t = k; t < K; t++) s = fmaf(x[r * ldx + t], WCVT_##T(w[j * K + t]), s); \
                y[r * ldy + j] = s;                                                          \
            }                                                                                \
    }

/* The rb-row block's loop over k in [k0, k1) (multiples of 8) for one row of w,
 * its accumulators acc[0 .. RB) carried in memory across calls; pf: what to
 * prefetch, in step with w + k0. */
#define ROWGEMM_PANEL(T, WT, LOADW, RB)                                                       \
    static inline void panel_##T##_##RB(const float *x, int64_t ldx, const WT *w, int64_t k0, int64_t k1, __m256 *acc, \
                                        const WT *pf) {                                      \
        __m256 a[RB];                                                                        \
        _Pragma("GCC unroll 8") for (int r = 0; r < RB; r++) a[r] = acc[r];                  \
        for (int64_t k = k0; k < k1; k += 8) {                                               \
            _mm_prefetch((const char *)(pf + (k - k0)), _MM_HINT_T0);                        \
            const __m256 wv = LOADW(w + k);                                                  \
            _Pragma("GCC unroll 8") for (int r = 0; r < RB; r++)                             \
                a[r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * ldx + k), wv, a[r]);          \
        }                                                                                    \
        _Pragma("GCC unroll 8") for (int r = 0; r < RB; r++) acc[r] = a[r];                  \
    }

/* How much of x a multi-row block keeps in L1 (32 KB a core on Zen 3) while the
 * weights stream past it: beyond X_L1_BYTES every weight vector re-read x from
 * L2, and the 8-row SwiGLU down projection (K = 1536) cost 1.5-1.8x one row,
 * against ~1.2x for K = 576; it is then reduced in chunks of X_CHUNK_BYTES of x. */
#ifndef X_L1_BYTES
#define X_L1_BYTES 24576
#endif
#ifndef X_CHUNK_BYTES
#define X_CHUNK_BYTES 8192
#endif

/* From this many rows on (a prompt's prefill, a large batch), rows go three at a time
 * against four weight rows (tile_*_3x4): the weights are then reused across many rows and
 * the pass is compute-bound, where the one-output-at-a-time blocks below spend a load per
 * FMA. Measured on a 2-core Zen 3 over SmolLM2-shaped layers, weights cold: 1.4x at 64
 * rows, 1.6x at 235 and 512 (74 -> 115-125 GFLOPS); no gain up to 32 rows, where reading
 * four weight rows at once loses the one contiguous stream (8 rows: 1.5x slower). The
 * same FMAs in the same order per output: the bits do not change. Float32 only: int8
 * weights are converted per load, and three rows a load measured 1.2x slower than eight. */
#ifndef TILE_MIN_ROWS
#define TILE_MIN_ROWS 48
#endif

/* Block shapes, measured on a 2-core Zen 3 over a SmolLM2-135M-shaped step
 * (30 layers + LM head): one row takes eight outputs at once (eight FMA chains
 * hide the FMA latency; 22-25 ms, ~21 GB/s, vs MKL's 43 ms); two to eight rows
 * take one output at a time, so the eight weight rows of a work item are read
 * as one contiguous stream (8 rows: 1.25x one row; interleaving two or four
 * weight rows, or capping row blocks at four or six, measured 1.5-1.9x).
 * Every shape reduces an output in the same order. */
#define ROWGEMM_KERNEL(T, WT, LOADW, INTERLEAVE, TILE)                                                        \
    ROWGEMM_BLOCK(T, WT, LOADW, 8, 1, INTERLEAVE)                                                         \
    ROWGEMM_BLOCK(T, WT, LOADW, 1, 2, INTERLEAVE)                                                         \
    ROWGEMM_BLOCK(T, WT, LOADW, 1, 3, INTERLEAVE)                                                         \
    ROWGEMM_BLOCK(T, WT, LOADW, 1, 4, INTERLEAVE)                                                         \
    ROWGEMM_BLOCK(T, WT, LOADW, 1, 5, INTERLEAVE)                                                         \
    ROWGEMM_BLOCK(T, WT, LOADW, 1, 6, INTERLEAVE)                                                         \
    ROWGEMM_BLOCK(T, WT, LOADW, 1, 7, INTERLEAVE)                                                         \
    ROWGEMM_BLOCK(T, WT, LOADW, 1, 8, INTERLEAVE)                                                         \
    ROWGEMM_BLOCK(T, WT, LOADW, 1, 1, INTERLEAVE) /* the N % 8 leftover outputs */                        \
    ROWGEMM_PANEL(T, WT, LOADW, 2) ROWGEMM_PANEL(T, WT, LOADW, 3) ROWGEMM_PANEL(T, WT, LOADW, 4)         \
    ROWGEMM_PANEL(T, WT, LOADW, 5) ROWGEMM_PANEL(T, WT, LOADW, 6) ROWGEMM_PANEL(T, WT, LOADW, 7)         \
    ROWGEMM_PANEL(T, WT, LOADW, 8)                                                            \
    /* rb rows of x too long to stay in L1 (rb * K * 4 bytes > X_L1_BYTES): the 8 x rb   \
       outputs of a work item are reduced over K in chunks of kc, their accumulators     \
       kept in memory between chunks (a store and a load are exact: the same FMAs, in    \
       the same order, as the one-pass blocks). The weights are then read row by row     \
       in pieces, so each piece prefetches the piece read two after it. */               \
    static void rows_chunked_##T(const float *x, int64_t K, const WT *wb, float *y, int64_t N, int64_t rb, int64_t kc) { \
        __m256 acc[8][8];                                                                     \
        const int64_t K8 = K & ~(int64_t)7;                                                   \
        for (int j = 0; j < 8; j++)                                                           \
            for (int r = 0; r < rb; r++) acc[j][r] = _mm256_setzero_ps();                     \
        for (int64_t k0 = 0; k0 < K8; k0 += kc) {                                             \
            const int64_t k1 = k0 + kc < K8 ? k0 + kc : K8;                                   \
            for (int j = 0; j < 8; j++) {                                                     \
                /* the piece two ahead: row j + 2 of this chunk, else of the next chunk,  \
                   else of the next work item (rows 8.. of wb) */                          \
                const WT *pf = j + 2 < 8 ? wb + (j + 2) * K + k0                              \
                               : k1 < K8 ? wb + (j - 6) * K + k1 : wb + (j + 2) * K;          \
                switch (rb) {                                                                 \
                case 2: panel_##T##_2(x, K, wb + j * K, k0, k1, acc[j], pf); break;           \
                case 3: panel_##T##_3(x, K, wb + j * K, k0, k1, acc[j], pf); break;           \
                case 4: panel_##T##_4(x, K, wb + j * K, k0, k1, acc[j], pf); break;           \
                case 5: panel_##T##_5(x, K, wb + j * K, k0, k1, acc[j], pf); break;           \
                case 6: panel_##T##_6(x, K, wb + j * K, k0, k1, acc[j], pf); break;           \
                case 7: panel_##T##_7(x, K, wb + j * K, k0, k1, acc[j], pf); break;           \
                default: panel_##T##_8(x, K, wb + j * K, k0, k1, acc[j], pf); break;          \
                }                                                                             \
            }                                                                                 \
        }                                                                                     \
        for (int j = 0; j < 8; j++)                                                           \
            for (int r = 0; r < rb; r++) {                                                    \
                float s = hsum8(acc[j][r]);                                                   \
                for (int64_t t = K8; t < K; t++) s = fmaf(x[r * K + t], WCVT_##T(wb[j * K + t]), s); \
                y[r * N + j] = s;                                                             \
            }                                                                                 \
    }                                                                                         \
    /* rows [0, rb) of x (rb in 1..8) against the 8 rows of w at wb */                        \
    static inline void rows_block_##T(const float *x, int64_t K, const WT *wb, float *y, int64_t N, int64_t rb) { \
        if (rb > 1 && rb * K * 4 > X_L1_BYTES) {                                              \
            rows_chunked_##T(x, K, wb, y, N, rb, (X_CHUNK_BYTES / (4 * rb)) & ~(int64_t)7);    \
            return;                                                                           \
        }                                                                                     \
        switch (rb) {                                                                         \
        case 1: block_##T##_8x1(x, K, wb, K, y, N); break;                                    \
        case 2: for (int j = 0; j < 8; j++) block_##T##_1x2(x, K, wb + j * K, K, y + j, N); break; \
        case 3: for (int j = 0; j < 8; j++) block_##T##_1x3(x, K, wb + j * K, K, y + j, N); break; \
        case 4: for (int j = 0; j < 8; j++) block_##T##_1x4(x, K, wb + j * K, K, y + j, N); break; \
        case 5: for (int j = 0; j < 8; j++) block_##T##_1x5(x, K, wb + j * K, K, y + j, N); break; \
        case 6: for (int j = 0; j < 8; j++) block_##T##_1x6(x, K, wb + j * K, K, y + j, N); break; \
        case 7: for (int j = 0; j < 8; j++) block_##T##_1x7(x, K, wb + j * K, K, y + j, N); break; \
        default: for (int j = 0; j < 8; j++) block_##T##_1x8(x, K, wb + j * K, K, y + j, N); break; \
        }                                                                                     \
    }                                                                                         \
    /* 3 rows of x against 4 rows of w, the whole of K: twelve accumulators, 3 x and 4 w   \
       loads per 12 FMAs; each output reduced exactly as in the blocks above */                \
    static inline void tile_##T##_3x4(const float *x, int64_t K, const WT *w, float *y, int64_t N) { \
        __m256 acc[3][4];                                                                     \
        _Pragma("GCC unroll 8") for (int r = 0; r < 3; r++)                                   \
            _Pragma("GCC unroll 8") for (int j = 0; j < 4; j++) acc[r][j] = _mm256_setzero_ps(); \
        int64_t k = 0;                                                                        \
        for (; k + 8 <= K; k += 8) {                                                          \
            const __m256 x0 = _mm256_loadu_ps(x + k), x1 = _mm256_loadu_ps(x + K + k),        \
                         x2 = _mm256_loadu_ps(x + 2 * K + k);                                 \
            _Pragma("GCC unroll 8") for (int j = 0; j < 4; j++) {                             \
                const __m256 wv = LOADW(w + j * K + k);                                       \
                acc[0][j] = _mm256_fmadd_ps(x0, wv, acc[0][j]);                               \
                acc[1][j] = _mm256_fmadd_ps(x1, wv, acc[1][j]);                               \
                acc[2][j] = _mm256_fmadd_ps(x2, wv, acc[2][j]);                               \
            }                                                                                 \
        }                                                                                     \
        _Pragma("GCC unroll 8") for (int r = 0; r < 3; r++)                                   \
            _Pragma("GCC unroll 8") for (int j = 0; j < 4; j++) {                             \
                float s = hsum8(acc[r][j]);                                                   \
                for (int64_t t = k; t < K; t++) s = fmaf(x[r * K + t], WCVT_##T(w[j * K + t]), s); \
                y[r * N + j] = s;                                                             \
            }                                                                                 \
    }                                                                                         \
    /* y = x w^T, times scale[n] per output when scale is not NULL */                         \
    static void rowgemm_##T(const float *x, int64_t M, int64_t K, const WT *w, const float *scale, int64_t N, float *y) { \
        const int64_t nblocks = N / 8;                                                        \
        _Pragma("omp parallel for schedule(static)")                                          \
        for (int64_t b = 0; b < nblocks; b++) {                                               \
            const int64_t n0 = b * 8;                                                         \
            int64_t m = 0;                                                                    \
            if (TILE && !scale && M >= TILE_MIN_ROWS) /* (only float32 tiles; it has no scale) */ \
                for (; m + 3 <= M; m += 3) {                                                  \
                    tile_##T##_3x4(x + m * K, K, w + n0 * K, y + m * N + n0, N);               \
                    tile_##T##_3x4(x + m * K, K, w + (n0 + 4) * K, y + m * N + n0 + 4, N);     \
                }                                                                             \
            for (; m < M; m += 8) {                                                           \
                const int64_t rb = M - m < 8 ? M - m : 8;                                     \
                rows_block_##T(x + m * K, K, w + n0 * K, y + m * N + n0, N, rb);               \
                if (scale)                                                                    \
                    for (int64_t r = m; r < m + rb; r++)                                      \
                        for (int j = 0; j < 8; j++) y[r * N + n0 + j] *= scale[n0 + j];       \
            }                                                                                 \
        }                                                                                     \
        for (int64_t n = nblocks * 8; n < N; n++)                                             \
            for (int64_t m = 0; m < M; m++) {                                                 \
                block_##T##_1x1(x + m * K, K, w + n * K, K, y + m * N + n, N);                 \
                if (scale) y[m * N + n] *= scale[n];                                          \
            }                                                                                 \
    }

ROWGEMM_KERNEL(f32, float, LOAD_F32, 0, 1)
ROWGEMM_KERNEL(i8, int8_t, LOAD_I8, 1, 0) /* int8 converts each weight vector it loads: it wants the 8-row blocks' reuse */
ROWGEMM_KERNEL(bf16, uint16_t, LOAD_BF16, 1, 1) /* the float32 kernel's FMAs in its order: its bits */
ROWGEMM_KERNEL(f16, uint16_t, LOAD_F16, 1, 1)

#include "sparse_f32.c" /* 2:4 sparse float32 weights on the float32 GEMM's blocks, reached through fd_project */

void fd_rowgemm_f32(const float *x, int64_t M, int64_t K, const float *w, int64_t N, float *y) {
    rowgemm_f32(x, M, K, w, NULL, N, y);
}

/* Weight-only int8, symmetric per output channel: y[m, n] = scale[n] * sum_k x[m, k] * q[n, k],
 * the sum in exactly the float32 kernel's order. q: int8 [N, K]; scale: float32 [N]. */
void fd_rowgemm_i8(const float *x, int64_t M, int64_t K, const int8_t *q, const float *scale, int64_t N, float *y) {
    rowgemm_i8(x, M, K, q, scale, N, y);
}

/* Causal attention for decode and verification passes, one query at a time in
 * its arithmetic, several at a time in its memory traffic.
 *
 *     out[i, h, :] = softmax_t(scale * q[i, h, :] . k[g, t, :]) @ v[g, t, :],  t = lo .. start + i
 *
 * with g = h / (H / KV) (grouped-query attention) and lo = 0, or with a sliding
 * window of W > 0 positions (Gemma's local layers) lo = max(0, start + i + 1 - W). q: n rows x H heads of D
 * contiguous floats, at the given row and head strides; k, v: [KV, cap, D], the
 * native decoder's cache, already holding the n new positions; out: [n, H * D].
 *
 * Row-invariant by construction, like the GEMM above: each query (row, head)
 * is reduced alone, in one fixed order - every score its own FMA chain over d
 * and its own hsum8, the max, the exponentials and their sum in increasing t,
 * each output lane's weighted values in increasing t, one division - so a
 * verification row gets a decode step's bits. It replaces one SDPA call per
 * row and layer (torch's SDPA is not row-invariant across query counts).
 *
 * The queries that share a KV group (the group's heads, in every row) are
 * taken up to four at a time for the scores, so each key is loaded once for the
 * block instead of once per query (the values go a query at a time, at
 * values_query): blocking changes which accumulators share
 * registers, never an operation. Measured on the 2-core Zen 3 (30 layers,
 * 9 heads over 3 KV groups, D = 64, 256 positions): query by query, 8 rows took
 * 5.3x one row (5.7 ms, re-reading each group's keys and values from L2 for
 * every query). Decode steps (fewer than eight queries a group) keep one query
 * per work item, which spreads them over more threads. scratch: n * H * (start + n) floats. */
#define MAX_HEAD_DIM 256
#define AINLINE static inline __attribute__((always_inline))

/* The KV pools hold float32, float16, or ggml's q8_0 / q4_0 blocks (kv.c: the row layouts,
 * kv_load8, kv_levels8 and kv_store_row). K and V may differ in type; each is a compile-time constant
 * in the inlined readers below (T, one kernel built per type), a run-time code (k_type,
 * v_type) in the exported functions. */
#include "kv.c"

/* hsum8 of eight vectors at once, each sum in hsum8's own order,
 *     ((v0 + v4) + (v2 + v6)) + ((v1 + v5) + (v3 + v7)),
 * so the bits are hsum8's: out lane i = hsum8(a[i]). 21 shuffles and adds for
 * eight sums against 48 one by one. */
AINLINE __m256 hsum8x8(const __m256 *a) {
    __m256 s[4], t[2];
    for (int i = 0; i < 4; i++) /* s[i]: low half a[2i]'s (v0 + v4, .. v3 + v7), high half a[2i + 1]'s */
        s[i] = _mm256_add_ps(_mm256_permute2f128_ps(a[2 * i], a[2 * i + 1], 0x20), _mm256_permute2f128_ps(a[2 * i], a[2 * i + 1], 0x31));
    for (int i = 0; i < 2; i++) /* per half: (v0 + v4) + (v2 + v6), (v1 + v5) + (v3 + v7) of two vectors each */
        t[i] = _mm256_add_ps(_mm256_shuffle_ps(s[2 * i], s[2 * i + 1], 0x44), _mm256_shuffle_ps(s[2 * i], s[2 * i + 1], 0xEE));
    /* lanes a[0], a[2], a[4], a[6] | a[1], a[3], a[5], a[7]; then back in order */
    const __m256 r = _mm256_add_ps(_mm256_shuffle_ps(t[0], t[1], 0x88), _mm256_shuffle_ps(t[0], t[1], 0xDD));
    return _mm256_permutevar8x32_ps(r, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* The scores of QB queries at positions t .. t + P - 1 from their chains a[j * P + p]: each chain's
 * horizontal sum (hsum8x8 or hsum8, the same bits) times the scale. */
AINLINE void store_scores(const int QB, const int P, const __m256 *a, int64_t t, float scale, float *const *ss) {
    if (QB * P == 8) {
        const __m256 sums = _mm256_mul_ps(hsum8x8(a), _mm256_set1_ps(scale));
        if (QB == 1) {
            _mm256_storeu_ps(ss[0] + t, sums);
        } else {
            float tmp[8];
            _mm256_storeu_ps(tmp, sums);
            _Pragma("GCC unroll 4") for (int j = 0; j < QB; j++)
                _Pragma("GCC unroll 8") for (int p = 0; p < P; p++) ss[j][t + p] = tmp[j * P + p];
        }
    } else {
        _Pragma("GCC unroll 4") for (int j = 0; j < QB; j++)
            _Pragma("GCC unroll 8") for (int p = 0; p < P; p++) ss[j][t + p] = hsum8(a[j * P + p]) * scale;
    }
}

/* scores_block over q8_0 or q4_0 keys, on integers (kv.c: kv_quantize_query, kv_scores8,
 * kv_score1): qs[j] holds query j's int8 blocks. Each score is kv.c's per-position chain, eight
 * positions at a time (zmm: kv_avx512.c takes sixteen first), the same bits whatever QB or len. */
AINLINE void scores_block_int(const int QB, const int T, const float *const *qs, const char *kb, int64_t RB, int64_t D,
                              int64_t t0, int64_t len, float scale, float *const *ss) {
    const char *qc[4];
    for (int j = 0; j < QB; j++) qc[j] = (const char *)qs[j];
    int64_t t = t0;
    for (; t + 8 <= len; t += 8) {
        float *out[4];
        for (int j = 0; j < QB; j++) out[j] = ss[j] + t;
        kv_scores8(QB, T, qc, kb + t * RB, RB, D, scale, out);
    }
    for (; t < len; t++)
        for (int j = 0; j < QB; j++) ss[j][t] = kv_score1(kb + t * RB, qc[j], D, scale, T);
}

/* s_j[t] = scale * q_j . k_t for QB queries and t in [t0, len), P positions at a
 * time (QB * P independent FMA chains: eight for one query, eight positions, which
 * keeps Zen 3's two FMA pipes busy through their four-cycle latency). Every score
 * is the chain a = fma(q[d], k_t[d], a) over d = 0, 8, ... lane-wise, then hsum8
 * (or hsum8x8, the same bits), then the scale: the same whatever QB, P or len. */
AINLINE void scores_block(const int QB, const int P, const int T, const float *const *qs, const char *kb, int64_t RB,
                          int64_t D, int64_t t0, int64_t len, float scale, float *const *ss) {
    /* kb: the rows of the block's positions, RB bytes apart; quantized keys: scores_block_int */
    if (T >= KV_Q8_0) {
        scores_block_int(QB, T, qs, kb, RB, D, t0, len, scale, ss);
        return;
    }
    int64_t t = t0;
    for (; t + P <= len; t += P) {
        __m256 a[8]; /* a[j * P + p]: query j, position t + p */
        _Pragma("GCC unroll 8") for (int i = 0; i < QB * P; i++) a[i] = _mm256_setzero_ps();
        const char *kt = kb + t * RB;
        for (int64_t d = 0; d < D; d += 8) {
            __m256 kv[8];
            _Pragma("GCC unroll 8") for (int p = 0; p < P; p++) kv[p] = kv_load8(kt + p * RB, d, T);
            _Pragma("GCC unroll 4") for (int j = 0; j < QB; j++) {
                const __m256 qd = _mm256_loadu_ps(qs[j] + d);
                _Pragma("GCC unroll 8") for (int p = 0; p < P; p++) a[j * P + p] = _mm256_fmadd_ps(qd, kv[p], a[j * P + p]);
            }
        }
        store_scores(QB, P, a, t, scale, ss);
    }
    for (; t < len; t++)
        for (int j = 0; j < QB; j++) {
            __m256 a0 = _mm256_setzero_ps();
            const char *kt = kb + t * RB;
            for (int64_t d = 0; d < D; d += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qs[j] + d), kv_load8(kt, d, T), a0);
            ss[j][t] = hsum8(a0) * scale;
        }
}

/* cap * tanh(s / cap) (Gemma 2's soft-capping of attention scores), with tanh(x) = sign(x) (1 - e) / (1 + e),
 * e = e^-2|x| (exp8: no cancellation past |x| ~ 1e-3, and 1 for |x| past ~44); one function for every lane. */
static inline __m256 softcap8(__m256 s, float cap) {
    const __m256 c = _mm256_set1_ps(cap), sign = _mm256_set1_ps(-0.0f), one = _mm256_set1_ps(1.0f);
    const __m256 x = _mm256_div_ps(s, c);
    const __m256 e = exp8(_mm256_mul_ps(_mm256_set1_ps(-2.0f), _mm256_andnot_ps(sign, x)));
    const __m256 t = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
    return _mm256_mul_ps(_mm256_or_ps(t, _mm256_and_ps(sign, x)), c);
}

/* In place over s[0, len): s[t] = cap tanh(s[t] / cap) where softcap = cap > 0, then
 * s[t] = e^(s[t] - max); returns their sum. The max is
 * exact in any order; the sum runs in eight lanes, lane l adding positions l,
 * l + 8, ... - an order fixed by len, i.e. by the query's position. sink: the head's
 * attention sink (gpt-oss), a logit in the denominator only (no value): it joins the max
 * and adds e^(sink - max) after the lanes' sum; -INFINITY: none (nothing added). */
static float softmax_numerators(float *s, int64_t len, float softcap, float sink) {
    __m256 mv = _mm256_set1_ps(-INFINITY);
    int64_t t;
    if (softcap > 0.0f) {
        for (t = 0; t + 8 <= len; t += 8) _mm256_storeu_ps(s + t, softcap8(_mm256_loadu_ps(s + t), softcap));
        if (t < len) {
            float tail[8] = {0};
            memcpy(tail, s + t, sizeof(float) * (len - t));
            _mm256_storeu_ps(tail, softcap8(_mm256_loadu_ps(tail), softcap));
            memcpy(s + t, tail, sizeof(float) * (len - t));
        }
    }
    for (t = 0; t + 8 <= len; t += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + t));
    float m = hmax8(mv);
    for (; t < len; t++) m = s[t] > m ? s[t] : m;
    const int has_sink = sink > -INFINITY;
    if (has_sink && sink > m) m = sink;
    const __m256 mb = _mm256_set1_ps(m);
    __m256 sumv = _mm256_setzero_ps();
    for (t = 0; t + 8 <= len; t += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), mb));
        _mm256_storeu_ps(s + t, e);
        sumv = _mm256_add_ps(sumv, e);
    }
    if (t < len) {
        float tail[8] = {0};
        for (int64_t j = t; j < len; j++) tail[j - t] = s[j] - m;
        _mm256_storeu_ps(tail, exp8(_mm256_loadu_ps(tail)));
        for (int64_t j = len - t; j < 8; j++) tail[j] = 0.0f;
        sumv = _mm256_add_ps(sumv, _mm256_loadu_ps(tail));
        for (int64_t j = t; j < len; j++) s[j] = tail[j - t];
    }
    if (!has_sink) return hsum8(sumv);
    float e[8] = {sink - m}; /* through exp8, as every score */
    _mm256_storeu_ps(e, exp8(_mm256_loadu_ps(e)));
    return hsum8(sumv) + e[0];
}

/* The paged KV cache (vLLM's PagedAttention layout): a pool of fixed-size
 * blocks per layer, k, v: [num_blocks, KV, B, D]; a sequence's positions live in
 * the blocks its block table lists, position t in block table[t / B] at offset
 * t % B. Each row i of a pass belongs to sequence seq[i] (its block table is
 * tables + seq[i] * max_blocks) and sits at position pos[i]; a sequence's rows
 * are consecutive in the pass, at increasing positions. A contiguous cache
 * [KV, cap, D] is the special case of one block of B = cap positions.
 *
 * Paging changes where a key or value is read from, never an operation: each
 * query still takes its positions in increasing t through the same FMA chains
 * as above, so a row's bits depend neither on the blocks its sequence was given
 * nor on the other sequences in the pass. */
static inline int64_t kv_rows(const int64_t *table, int64_t b, int64_t g, int64_t KV, int64_t B) {
    return (table[b] * KV + g) * B; /* the row index of (block table[b], group g, offset 0) */
}

#include "kv_avx512.c" /* the zmm loops over a quantized cache, taken where the CPU has AVX-512 VNNI (zmm) */

/* Scores over [t0, t1) for QB queries of one sequence and KV group, block by
 * block (ss[j] indexed by absolute position). */
AINLINE void scores_paged(const int QB, const int T, const float *const *qs, const char *k, const int64_t *table, int64_t g,
                          int64_t KV, int64_t B, int64_t D, int64_t t0, int64_t t1, float scale, float *const *ss) {
    const int64_t RB = kv_row_bytes(T, D);
    for (int64_t b = t0 / B; b * B < t1; b++) {
        const int64_t base = b * B, s0 = t0 > base ? t0 - base : 0, s1 = t1 - base < B ? t1 - base : B;
        float *sb[4];
        for (int j = 0; j < QB; j++) sb[j] = ss[j] + base;
        scores_block(QB, QB == 1 ? 8 : QB == 2 ? 4 : 2, T, qs, k + kv_rows(table, b, g, KV, B) * RB, RB, D, s0, s1, scale, sb);
    }
}

/* o[d0 .. d0 + 8 W) = (sum_t s[t] v_t) / sum over one query's [lo, hi), in
 * increasing t (one FMA chain per lane), block by block. A query at a time with
 * W up to 8 (the whole of D = 64): W independent chains per position. Blocking
 * the values of four queries together had kept only two chains a query, which
 * left the FMAs latency-bound: measured on the 2-core Zen 3 (30 layers, 9
 * heads, D = 64), attention 3.1 -> 2.5 ms for one row at 1,024 positions with
 * a float16 cache, 4.3 -> 3.2 ms for 8 rows at 256. The values of a group,
 * re-read by its next query, come from L2. A quantized type (W 4 or 8, d0 a
 * multiple of 32) folds each block's scale into the weight once a position, fma(p d, q, acc):
 * measured with the integer scores (single-threaded CPU time, 4,096 positions), q8_0 attention
 * 0.264 -> 0.243 ms a layer. */
AINLINE void values_query(const int W, const int T, const float *s, int64_t lo, int64_t hi, const char *v,
                          const int64_t *table, int64_t g, int64_t KV, int64_t B, int64_t D, int64_t d0, float sum,
                          float *out) {
    const int64_t RB = kv_row_bytes(T, D);
    const int U = KV_STEP(T) / 8; /* lane groups of 8 a scale covers */
    __m256 acc[8];
    _Pragma("GCC unroll 8") for (int w = 0; w < W; w++) acc[w] = _mm256_setzero_ps();
    for (int64_t b = lo / B; b * B < hi; b++) {
        const int64_t base = b * B;
        const char *vb = v + kv_rows(table, b, g, KV, B) * RB;
        const int64_t t0 = lo > base ? lo : base, t1 = hi < base + B ? hi : base + B;
        for (int64_t t = t0; t < t1; t++) {
            const __m256 p = _mm256_set1_ps(s[t]);
            const char *vt = vb + (t - base) * RB;
            _Pragma("GCC unroll 8") for (int w = 0; w < W; w += U) {
                if (T >= KV_Q8_0) { /* the weight times the block's scale, once: fma(p d, q, acc) */
                    const __m256 pd = _mm256_mul_ps(p, kv_scale8(vt, d0 + 8 * w, T));
                    _Pragma("GCC unroll 4") for (int u = 0; u < U; u++)
                        acc[w + u] = _mm256_fmadd_ps(pd, kv_levels8(vt, d0 + 8 * w, 8 * u, T), acc[w + u]);
                } else {
                    acc[w] = _mm256_fmadd_ps(p, kv_load8(vt, d0 + 8 * w, T), acc[w]);
                }
            }
        }
    }
    const __m256 total = _mm256_set1_ps(sum);
    _Pragma("GCC unroll 8") for (int w = 0; w < W; w++) _mm256_storeu_ps(out + d0 + 8 * w, _mm256_div_ps(acc[w], total));
}

/* values_query over lanes [d0, d1) (multiples of 8; of 32 for a quantized type), in as wide pieces as fit. */
AINLINE void values_range(const int T, const float *s, int64_t lo, int64_t hi, const char *v, const int64_t *table,
                          int64_t g, int64_t KV, int64_t B, int64_t D, int64_t d0, int64_t d1, float sum, float *out) {
    for (; d0 + 64 <= d1; d0 += 64) values_query(8, T, s, lo, hi, v, table, g, KV, B, D, d0, sum, out);
    for (; d0 + 32 <= d1; d0 += 32) values_query(4, T, s, lo, hi, v, table, g, KV, B, D, d0, sum, out);
    if (T >= KV_Q8_0) return;
    for (; d0 + 16 <= d1; d0 += 16) values_query(2, T, s, lo, hi, v, table, g, KV, B, D, d0, sum, out);
    for (; d0 < d1; d0 += 8) values_query(1, T, s, lo, hi, v, table, g, KV, B, D, d0, sum, out);
}

/* scores_paged for qn (1..4) queries and a key type known only at run time. */
static void scores_dispatch(int64_t qn, int64_t k_type, const float *const *qs, const void *k, const int64_t *table,
                            int64_t g, int64_t KV, int64_t B, int64_t D, int64_t t0, int64_t t1, float scale, float *const *ss,
                            int zmm) {
#ifdef FD_HAVE_VNNI
    if (zmm && k_type >= KV_Q8_0) {
        kvz_scores_paged(qn, k_type, qs, (const char *)k, table, g, KV, B, D, t0, t1, scale, ss);
        return;
    }
#endif
    (void)zmm;
#define SCORES_CASE(QB, T) \
    case (QB) + 4 * (T): scores_paged(QB, T, qs, (const char *)k, table, g, KV, B, D, t0, t1, scale, ss); break;
#define SCORES_CASES(T) SCORES_CASE(1, T) SCORES_CASE(2, T) SCORES_CASE(3, T) SCORES_CASE(4, T)
    switch (qn + 4 * k_type) {
        SCORES_CASES(KV_F32) SCORES_CASES(KV_F16) SCORES_CASES(KV_Q8_0) SCORES_CASES(KV_Q4_0)
    }
#undef SCORES_CASES
#undef SCORES_CASE
}

/* values_range for a value type known only at run time. */
static void values_dispatch(int64_t v_type, const float *s, int64_t lo, int64_t hi, const void *v, const int64_t *table,
                            int64_t g, int64_t KV, int64_t B, int64_t D, int64_t d0, int64_t d1, float sum, float *out) {
    const char *vc = (const char *)v;
    switch (v_type) {
    case KV_F32: values_range(KV_F32, s, lo, hi, vc, table, g, KV, B, D, d0, d1, sum, out); break;
    case KV_F16: values_range(KV_F16, s, lo, hi, vc, table, g, KV, B, D, d0, d1, sum, out); break;
    case KV_Q8_0: values_range(KV_Q8_0, s, lo, hi, vc, table, g, KV, B, D, d0, d1, sum, out); break;
    default: values_range(KV_Q4_0, s, lo, hi, vc, table, g, KV, B, D, d0, d1, sum, out);
    }
}

/* The values of qn (1..4) queries of one KV group, lanes [d0, d1): over a quantized cache on zmm,
 * kv_avx512.c's kvz_values (each value widened once for the queries together), else values_range a
 * query at a time - the same bits. */
static void values_item(int64_t qn, int64_t v_type, float *const *ss, const int64_t *lo, const int64_t *hi, const void *v,
                        const int64_t *table, int64_t g, int64_t KV, int64_t B, int64_t D, int64_t d0, int64_t d1,
                        const float *sums, float *const *outs, int zmm) {
#ifdef FD_HAVE_VNNI
    if (zmm && v_type >= KV_Q8_0) {
        kvz_values(qn, v_type, (const float *const *)ss, lo, hi, (const char *)v, table, g, KV, B, D, d0, d1, sums, outs);
        return;
    }
#endif
    (void)zmm;
    for (int64_t j = 0; j < qn; j++) values_dispatch(v_type, ss[j], lo[j], hi[j], v, table, g, KV, B, D, d0, d1, sums[j], outs[j]);
}

/* One work item: qn (1..4) queries of one sequence and KV group, whole. */
static void attend_paged(int64_t qn, int64_t k_type, int64_t v_type, const float *const *qs, const int64_t *lo,
                         const int64_t *hi, const void *k, const void *v, const int64_t *table, int64_t g, int64_t KV,
                         int64_t B, int64_t D, float scale, float softcap, const float *sinks, float *const *ss,
                         float *const *outs, int zmm) {
    int64_t lo_min = lo[0], hi_max = hi[0];
    for (int64_t j = 1; j < qn; j++) {
        lo_min = lo[j] < lo_min ? lo[j] : lo_min;
        hi_max = hi[j] > hi_max ? hi[j] : hi_max;
    }
    /* a query's extra scores (positions only another query of the block attends) are computed and never read */
    scores_dispatch(qn, k_type, qs, k, table, g, KV, B, D, lo_min, hi_max, scale, ss, zmm);
    float sums[4];
    for (int64_t j = 0; j < qn; j++) sums[j] = softmax_numerators(ss[j] + lo[j], hi[j] - lo[j], softcap, sinks[j]);
    values_item(qn, v_type, ss, lo, hi, v, table, g, KV, B, D, 0, D, sums, outs, zmm);
}

/* The attention's work items, four int64 each: (first row of a run of one sequence's rows,
 * KV group, first query of the run's group, count), the group's queries of a run taken four
 * at a time where there are eight or more, else few_qb at a time. items: room for 4 n H;
 * returns the count. */
static int64_t query_blocks(int64_t n, const int64_t *seq, int64_t group, int64_t KV, int64_t few_qb, int64_t *items) {
    int64_t n_items = 0;
    for (int64_t r0 = 0; r0 < n;) {
        int64_t r1 = r0 + 1;
        while (r1 < n && seq[r1] == seq[r0]) r1++;
        const int64_t nq = (r1 - r0) * group, QB = nq >= 8 ? 4 : few_qb;
        for (int64_t g = 0; g < KV; g++)
            for (int64_t q0 = 0; q0 < nq; q0 += QB) {
                int64_t *it = items + 4 * n_items++;
                it[0] = r0, it[1] = g, it[2] = q0, it[3] = (nq - q0 < QB ? nq - q0 : QB);
            }
        r0 = r1;
    }
    return n_items;
}

/* Few queries (a decode step of one sequence: H of them): work items of whole
 * queries leave threads idle (nine heads on two threads: five and four) or read
 * a group's keys on two threads. Here each phase is split where it is
 * embarrassingly parallel, so every query's arithmetic is attend_paged's, bit for
 * bit: (1) scores by (block of a group's queries, range of positions) - each score
 * is its own chain; (2) each query's softmax numerators and sum, whole; (3) the
 * values by query, or by (query, half of the lanes) when queries are very few -
 * each lane is its own chain over t. */
static void attention_phased(const float *q, int64_t q_row_stride, int64_t q_head_stride, int64_t n, int64_t H, int64_t KV,
                             int64_t D, const void *k, const void *v, int64_t B, const int64_t *pos, const int64_t *seq,
                             const int64_t *tables, int64_t max_blocks, float scale, float softcap, const float *sinks,
                             int64_t window, float *scratch, float *out, int64_t k_type, int64_t v_type, int64_t L,
                             int zmm) {
    const int64_t group = H / KV, nq = n * H, threads = omp_get_max_threads();
    /* query index qi = i * H + h (row i, head h); a row's lo and hi */
#define PH_HI(i) (pos[i] + 1)
#define PH_LO(i) (window > 0 && PH_HI(i) > window ? PH_HI(i) - window : 0)
    /* scores items: query_blocks of up to four queries, each over a range of positions */
    int64_t *items = malloc(sizeof(int64_t) * 4 * (nq + 1));
    const int64_t n_items = query_blocks(n, seq, group, KV, 4, items);
    int64_t ranges = (2 * threads + n_items - 1) / n_items; /* at least two pieces a thread */
    ranges = ranges > L / 64 ? (L / 64 > 0 ? L / 64 : 1) : ranges; /* of 64 positions or more */
    /* values by query, or by halves of D when there are fewer than four queries a thread: a half
     * has half the FMA chains, and at nine queries on two threads whole queries measured faster
     * (30 layers at 1,024 positions: 2.65 against 3.05 ms, float16 cache) */
    const int64_t lanes = D % (v_type >= KV_Q8_0 ? 2 * KV_QK : 16) == 0 && nq < 4 * threads ? 2 : 1;
    float *sums = malloc(sizeof(float) * nq);
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t w = 0; w < n_items * ranges; w++) {
            const int64_t *it = items + 4 * (w / ranges), part = w % ranges;
            const int64_t r0 = it[0], g = it[1], q0 = it[2], qn = it[3];
            const float *qs[4];
            float *ss[4];
            int64_t lo = INT64_MAX, hi = 0;
            for (int64_t j = 0; j < qn; j++) {
                const int64_t i = r0 + (q0 + j) / group, h = g * group + (q0 + j) % group;
                qs[j] = q + i * q_row_stride + h * q_head_stride;
                ss[j] = scratch + (i * H + h) * L;
                lo = PH_LO(i) < lo ? PH_LO(i) : lo;
                hi = PH_HI(i) > hi ? PH_HI(i) : hi;
            }
            const int64_t span = (hi - lo + ranges - 1) / ranges, t0 = lo + part * span;
            const int64_t t1 = t0 + span < hi ? t0 + span : hi;
            if (t0 < t1) scores_dispatch(qn, k_type, qs, k, tables + seq[r0] * max_blocks, g, KV, B, D, t0, t1, scale, ss, zmm);
        }
#pragma omp for schedule(static)
        for (int64_t qi = 0; qi < nq; qi++) {
            const int64_t i = qi / H;
            sums[qi] = softmax_numerators(scratch + qi * L + PH_LO(i), PH_HI(i) - PH_LO(i), softcap,
                                          sinks ? sinks[qi % H] : -INFINITY);
        }
        if (zmm && v_type >= KV_Q8_0) { /* by the scores' items (and halves of D), their queries together */
            const int64_t parts = D % (2 * KV_QK) == 0 && n_items < 4 * threads ? 2 : 1, half = D / parts;
#pragma omp for schedule(static)
            for (int64_t w = 0; w < n_items * parts; w++) {
                const int64_t *it = items + 4 * (w / parts), r0 = it[0], g = it[1], d0 = (w % parts) * half;
                float *ss[4], *outs[4], sm[4];
                int64_t lo[4], hi[4];
                for (int64_t j = 0; j < it[3]; j++) {
                    const int64_t i = r0 + (it[2] + j) / group, qi = i * H + g * group + (it[2] + j) % group;
                    ss[j] = scratch + qi * L, outs[j] = out + qi * D, sm[j] = sums[qi], lo[j] = PH_LO(i), hi[j] = PH_HI(i);
                }
                values_item(it[3], v_type, ss, lo, hi, v, tables + seq[r0] * max_blocks, g, KV, B, D, d0, d0 + half, sm, outs, zmm);
            }
        } else {
#pragma omp for schedule(static)
            for (int64_t w = 0; w < nq * lanes; w++) {
                const int64_t qi = w / lanes, i = qi / H, h = qi % H, g = h / group, half = D / lanes;
                const int64_t d0 = (w % lanes) * half;
                const float *s = scratch + qi * L;
                const int64_t *table = tables + seq[i] * max_blocks;
                values_dispatch(v_type, s, PH_LO(i), PH_HI(i), v, table, g, KV, B, D, d0, d0 + half, sums[qi], out + qi * D);
            }
        }
    }
#undef PH_HI
#undef PH_LO
    free(sums);
    free(items);
}

/* Causal attention of n query rows over the paged cache (layout above); each
 * row's keys and values (its own position included) are already written.
 * scratch: n * H * L floats, L = max_i pos[i] + 1 (a block of queries scores every
 * position one of them attends, so each (row, head) gets L); out: [n, H * D].
 * k, v: pools of k_type and v_type (KV_F32, KV_F16, KV_Q8_0, KV_Q4_0: kv.c's rows). */
static void attention_paged(const float *q, int64_t q_row_stride, int64_t q_head_stride, int64_t n, int64_t H, int64_t KV,
                            int64_t D, const void *k, const void *v, int64_t B, const int64_t *pos, const int64_t *seq,
                            const int64_t *tables, int64_t max_blocks, float scale, float softcap, const float *sinks,
                            int64_t window, float *scratch, float *out, int64_t k_type, int64_t v_type, int zmm) {
    const int64_t group = H / KV;
    /* Work items: (run of one sequence's rows, KV group, block of up to QB of the
     * group's queries in that run). A run of fewer than eight queries a group keeps
     * one query per item, which spreads a decode step over more threads. */
    int64_t L = 0;
    for (int64_t i = 0; i < n; i++) L = pos[i] + 1 > L ? pos[i] + 1 : L;
    /* Measured on the 2-core Zen 3, one row, 30 layers' caches streamed from memory: 1,024 positions 4.5 -> 3.7 ms
     * (float16) and 8.1 -> 6.6 ms (float32), 256 positions 2.1 -> 1.9 ms; below ~64 positions the two extra
     * barriers cost more than the balance saves. */
    if (n * H < 8 * omp_get_max_threads() && L >= 64) {
        attention_phased(q, q_row_stride, q_head_stride, n, H, KV, D, k, v, B, pos, seq, tables, max_blocks, scale, softcap,
                         sinks, window, scratch, out, k_type, v_type, L, zmm);
        return;
    }
    int64_t *items = malloc(sizeof(int64_t) * 4 * (n * H + 1));
    /* Over quantized keys a group's queries share each key's scale (kv_scores8), and on zmm over
     * quantized values each widened value (kvz_values): blocks of them where that still leaves every
     * thread two items (one thread, one row, SmolLM2 at 4,096 positions, scripts/attention_cpu_time.py:
     * zmm q8_0 0.42 -> 0.35 ms a layer, q4_0 0.44 -> 0.38). */
    const int64_t few_qb = (k_type >= KV_Q8_0 || (zmm && v_type >= KV_Q8_0)) && n * KV >= 2 * omp_get_max_threads() ? 4 : 1;
    const int64_t n_items = query_blocks(n, seq, group, KV, few_qb, items);
    /* Each thread takes a contiguous run of items (neighbours read the same keys and values)
     * holding an equal share of the positions attended: a prompt's causal rows attend 1..n
     * positions, and equal counts of items had given one thread ~40% more of the work (three KV
     * groups on two threads). Measured, SmolLM2's shapes at 1,141 prompt rows: 56-59 -> 43-52 ms
     * a layer.
     * Which thread computes an item does not change its bits. */
    int64_t *first = malloc(sizeof(int64_t) * (n_items + 1));
    int64_t total = 0;
    for (int64_t item = 0; item < n_items; item++) {
        const int64_t *it = items + 4 * item;
        first[item] = total;
        const int64_t i = it[0] + (it[2] + it[3] - 1) / group; /* the block's last (longest) row */
        total += (pos[i] + 1 < (window > 0 ? window : INT64_MAX) ? pos[i] + 1 : window) * it[3];
    }
    first[n_items] = total;
#pragma omp parallel
    {
    const int64_t t = omp_get_thread_num(), T = omp_get_num_threads();
    const int64_t from = total * t / T, to = total * (t + 1) / T;
    /* A work item's scores live only until its values are summed: each thread reuses four
     * queries' worth of scratch, which stays in cache, where a region per (row, head) touched
     * n H L floats (47 MB a layer at 1,141 prompt rows). Measured in one process, SmolLM2's
     * shapes at 1,141 rows: attention_rows (a fresh scratch each call) 45-49 -> 23-24 ms a
     * layer; a whole prefill, whose layers share one buffer, 3.19 -> 3.12 s. (With fewer than
     * 4 T queries the scratch has no room for that: the regions per query then.) Where a score
     * is stored does not change its bits. */
    float *mine = n * H >= 4 * T ? scratch + t * 4 * L : NULL;
    for (int64_t item = 0; item < n_items; item++) {
        if (first[item] < from || first[item] >= to) /* an item belongs to the share its start falls in */
            continue;
        const int64_t *it = items + 4 * item;
        const int64_t r0 = it[0], g = it[1], q0 = it[2], qn = it[3];
        const int64_t *table = tables + seq[r0] * max_blocks;
        const float *qs[4];
        float *ss[4], *outs[4];
        int64_t lo[4], hi[4];
        float sk[4];
        for (int64_t j = 0; j < qn; j++) {
            const int64_t i = r0 + (q0 + j) / group, h = g * group + (q0 + j) % group;
            qs[j] = q + i * q_row_stride + h * q_head_stride;
            sk[j] = sinks ? sinks[h] : -INFINITY;
            ss[j] = mine ? mine + j * L : scratch + (i * H + h) * L;
            outs[j] = out + i * H * D + h * D;
            hi[j] = pos[i] + 1;
            lo[j] = window > 0 && hi[j] > window ? hi[j] - window : 0;
        }
        attend_paged(qn, k_type, v_type, qs, lo, hi, k, v, table, g, KV, B, D, scale, softcap, sk, ss, outs, zmm);
    }
    }
    free(first);
    free(items);
}

/* attention_paged over pools whose types may carry KV_ROTATED (kv.c): rotated keys are met by
 * rotated queries (q.k = (H q).(H k)), and the weighted sum of rotated values is rotated back
 * (H = H^-1), each query and output row by itself, so rows stay invariant. k_affine: the keys'
 * affine (kv.c's kv_key_affine: [KV, 3 + D, D] floats, NULL: none), met by queries q * s. impl (quant.c's
 * FD_IMPL_*): FD_IMPL_AVX512_VNNI (AUTO where the CPU has it) takes kv_avx512.c's zmm loops over
 * a quantized cache, any other the ymm loops - the same bits. softcap: cap > 0 takes each score s as
 * cap tanh(s / cap) before the softmax (Gemma 2), 0 leaves it. sinks: [H] floats, each head's attention sink
 * (gpt-oss: a logit in the softmax's denominator only), NULL: none. */
void fd_attention_f32(const float *q, int64_t q_row_stride, int64_t q_head_stride, int64_t n, int64_t H, int64_t KV,
                      int64_t D, const void *k, const void *v, int64_t B, const int64_t *pos, const int64_t *seq,
                      const int64_t *tables, int64_t max_blocks, float scale, int64_t window, float *scratch,
                      float *out, int64_t k_type, int64_t v_type, int64_t impl, const float *k_affine, float softcap,
                      const float *sinks) {
    float *qr = NULL, *q8 = NULL;
    if ((k_type & KV_ROTATED) || k_affine) {
        qr = malloc(sizeof(float) * n * H * D);
        for (int64_t i = 0; i < n; i++)
            for (int64_t h = 0; h < H; h++) {
                const float *x = q + i * q_row_stride + h * q_head_stride;
                float *r = qr + (i * H + h) * D;
                if (k_affine) { /* q * s of the head's KV group: the keys were stored (k - mu) / s */
                    const float *s = k_affine + (h / (H / KV)) * KV_AFFINE_FLOATS(D) + 2 * D;
                    for (int64_t d = 0; d < D; d++) r[d] = x[d] * s[d];
                } else {
                    memcpy(r, x, sizeof(float) * D);
                }
                if (k_type & KV_ROTATED) kv_rotate(r, D);
            }
        q = qr, q_row_stride = H * D, q_head_stride = D;
    }
    if (KV_TYPE(k_type) >= KV_Q8_0) { /* the queries as int8 blocks (kv_quantize_query): scores_block_int */
        const int64_t QF = kv_query_floats(D);
        q8 = malloc(sizeof(float) * n * H * QF);
        for (int64_t i = 0; i < n; i++)
            for (int64_t h = 0; h < H; h++)
                kv_quantize_query(q + i * q_row_stride + h * q_head_stride, D, (char *)(q8 + (i * H + h) * QF));
        q = q8, q_row_stride = H * QF, q_head_stride = QF;
    }
    attention_paged(q, q_row_stride, q_head_stride, n, H, KV, D, k, v, B, pos, seq, tables, max_blocks, scale, softcap,
                    sinks, window, scratch, out, KV_TYPE(k_type), KV_TYPE(v_type), impl_of(impl) == FD_IMPL_AVX512_VNNI);
    if (v_type & KV_ROTATED)
        for (int64_t r = 0; r < n * H; r++) kv_rotate(out + r * D, D);
    free(q8);
    free(qr);
}

/* The row-local glue of a decoder layer, fused so that a one-token step does
 * not pay torch's per-op dispatch (~5-15 us an op, ~20 ops a layer on the
 * 2-core Zen 3: ~10 ms of a ~40 ms step). Each is computed row by row in a
 * fixed order, so it is row-invariant like everything above. */

/* out[i] = weight * (x[i] * 1 / sqrt(mean(x[i]^2) + eps)): transformers'
 * LlamaRMSNorm in float32. x, out: [n, dim] contiguous (out may be x). */
static inline void rmsnorm_vec(const float *xi, int64_t dim, const float *weight, float eps, float *oi) {
    __m256 acc = _mm256_setzero_ps();
    int64_t d = 0;
    for (; d + 8 <= dim; d += 8) {
        const __m256 v = _mm256_loadu_ps(xi + d);
        acc = _mm256_fmadd_ps(v, v, acc);
    }
    float ss = hsum8(acc);
    for (; d < dim; d++) ss = fmaf(xi[d], xi[d], ss);
    const float inv = 1.0f / sqrtf(ss / (float)dim + eps);
    for (d = 0; d < dim; d++) oi[d] = weight[d] * (xi[d] * inv);
}

void fd_rmsnorm_f32(const float *x, int64_t n, int64_t dim, const float *weight, float eps, float *out) {
    for (int64_t i = 0; i < n; i++) rmsnorm_vec(x + i * dim, dim, weight, eps, out + i * dim);
}

/* Per-head RMSNorm in place (Gemma 3's q_norm / k_norm): for each of n rows
 * (row_stride floats apart), the heads vectors of dim contiguous floats there. */
void fd_head_rmsnorm_f32(float *x, int64_t n, int64_t row_stride, int64_t heads, int64_t dim, const float *weight,
                         float eps) {
    for (int64_t i = 0; i < n; i++)
        for (int64_t h = 0; h < heads; h++) rmsnorm_vec(x + i * row_stride + h * dim, dim, weight, eps, x + i * row_stride + h * dim);
}

/* Rows x [n, D] (float32, already in the stored domain: rotated where the pool's rows are) as rows of
 * quantized type T (KV_Q8_0 or KV_Q4_0) rounded with error feedback (kv.c's kv_store_blocks), row r
 * with the F of head index[r] of the affine A ([heads, 3 + D, D]); out: [n, kv_row_bytes(T, D)]. KVFormat.store's
 * writer for rows a policy moves and for the torch layer path: the same bytes as fd_rope_qkv_f32 writes.
 * kv_formats.store_feedback checks the arguments (D <= MAX_HEAD_DIM, a multiple of KV_QK; T quantized). */
void fd_kv_store_feedback(const float *x, int64_t n, int64_t D, int64_t T, const float *A, const int64_t *index,
                          char *out) {
    const int64_t R = kv_row_bytes(T, D);
    _Pragma("omp parallel for schedule(static) if (n > 256)") for (int64_t r = 0; r < n; r++) {
        float row[MAX_HEAD_DIM];
        memcpy(row, x + r * D, sizeof(float) * D);
        kv_store_blocks(out + r * R, row, D, KV_TYPE(T), KV_AFFINE_F(A + index[r] * KV_AFFINE_FLOATS(D), D));
    }
}

/* RoPE (transformers' rotate_half convention) on the q and k parts of a fused
 * QKV output, and the new keys and values written into the paged cache (layout
 * at fd_attention_f32, rows of k_type and v_type: kv.c) at each row's position.
 * qkv: [n, (H + 2 KV) * D] contiguous; cos, sin: [n, D] (the rows of the n
 * positions); q_out: [n, H, D]. k_affine: NULL, or the keys' affine [KV, 3 + D, D] (kv.c's kv_key_affine),
 * applied after RoPE. */
void fd_rope_qkv_f32(const float *qkv, int64_t n, int64_t H, int64_t KV, int64_t D, const float *cos,
                     const float *sin, float *q_out, void *k, void *v, int64_t B, const int64_t *pos,
                     const int64_t *seq, const int64_t *tables, int64_t max_blocks, int64_t k_type, int64_t v_type,
                     const float *k_affine) {
    const int64_t half = D / 2, width = (H + 2 * KV) * D, RK = kv_row_bytes(k_type, D), RV = kv_row_bytes(v_type, D);
    float rotated[MAX_HEAD_DIM];
    for (int64_t i = 0; i < n; i++) {
        const float *row = qkv + i * width, *c = cos + i * D, *s = sin + i * D;
        const int64_t block = tables[seq[i] * max_blocks + pos[i] / B], off = pos[i] % B;
        for (int64_t h = 0; h < H + KV; h++) {
            const float *x = row + h * D;
            float *o = h < H ? q_out + (i * H + h) * D : rotated;
            for (int64_t d = 0; d < half; d++) o[d] = x[d] * c[d] + (-x[d + half]) * s[d];
            for (int64_t d = half; d < D; d++) o[d] = x[d] * c[d] + x[d - half] * s[d];
            if (h < H) continue;
            const float *A = k_affine ? k_affine + (h - H) * KV_AFFINE_FLOATS(D) : NULL;
            if (A) kv_key_affine(rotated, A, D);
            kv_store_row((char *)k + ((block * KV + h - H) * B + off) * RK, rotated, D, k_type, A ? KV_AFFINE_F(A, D) : NULL);
        }
        for (int64_t g = 0; g < KV; g++) {
            const float *x = row + (H + KV + g) * D;
            kv_store_row((char *)v + ((block * KV + g) * B + off) * RV, x, D, v_type, NULL);
        }
    }
}

/* Token-tree verification: the rows of a pass compute each tree node once, and
 * a node that lies on several root-to-leaf paths is needed in each path's cache.
 * Every path is a sequence of the pass (its own block table); the rows of a node
 * are computed in the first path through it, and its key and value are copied
 * here, bit for bit, to the same position of the other paths, after fd_rope_qkv_f32
 * wrote them and before the attention reads them. A path's rows then attend to
 * exactly a chain's keys and values, so each row keeps a decode step's bits.
 * mirrors: [m, 3] int64 (row i, sequence s, position p): row i's key and value
 * (position pos[i] of sequence seq[i]) copied to position p of sequence s (p ==
 * pos[i]: the key carries its position's rotation). */
void fd_kv_mirror(void *k, void *v, int64_t KV, int64_t D, int64_t B, const int64_t *pos, const int64_t *seq,
                  const int64_t *tables, int64_t max_blocks, const int64_t *mirrors, int64_t m, int64_t k_type,
                  int64_t v_type) {
    const int64_t RK = kv_row_bytes(k_type, D), RV = kv_row_bytes(v_type, D);
    for (int64_t j = 0; j < m; j++) {
        const int64_t i = mirrors[3 * j], s = mirrors[3 * j + 1], p = mirrors[3 * j + 2];
        const int64_t src = tables[seq[i] * max_blocks + pos[i] / B], src_off = pos[i] % B;
        const int64_t dst = tables[s * max_blocks + p / B], dst_off = p % B;
        for (int64_t g = 0; g < KV; g++) {
            const int64_t a = (src * KV + g) * B + src_off, b = (dst * KV + g) * B + dst_off; /* rows */
            memcpy((char *)k + b * RK, (const char *)k + a * RK, RK);
            memcpy((char *)v + b * RV, (const char *)v + a * RV, RV);
        }
    }
}

/* The argument z of act(g) = g / (1 + e^-z): SiLU (z = g), or the tanh
 * approximation of GELU (z = 2 sqrt(2 / pi) (g + 0.044715 g^3), since
 * 0.5 (1 + tanh(u)) = 1 / (1 + e^-2u)). */
#define ACT_SILU 0
#define ACT_GELU_TANH 1
static inline __m256 act_arg8(__m256 g, int64_t act) {
    if (act == ACT_SILU) return g;
    const __m256 g3 = _mm256_mul_ps(_mm256_mul_ps(g, g), g);
    return _mm256_mul_ps(_mm256_set1_ps(1.5957691216057308f), _mm256_add_ps(g, _mm256_mul_ps(_mm256_set1_ps(0.044715f), g3)));
}

/* out[i, j] = act(gate_up[i, j]) * gate_up[i, inter + j]: the gated MLP of a
 * fused gate/up output [n, 2 * inter] (SwiGLU, or GeGLU for Gemma); out: [n, inter]. */
void fd_glu_f32(const float *gate_up, int64_t n, int64_t inter, int64_t act, float *out) {
    const __m256 one = _mm256_set1_ps(1.0f);
    for (int64_t i = 0; i < n; i++) {
        const float *g = gate_up + i * 2 * inter, *u = g + inter;
        float *o = out + i * inter;
        int64_t j = 0;
        for (; j + 8 <= inter; j += 8) {
            const __m256 gj = _mm256_loadu_ps(g + j);
            const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), act_arg8(gj, act)));
            _mm256_storeu_ps(o + j, _mm256_mul_ps(_mm256_div_ps(gj, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + j)));
        }
        for (; j < inter; j++) {  /* the tail through the same vector code: one function for every element */
            float e[8] = {g[j]};
            _mm256_storeu_ps(e, exp8(_mm256_sub_ps(_mm256_setzero_ps(), act_arg8(_mm256_loadu_ps(e), act))));
            o[j] = (g[j] / (1.0f + e[0])) * u[j];
        }
    }
}

/* gpt-oss's clamped SwiGLU of a fused gate/up output [n, 2 * inter] (gate, then up): g = min(g, limit),
 * u = clamp(u, -limit, limit), out = (u + 1) * (g / (1 + e^-(alpha g))), [n, inter]; each element alone,
 * the tail through the same vector code. */
void fd_glu_clamped_f32(const float *gate_up, int64_t n, int64_t inter, float alpha, float limit, float *out) {
    const __m256 one = _mm256_set1_ps(1.0f), a = _mm256_set1_ps(alpha);
    const __m256 hi = _mm256_set1_ps(limit), lo = _mm256_set1_ps(-limit);
    for (int64_t i = 0; i < n; i++) {
        const float *g = gate_up + i * 2 * inter, *u = g + inter;
        float *o = out + i * inter;
        for (int64_t j = 0; j < inter; j += 8) {
            float gt[8] = {0}, ut[8] = {0}, ot[8];
            const int64_t m = inter - j < 8 ? inter - j : 8;
            memcpy(gt, g + j, sizeof(float) * m);
            memcpy(ut, u + j, sizeof(float) * m);
            const __m256 gj = _mm256_min_ps(_mm256_loadu_ps(gt), hi);
            const __m256 uj = _mm256_max_ps(_mm256_min_ps(_mm256_loadu_ps(ut), hi), lo);
            const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(gj, a)));
            const __m256 glu = _mm256_div_ps(gj, _mm256_add_ps(one, e));
            _mm256_storeu_ps(ot, _mm256_mul_ps(_mm256_add_ps(uj, one), glu));
            memcpy(o + j, ot, sizeof(float) * m);
        }
    }
}

/* x += y * scale (the residual add; Granite scales the branch first: the product rounded, then the sum,
 * as torch computes x + y * scale; -ffp-contract=off keeps the two roundings). */
static void add_rows(float *x, const float *y, int64_t count, float scale) {
    if (scale == 1.0f)
        for (int64_t i = 0; i < count; i++) x[i] += y[i];
    else
        for (int64_t i = 0; i < count; i++) x[i] += y[i] * scale;
}

/* The FFN kinds a layer's ffn field may point at (kernels/abi.py's FFN_KINDS). FFN_NONE: the layer's
 * attention half only (ffn NULL): fd_layer stops after the attention's residual add, leaving the FFN's
 * input (x through mlp_norm, or x itself) in work's first n * hidden floats for its caller (a mixture of
 * experts' FFN with a shared expert runs in Python: backends/layer.py), which adds the FFN's branch.
 * FFN_EXPERTS: the router, its top k and the experts in C (experts.c's fd_moe). */
#define FFN_GATED 0
#define FFN_NONE 1
#define FFN_EXPERTS 2 /* a mixture of experts without a shared expert (experts.c's fd_moe_ffn) */

/* FFN_GATED: down(act(gate) * up), with gate and up one projection [2 * inter, hidden] (fd_glu_f32). */
typedef struct {
    const fd_proj *gate_up, *down;
    int64_t inter, act;
} fd_gated_mlp;

/* A decoder layer as fd_layer runs it (kernels/abi.py's CLayerDesc; backends/layer.py's DecoderLayer
 * describes it): its weights, NULL where the layer has no such part, and its shape. The norms around
 * each branch: attn_norm and mlp_norm before it (Llama), post_attn_norm and post_mlp_norm on its output
 * before the residual add (Gemma: all four; OLMo 2: only these), each weight [hidden] with any offset
 * already added (Gemma's 1 + w). q_norm, k_norm: RMSNorm of each query and key head ([D]), or with
 * qk_norm_whole of the whole query and key projections ([H * D], [KV * D]: OLMo 2), before RoPE.
 * window: a sliding window in positions (0: none); residual_scale multiplies each branch before its
 * residual add (Granite's residual multiplier; 1: none); softcap: the attention scores' soft cap (Gemma 2;
 * 0: none); sinks: [H] each head's attention sink (gpt-oss; NULL: none), one more logit in the softmax's
 * denominator (fd_attention_f32); ffn: an FFN of kind ffn_kind. */
typedef struct {
    const float *attn_norm, *post_attn_norm, *mlp_norm, *post_mlp_norm;
    const fd_proj *qkv, *o;
    const float *q_norm, *k_norm, *sinks;
    const void *ffn;
    int64_t H, KV, D, qk_norm_whole, window, ffn_kind;
    float eps, residual_scale, softcap;
} fd_layer_desc;

/* What every layer of a pass shares: its rows (n, at paged positions, as fd_attention_f32 takes them),
 * the tree paths' mirrors (fd_kv_mirror), the attention's scale, the pools' row types and the work. */
typedef struct {
    int64_t n, B, max_blocks, n_mirrors, k_type, v_type;
    const int64_t *pos, *seq, *tables, *mirrors;
    float scale;
    float *work;
} fd_pass;

/* Floats of work a layer's FFN takes for n rows: FFN_GATED's gate_up, act(gate) * up (and a spare inter a
 * row: the layer's historical layout), FFN_EXPERTS' fd_moe_work_floats, none for FFN_NONE. */
int64_t fd_layer_ffn_floats(const fd_layer_desc *L, int64_t n) {
    if (L->ffn_kind == FFN_GATED) return 3 * n * ((const fd_gated_mlp *)L->ffn)->inter;
    if (L->ffn_kind == FFN_EXPERTS) return fd_moe_work_floats(L->ffn, n);
    return 0;
}

static void ffn_gated(const fd_gated_mlp *F, const float *h, int64_t n, int64_t hidden, float *gu, float *mlp,
                      void *scratch, float *out) {
    fd_project(h, n, hidden, F->gate_up, scratch, gu);
    fd_glu_f32(gu, n, F->inter, F->act, mlp);
    fd_project(mlp, n, F->inter, F->down, scratch, out);
}

/* The norm of each query and key head, or of the whole query and key projections, in place on the fused
 * QKV output [n, (H + 2 KV) D] (DecoderLayer's qk_norm: "head" or "proj"). */
static void qk_norm(float *qkv, int64_t n, const fd_layer_desc *L) {
    const int64_t width = (L->H + 2 * L->KV) * L->D;
    if (L->qk_norm_whole) {
        fd_head_rmsnorm_f32(qkv, n, width, 1, L->H * L->D, L->q_norm, L->eps);
        fd_head_rmsnorm_f32(qkv + L->H * L->D, n, width, 1, L->KV * L->D, L->k_norm, L->eps);
    } else {
        fd_head_rmsnorm_f32(qkv, n, width, L->H, L->D, L->q_norm, L->eps);
        fd_head_rmsnorm_f32(qkv + L->H * L->D, n, width, L->KV, L->D, L->k_norm, L->eps);
    }
}

/* A branch's output through its post norm (when the layer has one), then into the residual stream. */
static void add_branch(float *x, float *out, int64_t n, int64_t hidden, const float *post_norm, const fd_layer_desc *L) {
    if (post_norm) fd_rmsnorm_f32(out, n, hidden, post_norm, L->eps, out);
    add_rows(x, out, n * hidden, L->residual_scale);
}

/* One whole decoder layer of a decode or verification pass, in place on the
 * residual stream x [n, hidden]: the very calls above, in the order the native
 * decoder makes them one by one (backends/layer.py, so the bits are the same), without ~9 returns
 * to Python a layer (~60 us a layer, ~2 ms of a step on the 2-core Zen 3).
 * Each projection (fd_proj, quant.c) holds nn.Linear's [out, in] weights as
 * float32, int8 with per-output scales, or ggml blocks (parts), and a bias or NULL.
 * cos, sin: the rows' RoPE [n, D] (a layer without position encoding gets cos 1, sin 0);
 * k, v: its pools, paged (fd_attention_f32); the mirrors of fd_kv_mirror (tree paths) are made before
 * the attention. k_affine: the pool's key affine (kv.c's kv_key_affine, [KV, 3 + D, D]) or NULL.
 * work: n * (2 * hidden + (H + 2 KV) * D + 2 * H * D) + fd_layer_ffn_floats(L, n) + n * H * (max_i pos[i] + 1)
 * floats, then the projections' scratch (fd_project_scratch_bytes of the widest input).
 * A layer of kind FFN_NONE ends after its attention branch, its FFN's input left in work. */
static void fd_layer(const fd_layer_desc *L, const fd_pass *P, float *x, int64_t hidden, const float *cos,
                     const float *sin, void *k, void *v, const float *k_affine) {
    const int64_t n = P->n, H = L->H, KV = L->KV, D = L->D, qkv_width = (H + 2 * KV) * D;
    const fd_gated_mlp *F = L->ffn;
    const int64_t inter = L->ffn_kind == FFN_GATED ? F->inter : 0;
    float *h = P->work, *tmp = h + n * hidden, *qkv = tmp + n * hidden, *q = qkv + n * qkv_width;
    float *att = q + n * H * D, *gu = att + n * H * D, *mlp = gu + n * 2 * inter, *scores = gu + fd_layer_ffn_floats(L, n);
    int64_t len = 0;
    for (int64_t i = 0; i < n; i++) len = P->pos[i] + 1 > len ? P->pos[i] + 1 : len;
    void *scratch = scores + n * H * len;

    if (L->attn_norm) fd_rmsnorm_f32(x, n, hidden, L->attn_norm, L->eps, h);
    fd_project(L->attn_norm ? h : x, n, hidden, L->qkv, scratch, qkv);
    if (L->q_norm) qk_norm(qkv, n, L);
    fd_rope_qkv_f32(qkv, n, H, KV, D, cos, sin, q, k, v, P->B, P->pos, P->seq, P->tables, P->max_blocks, P->k_type,
                    P->v_type, k_affine);
    if (P->n_mirrors)
        fd_kv_mirror(k, v, KV, D, P->B, P->pos, P->seq, P->tables, P->max_blocks, P->mirrors, P->n_mirrors, P->k_type,
                     P->v_type);
    fd_attention_f32(q, H * D, D, n, H, KV, D, k, v, P->B, P->pos, P->seq, P->tables, P->max_blocks, P->scale,
                     L->window, scores, att, P->k_type, P->v_type, L->qkv->impl, k_affine,
                     L->softcap, L->sinks); /* the layer's implementation: its projections' and its attention's */
    fd_project(att, n, H * D, L->o, scratch, tmp);
    add_branch(x, tmp, n, hidden, L->post_attn_norm, L);

    if (L->mlp_norm) fd_rmsnorm_f32(x, n, hidden, L->mlp_norm, L->eps, h);
    switch (L->ffn_kind) { /* kernels/layer.py admits only the kinds below */
    case FFN_GATED: ffn_gated(F, L->mlp_norm ? h : x, n, hidden, gu, mlp, scratch, tmp); break;
    case FFN_EXPERTS: fd_moe(L->ffn, L->mlp_norm ? h : x, n, hidden, gu, scratch, tmp); break;
    case FFN_NONE:
        if (!L->mlp_norm) memcpy(h, x, (size_t)(n * hidden) * sizeof(float));
        return;
    }
    add_branch(x, tmp, n, hidden, L->post_mlp_norm, L);
}

/* Layers 0 .. n_layers - 1 one after another, in place on x [n, hidden]: layer l
 * with its rope rows cos[l], sin[l], its pools k[l], v[l] and their key affine k_affine[l] (k_affine
 * NULL, or an entry NULL: none), all at the same
 * paged positions; work as fd_layer's, sized for the widest layer (a layer without an FFN comes last:
 * its FFN's input is what work holds after the call). One call a
 * pass instead of one a layer: a ctypes call of a layer's 32 arguments costs
 * ~7 us, ~0.2 ms of a ~7 ms decode step on the 2-core Zen 3. */
void fd_layer_stack(float *x, int64_t n, int64_t hidden, const fd_layer_desc *const *layers, int64_t n_layers,
                    const float *const *cos, const float *const *sin, void *const *k, void *const *v, int64_t B,
                    const int64_t *pos, const int64_t *seq, const int64_t *tables, int64_t max_blocks, float scale,
                    float *work, int64_t k_type, int64_t v_type, const int64_t *mirrors, int64_t n_mirrors,
                    const float *const *k_affine) {
    const fd_pass pass = {n, B, max_blocks, n_mirrors, k_type, v_type, pos, seq, tables, mirrors, scale, work};
    for (int64_t l = 0; l < n_layers; l++)
        fd_layer(layers[l], &pass, x, hidden, cos[l], sin[l], k[l], v[l], k_affine ? k_affine[l] : NULL);
}
