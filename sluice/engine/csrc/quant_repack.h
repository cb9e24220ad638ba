/* Q4_0, Q4_1 and Q8_0 weights repacked at load for int8 activations (llama.cpp's interleaved layouts, Q4_0x8 /
 * Q8_0x4, in our own form): QR_ROWS weight rows a group, each block's values stored lane by lane, so that one
 * load holds 4 values of every row of the group (a lane of 4 int8 products a row), each row of x's 4 values
 * broadcast to all of them, and the group's scales side by side (converted by one VCVTPH2PS).
 *
 * A group (QR_ROWS rows of k values, blocks = k / 32; the rows past n zero) takes the bytes its rows take in the
 * file, as:
 *   scales [blocks][QR_ROWS] float16, then (Q4_1) mins [blocks][QR_ROWS] float16, then
 *   values [blocks][chunks][QR_ROWS][4] bytes, a chunk 4 stored bytes of each row: Q4's 4 bytes of nibbles
 *   (the low nibbles values 4c..4c+3, the high ones 16+4c..), Q8_0's values 4c..4c+3 (8 chunks a block).
 *
 * The tile (QR_VL rows of a group, the vector's lanes, by up to QR_R rows of x): per block, each chunk decoded
 * once and multiplied by every row of x's broadcast 4 values, int8 pairs summed exactly in int32 per lane
 * (VPDPBUSD; VPMADDUBSW + VPMADDWD without it, a Q4 block's pairs summed in int16 first: 8 of |15 * 127 * 2|
 * fit), the offset taken off through the block's sum of x (-off * sum, in the int32 start), then scaled in
 * float32 by the row's scale times the block's d, and Q4_1's min added as min * d * sum. Included by
 * quant_int8.h after its shims.
 */
#ifndef SLUICE_QUANT_REPACK_H
#define SLUICE_QUANT_REPACK_H

/* QR_AHEAD: bytes ahead of a block that the tile prefetches into L2 (into a thread's next groups, which follow
 * in memory): a decode step streams its weights from memory, and the hardware's prefetch alone keeps too few
 * lines in flight */
enum { QR_ROWS = 16, QR_PACKED = 0x100, QR_AHEAD = 16384 };

/* a part's type for its weight repacked (quant_part_t's w then a repacked copy, its row_bytes the file's) */
static inline int qr_packed(int type) { return type & QR_PACKED; }
static inline int qr_repackable(int type) { return type == Q4_0 || type == Q4_1 || type == Q8_0; }
static inline int qr_block_bytes(int type) { return type == Q4_0 ? 18 : type == Q4_1 ? 20 : 34; }

/* w [n][row_bytes] (type's blocks, k values a row) as ceil(n / QR_ROWS) groups into out (the same bytes a
 * row, the last group's missing rows zero). */
static inline void qr_repack(const uint8_t *w, int type, int n, int k, long row_bytes, uint8_t *out) {
    const int blocks = k / 32, bb = qr_block_bytes(type), chunks = type == Q8_0 ? 8 : 4;
    const int head = type == Q4_1 ? 4 : 2;
    const long groups = (n + QR_ROWS - 1) / QR_ROWS;
    memset(out, 0, (size_t)groups * QR_ROWS * row_bytes);
    for (int j = 0; j < n; j++) {
        const int i = j % QR_ROWS;
        uint8_t *g = out + (size_t)(j / QR_ROWS) * QR_ROWS * row_bytes;
        uint8_t *values = g + (size_t)blocks * QR_ROWS * head;
        for (int b = 0; b < blocks; b++) {
            const uint8_t *blk = w + (size_t)j * row_bytes + (size_t)b * bb;
            memcpy(g + ((size_t)b * QR_ROWS + i) * 2, blk, 2);
            if (type == Q4_1) memcpy(g + ((size_t)(blocks + b) * QR_ROWS + i) * 2, blk + 2, 2);
            for (int c = 0; c < chunks; c++)
                memcpy(values + (((size_t)b * chunks + c) * QR_ROWS + i) * 4, blk + head + 4 * c, 4);
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
 * s16, Q8_0 without VPDPBUSD signed into dot, else VPDPBUSD into dot */
#define QR_DOT(V, T, R, DOT, w, cc)                                                                             \
    do {                                                                                                       \
        const qi_t aw_ = QI_SIGNED(T, V) ? qr_abs(w) : (w);                                                    \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                                  \
            const qi_t xb = qr_bcast(xq[r] + 32 * b + 4 * (cc));                                               \
            if (V) dot[r] = DOT(dot[r], w, xb);                                                                \
            else if (QI_SIGNED(T, V)) dot[r] = qr_add32(dot[r], qr_dot_signed(aw_, w, xb));                    \
            else s16[r] = qr_add16(s16[r], qr_maddubs(w, xb));                                                 \
        }                                                                                                      \
    } while (0)

/* sums[r][i] = row half * QR_VL + i of the group . row r0 + r of x8, over `blocks` blocks, for R rows of x */
#define QR_TILE(NAME, V, DOT, T, R)                                                                            \
    static void NAME##_##T##_##R(const uint8_t *group, int blocks, int half, const qm_x8_t *x8, int r0,        \
                                 float *sums) {                                                                \
        const int chunks = T == Q8_0 ? 8 : 4;                                                                  \
        const uint16_t *scales = (const uint16_t *)group + half * QR_VL;                                       \
        const uint16_t *mins = scales + (size_t)blocks * QR_ROWS;                                              \
        const uint8_t *values = group + (size_t)blocks * QR_ROWS * (T == Q4_1 ? 4 : 2) + half * QR_VL * 4;     \
        const long lb = x8->ld / 32;                                                                           \
        const int8_t *xq[R];                                                                                   \
        qf_t acc[R];                                                                                           \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                                  \
            xq[r] = x8->q + (size_t)(r0 + r) * x8->ld;                                                         \
            acc[r] = qf_zero();                                                                                \
        }                                                                                                      \
        for (int b = 0; b < blocks; b++) {                                                                     \
            qi_t dot[R], s16[R];                                                                               \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                              \
                const int32_t neg = x8->bneg[(size_t)(r0 + r) * lb + b];                                       \
                dot[r] = QI_OFF(T, V) ? qr_set1(neg * QI_OFF(T, V)) : qi_zero();                               \
                s16[r] = qi_zero();                                                                            \
            }                                                                                                  \
            const uint8_t *vb = values + (size_t)b * chunks * QR_ROWS * 4;                                     \
            _Pragma("GCC unroll 8") for (int c = 0; c < chunks; c++)                                           \
                _mm_prefetch((const char *)(vb + QR_AHEAD + c * QR_ROWS * 4), _MM_HINT_T1);                    \
            _Pragma("GCC unroll 8") for (int c = 0; c < chunks; c++) {                                         \
                const qi_t raw = qi_load(vb + c * QR_ROWS * 4);                                                \
                if (T == Q8_0) {                                                                               \
                    const qi_t w = (V) ? qi_xor80(raw) : raw;                                                  \
                    QR_DOT(V, T, R, DOT, w, c);                                                                \
                } else {                                                                                       \
                    const qi_t lo = qr_lo(raw), hi = qr_hi(raw);                                               \
                    QR_DOT(V, T, R, DOT, lo, c);                                                                \
                    QR_DOT(V, T, R, DOT, hi, c + 4);                                                            \
                }                                                                                              \
            }                                                                                                  \
            const qf_t ws = qr_halves(scales + (size_t)b * QR_ROWS);                                           \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                              \
                if (!(V) && T != Q8_0) dot[r] = qr_add32(dot[r], qr_pairs(s16[r]));                            \
                const qf_t d = qr_setf(x8->bd[(size_t)(r0 + r) * lb + b]);                                     \
                acc[r] = qf_fmadd(qr_cvt(dot[r]), qr_mul(ws, d), acc[r]);                                      \
            }                                                                                                  \
            if (T == Q4_1) {                                                                                   \
                const qf_t wm = qr_halves(mins + (size_t)b * QR_ROWS);                                         \
                _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                                            \
                    acc[r] = qf_fmadd(wm, qr_setf(x8->bsum[(size_t)(r0 + r) * lb + b]), acc[r]);               \
            }                                                                                                  \
        }                                                                                                      \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) qr_store(sums + r * QR_VL, acc[r]);                \
    }
