/* x @ W^T (+ bias) for float32 rows x on CPUs with AVX-512F: every linear of a model served in float32, and
 * its LM head (logits, or each row's argmax without writing them).
 *
 * The weight is bf16 (a bf16 checkpoint served in float32: bf16 -> float32 is exact, so this is float32
 * math on the same weights, reading half the bytes) or float32, packed once in tiles of 16 output rows,
 * each [K/2][2][16] for float32 and, for bf16, [K/2][16][2]: the pair layout of bf16_matmul.c, whose
 * 64-byte load holds both columns of a pair for the 16 rows: shifted left 16 bits it is the even column in
 * float32, masked to its high halves the odd one (no AVX512-BF16 needed).
 *
 * A block of up to GROUP tiles (64 outputs) is multiplied by ROWS input rows at a time in 24 zmm
 * accumulators, KP column pairs at a time, the block's slice of the weight reused from L1 for every chunk
 * of rows; with many rows (a prompt's), a bf16 slice is widened once into scratch for all of them, and the
 * rows go a panel at a time (f32_panel_rows). Each output is one chain of float32 multiply-adds over k in
 * order, whatever the number of rows, the thread or the blocking: a row's result does not depend on its
 * batch (the same sum as a dot product over k in order, float32 FMA at each step).
 *
 * The argmax keeps the first index of a row's maximum (compared in float32, as the logits would be
 * stored). Threads take chunks of (panel, block) units, panel by panel in column order, as they come free
 * (see bf16_matmul.c), each a chunk ahead (f32_queue: a unit's weights are fetched while the one before it
 * runs). sluice_f32_matmul_swiglu computes a SwiGLU's gate and up blocks together and writes
 * silu(gate) * up.
 */
#include <omp.h>
#include <stdlib.h>

#include "simd.h"

enum { F32_TILE = 16, F32_GROUP = 4, F32_ROWS = 6, F32_KP = 64, F32_LD = F32_TILE * F32_GROUP };
/* the `bf16` argument: 0 a float32 weight, 1 a bf16 one, F32_AMX a bf16 one run on AMX (the AMX build only) */
enum { F32_AMX = 2 };
/* a group's slice of KP pairs widened to float32 (bf16 weights, F32_WIDEN_ROWS rows or more): floats of scratch */
enum { F32_WIDE = F32_GROUP * F32_KP * 2 * F32_TILE, F32_WIDEN_ROWS = 4 * F32_ROWS };
/* bytes of input rows a panel holds: each group's weight slices are read (and widened) once a panel, so the
 * more rows the fewer times; past a few MB the rows' own traffic costs more (bench/RESULTS.md#tried-and-not-kept) */
#define F32_PANEL_BYTES (2 << 20)

/* a panel's rows come in steps of whole F32_ROWS blocks and whole AMX tiles of 16 rows */
enum { F32_PANEL_STEP = 48 };

/* Rows a panel takes (of m, each k floats): whole steps within F32_PANEL_BYTES, at least one.
 * Taking the rows a panel at a time, each group's weights are read once a panel and each panel's rows once
 * for all the groups, where the whole of the rows for each group would stream them from memory again and
 * again (a long prompt's rows are megabytes). */
static inline int f32_panel_rows(int m, int k) {
    int rows = (int)(F32_PANEL_BYTES / (4 * (long)k)) / F32_PANEL_STEP * F32_PANEL_STEP;
    rows = rows < F32_PANEL_STEP ? F32_PANEL_STEP : rows;
    return rows < m ? rows : m;
}

/* weight bytes from which a widened slice is fetched ahead (see f32_group) */
#define F32_FETCH_BYTES ((size_t)4 << 20)

/* multiply-adds below which one thread does it all (waking the other costs more) */
#define F32_SERIAL_WORK 1.5e6

/* R rows x NT tiles over the pairs [p0, p1): acc (R x NT vectors, F32_LD floats a row of c) starts from
 * zero when first, else from c, and is left in c. w: the block's first tile; k: columns (a tile holds k * 16
 * values); x: rows ldx apart. bf16 != 0: the weight is packed bf16, else float32. */
