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
#include <math.h>
#include <stdint.h>

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
                for (int64_t t = k; t < K; t++) s = fmaf(x[r * ldx + t], (float)w[j * K + t], s); \
                y[r * ldy + j] = s;                                                          \
            }                                                                                \
    }

/* Block shapes, measured on a 2-core Zen 3 over a SmolLM2-135M-shaped step
 * (30 layers + LM head): one row takes eight outputs at once (eight FMA chains
 * hide the FMA latency; 22-25 ms, ~21 GB/s, vs MKL's 43 ms); two to eight rows
 * take one output at a time, so the eight weight rows of a work item are read
 * as one contiguous stream (8 rows: 1.25x one row; interleaving two or four
 * weight rows, or capping row blocks at four or six, measured 1.5-1.9x).
 * Every shape reduces an output in the same order. */
#define ROWGEMM_KERNEL(T, WT, LOADW, INTERLEAVE)                                                          \
    ROWGEMM_BLOCK(T, WT, LOADW, 8, 1, INTERLEAVE)                                                         \
    ROWGEMM_BLOCK(T, WT, LOADW, 1, 2, INTERLEAVE)                                                         \
    ROWGEMM_BLOCK(T, WT, LOADW, 1, 3, INTERLEAVE)                                                         \
    ROWGEMM_BLOCK(T, WT, LOADW, 1, 4, INTERLEAVE)                                                         \
    ROWGEMM_BLOCK(T, WT, LOADW, 1, 5, INTERLEAVE)                                                         \
    ROWGEMM_BLOCK(T, WT, LOADW, 1, 6, INTERLEAVE)                                                         \
    ROWGEMM_BLOCK(T, WT, LOADW, 1, 7, INTERLEAVE)                                                         \
    ROWGEMM_BLOCK(T, WT, LOADW, 1, 8, INTERLEAVE)                                                         \
    ROWGEMM_BLOCK(T, WT, LOADW, 1, 1, INTERLEAVE) /* the N % 8 leftover outputs */                        \
    /* rows [0, rb) of x (rb in 1..8) against the 8 rows of w at wb */                        \
    static inline void rows_block_##T(const float *x, int64_t K, const WT *wb, float *y, int64_t N, int64_t rb) { \
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
    /* y = x w^T, times scale[n] per output when scale is not NULL */                         \
    static void rowgemm_##T(const float *x, int64_t M, int64_t K, const WT *w, const float *scale, int64_t N, float *y) { \
        const int64_t nblocks = N / 8;                                                        \
        _Pragma("omp parallel for schedule(static)")                                          \
        for (int64_t b = 0; b < nblocks; b++) {                                               \
            const int64_t n0 = b * 8;                                                         \
            for (int64_t m = 0; m < M; m += 8) {                                              \
                const int64_t rb = M - m < 8 ? M - m : 8;                                     \
                rows_block_##T(x + m * K, K, w + n0 * K, y + m * N + n0, N, rb);               \
                if (scale)                                                                    \
                    for (int64_t r = 0; r < rb; r++)                                          \
                        for (int j = 0; j < 8; j++) y[(m + r) * N + n0 + j] *= scale[n0 + j];  \
            }                                                                                 \
        }                                                                                     \
        for (int64_t n = nblocks * 8; n < N; n++)                                             \
            for (int64_t m = 0; m < M; m++) {                                                 \
                block_##T##_1x1(x + m * K, K, w + n * K, K, y + m * N + n, N);                 \
                if (scale) y[m * N + n] *= scale[n];                                          \
            }                                                                                 \
    }

ROWGEMM_KERNEL(f32, float, LOAD_F32, 0)
ROWGEMM_KERNEL(i8, int8_t, LOAD_I8, 1)

void fd_rowgemm_f32(const float *x, int64_t M, int64_t K, const float *w, int64_t N, float *y) {
    rowgemm_f32(x, M, K, w, NULL, N, y);
}

/* Weight-only int8, symmetric per output channel: y[m, n] = scale[n] * sum_k x[m, k] * q[n, k],
 * the sum in exactly the float32 kernel's order. q: int8 [N, K]; scale: float32 [N]. */
void fd_rowgemm_i8(const float *x, int64_t M, int64_t K, const int8_t *q, const float *scale, int64_t N, float *y) {
    rowgemm_i8(x, M, K, q, scale, N, y);
}

/* Causal attention for decode and verification passes, one query row at a time.
 *
 *     out[i, h, :] = softmax_t(scale * q[i, h, :] . k[g, t, :]) @ v[g, t, :],  t = 0 .. start + i
 *
 * with g = h / (H / KV) (grouped-query attention). q: n rows x H heads of D
 * contiguous floats, at the given row and head strides; k, v: [KV, cap, D], the
 * native decoder's cache, already holding the n new positions; out: [n, H * D].
 * Row-invariant by construction, like the GEMM above: each (row, head) is
 * computed alone, in one fixed order (scores in increasing t, the max, the
 * exponentials and their sum in increasing t, the weighted values in
 * increasing t, one division), so a verification row gets a decode step's
 * bits. It replaces one SDPA call per row and layer (torch's SDPA is not
 * row-invariant across query counts), measured at ~58 us each on the 2-core
 * Zen 3: ~11 ms of an 8-row verification pass. D: a multiple of 8, at most
 * MAX_HEAD_DIM. scratch: n * H * (start + n) floats. */
