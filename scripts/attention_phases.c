/* The decode step's phased attention (cpu.c's attention_phased: scores by items and ranges, softmax,
 * values) timed on one thread, built against one checkout's cpu.c: scripts/attention_cpu_time.py
 * --phased compiles it once per --sources entry (-DCPU_C="path", and -DFD_ZMM_ARG where that cpu.c
 * takes the zmm flag) and alternates them. SmolLM2-135M's shapes: 9 query heads over 3 KV heads,
 * head_dim 64, 30 layers' pools of 16-position blocks, random rows; one decode row at position L - 1. */
#include CPU_C
#include <time.h>

#define PH_H 9
#define PH_KV 3
#define PH_D 64
#define PH_B 16
#define PH_LAYERS 30

static double thread_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

static uint64_t ph_state;
static float ph_rand(void) { /* xorshift, in [-0.5, 0.5) */
    ph_state ^= ph_state << 13, ph_state ^= ph_state >> 7, ph_state ^= ph_state << 17;
    return (float)(ph_state >> 40) / (float)(1 << 24) - 0.5f;
}

/* Best CPU seconds a layer over `rounds` passes of every layer; out: the last layer's output [H * D]. */
double phase_bench(int64_t T, int64_t L, int64_t zmm, int64_t rounds, float *out) {
    const int64_t nblk = (L + PH_B - 1) / PH_B, RB = kv_row_bytes(T, PH_D), rows = nblk * PH_KV * PH_B;
    char *K[PH_LAYERS], *V[PH_LAYERS];
    float x[PH_D], q[PH_H * PH_D], qq[PH_H * PH_D];
    ph_state = 88172645463325252ull;
    for (int l = 0; l < PH_LAYERS; l++) {
        K[l] = malloc(rows * RB), V[l] = malloc(rows * RB);
        for (int64_t r = 0; r < rows; r++) {
            const float s = 8.0f * (ph_rand() + 0.5f);
            for (int d = 0; d < PH_D; d++) x[d] = s * ph_rand();
            kv_store_row(K[l] + r * RB, x, PH_D, T);
            for (int d = 0; d < PH_D; d++) x[d] = s * ph_rand();
            kv_store_row(V[l] + r * RB, x, PH_D, T);
        }
    }
    int64_t *table = malloc(sizeof(int64_t) * nblk), pos = L - 1, seq = 0;
    for (int64_t b = 0; b < nblk; b++) table[b] = b;
    for (int i = 0; i < PH_H * PH_D; i++) q[i] = ph_rand();
    const float *qp = q;
    int64_t stride = PH_D;
    if (T >= KV_Q8_0) { /* fd_attention_f32 hands the phases int8 query blocks */
        stride = kv_query_floats(PH_D);
        for (int h = 0; h < PH_H; h++) kv_quantize_query(q + h * PH_D, PH_D, (char *)(qq + h * stride));
        qp = qq;
    }
    float *scratch = malloc(sizeof(float) * PH_H * L);
    double best = 1e30;
    for (int64_t r = 0; r < rounds; r++) {
        const double t0 = thread_s();
        for (int l = 0; l < PH_LAYERS; l++)
            attention_phased(qp, PH_H * stride, stride, 1, PH_H, PH_KV, PH_D, K[l], V[l], PH_B, &pos, &seq, table, nblk,
                             0.125f, 0, scratch, out, T, T, L
#ifdef FD_ZMM_ARG
                             , (int)zmm
#endif
            );
        const double s = (thread_s() - t0) / PH_LAYERS;
        best = s < best ? s : best;
    }
    (void)zmm;
    for (int l = 0; l < PH_LAYERS; l++) free(K[l]), free(V[l]);
    free(scratch), free(table);
    return best;
}
