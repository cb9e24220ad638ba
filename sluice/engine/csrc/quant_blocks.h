/* GGUF's block formats (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) as the CPU kernels read them, and the float32
 * product of rows x by such a weight (what quant_matmul.c runs alone and f32_layers.c inside its one-call step).
 *
 * Every type's values are w = scale * q - min, q int8, one scale per group of 16 values and, for the types with
 * an offset, one min: unpack_row gives a whole row so (then dequantize_row its float32 values, exactly the gguf
 * package's), qm_raw_<type> 32 values of it at a time into registers (the same values).
 *
 * The product (qm_linear_part, one thread's share): a tile of QM_NR weight rows decoded unit by unit into
 * registers and multiplied by up to QM_R rows of x at a time (QM_R x QM_NR accumulators), so each weight byte
 * is read once for every QM_R rows of x and never written out; past QM_DIRECT_ROWS rows of x (a prompt's) the
 * tile is dequantized once a panel of them into a buffer the rows then read (a prompt's rows go a panel at a
 * time: qm_panel_rows). With int8 activations (quant_int8.h) x's rows
 * are quantized per block of 32 and multiplied by tiles of the same shape on the file's layout, or, for a part
 * repacked at load (its type | QR_PACKED), by quant_repack.h's groups of 16 weight rows. A
 * stacked projection's parts (of different types, as Q4_K_M files' q and v are) run as one weight.
 */
#ifndef SLUICE_QUANT_BLOCKS_H
#define SLUICE_QUANT_BLOCKS_H

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "f32_vec.h"

#include "quant_rows.h"

/* ---- float activations: weights decoded in registers, a tile of rows of each at a time ---- */

/* a float16 at p: normal values by their bits alone (the common case), the rest as half_to_float does */
static inline float qm_half(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    const uint32_t e = h & 0x7c00;
    if (e == 0 || e == 0x7c00) return half_to_float(h);
    const uint32_t bits = ((uint32_t)(h & 0x8000) << 16) | (((uint32_t)(h & 0x7fff) << 13) + (112u << 23));
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* 16 bytes of nibbles as 32 values: the low nibbles, then the high ones */
static inline __m256i qm_nibbles16(const uint8_t *b) {
    const __m128i v = _mm_loadu_si128((const __m128i *)b), mask = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), mask), _mm_and_si128(v, mask));
}

/* each byte of v shifted right by `by` bits (0-7), masked to `mask` */
static inline __m256i qm_bits(__m256i v, int by, int mask) {
    return _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(by)), _mm256_set1_epi8((char)mask));
}

/* Unit u (values 32u..32u+31) of a weight row as stored (qm_raw_<type>): its bytes r, the value q = r - QM_OFF_<type>
 * (int8: Q8_0's r is signed, the others' unsigned), and, for its two halves, the scale s and the min m
 * (w = s q - m): the values unpack_row gives, the scales computed as it computes them. */
typedef struct {
    float s0, s1, m0, m1;
} qm_scale_t;

enum { QM_OFF_Q8_0 = 0, QM_OFF_Q4_0 = 8, QM_OFF_Q4_1 = 0, QM_OFF_Q5_0 = 16, QM_OFF_Q5_1 = 0, QM_OFF_Q4_K = 0,
       QM_OFF_Q5_K = 0, QM_OFF_Q6_K = 32 };

static inline __m256i qm_raw_Q8_0(const uint8_t *row, int u, qm_scale_t *c) {
    const uint8_t *b = row + (size_t)34 * u;
    c->s0 = c->s1 = qm_half(b), c->m0 = c->m1 = 0.0f;
    return _mm256_loadu_si256((const __m256i *)(b + 2));
}

static inline __m256i qm_raw_Q4_0(const uint8_t *row, int u, qm_scale_t *c) {
    const uint8_t *b = row + (size_t)18 * u;
    c->s0 = c->s1 = qm_half(b), c->m0 = c->m1 = 0.0f;
    return qm_nibbles16(b + 2);
}