#define MAX_HEAD_DIM 256
void fd_attention_f32(const float *q, int64_t q_row_stride, int64_t q_head_stride, int64_t n, int64_t H, int64_t KV, int64_t D,
                      const float *k, const float *v, int64_t cap, int64_t start, float scale,
                      float *scratch, float *out) {
    const int64_t group = H / KV;
#pragma omp parallel for schedule(static)
    for (int64_t item = 0; item < n * H; item++) {
        const int64_t i = item / H, h = item % H, g = h / group, len = start + i + 1;
        const float *qi = q + i * q_row_stride + h * q_head_stride;
        const float *kg = k + g * cap * D, *vg = v + g * cap * D;
        float *s = scratch + item * (start + n);
        /* q . k_t for four positions at once (four independent FMA chains); each
         * score is still its own chain over d and its own hsum8, the same
         * operations as a lone position, whatever len is. */
        int64_t t = 0;
        for (; t + 4 <= len; t += 4) {
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            const float *k0 = kg + t * D;
            for (int64_t d = 0; d < D; d += 8) {
                const __m256 qd = _mm256_loadu_ps(qi + d);
                a0 = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k0 + d), a0);
                a1 = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k0 + D + d), a1);
                a2 = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k0 + 2 * D + d), a2);
                a3 = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k0 + 3 * D + d), a3);
            }
            s[t] = hsum8(a0) * scale;
            s[t + 1] = hsum8(a1) * scale;
            s[t + 2] = hsum8(a2) * scale;
            s[t + 3] = hsum8(a3) * scale;
        }
        for (; t < len; t++) {
            __m256 a0 = _mm256_setzero_ps();
            for (int64_t d = 0; d < D; d += 8)
                a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qi + d), _mm256_loadu_ps(kg + t * D + d), a0);
            s[t] = hsum8(a0) * scale;
        }
        /* softmax: the max (exact in any order), then e^(s - max) and its sum in
         * eight lanes, lane l adding positions l, l + 8, ... - an order fixed by
         * len, i.e. by the query's position, not by the number of rows. */
        __m256 mv = _mm256_set1_ps(-INFINITY);
        for (t = 0; t + 8 <= len; t += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + t));
        float m = hmax8(mv);
        for (; t < len; t++) m = s[t] > m ? s[t] : m;
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
        const float sum = hsum8(sumv);
        __m256 acc[MAX_HEAD_DIM / 8];
        for (int64_t d = 0; d < D; d += 8) acc[d / 8] = _mm256_setzero_ps();
        for (t = 0; t < len; t++) {
            const __m256 p = _mm256_set1_ps(s[t]);
            for (int64_t d = 0; d < D; d += 8)
                acc[d / 8] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vg + t * D + d), acc[d / 8]);
        }
        float *o = out + i * H * D + h * D;
        const __m256 total = _mm256_set1_ps(sum);
        for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(o + d, _mm256_div_ps(acc[d / 8], total));
    }
}

/* The row-local glue of a decoder layer, fused so that a one-token step does
 * not pay torch's per-op dispatch (~5-15 us an op, ~20 ops a layer on the
 * 2-core Zen 3: ~10 ms of a ~40 ms step). Each is computed row by row in a
 * fixed order, so it is row-invariant like everything above. */

/* out[i] = weight * (x[i] * 1 / sqrt(mean(x[i]^2) + eps)): transformers'
 * LlamaRMSNorm in float32. x, out: [n, dim] contiguous (out may be x). */
