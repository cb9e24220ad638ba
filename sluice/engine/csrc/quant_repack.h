/* Every block format's weights (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) repacked at load for int8
 * activations (llama.cpp's interleaved layouts, Q4_0x8 / Q8_0x4 / Q4_Kx8, in our own form): QR_ROWS weight rows a group, each block's values stored lane by
 * lane, so that one load holds 4 values of every row of the group (a lane of 4 int8 products a row), each row of
 * x's 4 values broadcast to all of them, and the group's scales side by side (converted by one VCVTPH2PS).
 *
 * A group (QR_ROWS rows of k values, blocks = k / 32; the rows past n zero) takes, for Q4_0 / Q4_1 / Q5_0 /
 * Q5_1 / Q8_0, the bytes its rows take in the file, as:
 *   scales [blocks][QR_ROWS] float16, then (Q4_1, Q5_1) mins [blocks][QR_ROWS] float16, then
 *   values [blocks][chunks][QR_ROWS][4] bytes, a chunk 4 stored bytes of each row: Q4's 4 bytes of nibbles
 *   (the low nibbles values 4c..4c+3, the high ones 16+4c..), Q8_0's values 4c..4c+3 (8 chunks a block); Q5's
 *   nibbles as Q4's, then their fifth bits as Q5_K's (below).
 * Q4_K (super-blocks of 256 values: d, dmin, 8 sub-blocks' 6-bit scales and mins, 4-bit q; w = d sc q - dmin m)
 * takes 148 bytes a super-block a row for the file's 144 (its 6-bit scales and mins as bytes):
 *   d [supers][QR_ROWS] float16, dmin [supers][QR_ROWS] float16, sc [blocks][QR_ROWS] and m [blocks][QR_ROWS]
 *   bytes, then values as Q4_0's (a sub-block's 32 nibbles re-paired: value l with value 16 + l). Q5_K the same,
 *   180 bytes for 176, each block's fifth bits after its nibbles [QR_ROWS][4]: byte t's bits 2c and 2c + 1 those
 *   of values 4c + t and 16 + 4c + t.
 * Q6_K (w = d sc (q - 32), q of 6 bits, an int8 scale sc per 16 values) takes the file's 210:
 *   d [supers][QR_ROWS] float16, sc [blocks][2][QR_ROWS] int8 (a block's halves), then per block its low 4 bits
 *   as Q4_0's nibbles [4 chunks][QR_ROWS][4], then its high 2 bits [2][QR_ROWS][4]: byte t of vector v holds
 *   those of values 4v + t, 16 + 4v + t, 8 + 4v + t and 24 + 4v + t (bits 0-1, 2-3, 4-5, 6-7), so chunk c's
 *   high bits are vector c & 1's, 4 (c >> 1) bits up. Its halves' dots are summed apart, each from minus 32
 *   times its half's sum of x (qm_x8_t's hneg).
 *
 * The tile (QR_VL rows of a group, the vector's lanes, by up to QR_R rows of x): per block, each chunk decoded
 * once and multiplied by every row of x's broadcast 4 values, int8 pairs summed exactly in int32 per lane
 * (VPDPBUSD; VPMADDUBSW + VPMADDWD without it, a Q4 block's pairs summed in int16 first: 8 of |15 * 127 * 2|
 * fit), the offset taken off through the block's sum of x (-off * sum, in the int32 start), then scaled in
 * float32 by the row's scale times the block's d, and Q4_1's min added as min * d * sum (Q4_K's scale d sc and
 * min dmin m formed in float32 from the bytes, exactly: the float path's values). Included by quant_int8.h after
 * its shims.
 */
#ifndef SLUICE_QUANT_REPACK_H
#define SLUICE_QUANT_REPACK_H

/* QR_AHEAD: bytes ahead of a block that the tile prefetches into L2 (into a thread's next groups, which follow
 * in memory): a decode step streams its weights from memory, and the hardware's prefetch alone keeps too few
 * lines in flight */
enum { QR_ROWS = 16, QR_PACKED = 0x100, QR_AHEAD = 16384 };

/* a part's type for its weight repacked (quant_part_t's w then a repacked copy, its row_bytes the file's) */
static inline int qr_packed(int type) { return type & QR_PACKED; }
static inline int qr_block_bytes(int type) {
    return type == Q4_0 ? 18 : type == Q4_1 ? 20 : type == Q5_0 ? 22 : type == Q5_1 ? 24 : 34;
}
/* Q5_0 / Q5_1 / Q5_K: a fifth bit a value, after the block's nibbles */
#define QR_FIVE(T) (T == Q5_0 || T == Q5_1 || T == Q5_K)
/* a repacked row's bytes (row_bytes: the file's) */
static inline long qr_row_bytes(int type, int k, long row_bytes) {
    return type == Q4_K ? (long)k / 256 * 148 : type == Q5_K ? (long)k / 256 * 180 : row_bytes;
}