#define F32_BLOCK(R, NT, BF16)                                                                                \
    static void f32_block_##R##_##NT##_##BF16(const void *w, int k, int p0, int p1, const float *restrict x,   \
                                              long ldx, float *restrict c, int first, const char *pf) {       \
        __m512 acc[R][NT];                                                                                    \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                                                   \
            _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++)                                              \
                acc[r][t] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(c + r * F32_LD + t * F32_TILE);      \
        const __m512i high = _mm512_set1_epi32((int)0xffff0000);                                              \
        const size_t tile = (size_t)k * F32_TILE; /* values a tile */                                         \
        for (int p = p0; p < p1; p++) {                                                                       \
            __m512 wv[NT];                                                                                    \
            _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++) {                                            \
                if (BF16) {                                                                                   \
                    const __m512i v = _mm512_loadu_si512((const uint16_t *)w + t * tile + (size_t)p * 32);   \
                    wv[t] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));                                    \
                } else {                                                                                      \
                    wv[t] = _mm512_loadu_ps((const float *)w + t * tile + (size_t)p * 32);                    \
                }                                                                                             \
            }                                                                                                 \
            if (pf)                                                                                           \
                _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++)                                          \
                    _mm_prefetch(pf + (t * tile + (size_t)p * 32) * (BF16 ? 2 : 4), _MM_HINT_T1);             \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                             \
                const __m512 xe = _mm512_set1_ps(x[r * ldx + 2 * p]);                                         \
                _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++) acc[r][t] = _mm512_fmadd_ps(wv[t], xe, acc[r][t]); \
            }                                                                                                 \
            _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++) {                                            \
                if (BF16) {                                                                                   \
                    const __m512i v = _mm512_loadu_si512((const uint16_t *)w + t * tile + (size_t)p * 32);   \
                    wv[t] = _mm512_castsi512_ps(_mm512_and_si512(v, high));                                   \
                } else {                                                                                      \
                    wv[t] = _mm512_loadu_ps((const float *)w + t * tile + (size_t)p * 32 + 16);               \
                }                                                                                             \
            }                                                                                                 \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                             \
                const __m512 xo = _mm512_set1_ps(x[r * ldx + 2 * p + 1]);                                     \
                _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++) acc[r][t] = _mm512_fmadd_ps(wv[t], xo, acc[r][t]); \
            }                                                                                                 \
        }                                                                                                     \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                                                   \
            _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++)                                              \
                _mm512_storeu_ps(c + r * F32_LD + t * F32_TILE, acc[r][t]);                                   \
    }
#define F32_BLOCKS(R)                                                                                          \
    F32_BLOCK(R, 4, 1) F32_BLOCK(R, 3, 1) F32_BLOCK(R, 2, 1) F32_BLOCK(R, 1, 1)                                \
    F32_BLOCK(R, 4, 0) F32_BLOCK(R, 3, 0) F32_BLOCK(R, 2, 0) F32_BLOCK(R, 1, 0)
F32_BLOCKS(1) F32_BLOCKS(2) F32_BLOCKS(3) F32_BLOCKS(4) F32_BLOCKS(5) F32_BLOCKS(6)

