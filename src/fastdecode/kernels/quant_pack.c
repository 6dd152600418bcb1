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
 * a zero sc, as there); a legacy format's last unit pads its missing blocks (a pair's one, MXFP4's up to three) with zero bytes.
 */

#define PK_UNIT_WEIGHTS 256 /* weights of a unit at most: a super-block (a legacy pair holds 64, MXFP4's four 128) */
#define PK_AHEAD 2          /* units ahead a row's stored blocks are prefetched */
#define PK_SCALE_BYTES 24   /* a row's scale values of a stored block at most (Q4_K's 2 + 2 + 8 + 8) */

/* One block format as packed: its stored block, the scales a unit holds per row (n16 fp16 values,
 * then n8 bytes, each written with the eight rows' values side by side: d[8], (m or dmin[8]),
 * sc[n8][8]) and its one or two bit planes (quant_pack.py's _PLANES). */
typedef struct {
    int64_t fmt;         /* FD_W_* */
    int64_t block_bytes; /* a stored block: a block of 32, or a super-block of 256 */
    int64_t sub;         /* blocks of 32 in a stored block: 1 or 8 */
    int64_t n16, n8;     /* a row's scale values of a stored block: fp16 ones, then bytes */
    int64_t scale_bytes; /* a stored block's scales in a unit: 8 (2 n16 + n8), a super-block's padded */
    int bits0, at0, bits1, at1; /* planes (bits, at); bits1 = 0: one plane */
    int64_t unit;        /* stored blocks a unit: 1 (a super-block), 2 (a pair), 4 (MXFP4: 32 bytes of scales) */
} pk_format;

static const pk_format PK_FORMATS[] = {
    {FD_W_Q8_0, 34, 1, 1, 0, 16, 8, 0, 0, 0, 2},
    {FD_W_Q4_0, 18, 1, 1, 0, 16, 4, 0, 0, 0, 2},
    {FD_W_Q4_1, 20, 1, 2, 0, 32, 4, 0, 0, 0, 2},
    {FD_W_Q5_0, 22, 1, 1, 0, 16, 4, 0, 1, 4, 2},
    {FD_W_Q5_1, 24, 1, 2, 0, 32, 4, 0, 1, 4, 2},
    {FD_W_IQ4_NL, 18, 1, 1, 0, 16, 4, 0, 0, 0, 2},
    {FD_W_Q2_K, 84, 8, 2, 16, 160, 2, 0, 0, 0, 1}, /* sc | m << 4 a 16 weights */
    {FD_W_Q3_K, 110, 8, 1, 16, 160, 2, 0, 1, 2, 1},
    {FD_W_Q4_K, 144, 8, 2, 16, 160, 4, 0, 0, 0, 1}, /* sc[8], then m[8] */
    {FD_W_Q5_K, 176, 8, 2, 16, 160, 4, 0, 1, 4, 1},
    {FD_W_Q6_K, 210, 8, 1, 16, 160, 4, 0, 2, 4, 1},
    {FD_W_IQ4_XS, 136, 8, 1, 8, 96, 4, 0, 0, 0, 1},
    {FD_W_MXFP4, 17, 1, 0, 1, 8, 4, 0, 0, 0, 4}, /* e (E8M0), then nibbles */
};

static const pk_format *pk_format_of(int64_t fmt) {
    for (size_t i = 0; i < sizeof PK_FORMATS / sizeof PK_FORMATS[0]; i++)
        if (PK_FORMATS[i].fmt == fmt) return &PK_FORMATS[i];
    return NULL;
}

static int64_t pk_float_bytes(int64_t fmt) { /* a float format's bytes a weight, else 0 */
    return fmt == FD_W_F32 ? 4 : (fmt == FD_W_BF16 || fmt == FD_W_F16) ? 2 : 0;
}

static int64_t pk_plane_bytes(const pk_format *f) { return 32 * (f->bits0 + f->bits1); } /* a block of 32's quants */

/* Stored blocks a unit: a legacy pair (MXFP4's four), or one super-block. */
static int64_t pk_unit_blocks(const pk_format *f) { return f->unit; }