static inline __m256i qm_raw_Q4_1(const uint8_t *row, int u, qm_scale_t *c) {
    const uint8_t *b = row + (size_t)20 * u;
    c->s0 = c->s1 = qm_half(b), c->m0 = c->m1 = -qm_half(b + 2);
    return qm_nibbles16(b + 4);
}

/* Q5_0 / Q5_1's 32 fifth bits at p, bit j of the word as byte j's 0x10 (llama.cpp's bytes_from_bits_32) */
static inline __m256i qm_fifth_bits(const uint8_t *p) {
    int32_t bits;
    memcpy(&bits, p, 4);
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2,
                                            3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    const __m256i v = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32(bits), spread), bit);
    return _mm256_and_si256(_mm256_cmpeq_epi8(v, bit), _mm256_set1_epi8(0x10));
}

static inline __m256i qm_raw_Q5_0(const uint8_t *row, int u, qm_scale_t *c) {
    const uint8_t *b = row + (size_t)22 * u;
    c->s0 = c->s1 = qm_half(b), c->m0 = c->m1 = 0.0f;
    return _mm256_or_si256(qm_nibbles16(b + 6), qm_fifth_bits(b + 2));
}

static inline __m256i qm_raw_Q5_1(const uint8_t *row, int u, qm_scale_t *c) {
    const uint8_t *b = row + (size_t)24 * u;
    c->s0 = c->s1 = qm_half(b), c->m0 = c->m1 = -qm_half(b + 2);
    return _mm256_or_si256(qm_nibbles16(b + 8), qm_fifth_bits(b + 4));
}

/* Q4_K / Q5_K: sub-block j of a super-block of 256 (its scale and min of 6 bits), the nibbles of chunk j / 2 */
static inline const uint8_t *qm_k_scales(const uint8_t *b, int j, qm_scale_t *c) {
    int sc, m;
    k4_scale_min(j, b + 4, &sc, &m);
    c->s0 = c->s1 = qm_half(b) * (float)sc;
    c->m0 = c->m1 = qm_half(b + 2) * (float)m;
    return b;
}

static inline __m256i qm_raw_Q4_K(const uint8_t *row, int u, qm_scale_t *c) {
    const int j = u & 7;
    const uint8_t *b = qm_k_scales(row + (size_t)144 * (u >> 3), j, c);
    return qm_bits(_mm256_loadu_si256((const __m256i *)(b + 16 + 32 * (j >> 1))), 4 * (j & 1), 0x0F);
}

static inline __m256i qm_raw_Q5_K(const uint8_t *row, int u, qm_scale_t *c) {
    const int j = u & 7;
    const uint8_t *b = qm_k_scales(row + (size_t)176 * (u >> 3), j, c);
    const __m256i low = qm_bits(_mm256_loadu_si256((const __m256i *)(b + 48 + 32 * (j >> 1))), 4 * (j & 1), 0x0F);
    const __m256i high = qm_bits(_mm256_loadu_si256((const __m256i *)(b + 16)), j, 1);
    return _mm256_or_si256(low, _mm256_slli_epi16(high, 4));
}

/* Q6_K: unit j = 4 h + s of a super-block is values 128 h + 32 s + l: the low 4 bits from ql (the bytes of
 * half h, the second 32 of them for odd s, their high nibbles for s >= 2), the high 2 from qh's bits 2 s */
static inline __m256i qm_raw_Q6_K(const uint8_t *row, int u, qm_scale_t *c) {
    const int j = u & 7, h = j >> 2, s = j & 3;
    const uint8_t *b = row + (size_t)210 * (u >> 3);
    const float d = qm_half(b + 208);
    const int8_t *sc = (const int8_t *)(b + 192);
    c->s0 = d * (float)sc[2 * j], c->s1 = d * (float)sc[2 * j + 1], c->m0 = c->m1 = 0.0f;
    const __m256i low = qm_bits(_mm256_loadu_si256((const __m256i *)(b + 64 * h + 32 * (s & 1))), 4 * (s >> 1), 0x0F);
    const __m256i high = qm_bits(_mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h)), 2 * s, 3);
    return _mm256_or_si256(low, _mm256_slli_epi16(high, 4));
}