typedef void (*f32_block_fn)(const void *, int, int, int, const float *, long, float *, int, const char *);
#define F32_BY_ROWS(NT, BF16)                                                                                  \
    {0, f32_block_1_##NT##_##BF16, f32_block_2_##NT##_##BF16, f32_block_3_##NT##_##BF16,                       \
     f32_block_4_##NT##_##BF16, f32_block_5_##NT##_##BF16, f32_block_6_##NT##_##BF16}
/* [bf16][tiles][rows]: a group's tiles in one block whatever their number (a last group of 1-3 tiles, one at
 * a time, would load a weight vector for every 6 multiply-adds) */
static const f32_block_fn F32_BLOCK_FN[2][F32_GROUP + 1][F32_ROWS + 1] = {
    {{0}, F32_BY_ROWS(1, 0), F32_BY_ROWS(2, 0), F32_BY_ROWS(3, 0), F32_BY_ROWS(4, 0)},
    {{0}, F32_BY_ROWS(1, 1), F32_BY_ROWS(2, 1), F32_BY_ROWS(3, 1), F32_BY_ROWS(4, 1)},
};

/* The block's rows c [m][F32_LD] (the outputs from tile0 on) as logits (+ bias) into out, or folded into
 * each row's per-lane best values and their columns (strictly greater wins: the first column of a lane's
 * maximum, tiles in column order). */
static void f32_finish(const float *c, int m, int tile0, int nt, int n, const float *bias, float *out, long ldo,
                       float *best, int32_t *where) {
    for (int r = 0; r < m; r++) {
        for (int t = 0; t < nt; t++) {
            const int col0 = (tile0 + t) * F32_TILE;
            const __mmask16 valid = first_lanes(n - col0);
            __m512 v = _mm512_loadu_ps(c + (size_t)r * F32_LD + t * F32_TILE);
            if (out) {
                if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(valid, bias + col0));
                _mm512_mask_storeu_ps(out + (size_t)r * ldo + col0, valid, v);
            } else {
                float *b = best + (size_t)r * F32_TILE;
                int32_t *wh = where + (size_t)r * F32_TILE;
                const __m512 cur = _mm512_loadu_ps(b);
                const __mmask16 gt = _mm512_mask_cmp_ps_mask(valid, v, cur, _CMP_GT_OQ);
                if (!gt) continue;
                const __m512i cols = _mm512_add_epi32(_mm512_set1_epi32(col0),
                                                      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
                _mm512_storeu_ps(b, _mm512_mask_blend_ps(gt, cur, v));
                _mm512_storeu_si512(wh, _mm512_mask_blend_epi32(gt, _mm512_loadu_si512(wh), cols));
            }
        }
    }
}

/* The next `chunk` blocks for the calling thread, [g0, g1) (shared counter *next): 0 when none are left. */
static inline int f32_take(int *next, int chunk, int groups, int *g0, int *g1) {
    int g;
#pragma omp atomic capture
    {
        g = *next;
        *next += chunk;
    }
    *g0 = g;
    *g1 = g + chunk < groups ? g + chunk : groups;
    return g < groups;
}

/* A thread's units of work, taken from the shared counter a chunk ahead so that the unit after this one is
 * known (its weights are fetched meanwhile): [u, u1) to do now, [n0, n1) taken ahead (empty: none left). */
typedef struct {
    int u, u1, n0, n1;
} f32_queue;

static inline f32_queue f32_queue_new(int *next, int chunk, int units) {
    f32_queue q = {0, 0, 0, 0};
    if (!f32_take(next, chunk, units, &q.n0, &q.n1)) q.n0 = q.n1 = 0;
    return q;
}

/* the calling thread's next unit, or -1 when none is left; *after: the one after it, or -1 */
static inline int f32_unit(f32_queue *q, int *next, int chunk, int units, int *after) {
    if (q->u >= q->u1) {
        q->u = q->n0, q->u1 = q->n1;
        if (q->u >= q->u1) return -1;
        if (!f32_take(next, chunk, units, &q->n0, &q->n1)) q->n0 = q->n1 = 0;
    }
    const int u = q->u++;
    *after = q->u < q->u1 ? q->u : q->n0 < q->n1 ? q->n0 : -1;
    return u;
}

/* tiles [0, nt) of a bf16 group's pairs [p0, p1) (tiles k * F32_TILE values apart) as float32 in the float32
 * packing, each tile's (p1 - p0) pairs together: wide [nt][p1 - p0][2][16] (exact: bf16 -> float32) */
static void f32_widen(const uint16_t *w, int k, int nt, int p0, int p1, float *wide) {
    const __m512i high = _mm512_set1_epi32((int)0xffff0000);
    const size_t tile = (size_t)k * F32_TILE;
    for (int t = 0; t < nt; t++)
        for (int p = p0; p < p1; p++) {
            const __m512i v = _mm512_loadu_si512(w + t * tile + (size_t)p * 32);
            float *dst = wide + ((size_t)t * (p1 - p0) + (p - p0)) * 32;
            _mm512_storeu_ps(dst, _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)));
            _mm512_storeu_ps(dst + 16, _mm512_castsi512_ps(_mm512_and_si512(v, high)));
        }
}

