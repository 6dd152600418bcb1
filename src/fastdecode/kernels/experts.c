/* The experts FFN of a mixture of experts in one call (fd_experts): backends/ffn.py's ExpertsMLP after
 * its router, for n rows each routed to k experts (the router's choice, made in float32 by the caller):
 *
 *     out[r] = sum over ranks j = 0 .. k - 1, in that order, of  w[r, j] * down_e(act(gate_e(x[r])) * up_e(x[r]))
 *
 * with e = index[r, j], each expert's gate and up one projection [2 inter, hidden] and down [hidden, inter]
 * in the block formats quant.c runs (fd_proj, one or more parts, each projection's bias or none: gpt-oss's), act
 * SwiGLU, GeGLU or gpt-oss's clamped SwiGLU (EX_ACT_CLAMPED: fd_glu_clamped_f32). The work, for one pass:
 *
 *   1. the (row, rank) pairs grouped by expert (within an expert, in row-major order);
 *   2. each row's activations quantized once (fd_quantize_rows), then copied to its pairs' places;
 *   3. gate_up of every active expert over its pairs' rows, then its bias;
 *   4. per pair: act(gate) * up (fd_glu_f32, or fd_glu_clamped_f32), quantized (quant.c's quantize_row);
 *   5. down of every active expert over its pairs' rows, then its bias;
 *   6. per row: its k outputs times their weights, added in rank order.
 *
 * Bits: every step is the per-op path's own arithmetic on each pair alone - the block GEMM's outputs
 * are row-invariant by construction (quant.c), a bias added to each output as fd_project adds it (after
 * the GEMM, one rounding), the activations quantized per row, the GLU per element,
 * and step 6 is the product w * y rounded, then the sum in rank order, as ExpertsMLP's torch ops do
 * (slots[rows, rank] = y * w; out = slots[:, 0] + slots[:, 1] + ...). So a row's bits never depend on
 * which other rows the pass holds, and equal those of the per-op path (tests/kernels/test_experts.py).
 *
 * Threads: one parallel region; steps 3 and 5 split into (expert, tile of EXPERT_TILE groups of eight
 * outputs) items taken dynamically, so one decoded row (k experts) still keeps every thread busy; a
 * tile runs the ymm loop's gemm_groups on its thread alone (quant_ymm.c). The scalar loop and the zmm
 * loop (from ZMIN_ROWS rows) run a tile through their own gemm on the tile's groups, whose parallel
 * region is then nested (one thread): the same bits.
 */

#define EXPERT_TILE 16 /* groups of QGROUP outputs a work item takes: 128 outputs */
#define EX_MAX_TOP_K 64 /* the most experts a row is routed to (kernels/abi.py's MAX_TOP_K) */

extern void fd_glu_f32(const float *gate_up, int64_t n, int64_t inter, int64_t act, float *out); /* cpu.c */
extern void fd_glu_clamped_f32(const float *gate_up, int64_t n, int64_t inter, float alpha, float limit, float *out);

#define EX_ACT_CLAMPED 2 /* act beyond cpu.c's ACT_*: gpt-oss's clamped SwiGLU, with alpha and limit */

/* An experts FFN (kernels/abi.py's CExperts): per expert, gate and up as one projection [2 inter, hidden]
 * and down [hidden, inter], every part in a block format, each with a bias or none; act: cpu.c's ACT_*, or
 * EX_ACT_CLAMPED with alpha and limit (read only then); impl: FD_IMPL_*. */
typedef struct {
    const fd_proj *const *gate_up, *const *down;
    int64_t n_experts, hidden, inter, act, impl;
    float alpha, limit;
} fd_experts_desc;

/* A pass's work, carved from one buffer (fd_experts_work_bytes). */
typedef struct {
    int64_t *count, *start, *cursor; /* per expert: its pairs, where they begin (start[E] = P), a fill cursor */
    int64_t *row_of, *pair_of;       /* pair q's row; slot r k + j's pair */
    int64_t *items;                  /* (expert, part, g0, g1) a work item: step 3's, then step 5's */
    float *gu, *h, *yd;              /* per pair: gate_up [2 inter], act(gate) * up [inter], down [hidden] (gu's place) */
    void *xq, *gq, *hq;              /* quantized: the rows [n, hidden], their pairs' copies [P, hidden], h [P, inter] */
} ex_work;

static inline int64_t ex_align(int64_t bytes) { return (bytes + 63) / 64 * 64; }

