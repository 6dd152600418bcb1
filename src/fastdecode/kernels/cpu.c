/* Row-invariant CPU kernels for the native decoder: a small-M float32 GEMM and
 * causal attention by query row.
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

/* y[r, j] for RB rows of x (stride ldx) and NB rows of w (stride K); y stride ldy.
 * The unroll pragmas keep the RB x NB accumulators in registers: without them
 * gcc leaves the constant-bound loops rolled and the accumulators on the stack
 * (measured: 1.6x slower at eight rows). */
#define ROWGEMM_BLOCK(NB, RB)                                                               \
    static inline void block_##NB##x##RB(const float *x, int64_t ldx, const float *w,        \
                                         int64_t K, float *y, int64_t ldy) {                 \
        __m256 acc[RB][NB];                                                                  \
        _Pragma("GCC unroll 8") for (int r = 0; r < RB; r++)                                 \
            _Pragma("GCC unroll 8") for (int j = 0; j < NB; j++) acc[r][j] = _mm256_setzero_ps(); \
        int64_t k = 0;                                                                       \
        for (; k + 8 <= K; k += 8) {                                                         \
            __m256 wv[NB];                                                                   \
            _Pragma("GCC unroll 8") for (int j = 0; j < NB; j++) wv[j] = _mm256_loadu_ps(w + j * K + k); \
            _Pragma("GCC unroll 8") for (int r = 0; r < RB; r++) {                           \
                __m256 xv = _mm256_loadu_ps(x + r * ldx + k);                                \
                _Pragma("GCC unroll 8") for (int j = 0; j < NB; j++)                         \
                    acc[r][j] = _mm256_fmadd_ps(xv, wv[j], acc[r][j]);                       \
            }                                                                                \
        }                                                                                    \
        _Pragma("GCC unroll 8") for (int r = 0; r < RB; r++)                                 \
            _Pragma("GCC unroll 8") for (int j = 0; j < NB; j++) {                           \
                float s = hsum8(acc[r][j]);                                                  \
                for (int64_t t = k; t < K; t++) s = fmaf(x[r * ldx + t], w[j * K + t], s);    \
                y[r * ldy + j] = s;                                                          \
            }                                                                                \
    }

/* Block shapes, measured on a 2-core Zen 3 over a SmolLM2-135M-shaped step
 * (30 layers + LM head): one row takes eight outputs at once (eight FMA chains
 * hide the FMA latency; 22-25 ms, ~21 GB/s, vs MKL's 43 ms); two to eight rows
 * take one output at a time, so the eight weight rows of a work item are read
 * as one contiguous stream (8 rows: 1.32x one row; interleaving two or four
 * weight rows, or capping row blocks at four or six, measured 1.5-1.9x).
 * Every shape reduces an output in the same order. */
ROWGEMM_BLOCK(8, 1)
ROWGEMM_BLOCK(1, 2)
ROWGEMM_BLOCK(1, 3)
ROWGEMM_BLOCK(1, 4)
ROWGEMM_BLOCK(1, 5)
ROWGEMM_BLOCK(1, 6)
ROWGEMM_BLOCK(1, 7)
ROWGEMM_BLOCK(1, 8)
ROWGEMM_BLOCK(1, 1) /* the N % 8 leftover outputs */

#define NB_OUT 8 /* outputs per parallel work item: their 8 rows of w stay in L1/L2 */

/* rows [m, m + rb) of x against the NB_OUT rows of w at wb, rb in 1..8 */
static inline void rows_block(const float *x, int64_t K, const float *wb, float *y, int64_t N, int64_t rb) {
    switch (rb) {
    case 1: block_8x1(x, K, wb, K, y, N); break;
    case 2: for (int j = 0; j < 8; j++) block_1x2(x, K, wb + j * K, K, y + j, N); break;
    case 3: for (int j = 0; j < 8; j++) block_1x3(x, K, wb + j * K, K, y + j, N); break;
    case 4: for (int j = 0; j < 8; j++) block_1x4(x, K, wb + j * K, K, y + j, N); break;
    case 5: for (int j = 0; j < 8; j++) block_1x5(x, K, wb + j * K, K, y + j, N); break;
    case 6: for (int j = 0; j < 8; j++) block_1x6(x, K, wb + j * K, K, y + j, N); break;
    case 7: for (int j = 0; j < 8; j++) block_1x7(x, K, wb + j * K, K, y + j, N); break;
    default: for (int j = 0; j < 8; j++) block_1x8(x, K, wb + j * K, K, y + j, N); break;
    }
}

void fd_rowgemm_f32(const float *x, int64_t M, int64_t K, const float *w, int64_t N, float *y) {
    const int64_t nblocks = N / NB_OUT;
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < nblocks; b++) {
        const int64_t n0 = b * NB_OUT;
        for (int64_t m = 0; m < M; m += 8) {
            const int64_t rb = M - m < 8 ? M - m : 8;
            rows_block(x + m * K, K, w + n0 * K, y + m * N + n0, N, rb);
        }
    }
    for (int64_t n = nblocks * NB_OUT; n < N; n++)
        for (int64_t m = 0; m < M; m++) block_1x1(x + m * K, K, w + n * K, K, y + m * N + n, N);
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
        float m = -INFINITY;
        for (int64_t t = 0; t < len; t++) {
            __m256 acc = _mm256_setzero_ps();
            for (int64_t d = 0; d < D; d += 8)
                acc = _mm256_fmadd_ps(_mm256_loadu_ps(qi + d), _mm256_loadu_ps(kg + t * D + d), acc);
            s[t] = hsum8(acc) * scale;
            m = s[t] > m ? s[t] : m;
        }
        float sum = 0.0f;
        for (int64_t t = 0; t < len; t++) {
            s[t] = expf(s[t] - m);
            sum += s[t];
        }
        __m256 acc[MAX_HEAD_DIM / 8];
        for (int64_t d = 0; d < D; d += 8) acc[d / 8] = _mm256_setzero_ps();
        for (int64_t t = 0; t < len; t++) {
            const __m256 p = _mm256_set1_ps(s[t]);
            for (int64_t d = 0; d < D; d += 8)
                acc[d / 8] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vg + t * D + d), acc[d / 8]);
        }
        float *o = out + i * H * D + h * D;
        const __m256 total = _mm256_set1_ps(sum);
        for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(o + d, _mm256_div_ps(acc[d / 8], total));
    }
}