#ifdef __AMX_BF16__
/* AMX (built with -mamx-tile -mamx-bf16 -mavx512bf16; run only after sluice_f32_amx_init says yes): a bf16
 * weight's products in float32 on the tile unit. Each float32 row x is split into three bf16 parts, x = hi +
 * mid + lo exactly (hi = bf16(x), mid = bf16(x - hi), lo = bf16(x - hi - mid): 8 + 8 + 8 bits of x's 24; each
 * difference exact in float32), and x . w = hi . w + mid . w + lo . w, each bf16 product exact in float32 and
 * every sum kept in float32 (TDPBF16PS): float32 math on the same weights up to the order of the sums (and
 * DAZ/FTZ: parts below 2^-126 count as zero, i.e. |x| below ~2^-110), at three tile products a block where
 * AVX-512F's float32 FMAs make one sixteenth of one. The weight's bf16 packing [K/2][16][2] is the tile
 * unit's B layout as it is (16 pairs of columns of a tile: one 1 KB tile).
 *
 * Tiles: 0-3 the accumulators of a group's 4 output tiles (16 rows x 16 outputs), then parts of the rows (16
 * rows x 32 columns) and weight tiles (see amx_group). Each row's sum runs over k in blocks of 32, in each
 * its hi, then mid, then lo products: a row's values depend neither on its batch nor on the threads. */
#include <sys/syscall.h>
#include <unistd.h>

enum { AMX_K = 32, AMX_ROWS = 16 };
/* rows up to which each thread splits all of them for itself (no barrier: a decode step has ~120 products) */
enum { AMX_OWN_ROWS = 32 };
/* blocks of k ahead that a few rows' products fetch the weight (see amx_group) */
enum { AMX_AHEAD = 1 };

typedef struct {
    uint8_t palette, start;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((aligned(64))) amx_config_t;

/* Asks the kernel for the tile state (Linux keeps AMX off until a process asks): 0 when AMX may run here. */
int sluice_f32_amx_init(void) {
    unsigned long features = 0;
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */)) return -1;
    if (syscall(SYS_arch_prctl, 0x1022 /* ARCH_GET_XCOMP_PERM */, &features)) return -1;
    return features & (1ul << 18) ? 0 : -1;
}

/* The calling thread's tiles for a product of m rows, as amx_group uses them: accumulators (0-3) and rows (4,
 * 5; and 6 below 16 rows) of min(m, 16) rows (a tile product costs by its rows: a decode's single row is not
 * run as 16), weights (7; and 6 from 16 rows) of 16 pairs of columns. */
static void amx_configure(int m) {
    amx_config_t cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) cfg.colsb[t] = 64, cfg.rows[t] = t < 7 && m < AMX_ROWS ? m : AMX_ROWS;
    /* (not _tile_loadconfig: GCC 12 does not see its builtin read the struct, and where it inlined this
     * function it dropped the stores above as dead: tiles left unconfigured, SIGILL at the first product) */
    __asm__ volatile("ldtilecfg %0" : : "m"(cfg));
}

/* The rows a product's split parts hold (each part a plane of amx_rows(m) * k): m below 16 (the tiles are
 * configured for m rows: amx_configure), else whole tiles of 16 (zero past m). */
static inline int amx_rows(int m) { return m < AMX_ROWS ? m : (m + AMX_ROWS - 1) / AMX_ROWS * AMX_ROWS; }

/* Rows [r0, r1) of x (k floats, ldx apart) split into bf16 hi, mid and lo parts: xs [3][plane] with row r at
 * r * k of each part (see the section's comment). */
static void amx_split(const float *x, long ldx, int r0, int r1, int k, uint16_t *xs, size_t plane) {
    for (int r = r0; r < r1; r++) {
        const float *xr = x + (size_t)r * ldx;
        uint16_t *hi = xs + (size_t)r * k, *mid = hi + plane, *lo = mid + plane;
        for (int c = 0; c < k; c += 16) {
            const __mmask16 keep = first_lanes(k - c);
            const __m512 v = _mm512_maskz_loadu_ps(keep, xr + c);
            const __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
            const __m512 rest = _mm512_sub_ps(v, widen_bf16(h));
            const __m256i md = (__m256i)_mm512_cvtneps_pbh(rest);
            const __m256i l = (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(rest, widen_bf16(md)));
            _mm256_mask_storeu_epi16(hi + c, keep, h);
            _mm256_mask_storeu_epi16(mid + c, keep, md);
            _mm256_mask_storeu_epi16(lo + c, keep, l);
        }
    }
}