/* Work items of one step at most: per active expert (at most min(E, P)), its projection's tiles. */
static int64_t ex_max_items(const fd_experts_desc *E, int64_t P) {
    const int64_t widest = 2 * E->inter > E->hidden ? 2 * E->inter : E->hidden;
    const int64_t tiles = (widest + QGROUP * EXPERT_TILE - 1) / (QGROUP * EXPERT_TILE) + FD_MAX_PARTS;
    return (E->n_experts < P ? E->n_experts : P) * tiles;
}

/* The buffer carved into ex_work (W NULL: only its size). Step 5's down outputs take the place of step
 * 3's gate_up outputs, dead once step 4 has read them. */
static int64_t ex_layout(const fd_experts_desc *E, int64_t n, int64_t k, char *base, ex_work *W) {
    const int64_t P = n * k, nE = E->n_experts, widest = 2 * E->inter > E->hidden ? 2 * E->inter : E->hidden;
    const int64_t sizes[11] = {8 * nE,
                               8 * (nE + 1),
                               8 * nE,
                               8 * P,
                               8 * P,
                               2 * 32 * ex_max_items(E, P), /* steps 3 and 5 */
                               4 * P * widest,
                               4 * P * E->inter,
                               fd_qact_bytes(n, E->hidden),
                               fd_qact_bytes(P, E->hidden),
                               fd_qact_bytes(P, E->inter)};
    void *at[11];
    int64_t off = 0;
    for (int i = 0; i < 11; i++) {
        at[i] = base ? base + off : NULL;
        off += ex_align(sizes[i]);
    }
    if (W) *W = (ex_work){at[0], at[1], at[2], at[3], at[4], at[5], at[6], at[7], at[6], at[8], at[9], at[10]};
    return off;
}

/* Bytes of work fd_experts needs for n rows routed to k experts each. */
int64_t fd_experts_work_bytes(const fd_experts_desc *E, int64_t n, int64_t k) { return ex_layout(E, n, k, NULL, NULL); }

/* Step 1: the pairs grouped by expert. Returns the experts with a pair, or -1 where an index is not an expert. */
static int64_t ex_group(const fd_experts_desc *E, int64_t P, int64_t k, const int64_t *index, const ex_work *W) {
    const int64_t nE = E->n_experts;
    int64_t active = 0;
    for (int64_t e = 0; e < nE; e++) W->count[e] = 0;
    for (int64_t p = 0; p < P; p++) {
        if (index[p] < 0 || index[p] >= nE) return -1;
        W->count[index[p]]++;
    }
    W->start[0] = 0;
    for (int64_t e = 0; e < nE; e++) {
        W->start[e + 1] = W->start[e] + W->count[e];
        W->cursor[e] = W->start[e];
        active += W->count[e] > 0;
    }
    for (int64_t p = 0; p < P; p++) {
        const int64_t q = W->cursor[index[p]]++;
        W->row_of[q] = p / k;
        W->pair_of[p] = q;
    }
    return active;
}

/* The work items of a step over projections proj[e]: (expert, part, first group, end group), the experts
 * with pairs in ascending order, each part's groups in tiles. Returns their count. */
static int64_t ex_items(const fd_experts_desc *E, const fd_proj *const *proj, const ex_work *W, int64_t *items) {
    int64_t m = 0;
    for (int64_t e = 0; e < E->n_experts; e++) {
        if (!W->count[e]) continue;
        for (int64_t i = 0; i < proj[e]->n_parts; i++) {
            const int64_t G = (proj[e]->part[i].n + QGROUP - 1) / QGROUP;
            for (int64_t g0 = 0; g0 < G; g0 += EXPERT_TILE) {
                int64_t *item = items + 4 * m++;
                item[0] = e, item[1] = i, item[2] = g0, item[3] = g0 + EXPERT_TILE < G ? g0 + EXPERT_TILE : G;
            }
        }
    }
    return m;
}

/* The quantized activations a from row m0 on, as a block of their own. */
static qact qact_from(const qact *a, int64_t m0) {
    qact v = *a;
    v.qs += m0 * a->nb * QK, v.d += m0 * a->nb, v.s += m0 * a->nb, v.sx += m0 * a->nb, v.sxh += 2 * m0 * a->nb;
    return v;
}