/* A block's 32 unsigned values q (`bits` wide: 4, 5 or 6) as row i of its group's repacked chunks at vb (zeroed
 * first): the low 4 bits as Q4_0's nibble chunks [4][QR_ROWS][4] (value 4c + t low, 16 + 4c + t high), the bits
 * above them as Q5's fifth-bit vector [QR_ROWS][4] (byte t's bits 2c, 2c + 1) or Q6_K's two 2-bit vectors
 * [2][QR_ROWS][4] (vector c & 1, byte t's bits 4 (c >> 1) up) */
static inline void qr_put_block(uint8_t *vb, int i, const uint8_t *q, int bits) {
    for (int c = 0; c < 4; c++)
        for (int t = 0; t < 4; t++) {
            const int lo = q[4 * c + t], hi = q[16 + 4 * c + t];
            vb[((size_t)c * QR_ROWS + i) * 4 + t] = (uint8_t)((lo & 0xF) | (hi & 0xF) << 4);
            if (bits == 5) vb[((size_t)4 * QR_ROWS + i) * 4 + t] |= (uint8_t)(((lo >> 4) | (hi >> 4) << 1) << (2 * c));
            if (bits == 6)
                vb[((size_t)(4 + (c & 1)) * QR_ROWS + i) * 4 + t] |= (uint8_t)(((lo >> 4) | (hi >> 4) << 2) << (4 * (c >> 1)));
        }
}

/* Q4_K or Q5_K rows [n][row_bytes] (k values a row) as groups of QR_ROWS (see above) into out, `packed` bytes a
 * row */
static inline void qr_repack_k(const uint8_t *w, int type, int n, int k, long row_bytes, long packed, uint8_t *out) {
    const int supers = k / 256, blocks = k / 32, five = type == Q5_K, bytes_a_super = five ? 176 : 144;
    for (int j = 0; j < n; j++) {
        const int i = j % QR_ROWS;
        uint8_t *g = out + (size_t)(j / QR_ROWS) * QR_ROWS * packed;
        uint8_t *sc = g + (size_t)supers * QR_ROWS * 4, *mins = sc + (size_t)blocks * QR_ROWS;
        uint8_t *values = mins + (size_t)blocks * QR_ROWS;
        for (int s = 0; s < supers; s++) {
            const uint8_t *sb = w + (size_t)j * row_bytes + (size_t)s * bytes_a_super;
            memcpy(g + ((size_t)s * QR_ROWS + i) * 2, sb, 2);
            memcpy(g + ((size_t)(supers + s) * QR_ROWS + i) * 2, sb + 2, 2);
            for (int sub = 0; sub < 8; sub++) {
                const int b = 8 * s + sub;
                int scale, min;
                k4_scale_min(sub, sb + 4, &scale, &min);
                sc[(size_t)b * QR_ROWS + i] = (uint8_t)scale, mins[(size_t)b * QR_ROWS + i] = (uint8_t)min;
                const uint8_t *qs = sb + (five ? 48 : 16) + 32 * (sub >> 1), *qh = sb + 16;
                uint8_t q[32];
                for (int l = 0; l < 32; l++)
                    q[l] = (uint8_t)(((qs[l] >> (4 * (sub & 1))) & 0xF) | (five ? ((qh[l] >> sub) & 1) << 4 : 0));
                qr_put_block(values + (size_t)b * (4 + five) * QR_ROWS * 4, i, q, five ? 5 : 4);
            }
        }
    }
}

/* Q6_K rows [n][row_bytes] (k values a row) as groups of QR_ROWS (see above) into out, `packed` bytes a row */
static inline void qr_repack_q6_k(const uint8_t *w, int n, int k, long row_bytes, long packed, uint8_t *out) {
    const int supers = k / 256, blocks = k / 32;
    for (int j = 0; j < n; j++) {
        const int i = j % QR_ROWS;
        uint8_t *g = out + (size_t)(j / QR_ROWS) * QR_ROWS * packed;
        uint8_t *sc = g + (size_t)supers * QR_ROWS * 2, *values = sc + (size_t)blocks * 2 * QR_ROWS;
        for (int s = 0; s < supers; s++) {
            const uint8_t *sb = w + (size_t)j * row_bytes + (size_t)s * 210;
            memcpy(g + ((size_t)s * QR_ROWS + i) * 2, sb + 208, 2);
            for (int u = 0; u < 8; u++) { /* (unit u = 4 h + t: values 128 h + 32 t + l, as qm_raw_Q6_K reads) */
                const int b = 8 * s + u, h = u >> 2, t = u & 3;
                uint8_t q[32];
                for (int l = 0; l < 32; l++)
                    q[l] = (uint8_t)(((sb[64 * h + 32 * (t & 1) + l] >> (4 * (t >> 1))) & 0xF) |
                                     (((sb[128 + 32 * h + l] >> (2 * t)) & 3) << 4));
                sc[((size_t)b * 2 + 0) * QR_ROWS + i] = sb[192 + 2 * u];
                sc[((size_t)b * 2 + 1) * QR_ROWS + i] = sb[192 + 2 * u + 1];
                qr_put_block(values + (size_t)b * 6 * QR_ROWS * 4, i, q, 6);
            }
        }
    }
}