/* zero rows [r0, r1) of the three parts (the rows past m that fill a last tile) */
static void amx_zero(int r0, int r1, int k, uint16_t *xs, size_t plane) {
    for (int part = 0; part < 3; part++) memset(xs + part * plane + (size_t)r0 * k, 0, sizeof(uint16_t) * (r1 - r0) * k);
}

/* Thread th of nth's part in readying a product of m rows of x (k floats, ldx apart) for amx_group: the rows
 * split into xs (planes `plane` = amx_rows(m) * k apart, zero past m) and this thread's tiles configured. Up to
 * AMX_OWN_ROWS rows each thread splits them all into an xs of its own; past that the team shares one xs, each
 * thread splitting its share, and returns 1: the team must then wait at a barrier before the product. */
static int amx_ready(const float *x, long ldx, int m, int k, int th, int nth, uint16_t *xs, size_t plane) {
    const int shared = m > AMX_OWN_ROWS;
    const int r0 = shared ? (int)((long)m * th / nth) : 0, r1 = shared ? (int)((long)m * (th + 1) / nth) : m;
    amx_split(x, ldx, r0, r1, k, xs, plane);
    if (r1 == m) amx_zero(m, amx_rows(m), k, xs, plane);
    amx_configure(m);
    return shared;
}

/* The nt (1-4) tiles of a group from wg (tiles k * 16 values apart) for m rows of split parts xs (planes
 * `plane` apart, see amx_rows: a product's m rows, or a panel of them), into c [m][nt * 16] (rows ldc floats
 * apart); the tiles as amx_configure left them for the product. */
static void amx_group(const uint16_t *wg, int k, int nt, const uint16_t *xs, size_t plane, int m, float *c,
                      long ldc) {
    float part[AMX_ROWS * F32_LD] __attribute__((aligned(64)));
    const size_t tile = (size_t)k * F32_TILE;
    const long lda = (long)k * 2;
    /* a product of fewer than 16 rows (tiles of m rows); a last panel of fewer rows in a larger product takes
     * the whole tiles' path below (tiles of 16 rows, zero past the product's m) */
    const int few = m < AMX_ROWS && plane == (size_t)m * k;
    for (int r0 = 0; r0 < m; r0 += AMX_ROWS) {
        const uint16_t *a = xs + (size_t)r0 * k;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int k0 = 0; k0 < k; k0 += AMX_K) {
            const uint16_t *wk = wg + (size_t)k0 * F32_TILE;
            if (few) {
                /* a few rows (a decode step's): the three parts in tiles 4-6 and each weight tile once into 7,
                 * its lines fetched AMX_AHEAD blocks of k ahead (it comes from memory) */
                if (k0 + AMX_AHEAD * AMX_K < k)
                    for (int t = 0; t < nt; t++)
                        for (int l = 0; l < 16; l++)
                            _mm_prefetch((const char *)(wk + t * tile + (size_t)AMX_AHEAD * AMX_K * F32_TILE) + 64 * l,
                                         _MM_HINT_T0);
                _tile_loadd(4, a + k0, lda);
                _tile_loadd(5, a + plane + k0, lda);
                _tile_loadd(6, a + 2 * plane + k0, lda);
                { _tile_loadd(7, wk + 0 * tile, 64); _tile_dpbf16ps(0, 4, 7); _tile_dpbf16ps(0, 5, 7); _tile_dpbf16ps(0, 6, 7); }
                if (nt > 1) { _tile_loadd(7, wk + 1 * tile, 64); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(1, 5, 7); _tile_dpbf16ps(1, 6, 7); }
                if (nt > 2) { _tile_loadd(7, wk + 2 * tile, 64); _tile_dpbf16ps(2, 4, 7); _tile_dpbf16ps(2, 5, 7); _tile_dpbf16ps(2, 6, 7); }
                if (nt > 3) { _tile_loadd(7, wk + 3 * tile, 64); _tile_dpbf16ps(3, 4, 7); _tile_dpbf16ps(3, 5, 7); _tile_dpbf16ps(3, 6, 7); }
                continue;
            }
            /* whole tiles of rows: part S's rows into tile 4 + S % 2, then each weight tile T into 6 + T % 2
             * and its product, the four accumulators' products interleaved (each waits on its own last one),
             * the weight from L1 after part 0 (the same sums, in the same order, as above) */
            _tile_loadd(4, a + 0 * plane + k0, lda);
            { _tile_loadd(6, wk + 0 * tile, 64); _tile_dpbf16ps(0, 4, 6); }
            if (nt > 1) { _tile_loadd(7, wk + 1 * tile, 64); _tile_dpbf16ps(1, 4, 7); }
            if (nt > 2) { _tile_loadd(6, wk + 2 * tile, 64); _tile_dpbf16ps(2, 4, 6); }
            if (nt > 3) { _tile_loadd(7, wk + 3 * tile, 64); _tile_dpbf16ps(3, 4, 7); }
            _tile_loadd(5, a + 1 * plane + k0, lda);
            { _tile_loadd(6, wk + 0 * tile, 64); _tile_dpbf16ps(0, 5, 6); }
            if (nt > 1) { _tile_loadd(7, wk + 1 * tile, 64); _tile_dpbf16ps(1, 5, 7); }
            if (nt > 2) { _tile_loadd(6, wk + 2 * tile, 64); _tile_dpbf16ps(2, 5, 6); }
            if (nt > 3) { _tile_loadd(7, wk + 3 * tile, 64); _tile_dpbf16ps(3, 5, 7); }
            _tile_loadd(4, a + 2 * plane + k0, lda);
            { _tile_loadd(6, wk + 0 * tile, 64); _tile_dpbf16ps(0, 4, 6); }
            if (nt > 1) { _tile_loadd(7, wk + 1 * tile, 64); _tile_dpbf16ps(1, 4, 7); }
            if (nt > 2) { _tile_loadd(6, wk + 2 * tile, 64); _tile_dpbf16ps(2, 4, 6); }
            if (nt > 3) { _tile_loadd(7, wk + 3 * tile, 64); _tile_dpbf16ps(3, 4, 7); }
        }
        const int rows = m - r0 < AMX_ROWS ? m - r0 : AMX_ROWS;
        const int whole = rows == AMX_ROWS || few;
        float *dst = whole ? c + (size_t)r0 * ldc : part;
        const long ld = whole ? ldc : F32_LD;
        _tile_stored(0, dst, ld * 4);
        if (nt > 1) _tile_stored(1, dst + F32_TILE, ld * 4);
        if (nt > 2) _tile_stored(2, dst + 2 * F32_TILE, ld * 4);
        if (nt > 3) _tile_stored(3, dst + 3 * F32_TILE, ld * 4);
        if (!whole)
            for (int r = 0; r < rows; r++)
                memcpy(c + (size_t)(r0 + r) * ldc, part + (size_t)r * F32_LD, sizeof(float) * nt * F32_TILE);
    }
}
#endif