void fd_rmsnorm_f32(const float *x, int64_t n, int64_t dim, const float *weight, float eps, float *out) {
    for (int64_t i = 0; i < n; i++) {
        const float *xi = x + i * dim;
        float *oi = out + i * dim;
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
}

/* RoPE (transformers' rotate_half convention) on the q and k parts of a fused
 * QKV output, and the new keys and values written into the cache.
 * qkv: [n, (H + 2 KV) * D] contiguous; cos, sin: [n, D] (the rows of the n
 * positions); q_out: [n, H, D]; k_cache, v_cache: [KV, cap, D], written at
 * positions start .. start + n - 1. */
void fd_rope_qkv_f32(const float *qkv, int64_t n, int64_t H, int64_t KV, int64_t D, const float *cos,
                     const float *sin, float *q_out, float *k_cache, float *v_cache, int64_t cap, int64_t start) {
    const int64_t half = D / 2, width = (H + 2 * KV) * D;
    for (int64_t i = 0; i < n; i++) {
        const float *row = qkv + i * width, *c = cos + i * D, *s = sin + i * D;
        for (int64_t h = 0; h < H + KV; h++) {
            const float *x = row + h * D;
            float *o = h < H ? q_out + (i * H + h) * D : k_cache + ((h - H) * cap + start + i) * D;
            for (int64_t d = 0; d < half; d++) o[d] = x[d] * c[d] + (-x[d + half]) * s[d];
            for (int64_t d = half; d < D; d++) o[d] = x[d] * c[d] + x[d - half] * s[d];
        }
        for (int64_t g = 0; g < KV; g++) {
            const float *x = row + (H + KV + g) * D;
            float *o = v_cache + (g * cap + start + i) * D;
            for (int64_t d = 0; d < D; d++) o[d] = x[d];
        }
    }
}

/* out[i, j] = silu(gate_up[i, j]) * gate_up[i, inter + j]: the SwiGLU of a fused
 * gate/up output [n, 2 * inter]; out: [n, inter]. */
void fd_silu_mul_f32(const float *gate_up, int64_t n, int64_t inter, float *out) {
    const __m256 one = _mm256_set1_ps(1.0f);
    for (int64_t i = 0; i < n; i++) {
        const float *g = gate_up + i * 2 * inter, *u = g + inter;
        float *o = out + i * inter;
        int64_t j = 0;
        for (; j + 8 <= inter; j += 8) {
            const __m256 gj = _mm256_loadu_ps(g + j);
            const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), gj));
            _mm256_storeu_ps(o + j, _mm256_mul_ps(_mm256_div_ps(gj, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + j)));
        }
        for (; j < inter; j++) {  /* the tail through exp8 too: one function for every element */
            float e[8] = {-g[j]};
            _mm256_storeu_ps(e, exp8(_mm256_loadu_ps(e)));
            o[j] = (g[j] / (1.0f + e[0])) * u[j];
        }
    }
}

/* y[i, :] += b for n rows of width m (the bias of a projection, or a residual
 * when b has n rows: see add_rows). One rounding per element, as torch's add. */
static void add_bias(float *y, int64_t n, int64_t m, const float *b) {
    if (!b) return;
    for (int64_t i = 0; i < n; i++)
        for (int64_t j = 0; j < m; j++) y[i * m + j] += b[j];
}

static void add_rows(float *x, const float *y, int64_t count) {
    for (int64_t i = 0; i < count; i++) x[i] += y[i];
}

/* A projection: float32 weights (scale NULL) or int8 weights with per-channel scales. */
static void project(const float *x, int64_t n, int64_t K, const void *w, const float *scale, int64_t N, float *y) {
    if (scale)
        rowgemm_i8(x, n, K, (const int8_t *)w, scale, N, y);
    else
        rowgemm_f32(x, n, K, (const float *)w, NULL, N, y);
}

/* One whole decoder layer of a decode or verification pass, in place on the
 * residual stream x [n, hidden]: the very calls above, in the order the native
 * decoder makes them one by one (so the bits are the same), without ~9 returns
 * to Python a layer (~60 us a layer, ~2 ms of a step on the 2-core Zen 3).
 * Weights are nn.Linear's [out, in], float32 - or int8 when the s_* scales are
 * given (all four, or none); biases may be NULL.
 * work: n * (2 * hidden + (H + 2 KV) * D + 2 * H * D + 3 * inter) + n * H * (start + n) floats. */
void fd_layer(float *x, int64_t n, int64_t hidden, const float *attn_norm, const float *mlp_norm, float eps,
              const void *w_qkv, const float *s_qkv, const float *b_qkv, const void *w_o, const float *s_o,
              const float *b_o, const void *w_gu, const float *s_gu, const float *b_gu, const void *w_down,
              const float *s_down, const float *b_down, int64_t H, int64_t KV, int64_t D, int64_t inter,
              const float *cos, const float *sin, float *k_cache, float *v_cache, int64_t cap, int64_t start,
              float scale, float *work) {
    const int64_t qkv_width = (H + 2 * KV) * D;
    float *h = work, *tmp = h + n * hidden, *qkv = tmp + n * hidden, *q = qkv + n * qkv_width;
    float *att = q + n * H * D, *gu = att + n * H * D, *act = gu + n * 2 * inter, *scores = act + n * inter;

    fd_rmsnorm_f32(x, n, hidden, attn_norm, eps, h);
    project(h, n, hidden, w_qkv, s_qkv, qkv_width, qkv);
    add_bias(qkv, n, qkv_width, b_qkv);
    fd_rope_qkv_f32(qkv, n, H, KV, D, cos, sin, q, k_cache, v_cache, cap, start);
    fd_attention_f32(q, H * D, D, n, H, KV, D, k_cache, v_cache, cap, start, scale, scores, att);
    project(att, n, H * D, w_o, s_o, hidden, tmp);
    add_bias(tmp, n, hidden, b_o);
    add_rows(x, tmp, n * hidden);

    fd_rmsnorm_f32(x, n, hidden, mlp_norm, eps, h);
    project(h, n, hidden, w_gu, s_gu, 2 * inter, gu);
    add_bias(gu, n, 2 * inter, b_gu);
    fd_silu_mul_f32(gu, n, inter, act);
    project(act, n, inter, w_down, s_down, hidden, tmp);
    add_bias(tmp, n, hidden, b_down);
    add_rows(x, tmp, n * hidden);
}