/* w [n][row_bytes] (type's blocks, k values a row) as ceil(n / QR_ROWS) groups into out (qr_row_bytes a row,
 * the last group's missing rows zero). */
static inline void qr_repack(const uint8_t *w, int type, int n, int k, long row_bytes, uint8_t *out) {
    const int blocks = k / 32, bb = qr_block_bytes(type), chunks = type == Q8_0 ? 8 : 4, five = QR_FIVE(type);
    const int head = type == Q4_1 || type == Q5_1 ? 4 : 2, mins = head == 4;
    const long groups = (n + QR_ROWS - 1) / QR_ROWS;
    memset(out, 0, (size_t)groups * QR_ROWS * qr_row_bytes(type, k, row_bytes));
    if (type == Q6_K) {
        qr_repack_q6_k(w, n, k, row_bytes, qr_row_bytes(type, k, row_bytes), out);
        return;
    }
    if (type == Q4_K || type == Q5_K) {
        qr_repack_k(w, type, n, k, row_bytes, qr_row_bytes(type, k, row_bytes), out);
        return;
    }
    for (int j = 0; j < n; j++) {
        const int i = j % QR_ROWS;
        uint8_t *g = out + (size_t)(j / QR_ROWS) * QR_ROWS * row_bytes;
        uint8_t *values = g + (size_t)blocks * QR_ROWS * head;
        for (int b = 0; b < blocks; b++) {
            const uint8_t *blk = w + (size_t)j * row_bytes + (size_t)b * bb;
            uint8_t *vb = values + (size_t)b * (chunks + five) * QR_ROWS * 4;
            memcpy(g + ((size_t)b * QR_ROWS + i) * 2, blk, 2);
            if (mins) memcpy(g + ((size_t)(blocks + b) * QR_ROWS + i) * 2, blk + 2, 2);
            if (five) { /* (nibbles after the 32 fifth bits: bit l is value l's) */
                uint32_t bits;
                memcpy(&bits, blk + head, 4);
                const uint8_t *qs = blk + head + 4;
                uint8_t q[32];
                for (int l = 0; l < 32; l++) q[l] = (uint8_t)(((qs[l % 16] >> (4 * (l / 16))) & 0xF) | ((bits >> l & 1) << 4));
                qr_put_block(vb, i, q, 5);
            } else {
                for (int c = 0; c < chunks; c++) memcpy(vb + ((size_t)c * QR_ROWS + i) * 4, blk + head + 4 * c, 4);
            }
        }
    }
}

/* The inverse of qr_put_block: row i's 32 values q of the block at vb (`bits` wide) */
static inline void qr_get_block(const uint8_t *vb, int i, uint8_t *q, int bits) {
    for (int c = 0; c < 4; c++)
        for (int t = 0; t < 4; t++) {
            const int v = vb[((size_t)c * QR_ROWS + i) * 4 + t];
            int lo = v & 0xF, hi = v >> 4;
            if (bits == 5) {
                const int h = vb[((size_t)4 * QR_ROWS + i) * 4 + t] >> (2 * c);
                lo |= (h & 1) << 4, hi |= (h >> 1 & 1) << 4;
            }
            if (bits == 6) {
                const int h = vb[((size_t)(4 + (c & 1)) * QR_ROWS + i) * 4 + t] >> (4 * (c >> 1));
                lo |= (h & 3) << 4, hi |= (h >> 2 & 3) << 4;
            }
            q[4 * c + t] = (uint8_t)lo, q[16 + 4 * c + t] = (uint8_t)hi;
        }
}

/* The inverse of qr_repack: the file's rows w [n][row_bytes] (row_bytes: the type's own, whole blocks) of the
 * groups at packed (qr_row_bytes a row). A weight kept only repacked gives its bytes back this way, exactly
 * (every bit of a row is in its repacked form; Q4_K's 6-bit scales and mins encoded back into their 12 bytes). */
