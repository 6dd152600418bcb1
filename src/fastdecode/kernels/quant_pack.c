/* A tensor's stored GGUF blocks into quant.c's packed layout (its comment gives the layout byte
 * by byte): the C twin of kernels/quant_pack.py's numpy packer, the same bytes for every format.
 *
 * Why C: the numpy packer unpacks every weight into temporaries and transposes them (~12 s of CPU
 * for a 1.1 GB Q8_0 file); here each group of eight output rows is read straight from the stored
 * blocks once and written once, at about the speed of a memory copy. The rows may come from
 * several parts (a fused projection's q, k and v, packed as one output without concatenating
 * them first) in any order (Llama's q / k rows un-permuted as they are read), so the packed
 * output is the only copy made. Groups are split over the OpenMP pool (torch's, sized by
 * kernels/threads.py); every group's bytes depend on its rows alone.
 *
 * A group's rows past the tensor's last (the last group's padding) are read as stored blocks of
 * zero bytes, as the numpy packer pads them (so Q3_K's and IQ4_XS's padded scales are sc - 32 of
 * a zero sc, as there); a legacy format's odd last block pads its pair with zero bytes.
 */

#define PK_UNIT_WEIGHTS 256 /* weights of a unit at most: a super-block (a legacy pair holds 64) */
#define PK_SCALE_BYTES 24   /* a stored block's scale fields at most (Q4_K's 2 + 2 + 8 + 8) */

/* One block format as packed: its stored block, the scale fields a unit holds per row (each
 * ``count`` values of ``size`` bytes, written value by value with the eight rows side by side),
 * and its bit planes (quant_pack.py's _PLANES). */
typedef struct {
    int64_t fmt;               /* FD_W_* */
    int64_t block_bytes;       /* a stored block: a block of 32, or a super-block of 256 */
    int64_t sub;               /* blocks of 32 in a stored block: 1 or 8 */
    int n_fields, field_size[4], field_count[4];
    int64_t scale_bytes;       /* a stored block's scales in a unit: the fields, a super-block's padded */
    int n_planes, plane_bits[2], plane_at[2];
} pk_format;

static const pk_format PK_FORMATS[] = {
    {FD_W_Q8_0, 34, 1, 1, {2}, {1}, 16, 1, {8}, {0}},
    {FD_W_Q4_0, 18, 1, 1, {2}, {1}, 16, 1, {4}, {0}},
    {FD_W_Q4_1, 20, 1, 2, {2, 2}, {1, 1}, 32, 1, {4}, {0}},
    {FD_W_Q5_0, 22, 1, 1, {2}, {1}, 16, 2, {4, 1}, {0, 4}},
    {FD_W_Q5_1, 24, 1, 2, {2, 2}, {1, 1}, 32, 2, {4, 1}, {0, 4}},
    {FD_W_IQ4_NL, 18, 1, 1, {2}, {1}, 16, 1, {4}, {0}},
    {FD_W_Q2_K, 84, 8, 3, {2, 2, 1}, {1, 1, 16}, 160, 1, {2}, {0}},
    {FD_W_Q3_K, 110, 8, 2, {2, 1}, {1, 16}, 160, 2, {2, 1}, {0, 2}},
    {FD_W_Q4_K, 144, 8, 4, {2, 2, 1, 1}, {1, 1, 8, 8}, 160, 1, {4}, {0}},
    {FD_W_Q5_K, 176, 8, 4, {2, 2, 1, 1}, {1, 1, 8, 8}, 160, 2, {4, 1}, {0, 4}},
    {FD_W_Q6_K, 210, 8, 2, {2, 1}, {1, 16}, 160, 2, {4, 2}, {0, 4}},
    {FD_W_IQ4_XS, 136, 8, 2, {2, 1}, {1, 8}, 96, 1, {4}, {0}},
};

static const pk_format *pk_format_of(int64_t fmt) {
    for (size_t i = 0; i < sizeof PK_FORMATS / sizeof PK_FORMATS[0]; i++)
        if (PK_FORMATS[i].fmt == fmt) return &PK_FORMATS[i];
    return NULL;
}

static int64_t pk_float_bytes(int64_t fmt) { /* a float format's bytes a weight, else 0 */
    return fmt == FD_W_F32 ? 4 : (fmt == FD_W_BF16 || fmt == FD_W_F16) ? 2 : 0;
}