/* QM_W vectors of a unit's 32 values; QM_NR weight rows and up to QM_R rows of x a tile (its products in
 * QM_R * QM_NR accumulators, the decoded rows in QM_NR * QM_W: within the build's registers) */
#ifdef __AVX512F__
enum { QM_W = 2, QM_NR = 2, QM_R = 8 };
static inline void qm_expand(__m256i q, const qm_scale_t *c, vf *w) {
    w[0] = _mm512_fmsub_ps(_mm512_set1_ps(c->s0), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q))),
                           _mm512_set1_ps(c->m0));
    w[1] = _mm512_fmsub_ps(_mm512_set1_ps(c->s1),
                           _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1))),
                           _mm512_set1_ps(c->m1));
}
#else
enum { QM_W = 4, QM_NR = 2, QM_R = 3 };
static inline void qm_expand(__m256i q, const qm_scale_t *c, vf *w) {
    const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
    const __m256 s0 = _mm256_set1_ps(c->s0), s1 = _mm256_set1_ps(c->s1);
    const __m256 m0 = _mm256_set1_ps(c->m0), m1 = _mm256_set1_ps(c->m1);
    w[0] = _mm256_fmsub_ps(s0, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)), m0);
    w[1] = _mm256_fmsub_ps(s0, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8))), m0);
    w[2] = _mm256_fmsub_ps(s1, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)), m1);
    w[3] = _mm256_fmsub_ps(s1, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8))), m1);
}
#endif

#define QM_LOAD_QUANT(T)                                                                                       \
    static inline void qm_load_##T(const uint8_t *row, int u, vf *w) {                                         \
        qm_scale_t c;                                                                                          \
        const __m256i r = qm_raw_##T(row, u, &c);                                                              \
        qm_expand(QM_OFF_##T ? _mm256_sub_epi8(r, _mm256_set1_epi8(QM_OFF_##T)) : r, &c, w);                   \
    }
QM_LOAD_QUANT(Q8_0) QM_LOAD_QUANT(Q4_0) QM_LOAD_QUANT(Q4_1) QM_LOAD_QUANT(Q5_0) QM_LOAD_QUANT(Q5_1)
QM_LOAD_QUANT(Q4_K) QM_LOAD_QUANT(Q5_K) QM_LOAD_QUANT(Q6_K)

/* a row already dequantized to float32 (many rows of x: see qm_float) */
static inline void qm_load_F32(const uint8_t *row, int u, vf *w) {
    _Pragma("GCC unroll 4") for (int v = 0; v < QM_W; v++) w[v] = vf_load((const float *)row + 32 * u + F32V * v);
}

/* sums[r][i] = row i of the weight (rows[i]) . row r of x, over `units` units of 32, for R rows of x */
#define QM_TILE(T, R)                                                                                          \
    static void qm_tile_##T##_##R(const uint8_t *const *rows, int units, const float *x, long ldx, float *sums) { \
        vf acc[R][QM_NR];                                                                                      \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                                                    \
            _Pragma("GCC unroll 8") for (int i = 0; i < QM_NR; i++) acc[r][i] = vf_zero();                     \
        for (int u = 0; u < units; u++) {                                                                      \
            vf w[QM_NR][QM_W];                                                                                 \
            _Pragma("GCC unroll 8") for (int i = 0; i < QM_NR; i++) qm_load_##T(rows[i], u, w[i]);             \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                                                \
                _Pragma("GCC unroll 4") for (int v = 0; v < QM_W; v++) {                                       \
                    const vf xv = vf_load(x + r * ldx + 32 * u + F32V * v);                                    \
                    _Pragma("GCC unroll 8") for (int i = 0; i < QM_NR; i++)                                    \
                        acc[r][i] = vf_fmadd(w[i][v], xv, acc[r][i]);                                          \
                }                                                                                              \
        }                                                                                                      \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                                                    \
            _Pragma("GCC unroll 8") for (int i = 0; i < QM_NR; i++) sums[r * QM_NR + i] = vf_sum(acc[r][i]);   \
    }