static inline void qr_unpack(const uint8_t *packed, int type, int n, int k, long row_bytes, uint8_t *w) {
    const int blocks = k / 32, supers = k / 256, five = QR_FIVE(type);
    const long pr = qr_row_bytes(type, k, row_bytes);
    memset(w, 0, (size_t)n * row_bytes);
    for (int j = 0; j < n; j++) {
        const int i = j % QR_ROWS;
        const uint8_t *g = packed + (size_t)(j / QR_ROWS) * QR_ROWS * pr;
        uint8_t *row = w + (size_t)j * row_bytes, q[32];
        if (type == Q6_K) {
            const uint8_t *sc = g + (size_t)supers * QR_ROWS * 2, *values = sc + (size_t)blocks * 2 * QR_ROWS;
            for (int s = 0; s < supers; s++) {
                uint8_t *sb = row + (size_t)s * 210;
                memcpy(sb + 208, g + ((size_t)s * QR_ROWS + i) * 2, 2);
                for (int u = 0; u < 8; u++) {
                    const int b = 8 * s + u, h = u >> 2, t = u & 3;
                    sb[192 + 2 * u] = sc[((size_t)b * 2 + 0) * QR_ROWS + i];
                    sb[192 + 2 * u + 1] = sc[((size_t)b * 2 + 1) * QR_ROWS + i];
                    qr_get_block(values + (size_t)b * 6 * QR_ROWS * 4, i, q, 6);
                    for (int l = 0; l < 32; l++) {
                        sb[64 * h + 32 * (t & 1) + l] |= (uint8_t)((q[l] & 0xF) << (4 * (t >> 1)));
                        sb[128 + 32 * h + l] |= (uint8_t)((q[l] >> 4) << (2 * t));
                    }
                }
            }
        } else if (type == Q4_K || type == Q5_K) {
            const int bytes_a_super = five ? 176 : 144;
            const uint8_t *sc = g + (size_t)supers * QR_ROWS * 4, *mins = sc + (size_t)blocks * QR_ROWS;
            const uint8_t *values = mins + (size_t)blocks * QR_ROWS;
            for (int s = 0; s < supers; s++) {
                uint8_t *sb = row + (size_t)s * bytes_a_super, *scales = sb + 4;
                memcpy(sb, g + ((size_t)s * QR_ROWS + i) * 2, 2);
                memcpy(sb + 2, g + ((size_t)(supers + s) * QR_ROWS + i) * 2, 2);
                for (int sub = 0; sub < 8; sub++) { /* (k4_scale_min's encoding) */
                    const int b = 8 * s + sub, a = sc[(size_t)b * QR_ROWS + i], m = mins[(size_t)b * QR_ROWS + i];
                    if (sub < 4) {
                        scales[sub] |= (uint8_t)a, scales[sub + 4] |= (uint8_t)m;
                    } else {
                        scales[sub - 4] |= (uint8_t)((a >> 4) << 6), scales[sub] |= (uint8_t)((m >> 4) << 6);
                        scales[sub + 4] = (uint8_t)((a & 0xF) | (m & 0xF) << 4);
                    }
                    qr_get_block(values + (size_t)b * (4 + five) * QR_ROWS * 4, i, q, five ? 5 : 4);
                    uint8_t *qs = sb + (five ? 48 : 16) + 32 * (sub >> 1), *qh = sb + 16;
                    for (int l = 0; l < 32; l++) {
                        qs[l] |= (uint8_t)((q[l] & 0xF) << (4 * (sub & 1)));
                        if (five) qh[l] |= (uint8_t)((q[l] >> 4) << sub);
                    }
                }
            }
        } else {
            const int bb = qr_block_bytes(type), chunks = type == Q8_0 ? 8 : 4;
            const int head = type == Q4_1 || type == Q5_1 ? 4 : 2;
            const uint8_t *values = g + (size_t)blocks * QR_ROWS * head;
            for (int b = 0; b < blocks; b++) {
                uint8_t *blk = row + (size_t)b * bb;
                const uint8_t *vb = values + (size_t)b * (chunks + five) * QR_ROWS * 4;
                memcpy(blk, g + ((size_t)b * QR_ROWS + i) * 2, 2);
                if (head == 4) memcpy(blk + 2, g + ((size_t)(blocks + b) * QR_ROWS + i) * 2, 2);
                if (five) {
                    uint32_t bits = 0;
                    qr_get_block(vb, i, q, 5);
                    for (int l = 0; l < 32; l++) {
                        blk[head + 4 + l % 16] |= (uint8_t)((q[l] & 0xF) << (4 * (l / 16)));
                        bits |= (uint32_t)(q[l] >> 4) << l;
                    }
                    memcpy(blk + head, &bits, 4);
                } else {
                    for (int c = 0; c < chunks; c++) memcpy(blk + head + 4 * c, vb + ((size_t)c * QR_ROWS + i) * 4, 4);
                }
            }
        }
    }
}