static int64_t pk_plane_bytes(const pk_format *f) { /* a block of 32's quants */
    int64_t bits = 0;
    for (int p = 0; p < f->n_planes; p++) bits += f->plane_bits[p];
    return 32 * bits;
}

/* Stored blocks a unit: a legacy pair, or one super-block. */
static int64_t pk_unit_blocks(const pk_format *f) { return f->sub == 1 ? 2 : 1; }

static int64_t pk_unit_bytes(const pk_format *f) {
    return pk_unit_blocks(f) * (f->scale_bytes + f->sub * pk_plane_bytes(f));
}

/* Units a row of K weights (-1: K is not whole super-blocks). */
static int64_t pk_units(const pk_format *f, int64_t K) {
    if (f->sub == 1) return ((K + QK - 1) / QK + 1) / 2;
    return K % (QK * f->sub) ? -1 : K / (QK * f->sub);
}

/* Stored blocks a row of K weights. */
static int64_t pk_row_blocks(const pk_format *f, int64_t K) {
    return f->sub == 1 ? (K + QK - 1) / QK : K / (QK * f->sub);
}

/* ggml's 6-bit scale and min j of a Q4_K / Q5_K super-block (get_scale_min_k4). */
static inline void pk_scale_min_k4(const uint8_t *q, int j, uint8_t *sc, uint8_t *m) {
    if (j < 4) {
        *sc = q[j] & 63, *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* Two nibbles a byte: the low ones weights 0..15, the high ones 16..31. */
static inline void pk_nibbles(const uint8_t *qs, uint8_t *u) {
    for (int k = 0; k < 16; k++) u[k] = qs[k] & 0xF, u[16 + k] = qs[k] >> 4;
}

/* ggml's K-quant planes: each run of ``width`` bytes gives 8 / bits runs of ``width`` weights,
 * its bits 0.. first; the field is added to u at bit ``at``. */
static inline void pk_kplanes(const uint8_t *qs, int bytes, int bits, int width, int at, uint8_t *u) {
    const int per = 8 / bits, mask = (1 << bits) - 1;
    for (int r = 0; r < bytes / width; r++)
        for (int s = 0; s < per; s++)
            for (int k = 0; k < width; k++) u[(r * per + s) * width + k] |= ((qs[r * width + k] >> (bits * s)) & mask) << at;
}

/* One stored block b: its weights' codes u (quant.c's: q, Q6_K's q + 32, Q3_K's q + 4, IQ4's level
 * index; sub * 32 of them) and its scale fields s as the unit stores them (gguf_types.py reads the
 * same bytes: _legacy, _k_quant and the *_scales functions). */
static void pk_decode(int64_t fmt, const uint8_t *b, uint8_t *u, uint8_t *s) {
    switch (fmt) {
    case FD_W_Q8_0:
        memcpy(s, b, 2), memcpy(u, b + 2, 32);
        break;
    case FD_W_Q4_0:
    case FD_W_IQ4_NL:
        memcpy(s, b, 2), pk_nibbles(b + 2, u);
        break;
    case FD_W_Q4_1:
        memcpy(s, b, 4), pk_nibbles(b + 4, u);
        break;
    case FD_W_Q5_0:
    case FD_W_Q5_1: { /* the fifth bits: bit k of a little-endian qh is weight k's */
        const int at = fmt == FD_W_Q5_1 ? 4 : 2;
        memcpy(s, b, at), pk_nibbles(b + at + 4, u);
        for (int k = 0; k < 32; k++) u[k] |= ((b[at + k / 8] >> (k % 8)) & 1) << 4;
        break;
    }
    case FD_W_Q2_K: /* sc | m << 4 is the stored byte */
        memcpy(s, b + 80, 4), memcpy(s + 4, b, 16);
        memset(u, 0, 256), pk_kplanes(b + 16, 64, 2, 32, 0, u);
        break;
    case FD_W_Q3_K: { /* 16 6-bit scales: low nibbles in bytes 0..7, top bits in 8..11; stored as sc - 32 */
        const uint8_t *q = b + 96;
        memcpy(s, b + 108, 2);
        for (int i = 0; i < 16; i++) {
            const uint8_t low = i < 8 ? q[i] & 0xF : q[i - 8] >> 4, high = (q[8 + i % 4] >> (2 * (i / 4))) & 3;
            s[2 + i] = (uint8_t)((low | (high << 4)) - 32);
        }
        memset(u, 0, 256), pk_kplanes(b + 32, 64, 2, 32, 0, u), pk_kplanes(b, 32, 1, 32, 2, u);
        break;
    }
    case FD_W_Q4_K:
    case FD_W_Q5_K:
        memcpy(s, b, 4);
        for (int j = 0; j < 8; j++) pk_scale_min_k4(b + 4, j, s + 4 + j, s + 12 + j);
        memset(u, 0, 256), pk_kplanes(b + (fmt == FD_W_Q5_K ? 48 : 16), 128, 4, 32, 0, u);
        if (fmt == FD_W_Q5_K) pk_kplanes(b + 16, 32, 1, 32, 4, u);
        break;
    case FD_W_Q6_K:
        memcpy(s, b + 208, 2), memcpy(s + 2, b + 192, 16);
        memset(u, 0, 256), pk_kplanes(b, 128, 4, 64, 0, u), pk_kplanes(b + 128, 64, 2, 32, 4, u);
        break;
    case FD_W_IQ4_XS: { /* 8 6-bit scales: nibbles of bytes 4..7, top bits in the u16 at 2; stored as sc - 32 */
        const uint16_t high = (uint16_t)(b[2] | (b[3] << 8));
        memcpy(s, b, 2);
        for (int j = 0; j < 8; j++) {
            const uint8_t low = j % 2 ? b[4 + j / 2] >> 4 : b[4 + j / 2] & 0xF;
            s[2 + j] = (uint8_t)((low | (((high >> (2 * j)) & 3) << 4)) - 32);
        }
        for (int j = 0; j < 8; j++) pk_nibbles(b + 8 + 16 * j, u + 32 * j);
        break;
    }
    }
}

/* One plane of the eight rows' block of codes u[j][o .. o + 31] (quant.c's interleave: byte
 * 4 j + i of chunk c is row j's weight 4 c + i): bits 8 (chunks as bytes), 4 (vector p: chunk p
 * in the low nibbles, p + 4 in the high), 2 (vector h: chunk 4 h + c in bits 2 c, 2 c + 1) or 1
 * (chunk c in bit c), of each code's bits at .. at + bits - 1. */
static void pk_plane(uint8_t u[QGROUP][PK_UNIT_WEIGHTS], int64_t o, int bits, int at, uint8_t *out) {
    const int mask = (1 << bits) - 1;
    for (int j = 0; j < QGROUP; j++) {
        const uint8_t *r = u[j] + o;
        for (int i = 0; i < 4; i++) {
            if (bits == 8) {
                for (int c = 0; c < 8; c++) out[32 * c + 4 * j + i] = r[4 * c + i];
            } else if (bits == 4) {
                for (int p = 0; p < 4; p++)
                    out[32 * p + 4 * j + i] = (uint8_t)(((r[4 * p + i] >> at) & 15) | (((r[16 + 4 * p + i] >> at) & 15) << 4));
            } else {
                const int per = 8 / bits; /* chunks a byte */
                for (int h = 0; h < 8 / per; h++) {
                    int v = 0;
                    for (int c = 0; c < per; c++) v |= ((r[4 * (per * h + c) + i] >> at) & mask) << (bits * c);
                    out[32 * h + 4 * j + i] = (uint8_t)v;
                }
            }
        }
    }
}

/* One unit of a group: rows[j] row j's first stored block of the unit, n of its stored blocks
 * there (a legacy pair's odd last unit: 1). */
static void pk_unit(const pk_format *f, const uint8_t *const rows[QGROUP], int64_t n, uint8_t *out) {
    uint8_t u[QGROUP][PK_UNIT_WEIGHTS], s[QGROUP][PK_SCALE_BYTES];
    const int64_t blocks = pk_unit_blocks(f), planes = pk_plane_bytes(f), w = f->sub * QK;
    uint8_t *quants = out + blocks * f->scale_bytes;
    memset(out, 0, pk_unit_bytes(f)); /* padding: a super-block's scales, an odd pair's missing block */
    for (int64_t b = 0; b < n; b++) {
        for (int j = 0; j < QGROUP; j++) pk_decode(f->fmt, rows[j] + b * f->block_bytes, u[j] + b * w, s[j]);
        uint8_t *o = out + b * f->scale_bytes;
        for (int fi = 0, at = 0; fi < f->n_fields; at += f->field_size[fi] * f->field_count[fi], fi++)
            for (int e = 0; e < f->field_count[fi]; e++)
                for (int j = 0; j < QGROUP; j++, o += f->field_size[fi])
                    memcpy(o, s[j] + at + e * f->field_size[fi], f->field_size[fi]);
    }
    for (int64_t k = 0; k < n * f->sub; k++)
        for (int p = 0, at = 0; p < f->n_planes; at += 32 * f->plane_bits[p], p++)
            pk_plane(u, k * QK, f->plane_bits[p], f->plane_at[p], quants + k * planes + at);
}

/* Bytes fd_pack_blocks writes for rows x K weights of format fmt (FD_W_*); -1 for a format it does
 * not pack or a K that is not whole super-blocks. */
int64_t fd_pack_bytes(int64_t fmt, int64_t rows, int64_t K) {
    if (pk_float_bytes(fmt)) return rows * K * pk_float_bytes(fmt);
    const pk_format *f = pk_format_of(fmt);
    if (f == NULL || pk_units(f, K) < 0) return -1;
    return (rows + QGROUP - 1) / QGROUP * pk_units(f, K) * pk_unit_bytes(f);
}

/* Logical row i of the parts stacked: its stored bytes. */
static const uint8_t *pk_row(const uint8_t *const *src, const int64_t *src_rows, const int64_t *src_stride, int64_t i) {
    int64_t p = 0;
    while (i >= src_rows[p]) i -= src_rows[p++];
    return src[p] + i * src_stride[p];
}

/* Packs rows x K weights of format fmt into out (fd_pack_bytes(fmt, rows, K) bytes; 64-byte
 * aligned for the kernels). The input is n_src parts stacked by row, part p src_rows[p] rows of
 * stored blocks at src[p], a row every src_stride[p] bytes; output row r is the stack's row
 * order[r] (r itself where order is NULL). A float format's rows are copied as they are. 0, or
 * -1 for a format fd_pack_bytes refuses, -2 for an order entry outside the stack. */
int64_t fd_pack_blocks(int64_t fmt, int64_t K, const uint8_t *const *src, const int64_t *src_rows,
                       const int64_t *src_stride, int64_t n_src, const int64_t *order, int64_t rows, void *out) {
    if (fd_pack_bytes(fmt, rows, K) < 0) return -1;
    int64_t total = 0;
    for (int64_t p = 0; p < n_src; p++) total += src_rows[p];
    for (int64_t r = 0; order != NULL && r < rows; r++)
        if (order[r] < 0 || order[r] >= total) return -2;
    if (order == NULL && rows > total) return -2;
    uint8_t *dst = (uint8_t *)out;
    const int64_t esize = pk_float_bytes(fmt);
    if (esize) {
#pragma omp parallel for schedule(static)
        for (int64_t r = 0; r < rows; r++)
            memcpy(dst + r * K * esize, pk_row(src, src_rows, src_stride, order ? order[r] : r), K * esize);
        return 0;
    }
    const pk_format *f = pk_format_of(fmt);
    const int64_t units = pk_units(f, K), unit_bytes = pk_unit_bytes(f), nblocks = pk_row_blocks(f, K);
    const int64_t G = (rows + QGROUP - 1) / QGROUP, step = pk_unit_blocks(f) * f->block_bytes;
    const uint8_t *zero = (const uint8_t *)calloc(1, step); /* a padding row's stored blocks */
    if (zero == NULL) return -3;
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < G; g++) {
        const uint8_t *rows_at[QGROUP];
        int pad[QGROUP];
        for (int j = 0; j < QGROUP; j++) {
            const int64_t r = g * QGROUP + j;
            pad[j] = r >= rows;
            rows_at[j] = pad[j] ? zero : pk_row(src, src_rows, src_stride, order ? order[r] : r);
        }
        for (int64_t t = 0; t < units; t++) {
            const uint8_t *unit_rows[QGROUP];
            for (int j = 0; j < QGROUP; j++) unit_rows[j] = pad[j] ? zero : rows_at[j] + t * step;
            const int64_t first = t * pk_unit_blocks(f), left = nblocks - first;
            pk_unit(f, unit_rows, left < pk_unit_blocks(f) ? left : pk_unit_blocks(f), dst + (g * units + t) * unit_bytes);
        }
    }
    free((void *)zero);
    return 0;
}