/* Row i of src copied to row j of dst (both of one width). */
static void qact_copy_row(const qact *src, int64_t i, const qact *dst, int64_t j) {
    const int64_t nb = src->nb;
    memcpy(dst->qs + j * nb * QK, src->qs + i * nb * QK, (size_t)(nb * QK));
    memcpy(dst->d + j * nb, src->d + i * nb, sizeof(float) * nb);
    memcpy(dst->s + j * nb, src->s + i * nb, sizeof(int32_t) * nb);
    memcpy(dst->sx + j * nb, src->sx + i * nb, sizeof(float) * nb);
    memcpy(dst->sxh + 2 * j * nb, src->sxh + 2 * i * nb, sizeof(float) * 2 * nb);
}

/* The ymm loop on groups g0 .. g1 - 1, on this thread: AVX-VNNI's copy where the CPU has it (gemm_ymm's choice). */
static void ex_gemm_ymm(const qact *a, int64_t M, int64_t fmt, const uint8_t *w, int64_t N, int64_t g0, int64_t g1, int vnni,
                        float *y, int64_t ldy) {
#ifdef FD_HAVE_VNNI
    if (vnni) {
        gemm_groups_avx_vnni(a, M, fmt, w, N, g0, g1, y, ldy);
        return;
    }
#endif
    (void)vnni;
    gemm_groups_avx2(a, M, fmt, w, N, g0, g1, y, ldy);
}

/* block_gemm's outputs for groups g0 .. g1 - 1 of the part at w (N outputs), on this thread; vnni: the
 * ymm loop's AVX-VNNI copy (where impl is AVX-512 VNNI or AVX-VNNI and the CPU has it). */
static void ex_gemm(const qact *a, int64_t M, int64_t fmt, const uint8_t *w, int64_t N, int64_t g0, int64_t g1, int impl,
                    int vnni, float *y, int64_t ldy) {
    const int64_t n0 = g0 * QGROUP, n1 = g1 * QGROUP < N ? g1 * QGROUP : N, skip = g0 * group_bytes(fmt, a->nb);
#ifdef FD_HAVE_VNNI
    if (impl == FD_IMPL_AVX512_VNNI && zfmt_supported(fmt) && M >= ZMIN_ROWS) {
        gemm_avx512(a, M, fmt, w + skip, n1 - n0, y + n0, ldy); /* its parallel region nested: one thread */
        return;
    }
    if (impl == FD_IMPL_AVX512_VNNI || impl == FD_IMPL_AVX_VNNI) {
        ex_gemm_ymm(a, M, fmt, w, N, g0, g1, vnni, y, ldy);
        return;
    }
#endif
    if (impl == FD_IMPL_AVX2)
        ex_gemm_ymm(a, M, fmt, w, N, g0, g1, 0, y, ldy);
    else
        gemm_scalar(a, M, fmt, w + skip, n1 - n0, y + n0, ldy); /* its parallel region nested: one thread */
}

/* A work item's outputs n0 + g0 * QGROUP .. n0 + min(g1 * QGROUP, part's n) - 1 of its expert's rows plus its
 * projection's bias (y += bias: fd_project's add). */
static void ex_bias(const fd_proj *p, int64_t n0, int64_t part_n, const int64_t *item, int64_t rows, float *y,
                    int64_t ldy) {
    const int64_t j0 = n0 + item[2] * QGROUP, j1 = n0 + (item[3] * QGROUP < part_n ? item[3] * QGROUP : part_n);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = j0; j < j1; j++) y[r * ldy + j] += p->bias[j];
}

/* Steps 3 and 5: the items over projections proj[e], each expert's pairs' rows of a into y [P, ldy]. */
static void ex_run(const fd_proj *const *proj, const ex_work *W, const int64_t *items, int64_t n_items, const qact *a,
                   int impl, int vnni, float *y, int64_t ldy) {
#pragma omp for schedule(dynamic, 1)
    for (int64_t m = 0; m < n_items; m++) {
        const int64_t *item = items + 4 * m, e = item[0], start = W->start[e];
        const fd_proj *p = proj[e];
        int64_t n0 = 0;
        for (int64_t i = 0; i < item[1]; i++) n0 += p->part[i].n;
        const fd_part *part = &p->part[item[1]];
        const qact rows = qact_from(a, start);
        ex_gemm(&rows, W->count[e], part->fmt, (const uint8_t *)part->w, part->n, item[2], item[3], impl, vnni,
                y + start * ldy + n0, ldy);
        if (p->bias) ex_bias(p, n0, part->n, item, W->count[e], y + start * ldy, ldy);
    }
}

