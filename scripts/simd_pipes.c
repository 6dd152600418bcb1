/* Which SIMD multiply instructions share an execution pipe on this CPU: the
 * throughput of vpmaddubsw, vpmaddwd and vfmadd231ps alone and interleaved, with
 * twelve independent chains each (no latency bound). Two instructions on one pipe
 * interleave at the rate of one alone; on two pipes, twice as fast.
 *   gcc -O3 -mavx2 -mfma -o /tmp/simd_pipes scripts/simd_pipes.c && /tmp/simd_pipes
 * docs/benchmarks.md §7c quotes it for the block kernels' multi-row floor. */
#include <immintrin.h>
#include <stdio.h>
#include <time.h>

#define N 100000000L
static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* Each test its own loop, so the twelve accumulators stay in registers. */
#define TEST(name, BODY)                                                                        \
    do {                                                                                        \
        for (int i = 0; i < 12; i++) a[i] = _mm256_set1_epi16(i), f[i] = _mm256_set1_ps(i);   \
        const double t0 = now();                                                                \
        for (long n = 0; n < N; n++) { BODY }                                                   \
        const double ns = (now() - t0) / (N * 12.0) * 1e9;                                      \
        for (int i = 0; i < 12; i++) sink += _mm256_extract_epi32(a[i], 0), fsink += _mm256_cvtss_f32(f[i]); \
        printf("%-34s %.3f ns an instruction\n", name, ns);                                    \
    } while (0)

int main(void) {
    const __m256i y = _mm256_set1_epi8(5);
    const __m256 c = _mm256_set1_ps(1.0000001f);
    __m256i a[12];
    __m256 f[12];
    int sink = 0;
    float fsink = 0;
    TEST("vpmaddubsw alone", _Pragma("GCC unroll 12") for (int i = 0; i < 12; i++) a[i] = _mm256_maddubs_epi16(a[i], y););
    TEST("vpmaddwd alone", _Pragma("GCC unroll 12") for (int i = 0; i < 12; i++) a[i] = _mm256_madd_epi16(a[i], y););
    TEST("vfmadd231ps alone", _Pragma("GCC unroll 12") for (int i = 0; i < 12; i++) f[i] = _mm256_fmadd_ps(f[i], c, c););
    TEST("vpmaddubsw + vpmaddwd, 6 each",
         _Pragma("GCC unroll 6") for (int i = 0; i < 6; i++) a[i] = _mm256_maddubs_epi16(a[i], y);
         _Pragma("GCC unroll 6") for (int i = 6; i < 12; i++) a[i] = _mm256_madd_epi16(a[i], y););
    TEST("vpmaddubsw + vfmadd231ps, 6 each",
         _Pragma("GCC unroll 6") for (int i = 0; i < 6; i++) a[i] = _mm256_maddubs_epi16(a[i], y);
         _Pragma("GCC unroll 6") for (int i = 0; i < 6; i++) f[i] = _mm256_fmadd_ps(f[i], c, c););
    return (sink == 42 && fsink == 0.5f) ? 1 : 0; /* keep the results live */
}