typedef void (*qm_tile_fn)(const uint8_t *const *, int, const float *, long, float *);
#if defined(__AVX512F__)
#define QM_TILES(T)                                                                                            \
    QM_TILE(T, 1) QM_TILE(T, 2) QM_TILE(T, 3) QM_TILE(T, 4) QM_TILE(T, 5) QM_TILE(T, 6) QM_TILE(T, 7) QM_TILE(T, 8)
#define QM_BY_ROWS(T)                                                                                          \
    {0, qm_tile_##T##_1, qm_tile_##T##_2, qm_tile_##T##_3, qm_tile_##T##_4, qm_tile_##T##_5, qm_tile_##T##_6,   \
     qm_tile_##T##_7, qm_tile_##T##_8}
#else
#define QM_TILES(T) QM_TILE(T, 1) QM_TILE(T, 2) QM_TILE(T, 3)
#define QM_BY_ROWS(T) {0, qm_tile_##T##_1, qm_tile_##T##_2, qm_tile_##T##_3}
#endif
QM_TILES(Q8_0) QM_TILES(Q4_0) QM_TILES(Q4_1) QM_TILES(Q5_0) QM_TILES(Q5_1) QM_TILES(Q4_K) QM_TILES(Q5_K)
QM_TILES(Q6_K) QM_TILES(F32)

static const qm_tile_fn *qm_tiles(int type) {
    static const qm_tile_fn q8_0[] = QM_BY_ROWS(Q8_0), q4_0[] = QM_BY_ROWS(Q4_0), q4_1[] = QM_BY_ROWS(Q4_1),
                            q5_0[] = QM_BY_ROWS(Q5_0), q5_1[] = QM_BY_ROWS(Q5_1), q4_k[] = QM_BY_ROWS(Q4_K),
                            q5_k[] = QM_BY_ROWS(Q5_K), q6_k[] = QM_BY_ROWS(Q6_K), f32[] = QM_BY_ROWS(F32);
    switch (type) {
    case Q8_0: return q8_0;
    case Q4_0: return q4_0;
    case Q4_1: return q4_1;
    case Q5_0: return q5_0;
    case Q5_1: return q5_1;
    case Q4_K: return q4_k;
    case Q5_K: return q5_k;
    case Q6_K: return q6_k;
    default: return f32;
    }
}

#include "quant_int8.h"

/* One part of a quantized linear's weight (a stacked projection's parts may have different types): n rows of
 * row_bytes, in GGUF's block format `type`, stacked on the outputs after the parts before it. perm (NULL: none;
 * the same for every part of a linear): the weight's columns stored in this order, column c of the blocks being
 * column perm[c] of x (a GPTQ act-order checkpoint's, its groups made contiguous), so x is read through it. */
typedef struct {
    const uint8_t *w;
    long row_bytes;
    int type, n;
    const int32_t *perm;
} quant_part_t;

/* a thread's row of x gathered through a perm (grown as needed, kept for the thread's life) */
static __thread float *qm_gathered;
static __thread int qm_gathered_room;

/* Rows [r0, r1) of x quantized into x8 as the parts' tiles read them: per group of 128 for per-channel weights
 * (quant_channel.h: a linear's parts are all Q8_C or none), else per block of 32; each row read through the
 * parts' perm where they have one. */
static inline void qm_quantize_for(const quant_part_t *parts, const float *x, long ldx, int r0, int r1, int k,
                                   const qm_x8_t *x8) {
    const int channel = (parts[0].type & ~QR_PACKED) == Q8_C;
    const int32_t *perm = parts[0].perm;
    if (perm && k > qm_gathered_room) {
        free(qm_gathered);
        qm_gathered = malloc(sizeof(float) * (size_t)k);
        if (!qm_gathered) abort(); /* (a row of floats) */
        qm_gathered_room = k;
    }
    for (int r = r0; r < r1; r++) {
        const float *xr = x + (size_t)r * ldx;
        if (perm) {
            for (int c = 0; c < k; c++) qm_gathered[c] = xr[perm[c]];
            xr = qm_gathered;
        }
        if (channel)
            qc_quantize_row(xr, r, k, x8);
        else
            qm_quantize_row(xr, r, k, x8);
    }
}

/* weight rows a tile of part p: a repacked group's (quant_repack.h), else QM_NR */
static inline int qm_tile_rows(const quant_part_t *p) { return qr_packed(p->type) ? QR_ROWS : QM_NR; }
static inline int qm_tiles_of(const quant_part_t *p) { return (p->n + qm_tile_rows(p) - 1) / qm_tile_rows(p); }

/* Rows of x up to which the weight is decoded in registers for every QM_R of them; past it, each tile of
 * weight rows is dequantized once into a buffer the rows of x then read (a prompt's many rows) */
enum { QM_DIRECT_ROWS = 8 };
/* multiply-adds below which one thread does it all (waking the other costs more) */
#define QM_SERIAL_WORK 1e6

/* One repacked group: weight rows [j0, j0 + count) of part p (j0 a multiple of QR_ROWS) times x8's rows [m0, m),
 * into out's columns at `col`: QR_VL rows of the group by up to QR_R rows of x a tile. */
static void qr_group(const quant_part_t *p, int j0, int count, int col, int k, const qm_x8_t *x8, int m0, int m,
                     const float *bias, float *out, long ldo) {
    const qr_tile_fn *tiles = qr_tiles(p->type & ~QR_PACKED);
    const uint8_t *group = p->w + (size_t)j0 * p->row_bytes;
    for (int h = 0; h * QR_VL < count; h++) {
        const int lanes = count - h * QR_VL < QR_VL ? count - h * QR_VL : QR_VL, c0 = col + h * QR_VL;
        for (int r0 = m0; r0 < m; r0 += QR_R) {
            const int rr = m - r0 < QR_R ? m - r0 : QR_R;
            float sums[QR_R * QR_VL];
            tiles[rr](group, k / 32, h, x8, r0, sums);
            for (int r = 0; r < rr; r++)
                for (int i = 0; i < lanes; i++)
                    out[(size_t)(r0 + r) * ldo + c0 + i] = sums[r * QR_VL + i] + (bias ? bias[c0 + i] : 0.0f);
        }
    }
}

/* One tile: weight rows [j0, j0 + count) of part p (count <= QM_NR; a repacked part's, a group: qr_group)
 * times x's rows [m0, m) (x8 set: its int8 rows instead), into out's columns at `col`. buf: QM_NR * k floats, and
 * q, gs, mn a row's unpacking (see unpack_row), or NULL: decoded in registers for every QM_R rows of x. */
static void qm_tile(const quant_part_t *p, int j0, int count, int col, int k, const float *x, long ldx,
                    const qm_x8_t *x8, int m0, int m, const float *bias, float *out, long ldo, float *buf, int8_t *q,
                    float *gs, float *mn) {
    if (qr_packed(p->type)) { /* (x8 set: sluice_quant_linear refuses a repacked part without it) */
        qr_group(p, j0, count, col, k, x8, m0, m, bias, out, ldo);
        return;
    }
    const uint8_t *rows[QM_NR];
    for (int i = 0; i < QM_NR; i++) {
        const int last = i < count ? i : count - 1; /* (a last tile's missing rows: its last again) */
        if (buf) {
            if (i < count) {
                if (!has_min(p->type)) memset(mn, 0, (size_t)k / 16 * sizeof(float)); /* (a part before may have had) */
                unpack_row(p->type, p->w + (size_t)(j0 + i) * p->row_bytes, k, q, gs, mn);
                dequantize_row(q, gs, mn, k, buf + (size_t)i * k);
            }
            rows[i] = (const uint8_t *)(buf + (size_t)last * k);
        } else {
            rows[i] = p->w + (size_t)(j0 + last) * p->row_bytes;
        }
    }
    const qm_tile_fn *tiles = qm_tiles(buf ? -1 : p->type);
    for (int r0 = m0; r0 < m; r0 += QM_R) {
        const int rr = m - r0 < QM_R ? m - r0 : QM_R;
        float sums[QM_R * QM_NR];
        if (x8)
            qi_tiles(p->type)[rr](rows, k / 32, x8, r0, sums);
        else
            tiles[rr](rows, k / 32, x + (size_t)r0 * ldx, ldx, sums);
        for (int r = 0; r < rr; r++)
            for (int i = 0; i < count; i++)
                out[(size_t)(r0 + r) * ldo + col + i] = sums[r * QM_NR + i] + (bias ? bias[col + i] : 0.0f);
    }
}

/* bytes of x's rows a panel of them holds: a prompt's rows go a panel at a time, each tile read once a panel,
 * so the panel's rows stay in the L2 for all the tiles (all of a prompt's rows for each tile streamed them from
 * the L3 again and again: 1-10% slower at 2,048 rows, bench/RESULTS.md#cpu-kernels) */
#define QM_PANEL_BYTES (256 << 10)

/* Rows a panel of x takes (of m, k values each; int8: as quantized): whole steps of 48 (QM_R, QR_R), at least one. */
static inline int qm_panel_rows(int m, int k, int int8) {
    const long row = int8 ? (long)k * 8 / 5 : 4L * k; /* (an int8 row's values, scales and sums: ~1.6 bytes a value) */
    int rows = (int)(QM_PANEL_BYTES / row) / 48 * 48;
    rows = rows < 48 ? 48 : rows;
    return rows < m ? rows : m;
}

/* This thread's share of x [m][k] @ W^T (+ bias) into out [m][ldo] for float32 rows x, or for x8 (not NULL:
 * x's rows quantized, see quant_int8.h): units of (a panel of x's rows, a tile of QM_NR rows of the parts, or a
 * repacked group), panel by panel, taken `chunk` at a time from the team's counter *next (0 at the start). */
static void qm_linear_part(const quant_part_t *parts, int num_parts, int k, const float *x, long ldx,
                           const qm_x8_t *x8, int m, const float *bias, float *out, long ldo, int *next, int chunk) {
    int tiles = 0;
    for (int p = 0; p < num_parts; p++) tiles += qm_tiles_of(parts + p);
    const int panel = qm_panel_rows(m, k, x8 != NULL), units = (m + panel - 1) / panel * tiles;
    float *buf = NULL, *gs = NULL, *mn = NULL;
    int8_t *q = NULL;
    if (m > QM_DIRECT_ROWS && !x8) {
        buf = malloc((size_t)QM_NR * k * sizeof(float)), q = malloc((size_t)k);
        gs = malloc((size_t)k / 16 * sizeof(float)), mn = calloc((size_t)k / 16, sizeof(float));
        if (!buf || !q || !gs || !mn) { /* (then decoded in registers: slower, the same values) */
            free(buf), free(q), free(gs), free(mn);
            buf = gs = mn = NULL, q = NULL;
        }
    }
    for (int u0; (u0 = __atomic_fetch_add(next, chunk, __ATOMIC_RELAXED)) < units;) {
        for (int u = u0; u < u0 + chunk && u < units; u++) {
            const int t = u % tiles, m0 = u / tiles * panel, m1 = m - m0 < panel ? m : m0 + panel;
            int p = 0, before = 0, col = 0; /* the part of tile t, the tiles and columns of the parts before it */
            while (t - before >= qm_tiles_of(parts + p)) before += qm_tiles_of(parts + p), col += parts[p++].n;
            const int rows = qm_tile_rows(parts + p), j0 = (t - before) * rows;
            const int count = parts[p].n - j0 < rows ? parts[p].n - j0 : rows;
            qm_tile(parts + p, j0, count, col + j0, k, x, ldx, x8, m0, m1, bias, out, ldo, buf, q, gs, mn);
        }
    }
    free(buf), free(q), free(gs), free(mn);
}

/* tiles a thread takes at a time: about eight turns each */
static inline int qm_chunk(const quant_part_t *parts, int num_parts, int threads) {
    int tiles = 0;
    for (int p = 0; p < num_parts; p++) tiles += qm_tiles_of(parts + p);
    const int chunk = tiles / (8 * threads);
    return chunk < 1 ? 1 : chunk;
}

#endif