#if defined(__AVX512BW__)
enum { QR_VL = 16, QR_R = 8 };
static inline qi_t qr_bcast(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}
static inline qi_t qr_set1(int v) { return _mm512_set1_epi32(v); }
static inline qi_t qr_lo(qi_t v) { return _mm512_and_si512(v, _mm512_set1_epi8(0x0F)); }
static inline qi_t qr_hi(qi_t v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F)); }
static inline qf_t qr_halves(const uint16_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
static inline qf_t qr_bytes(const uint8_t *p) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p))); }
static inline qf_t qr_sbytes(const uint8_t *p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p))); }
static inline qi_t qr_and(qi_t v, int mask) { return _mm512_and_si512(v, _mm512_set1_epi8((char)mask)); }
static inline qi_t qr_or(qi_t a, qi_t b) { return _mm512_or_si512(a, b); }
static inline qi_t qr_shl(qi_t v, int by) { return _mm512_slli_epi16(v, by); }
static inline qi_t qr_shr(qi_t v, int by) { return _mm512_srli_epi16(v, by); }
static inline qf_t qr_setf(float v) { return _mm512_set1_ps(v); }
static inline qf_t qr_mul(qf_t a, qf_t b) { return _mm512_mul_ps(a, b); }
static inline qf_t qr_cvt(qi_t v) { return _mm512_cvtepi32_ps(v); }
static inline void qr_store(float *p, qf_t v) { _mm512_storeu_ps(p, v); }
static inline qi_t qr_add16(qi_t a, qi_t b) { return _mm512_add_epi16(a, b); }
static inline qi_t qr_add32(qi_t a, qi_t b) { return _mm512_add_epi32(a, b); }
static inline qi_t qr_maddubs(qi_t w, qi_t x) { return _mm512_maddubs_epi16(w, x); }
static inline qi_t qr_pairs(qi_t v) { return _mm512_madd_epi16(v, _mm512_set1_epi16(1)); }
/* signed w (Q8_0 without VPDPBUSD): |w| once a chunk, x with w's sign a row (as qi_dot_s) */
static inline qi_t qr_abs(qi_t w) { return _mm512_abs_epi8(w); }
static inline qi_t qr_dot_signed(qi_t aw, qi_t w, qi_t x) {
    const qi_t sx = _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(w), _mm512_setzero_si512(), x);
    return qr_pairs(_mm512_maddubs_epi16(aw, sx));
}
#else
#pragma GCC push_options
#pragma GCC target("f16c") /* (every CPU with AVX2 has it; engine/cpu/quant.py checks) */
enum { QR_VL = 8, QR_R = 4 };
static inline qi_t qr_bcast(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}
static inline qi_t qr_set1(int v) { return _mm256_set1_epi32(v); }
static inline qi_t qr_lo(qi_t v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0F)); }
static inline qi_t qr_hi(qi_t v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F)); }
static inline qf_t qr_halves(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
static inline qf_t qr_bytes(const uint8_t *p) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p))); }
static inline qf_t qr_sbytes(const uint8_t *p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p))); }
static inline qi_t qr_and(qi_t v, int mask) { return _mm256_and_si256(v, _mm256_set1_epi8((char)mask)); }
static inline qi_t qr_or(qi_t a, qi_t b) { return _mm256_or_si256(a, b); }
static inline qi_t qr_shl(qi_t v, int by) { return _mm256_slli_epi16(v, by); }
static inline qi_t qr_shr(qi_t v, int by) { return _mm256_srli_epi16(v, by); }
static inline qf_t qr_setf(float v) { return _mm256_set1_ps(v); }
static inline qf_t qr_mul(qf_t a, qf_t b) { return _mm256_mul_ps(a, b); }
static inline qf_t qr_cvt(qi_t v) { return _mm256_cvtepi32_ps(v); }
static inline void qr_store(float *p, qf_t v) { _mm256_storeu_ps(p, v); }
static inline qi_t qr_add16(qi_t a, qi_t b) { return _mm256_add_epi16(a, b); }
static inline qi_t qr_add32(qi_t a, qi_t b) { return _mm256_add_epi32(a, b); }
static inline qi_t qr_maddubs(qi_t w, qi_t x) { return _mm256_maddubs_epi16(w, x); }
static inline qi_t qr_pairs(qi_t v) { return _mm256_madd_epi16(v, _mm256_set1_epi16(1)); }
static inline qi_t qr_abs(qi_t w) { return _mm256_abs_epi8(w); }
static inline qi_t qr_dot_signed(qi_t aw, qi_t w, qi_t x) {
    return qr_pairs(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(x, w)));
}
#endif

/* one weight chunk w (values 4cc..4cc+3 of the lanes' rows) times every row of x: Q4 (V = 0) into int16 pairs
 * s16, Q5's (V = 0; 8 of |31 * 127 * 2| would not fit) and Q8_0's without VPDPBUSD into dot, else VPDPBUSD
 * into dot */
#define QR_DOT(V, T, R, DOT, w, cc)                                                                             \
    do {                                                                                                       \
        const qi_t aw_ = QI_SIGNED(T, V) ? qr_abs(w) : (w);                                                    \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                                  \
            const qi_t xb = qr_bcast(xq[r] + 32 * b + 4 * (cc));                                               \
            if (V) dot[r] = DOT(dot[r], w, xb);                                                                \
            else if (QI_SIGNED(T, V)) dot[r] = qr_add32(dot[r], qr_dot_signed(aw_, w, xb));                    \
            else if (QR_FIVE(T)) dot[r] = qr_add32(dot[r], qr_pairs(qr_maddubs(w, xb)));                      \
            else s16[r] = qr_add16(s16[r], qr_maddubs(w, xb));                                                 \
        }                                                                                                      \
    } while (0)