/* Step 6: row r's k outputs times their weights, in rank order. */
static void ex_combine(const ex_work *W, int64_t n, int64_t k, int64_t hidden, const float *weight, float *out) {
#pragma omp for schedule(static)
    for (int64_t r = 0; r < n; r++) {
        float *o = out + r * hidden;
        const float *y = W->yd + W->pair_of[r * k] * hidden, w0 = weight[r * k];
        for (int64_t c = 0; c < hidden; c++) o[c] = y[c] * w0;
        for (int64_t j = 1; j < k; j++) {
            const float *yj = W->yd + W->pair_of[r * k + j] * hidden, wj = weight[r * k + j];
            for (int64_t c = 0; c < hidden; c++) o[c] = o[c] + yj[c] * wj;
        }
    }
}

/* Routings (kernels/abi.py's ROUTINGS; backends/ffn.py's Experts.gating): the softmax over every expert,
 * then its top k (Qwen3-MoE, OLMoE; optionally renormalised to sum 1), or the top k logits, then their
 * softmax (Mixtral, gpt-oss). */
#define ROUTE_SOFTMAX_TOPK 0
#define ROUTE_TOPK_SOFTMAX 1

/* Whether (value a, expert i) ranks after (b, j): the larger value first, a tie to the lower expert (a
 * stable descending sort's order). */
static inline int route_after(float a, int64_t i, float b, int64_t j) { return a < b || (a == b && i > j); }

/* Row r's top k of its E values v: index[j] the j-th in route_after's order (rank 0 the largest). A
 * selection, k passes over E values (k <= E, both small): each pass the largest ranking after the last
 * one taken. A NaN ranks nowhere: a row of them takes expert 0 (a valid id; its weight is NaN). */
static void route_top(const float *v, int64_t E, int64_t k, int64_t *index) {
    for (int64_t j = 0; j < k; j++) {
        int64_t best = -1;
        for (int64_t e = 0; e < E; e++) {
            if (j > 0 && !route_after(v[e], e, v[index[j - 1]], index[j - 1])) continue;
            if (best < 0 || route_after(v[best], best, v[e], e)) best = e;
        }
        index[j] = best < 0 ? 0 : best;
    }
}

/* softmax of v [m] into out [m], in index order: exp(v - max) over their sum (expf, one rounding each). */
static void route_softmax(const float *v, int64_t m, float *out) {
    float top = v[0], sum = 0.0f;
    for (int64_t i = 1; i < m; i++) top = v[i] > top ? v[i] : top;
    for (int64_t i = 0; i < m; i++) {
        out[i] = expf(v[i] - top);
        sum += out[i];
    }
    for (int64_t i = 0; i < m; i++) out[i] = out[i] / sum;
}

/* The router's choice for n rows of logits [n, E] (overwritten: each row's softmax where the routing takes
 * it first): index [n, k] and weights [n, k], rank 0 the largest, each row alone (backends/ffn.py's route,
 * this arithmetic on every CPU path, so a row's experts and weights never depend on the other rows). */
void fd_route_f32(float *logits, int64_t n, int64_t E, int64_t k, int64_t routing, int64_t renormalize, float *weight,
                  int64_t *index) {
    float top[EX_MAX_TOP_K];
    for (int64_t r = 0; r < n; r++) {
        float *v = logits + r * E, *w = weight + r * k;
        int64_t *ix = index + r * k;
        if (routing == ROUTE_SOFTMAX_TOPK) route_softmax(v, E, v);
        route_top(v, E, k, ix);
        for (int64_t j = 0; j < k; j++) top[j] = v[ix[j]];
        if (routing == ROUTE_TOPK_SOFTMAX) {
            route_softmax(top, k, w);
            continue;
        }
        float sum = 0.0f;
        for (int64_t j = 0; j < k; j++) sum += top[j];
        for (int64_t j = 0; j < k; j++) w[j] = renormalize ? top[j] / sum : top[j];
    }
}

/* The experts FFN of n rows x [n, hidden] routed to index [n, k] (expert ids) with weights [n, k], into
 * out [n, hidden]; work: fd_experts_work_bytes(E, n, k) bytes. Returns how many distinct experts ran,
 * or -1 (nothing written) where an index is no expert of E. */