static int64_t pk_unit_bytes(const pk_format *f) {
    return pk_unit_blocks(f) * (f->scale_bytes + f->sub * pk_plane_bytes(f));
}

/* Units a row of K weights (-1: K is not whole super-blocks). */
static int64_t pk_units(const pk_format *f, int64_t K) {
    if (f->sub == 1) return ((K + QK - 1) / QK + f->unit - 1) / f->unit;
    return K % (QK * f->sub) ? -1 : K / (QK * f->sub);
}

/* Stored blocks a row of K weights. */
static int64_t pk_row_blocks(const pk_format *f, int64_t K) {
    return f->sub == 1 ? (K + QK - 1) / QK : K / (QK * f->sub);
}

/* ggml's 6-bit scale and min j of a Q4_K / Q5_K super-block (get_scale_min_k4). */
QAINLINE void pk_scale_min_k4(const uint8_t *q, int j, uint8_t *sc, uint8_t *m) {
    if (j < 4) {
        *sc = q[j] & 63, *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* The decoding below works on words of eight codes (a byte each), SWAR: a shift of the word by
 * less than 8 - bits, then a mask a byte, takes every byte's field of ``bits`` at once (what the
 * neighbouring byte shifts in lands above it). */
#define PK_BYTES(x) (0x0101010101010101ull * (uint64_t)(x))

QAINLINE uint64_t pk_load64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

QAINLINE void pk_or64(uint8_t *p, uint64_t v) {
    v |= pk_load64(p);
    memcpy(p, &v, 8);
}

/* Bits 0..7 of x, each the low bit of its own byte (4 at a time: bit i times 2^(7 i) lands at 8 i, no carries). */
QAINLINE uint64_t pk_spread8(uint32_t x) {
    const uint64_t lo = ((x & 15) * 0x00204081u) & 0x01010101u, hi = (((x >> 4) & 15) * 0x00204081u) & 0x01010101u;
    return lo | hi << 32;
}

/* Two nibbles a byte: the low ones weights 0..15, the high ones 16..31 (u zeroed first). */
QAINLINE void pk_nibbles(const uint8_t *qs, uint8_t *u) {
    for (int k = 0; k < 16; k += 8) {
        const uint64_t q = pk_load64(qs + k);
        pk_or64(u + k, q & PK_BYTES(15)), pk_or64(u + 16 + k, (q >> 4) & PK_BYTES(15));
    }
}

/* ggml's K-quant planes: each run of ``width`` bytes gives 8 / bits runs of ``width`` weights,
 * its bits 0.. first; the field is added to u at bit ``at``. */
QAINLINE void pk_kplanes(const uint8_t *qs, int bytes, int bits, int width, int at, uint8_t *u) {
    const int per = 8 / bits;
    const uint64_t mask = PK_BYTES((1 << bits) - 1);
    for (int r = 0; r < bytes / width; r++)
        for (int s = 0; s < per; s++)
            for (int k = 0; k < width; k += 8)
                pk_or64(u + (r * per + s) * width + k, ((pk_load64(qs + r * width + k) >> (bits * s)) & mask) << at);
}

/* One stored block b: its weights' codes u (zeroed first; quant.c's: q, Q6_K's q + 32, Q3_K's q + 4,
 * IQ4's and MXFP4's level index; sub * 32 of them) and its scale values s as the unit stores them, n16 fp16 then
 * n8 bytes (gguf_types.py reads the same bytes: _legacy, _k_quant and the *_scales functions). */
QAINLINE void pk_decode(int64_t fmt, const uint8_t *b, uint8_t *u, uint8_t *s) {
    switch (fmt) {
    case FD_W_Q8_0:
        memcpy(s, b, 2), memcpy(u, b + 2, 32);
        break;
    case FD_W_Q4_0:
    case FD_W_IQ4_NL:
        memcpy(s, b, 2), pk_nibbles(b + 2, u);
        break;
    case FD_W_MXFP4: /* the E8M0 byte e as stored */
        s[0] = b[0], pk_nibbles(b + 1, u);
        break;
    case FD_W_Q4_1:
        memcpy(s, b, 4), pk_nibbles(b + 4, u);
        break;
    case FD_W_Q5_0:
    case FD_W_Q5_1: { /* the fifth bits: bit k of a little-endian qh is weight k's */
        const int at = fmt == FD_W_Q5_1 ? 4 : 2;
        memcpy(s, b, at), pk_nibbles(b + at + 4, u);
        for (int k = 0; k < 32; k += 8) pk_or64(u + k, pk_spread8(b[at + k / 8]) << 4);
        break;
    }
    case FD_W_Q2_K: /* sc | m << 4 is the stored byte */
        memcpy(s, b + 80, 4), memcpy(s + 4, b, 16);
        pk_kplanes(b + 16, 64, 2, 32, 0, u);
        break;
    case FD_W_Q3_K: { /* 16 6-bit scales: low nibbles in bytes 0..7, top bits in 8..11; stored as sc - 32 */
        const uint8_t *q = b + 96;
        uint32_t h;
        memcpy(&h, q + 8, 4);
        const uint64_t low = pk_load64(q), h0 = h & 0x03030303u, h1 = (h >> 2) & 0x03030303u;
        const uint64_t h2 = (h >> 4) & 0x03030303u, h3 = (h >> 6) & 0x03030303u;
        const uint64_t x[2] = {(low & PK_BYTES(15)) | (h0 | h1 << 32) << 4, ((low >> 4) & PK_BYTES(15)) | (h2 | h3 << 32) << 4};
        memcpy(s, b + 108, 2);
        for (int i = 0; i < 2; i++) { /* x - 32 a byte (x < 64): no borrow from a byte with its top bit set */
            const uint64_t v = ((x[i] | PK_BYTES(0x80)) - PK_BYTES(0x20)) ^ PK_BYTES(0x80);
            memcpy(s + 2 + 8 * i, &v, 8);
        }
        pk_kplanes(b + 32, 64, 2, 32, 0, u), pk_kplanes(b, 32, 1, 32, 2, u);
        break;
    }
    case FD_W_Q4_K:
    case FD_W_Q5_K:
        memcpy(s, b, 4);
        for (int j = 0; j < 8; j++) pk_scale_min_k4(b + 4, j, s + 4 + j, s + 12 + j);
        pk_kplanes(b + (fmt == FD_W_Q5_K ? 48 : 16), 128, 4, 32, 0, u);
        if (fmt == FD_W_Q5_K) pk_kplanes(b + 16, 32, 1, 32, 4, u);
        break;
    case FD_W_Q6_K:
        memcpy(s, b + 208, 2), memcpy(s + 2, b + 192, 16);
        pk_kplanes(b, 128, 4, 64, 0, u), pk_kplanes(b + 128, 64, 2, 32, 4, u);
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
 * 4 j + i of chunk c is row j's weight 4 c + i), of each code's bits at .. at + bits - 1: vector
 * p's four bytes of row j, a word of chunks w[c] (row j's weights 4 c .. 4 c + 3, a byte each), are
 * w[p] (bits 8), chunk p's nibbles and p + 4's above them (4), chunks 4 p + c in bits 2 c, 2 c + 1
 * (2), or chunk c in bit c (1). A byte's field is below bit 8 - at, so one shift of the word by at
 * and a mask a byte take every byte's field at once. */
QAINLINE void pk_plane(uint8_t u[QGROUP][PK_UNIT_WEIGHTS], int64_t o, int bits, int at, uint8_t *out) {
    const uint32_t mask = 0x01010101u * ((1u << bits) - 1);
    const int per = 8 / bits; /* chunks a byte */
    for (int j = 0; j < QGROUP; j++) {
        uint32_t w[8];
        memcpy(w, u[j] + o, 32);
        for (int p = 0; p < bits; p++) {
            uint32_t v = 0;
            if (bits == 8)
                v = w[p];
            else if (bits == 4)
                v = ((w[p] >> at) & mask) | (((w[p + 4] >> at) & mask) << 4);
            else
                for (int c = 0; c < per; c++) v |= ((w[per * p + c] >> at) & mask) << (bits * c);
            memcpy(out + 32 * p + 4 * j, &v, 4);
        }
    }
}

/* One unit of a group: rows[j] row j's first stored block of the unit, n of its stored blocks
 * there (fewer in a row's last unit: a legacy pair's odd block, MXFP4's last one to three).
 * Inlined for each format (pk_unit_of), so that its loops and copies have constant sizes. */
QAINLINE void pk_unit(const pk_format *f, const uint8_t *const rows[QGROUP], int64_t n, uint8_t *out) {
    uint8_t u[QGROUP][PK_UNIT_WEIGHTS], s[QGROUP][PK_SCALE_BYTES];
    const int64_t blocks = pk_unit_blocks(f), planes = pk_plane_bytes(f), w = f->sub * QK;
    uint8_t *quants = out + blocks * f->scale_bytes;
    if (n < blocks) { /* the last unit's missing blocks */
        memset(out + n * f->scale_bytes, 0, (blocks - n) * f->scale_bytes);
        memset(quants + n * f->sub * planes, 0, (blocks - n) * f->sub * planes);
    }
    for (int64_t b = 0; b < n; b++) {
        for (int j = 0; j < QGROUP; j++) {
            memset(u[j] + b * w, 0, w);
            pk_decode(f->fmt, rows[j] + b * f->block_bytes, u[j] + b * w, s[j]);
        }
        uint8_t *o = out + b * f->scale_bytes;
        for (int i = 0; i < f->n16; i++, o += 2 * QGROUP)
            for (int j = 0; j < QGROUP; j++) memcpy(o + 2 * j, s[j] + 2 * i, 2);
        for (int e = 0; e < f->n8; e++, o += QGROUP)
            for (int j = 0; j < QGROUP; j++) o[j] = s[j][2 * f->n16 + e];
        if (f->sub > 1) memset(o, 0, out + (b + 1) * f->scale_bytes - o); /* a super-block's scales padded */
    }
    for (int64_t k = 0; k < n * f->sub; k++) {
        pk_plane(u, k * QK, f->bits0, f->at0, quants + k * planes);
        if (f->bits1) pk_plane(u, k * QK, f->bits1, f->at1, quants + k * planes + 32 * f->bits0);
    }
}

#define PK_UNIT_CASE(i) \
    case i: pk_unit(&PK_FORMATS[i], rows, n, out); break;

static void pk_unit_of(const pk_format *f, const uint8_t *const rows[QGROUP], int64_t n, uint8_t *out) {
    switch (f - PK_FORMATS) { /* one copy of pk_unit a format, its descriptor a constant */
    PK_UNIT_CASE(0) PK_UNIT_CASE(1) PK_UNIT_CASE(2) PK_UNIT_CASE(3) PK_UNIT_CASE(4) PK_UNIT_CASE(5)
    PK_UNIT_CASE(6) PK_UNIT_CASE(7) PK_UNIT_CASE(8) PK_UNIT_CASE(9) PK_UNIT_CASE(10) PK_UNIT_CASE(11)
    PK_UNIT_CASE(12)
    }
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
 * aligned for the kernels: kernels/arena.py's memory, in huge pages). The input is n_src parts stacked by row, part p src_rows[p] rows of
 * stored blocks at src[p], a row every src_stride[p] bytes; output row r is the stack's row
 * order[r] (r itself where order is NULL). A float format's rows are copied as they are. 0, or
 * -1 for a format fd_pack_bytes refuses, -2 for an order entry outside the stack, -3 out of memory. */
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
            for (int j = 0; j < QGROUP; j++) {
                unit_rows[j] = pad[j] ? zero : rows_at[j] + t * step;
                for (int64_t c = 0; c < step && t + PK_AHEAD < units && !pad[j]; c += 64)
                    __builtin_prefetch(unit_rows[j] + PK_AHEAD * step + c); /* eight rows' streams: Q4_K 1.3 -> 1.9 GB/s */
            }
            const int64_t first = t * pk_unit_blocks(f), left = nblocks - first;
            pk_unit_of(f, unit_rows, left < pk_unit_blocks(f) ? left : pk_unit_blocks(f), dst + (g * units + t) * unit_bytes);
        }
    }
    free((void *)zero);
    return 0;
}