/* Q4_K and Q5_K (super-blocks: each block's scale and min of bytes, d and dmin a super-block's) */
#define QR_K(T) (T == Q4_K || T == Q5_K)
/* v shifted left by `by` bits (right where negative), 16-bit lanes */
#define QR_SHIFT(v, by) ((by) > 0 ? qr_shl(v, (by)) : (by) < 0 ? qr_shr(v, -(by)) : (v))

/* a tile's start: lb (x8's blocks a row), xq[r] (row r0 + r of x's int8 values) and acc[r] (its sums, zero) */
#define QR_ROWS_OF_X(R)                                                                                        \
    const long lb = x8->ld / 32;                                                                               \
    const int8_t *xq[R];                                                                                       \
    qf_t acc[R];                                                                                               \
    _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                                      \
        xq[r] = x8->q + (size_t)(r0 + r) * x8->ld;                                                             \
        acc[r] = qf_zero();                                                                                    \
    }

/* sums[r][i] = row half * QR_VL + i of the group . row r0 + r of x8, over `blocks` blocks, for R rows of x */
#define QR_TILE(NAME, V, DOT, T, R)                                                                            \
    static void NAME##_##T##_##R(const uint8_t *group, int blocks, int half, const qm_x8_t *x8, int r0,        \
                                 float *sums) {                                                                \
        const int chunks = T == Q8_0 ? 8 : 4, supers = QR_K(T) ? blocks / 8 : 0;                               \
        const uint16_t *scales = (const uint16_t *)group + half * QR_VL;                                       \
        const uint16_t *mins = scales + (size_t)(QR_K(T) ? supers : blocks) * QR_ROWS;                         \
        const uint8_t *ksc = group + (size_t)supers * QR_ROWS * 4 + half * QR_VL;                              \
        const uint8_t *kmin = ksc + (size_t)blocks * QR_ROWS;                                                  \
        const uint8_t *values = group + half * QR_VL * 4 + (QR_K(T) ? (size_t)supers * QR_ROWS * 4             \
            + (size_t)blocks * QR_ROWS * 2 : (size_t)blocks * QR_ROWS * (T == Q4_1 || T == Q5_1 ? 4 : 2));     \
        QR_ROWS_OF_X(R)                                                                                        \
        for (int b = 0; b < blocks; b++) {                                                                     \
            qi_t dot[R], s16[R];                                                                               \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                              \
                const int32_t neg = x8->bneg[(size_t)(r0 + r) * lb + b];                                       \
                dot[r] = QI_OFF(T, V) ? qr_set1(neg * QI_OFF(T, V)) : qi_zero();                               \
                s16[r] = qi_zero();                                                                            \
            }                                                                                                  \
            const uint8_t *vb = values + (size_t)b * (chunks + QR_FIVE(T)) * QR_ROWS * 4;                      \
            _Pragma("GCC unroll 8") for (int c = 0; c < chunks + QR_FIVE(T); c++)                              \
                _mm_prefetch((const char *)(vb + QR_AHEAD + c * QR_ROWS * 4), _MM_HINT_T1);                    \
            const qi_t fifth = QR_FIVE(T) ? qi_load(vb + 4 * QR_ROWS * 4) : qi_zero();                         \
            _Pragma("GCC unroll 8") for (int c = 0; c < chunks; c++) {                                         \
                const qi_t raw = qi_load(vb + c * QR_ROWS * 4);                                                \
                if (T == Q8_0) {                                                                               \
                    const qi_t w = (V) ? qi_xor80(raw) : raw;                                                  \
                    QR_DOT(V, T, R, DOT, w, c);                                                                \
                } else if (QR_FIVE(T)) { /* (bits 2c and 2c + 1 of fifth to bit 4) */                          \
                    const qi_t lo = qr_or(qr_lo(raw), qr_and(QR_SHIFT(fifth, 4 - 2 * c), 0x10));               \
                    const qi_t hi = qr_or(qr_hi(raw), qr_and(QR_SHIFT(fifth, 3 - 2 * c), 0x10));               \
                    QR_DOT(V, T, R, DOT, lo, c);                                                                \
                    QR_DOT(V, T, R, DOT, hi, c + 4);                                                            \
                } else {                                                                                       \
                    const qi_t lo = qr_lo(raw), hi = qr_hi(raw);                                               \
                    QR_DOT(V, T, R, DOT, lo, c);                                                                \
                    QR_DOT(V, T, R, DOT, hi, c + 4);                                                            \
                }                                                                                              \
            }                                                                                                  \
            const qf_t ws = QR_K(T) ? qr_mul(qr_bytes(ksc + (size_t)b * QR_ROWS),                            \
                                               qr_halves(scales + (size_t)(b >> 3) * QR_ROWS))                 \
                                      : qr_halves(scales + (size_t)b * QR_ROWS);                               \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                              \
                if (!(V) && T != Q8_0 && !QR_FIVE(T)) dot[r] = qr_add32(dot[r], qr_pairs(s16[r]));             \
                const qf_t d = qr_setf(x8->bd[(size_t)(r0 + r) * lb + b]);                                     \
                acc[r] = qf_fmadd(qr_cvt(dot[r]), qr_mul(ws, d), acc[r]);                                      \
            }                                                                                                  \
            if (T == Q4_1 || T == Q5_1) {                                                                      \
                const qf_t wm = qr_halves(mins + (size_t)b * QR_ROWS);                                         \
                _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                                            \
                    acc[r] = qf_fmadd(wm, qr_setf(x8->bsum[(size_t)(r0 + r) * lb + b]), acc[r]);               \
            }                                                                                                  \
            if (QR_K(T)) { /* (w = d sc q - dmin m: the min taken off) */                                      \
                const qf_t wm = qr_mul(qr_bytes(kmin + (size_t)b * QR_ROWS),                                   \
                                       qr_halves(mins + (size_t)(b >> 3) * QR_ROWS));                          \
                _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                                            \
                    acc[r] = qf_fnmadd(wm, qr_setf(x8->bsum[(size_t)(r0 + r) * lb + b]), acc[r]);              \
            }                                                                                                  \
        }                                                                                                      \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) qr_store(sums + r * QR_VL, acc[r]);                \
    }