/* Group g (F32_GROUP tiles from tile g * F32_GROUP) of the product for all m rows, into c [m][F32_LD]; returns
 * its number of tiles. xs: NULL, or (AMX) the rows' split parts (see amx_ready), planes `plane` apart, from
 * which the group runs on the tile unit instead, into c's rows ldc floats apart (else F32_LD). wide: F32_WIDE
 * floats of scratch, or NULL: with many rows, a bf16 weight's slice is widened once there for all of them
 * rather than in registers for each F32_ROWS (the same values). `then`:
 * the group this thread takes next (-1: none), fetched as this one is read: unwidened, whole, with the first
 * row block; widened, from a weight of F32_FETCH_BYTES or more, the slice widened next (this group's next
 * pairs, else group then's first) into L2, a few lines for each block of rows (a large weight's slices come
 * from memory again for each panel of rows, and the widening waited on every line; a small one's stay in the
 * caches, where the fetching only costs). */
static int f32_group(const void *w, int bf16, int n, int k, const float *x, long ldx, int m, float *c, long ldc,
                     int g, float *wide, int then, const uint16_t *xs, size_t plane) {
    const int tiles = (n + F32_TILE - 1) / F32_TILE, groups = (tiles + F32_GROUP - 1) / F32_GROUP, pairs = k / 2;
    const size_t tile_bytes = (size_t)k * F32_TILE * (bf16 ? 2 : 4);
    const int tile0 = g * F32_GROUP, nt = tiles - tile0 < F32_GROUP ? tiles - tile0 : F32_GROUP;
    const char *wg = (const char *)w + (size_t)tile0 * tile_bytes;
#ifdef __AMX_BF16__
    if (xs) {
        (void)x, (void)ldx, (void)wide, (void)then;
        amx_group((const uint16_t *)wg, k, nt, xs, plane, m, c, ldc);
        return nt;
    }
#else
    (void)xs, (void)plane;
#endif
    (void)ldc; /* (F32_LD: the blocks' own) */
    const int widen = bf16 && wide && m >= F32_WIDEN_ROWS, blocks = (m + F32_ROWS - 1) / F32_ROWS;
    const char *wthen = then >= 0 && then < groups ? (const char *)w + (size_t)then * F32_GROUP * tile_bytes : NULL;
    const int fetch = widen && (size_t)tiles * tile_bytes >= F32_FETCH_BYTES;
    for (int p0 = 0; p0 < pairs; p0 += F32_KP) {
        const int p1 = p0 + F32_KP < pairs ? p0 + F32_KP : pairs;
        if (widen) f32_widen((const uint16_t *)wg, k, nt, p0, p1, wide);
        /* the slice widened next: tiles of `span` pairs (a 64-byte line each) from pair q0 of the tiles from wn */
        const char *wn = p1 < pairs ? wg : wthen;
        const int q0 = p1 < pairs ? p1 : 0, span = pairs - q0 < F32_KP ? pairs - q0 : F32_KP;
        const int lines = fetch && wn ? F32_GROUP * span : 0;
        for (int r0 = 0, b = 0, l = 0, lt = 0, lq = 0; r0 < m; r0 += F32_ROWS, b++) {
            const int r = m - r0 < F32_ROWS ? m - r0 : F32_ROWS;
            const float *xr = x + (size_t)r0 * ldx;
            float *cr = c + (size_t)r0 * F32_LD;
            if (widen) { /* the slice as a float32 weight of 2 * (p1 - p0) columns, from column 2 * p0 of x */
                for (const int l1 = lines * (b + 1) / blocks; l < l1; l++) { /* line lq of tile lt */
                    _mm_prefetch(wn + (size_t)lt * tile_bytes + (size_t)(q0 + lq) * 64, _MM_HINT_T1);
                    if (++lq == span) lq = 0, lt++;
                }
                F32_BLOCK_FN[0][nt][r](wide, 2 * (p1 - p0), 0, p1 - p0, xr + 2 * p0, ldx, cr, p0 == 0, NULL);
            } else {
                F32_BLOCK_FN[bf16 != 0][nt][r](wg, k, p0, p1, xr, ldx, cr, p0 == 0, r0 == 0 ? wthen : NULL);
            }
        }
    }
    return nt;
}