int64_t fd_experts(const fd_experts_desc *E, const float *x, int64_t n, int64_t k, const int64_t *index, const float *weight,
                   void *work, float *out) {
    const int64_t P = n * k, hidden = E->hidden, inter = E->inter;
    ex_work W;
    ex_layout(E, n, k, (char *)work, &W);
    const int64_t active = ex_group(E, P, k, index, &W);
    if (active < 0 || n == 0) return active;
    const int impl = impl_of(E->impl), avx2 = impl != FD_IMPL_SCALAR;
    const int vnni = impl == FD_IMPL_AVX_VNNI || (impl == FD_IMPL_AVX512_VNNI && fd_impl_supported(FD_IMPL_AVX_VNNI));
    const int64_t n_up = ex_items(E, E->gate_up, &W, W.items), n_down = ex_items(E, E->down, &W, W.items + 4 * n_up);
    fd_quantize_rows(x, n, hidden, impl, W.xq);
    const qact xq = qact_at(W.xq, n, hidden), gq = qact_at(W.gq, P, hidden), hq = qact_at(W.hq, P, inter);
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t q = 0; q < P; q++) qact_copy_row(&xq, W.row_of[q], &gq, q);
        ex_run(E->gate_up, &W, W.items, n_up, &gq, impl, vnni, W.gu, 2 * inter);
#pragma omp for schedule(static)
        for (int64_t q = 0; q < P; q++) {
            if (E->act == EX_ACT_CLAMPED)
                fd_glu_clamped_f32(W.gu + q * 2 * inter, 1, inter, E->alpha, E->limit, W.h + q * inter);
            else
                fd_glu_f32(W.gu + q * 2 * inter, 1, inter, E->act, W.h + q * inter);
            quantize_row(W.h + q * inter, inter, avx2, &hq, q);
        }
        ex_run(E->down, &W, W.items + 4 * n_up, n_down, &hq, impl, vnni, W.yd, hidden);
        ex_combine(&W, n, k, hidden, weight, out);
    }
    return active;
}

/* A mixture of experts' FFN as fd_layer runs it (cpu.c's FFN_EXPERTS; kernels/abi.py's CMoE): the router,
 * a float32 projection [E, hidden] with its bias or none (fd_project's row-invariant float GEMM), the
 * routing (ROUTE_*, renormalize) of top_k experts, the experts (fd_experts_desc), and runs: a counter the
 * call adds its distinct experts run to (the engine's cost model reads it), or NULL. No shared expert. */
typedef struct {
    const fd_proj *router;
    const fd_experts_desc *experts;
    int64_t top_k, routing, renormalize;
    int64_t *runs;
} fd_moe_ffn;

/* Floats of work fd_moe needs for n rows: the expert ids [n, k] (int64), the logits [n, E], the weights
 * [n, k], then fd_experts' work, each 64-byte aligned within it. */
int64_t fd_moe_work_floats(const fd_moe_ffn *M, int64_t n) {
    const int64_t E = M->experts->n_experts, k = M->top_k;
    return 2 * n * k + n * E + n * k + (fd_experts_work_bytes(M->experts, n, k) + 3) / 4 + 2 * 16;
}

static inline void *ex_align_ptr(void *p) { return (void *)(((uintptr_t)p + 63) & ~(uintptr_t)63); }

/* The FFN of n rows h [n, hidden] into out [n, hidden]: the router's logits (fd_project), its choice
 * (fd_route_f32), the experts (fd_experts): the calls backends/ffn.py's ExpertsMLP makes one by one on
 * fastdecode's kernels (KernelOps), so the same bits. work: fd_moe_work_floats(M, n) floats; scratch: the
 * router's (a float32 projection needs none). */
static void fd_moe(const fd_moe_ffn *M, const float *h, int64_t n, int64_t hidden, float *work, void *scratch,
                   float *out) {
    const int64_t E = M->experts->n_experts, k = M->top_k;
    int64_t *index = ex_align_ptr(work);
    float *logits = (float *)(index + n * k), *weight = logits + n * E;
    void *ex = ex_align_ptr(weight + n * k);
    fd_project(h, n, hidden, M->router, scratch, logits);
    fd_route_f32(logits, n, E, k, M->routing, M->renormalize, weight, index);
    const int64_t run = fd_experts(M->experts, h, n, k, index, weight, ex, out);
    if (M->runs && run > 0) *M->runs += run;
}