/* Q6_K's tile (see above): q of 6 bits (<= 63: VPMADDUBSW's pairs fit in int16, each chunk's summed on in
 * int32), each block's two halves summed apart from -32 times their sums of x and scaled by their own scales */
#define QR_DOT6(V, R, DOT, w, acc, half_at)                                                                     \
    _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                                      \
        const qi_t xb = qr_bcast(xq[r] + 32 * b + (half_at));                                                  \
        acc[r] = (V) ? DOT(acc[r], w, xb) : qr_add32(acc[r], qr_pairs(qr_maddubs(w, xb)));                     \
    }
#define QR_TILE6(NAME, V, DOT, R)                                                                              \
    static void NAME##_Q6_K_##R(const uint8_t *group, int blocks, int half, const qm_x8_t *x8, int r0,         \
                                float *sums) {                                                                 \
        const int supers = blocks / 8;                                                                         \
        const uint16_t *scales = (const uint16_t *)group + half * QR_VL;                                       \
        const uint8_t *sc = group + (size_t)supers * QR_ROWS * 2 + half * QR_VL;                               \
        const uint8_t *values = group + (size_t)supers * QR_ROWS * 2 + (size_t)blocks * QR_ROWS * 2 + half * QR_VL * 4; \
        QR_ROWS_OF_X(R)                                                                                        \
        for (int b = 0; b < blocks; b++) {                                                                     \
            qi_t lo[R], hi[R];                                                                                 \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                              \
                const int32_t *hneg = x8->hneg + (size_t)(r0 + r) * lb * 2 + 2 * b;                            \
                lo[r] = qr_set1(32 * hneg[0]), hi[r] = qr_set1(32 * hneg[1]);                                  \
            }                                                                                                  \
            const uint8_t *vb = values + (size_t)b * 6 * QR_ROWS * 4;                                          \
            _Pragma("GCC unroll 8") for (int c = 0; c < 6; c++)                                                \
                _mm_prefetch((const char *)(vb + QR_AHEAD + c * QR_ROWS * 4), _MM_HINT_T1);                    \
            const qi_t h01 = qi_load(vb + 4 * QR_ROWS * 4), h23 = qi_load(vb + 5 * QR_ROWS * 4);               \
            _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++) {                                              \
                const qi_t raw = qi_load(vb + c * QR_ROWS * 4), h = c & 1 ? h23 : h01;                         \
                const qi_t hl = c < 2 ? qr_shl(h, 4) : h, hh = c < 2 ? qr_shl(h, 2) : qr_shr(h, 2);            \
                const qi_t wl = qr_or(qr_lo(raw), qr_and(hl, 0x30)), wh = qr_or(qr_hi(raw), qr_and(hh, 0x30));  \
                QR_DOT6(V, R, DOT, wl, lo, 4 * c)                                                              \
                QR_DOT6(V, R, DOT, wh, hi, 16 + 4 * c)                                                         \
            }                                                                                                  \
            const qf_t d = qr_halves(scales + (size_t)(b >> 3) * QR_ROWS);                                     \
            const qf_t sl = qr_mul(qr_sbytes(sc + (size_t)b * 2 * QR_ROWS), d);                                \
            const qf_t sh = qr_mul(qr_sbytes(sc + (size_t)(b * 2 + 1) * QR_ROWS), d);                          \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                              \
                const qf_t dx = qr_setf(x8->bd[(size_t)(r0 + r) * lb + b]);                                    \
                acc[r] = qf_fmadd(qr_cvt(lo[r]), qr_mul(sl, dx), acc[r]);                                      \
                acc[r] = qf_fmadd(qr_cvt(hi[r]), qr_mul(sh, dx), acc[r]);                                      \
            }                                                                                                  \
        }                                                                                                      \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) qr_store(sums + r * QR_VL, acc[r]);                \
    }