/* The calling thread's share of a product (see sluice_f32_matmul): units of (panel of rows, group), panel by
 * panel, taken from the shared counter *next as they come, `chunk` at a time. c: f32_panel_rows * F32_LD
 * floats of scratch; wide: F32_WIDE floats, or NULL (see f32_group); best / where: this thread's (argmax
 * only). */
static void f32_matmul_part(const void *w, int bf16, int n, int k, const float *x, long ldx, int m, const float *bias,
                            float *out, long ldo, float *best, int32_t *where, float *c, float *wide, int *next,
                            int chunk, const uint16_t *xs, size_t plane) {
    const int groups = ((n + F32_TILE - 1) / F32_TILE + F32_GROUP - 1) / F32_GROUP, panel = f32_panel_rows(m, k);
    const int units = (m + panel - 1) / panel * groups;
    f32_queue q = f32_queue_new(next, chunk, units);
    for (int u, after; (u = f32_unit(&q, next, chunk, units, &after)) >= 0;) {
        const int r0 = u / groups * panel, g = u % groups, rows = m - r0 < panel ? m - r0 : panel;
        /* AMX's tiles straight into the output where it takes them as they are (no bias, whole tiles) */
        const int direct = xs && out && !bias && (g + 1) * F32_GROUP * F32_TILE <= n;
        const int nt = f32_group(w, bf16, n, k, x + (size_t)r0 * ldx, ldx, rows,
                                 direct ? out + (size_t)r0 * ldo + g * F32_GROUP * F32_TILE : c, direct ? ldo : F32_LD,
                                 g, wide, after < 0 ? -1 : after % groups, xs ? xs + (size_t)r0 * k : NULL, plane);
        if (!direct)
            f32_finish(c, rows, g * F32_GROUP, nt, n, bias, out ? out + (size_t)r0 * ldo : NULL, ldo,
                       best ? best + (size_t)r0 * F32_TILE : NULL, where ? where + (size_t)r0 * F32_TILE : NULL);
    }
}