typedef void (*qr_tile_fn)(const uint8_t *, int, int, const qm_x8_t *, int, float *);
#if defined(__AVX512BW__)
#define QR_TILES(NAME, V, DOT, T)                                                                              \
    QR_TILE(NAME, V, DOT, T, 1) QR_TILE(NAME, V, DOT, T, 2) QR_TILE(NAME, V, DOT, T, 3) QR_TILE(NAME, V, DOT, T, 4) \
    QR_TILE(NAME, V, DOT, T, 5) QR_TILE(NAME, V, DOT, T, 6) QR_TILE(NAME, V, DOT, T, 7) QR_TILE(NAME, V, DOT, T, 8)
#define QR_BY_ROWS(NAME, T)                                                                                    \
    {0, NAME##_##T##_1, NAME##_##T##_2, NAME##_##T##_3, NAME##_##T##_4, NAME##_##T##_5, NAME##_##T##_6,          \
     NAME##_##T##_7, NAME##_##T##_8}
#else
#define QR_TILES(NAME, V, DOT, T)                                                                              \
    QR_TILE(NAME, V, DOT, T, 1) QR_TILE(NAME, V, DOT, T, 2) QR_TILE(NAME, V, DOT, T, 3) QR_TILE(NAME, V, DOT, T, 4)
#define QR_BY_ROWS(NAME, T) {0, NAME##_##T##_1, NAME##_##T##_2, NAME##_##T##_3, NAME##_##T##_4}
#endif
#define QR_ALL(NAME, V, DOT)                                                                                   \
    QR_TILES(NAME, V, DOT, Q8_0) QR_TILES(NAME, V, DOT, Q4_0) QR_TILES(NAME, V, DOT, Q4_1)                     \
    static const qr_tile_fn *NAME##s(int type) {                                                               \
        static const qr_tile_fn q8_0[] = QR_BY_ROWS(NAME, Q8_0), q4_0[] = QR_BY_ROWS(NAME, Q4_0),              \
                                q4_1[] = QR_BY_ROWS(NAME, Q4_1);                                               \
        return type == Q8_0 ? q8_0 : type == Q4_0 ? q4_0 : q4_1;                                               \
    }

/* The tiles of a type, chosen as quant_int8.h's qi_tiles are. */
#if defined(__AVX512VNNI__)
QR_ALL(qr_vnni_tile, 1, qi_dot_vnni)
static const qr_tile_fn *qr_tiles(int type) { return qr_vnni_tiles(type); }
#else
QR_ALL(qr_mtile, 0, qi_dot_pairs)
#if defined(__AVX512BW__)
#pragma GCC push_options
#pragma GCC target("avx512vnni")
QR_ALL(qr_vnni_tile, 1, qi_dot_vnni)
#pragma GCC pop_options
static const qr_tile_fn *qr_tiles(int type) {
    return __builtin_cpu_supports("avx512vnni") ? qr_vnni_tiles(type) : qr_mtiles(type);
}
#else
static const qr_tile_fn *qr_tiles(int type) { return qr_mtiles(type); }
#endif
#endif
#if !defined(__AVX512BW__)
#pragma GCC pop_options
#endif

#endif