typedef void (*qr_tile_fn)(const uint8_t *, int, int, const qm_x8_t *, int, float *);
#if defined(__AVX512BW__)
#define QR_TILES(NAME, V, DOT, T)                                                                              \
    QR_TILE(NAME, V, DOT, T, 1) QR_TILE(NAME, V, DOT, T, 2) QR_TILE(NAME, V, DOT, T, 3) QR_TILE(NAME, V, DOT, T, 4) \
    QR_TILE(NAME, V, DOT, T, 5) QR_TILE(NAME, V, DOT, T, 6) QR_TILE(NAME, V, DOT, T, 7) QR_TILE(NAME, V, DOT, T, 8)
#define QR_TILES6(NAME, V, DOT)                                                                                \
    QR_TILE6(NAME, V, DOT, 1) QR_TILE6(NAME, V, DOT, 2) QR_TILE6(NAME, V, DOT, 3) QR_TILE6(NAME, V, DOT, 4)         \
    QR_TILE6(NAME, V, DOT, 5) QR_TILE6(NAME, V, DOT, 6) QR_TILE6(NAME, V, DOT, 7) QR_TILE6(NAME, V, DOT, 8)
#define QR_BY_ROWS(NAME, T)                                                                                    \
    {0, NAME##_##T##_1, NAME##_##T##_2, NAME##_##T##_3, NAME##_##T##_4, NAME##_##T##_5, NAME##_##T##_6,          \
     NAME##_##T##_7, NAME##_##T##_8}
#else
#define QR_TILES(NAME, V, DOT, T)                                                                              \
    QR_TILE(NAME, V, DOT, T, 1) QR_TILE(NAME, V, DOT, T, 2) QR_TILE(NAME, V, DOT, T, 3) QR_TILE(NAME, V, DOT, T, 4)
#define QR_TILES6(NAME, V, DOT)                                                                                \
    QR_TILE6(NAME, V, DOT, 1) QR_TILE6(NAME, V, DOT, 2) QR_TILE6(NAME, V, DOT, 3) QR_TILE6(NAME, V, DOT, 4)
#define QR_BY_ROWS(NAME, T) {0, NAME##_##T##_1, NAME##_##T##_2, NAME##_##T##_3, NAME##_##T##_4}
#endif
#define QR_ALL(NAME, V, DOT)                                                                                   \
    QR_TILES(NAME, V, DOT, Q8_0) QR_TILES(NAME, V, DOT, Q4_0) QR_TILES(NAME, V, DOT, Q4_1)                     \
    QR_TILES(NAME, V, DOT, Q5_0) QR_TILES(NAME, V, DOT, Q5_1)                                                  \
    QR_TILES(NAME, V, DOT, Q4_K) QR_TILES(NAME, V, DOT, Q5_K) QR_TILES6(NAME, V, DOT)                          \
    QX_BY_TYPE(qr_tile_fn, QR_BY_ROWS, NAME) QC_ALL(NAME##_c, V, DOT)

#include "quant_channel.h"

/* The tiles of a type (Q8_C's: quant_channel.h's), chosen as quant_int8.h's qi_tiles are. */
#define QR_TYPE_TILES(NAME, type) ((type) == Q8_C ? NAME##_cs : NAME##s(type))
#if defined(__AVX512VNNI__)
QR_ALL(qr_vnni_tile, 1, qi_dot_vnni)
static const qr_tile_fn *qr_tiles(int type) { return QR_TYPE_TILES(qr_vnni_tile, type); }
#else
QR_ALL(qr_mtile, 0, qi_dot_pairs)
#if defined(__AVX512BW__)
#pragma GCC push_options
#pragma GCC target("avx512vnni")
QR_ALL(qr_vnni_tile, 1, qi_dot_vnni)
#pragma GCC pop_options
static const qr_tile_fn *qr_tiles(int type) {
    return __builtin_cpu_supports("avx512vnni") ? QR_TYPE_TILES(qr_vnni_tile, type) : QR_TYPE_TILES(qr_mtile, type);
}
#else
static const qr_tile_fn *qr_tiles(int type) { return QR_TYPE_TILES(qr_mtile, type); }
#endif
#endif

#if !defined(__AVX512BW__)
#pragma GCC pop_options
#endif

#endif