/* The rows' SwiGLU of a gate group's products c and the matching up group's cu (+ their biases) into out:
 * out [r][col] = silu(gate) * up for the columns from tile0 * F32_TILE on, n (inter) columns in all. */
static void f32_finish_swiglu(const float *c, const float *cu, int m, int tile0, int nt, int n, const float *bias,
                              float *out, long ldo) {
    for (int r = 0; r < m; r++) {
        for (int t = 0; t < nt; t++) {
            const int col0 = (tile0 + t) * F32_TILE;
            const __mmask16 valid = first_lanes(n - col0);
            __m512 g = _mm512_loadu_ps(c + (size_t)r * F32_LD + t * F32_TILE);
            __m512 u = _mm512_loadu_ps(cu + (size_t)r * F32_LD + t * F32_TILE);
            if (bias) {
                g = _mm512_add_ps(g, _mm512_maskz_loadu_ps(valid, bias + col0));
                u = _mm512_add_ps(u, _mm512_maskz_loadu_ps(valid, bias + n + col0));
            }
            _mm512_mask_storeu_ps(out + (size_t)r * ldo + col0, valid, silu_mul(g, u));
        }
    }
}

/* The calling thread's share of silu(x @ Wg^T + bg) * (x @ Wu^T + bu) for a stacked weight of n outputs (gate
 * rows, then up rows, n / 2 a multiple of F32_GROUP * F32_TILE: gate group g and up group g + n / 2 / 64 hold
 * the same columns). A unit is such a pair of groups for a panel of rows (see f32_matmul_part); the
 * [m][2 * inter] product is never written. c: 2 * f32_panel_rows * F32_LD floats of scratch. */
static void f32_swiglu_part(const void *w, int bf16, int n, int k, const float *x, long ldx, int m, const float *bias,
                            float *out, long ldo, float *best, int32_t *where, float *c, float *wide, int *next,
                            int chunk, const uint16_t *xs, size_t plane) {
    (void)best, (void)where;
    const int half = n / 2 / (F32_GROUP * F32_TILE), panel = f32_panel_rows(m, k);
    const int units = (m + panel - 1) / panel * half;
    float *cu = c + (size_t)panel * F32_LD;
    f32_queue q = f32_queue_new(next, chunk, units);
    for (int u, after; (u = f32_unit(&q, next, chunk, units, &after)) >= 0;) {
        const int r0 = u / half * panel, g = u % half, rows = m - r0 < panel ? m - r0 : panel;
        const float *xr = x + (size_t)r0 * ldx;
        const uint16_t *xsr = xs ? xs + (size_t)r0 * k : NULL;
        const int nt = f32_group(w, bf16, n, k, xr, ldx, rows, c, F32_LD, g, wide, g + half, xsr, plane);
        f32_group(w, bf16, n, k, xr, ldx, rows, cu, F32_LD, g + half, wide, after < 0 ? -1 : after % half, xsr, plane);
        f32_finish_swiglu(c, cu, rows, g * F32_GROUP, nt, n / 2, bias, out + (size_t)r0 * ldo, ldo);
    }
}

#include "f32_drive.h"

/* out [m][ldo] = silu(x @ Wg^T + bg) * (x @ Wu^T + bu) for the stacked weight w of n outputs (gate, then up;
 * see f32_swiglu_part) and bias (NULL or n floats): a SwiGLU MLP's first half in one pass. Returns 0, -1 when
 * out of memory, -2 when n / 2 is not a multiple of 64. */
int sluice_f32_matmul_swiglu(const void *w, int bf16, int n, int k, const float *x, long ldx, int m,
                             const float *bias, float *out, long ldo) {
    if (n % (2 * F32_GROUP * F32_TILE)) return -2;
    return f32_run(f32_swiglu_part, 2, w, bf16, n, k, x, ldx, m, bias, out, ldo, NULL);
}
