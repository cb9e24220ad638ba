/* Greedy tokens from a float32 model's LM head (f32_matmul.c's), screened in int8 first: the same tokens.
 *
 * The method and its bounds are int8_argmax.c's (the bf16 head's): each row is screened against an int8
 * copy of the weight with VPDPBUSD (AVX512-VNNI, 64 multiply-adds an instruction against float32 FMA's 16),
 * and only the columns whose logit could still be the row's maximum are computed again exactly as
 * f32_matmul.c computes them (its own block function, in the same order over k, on the same packed weight:
 * the same bits), the first index of a tie winning. Here the logits are float32 and compared unrounded, so
 * the slack below the best lower bound L is the float32 sums' rounding alone (2 G: the token's and L's
 * column's), with 2^-16 of |L| and of the largest bound for the screen's own float rounding.
 *
 * Built for AVX2 and FMA (no AVX-512), the screen multiplies with VPMADDUBSW + VPMADDWD (int8_screen.h) and the
 * exact logits are f32_matmul_avx2.c's (the same bits as f32_matmul.c's): the same tokens on either build.
 * Built with AVX512-BF16 it also screens a bf16 weight in bf16 (sluice_f32_bf16_argmax, at the end).
 */
#ifdef __AVX512F__
#include "f32_matmul.c"
#else
#include "f32_matmul_avx2.c"
#endif

enum { TILE = F32_TILE, GROUP = F32_GROUP, CHUNK = 8 };

static inline int take_groups(int *next, int groups, int *g0, int *g1) { return f32_take(next, CHUNK, groups, g0, g1); }

#include "int8_screen.h"

/* The float32 head: its packed weight w (bf16 pairs or float32, as `bf16` says, F32_AMX on AMX); hs: room for a
 * row's split parts on AMX (3 x k, planes k apart). */
typedef struct {
    Head head;
    const void *w;
    int bf16, n, k;
    uint16_t *hs;
} F32Head;

static const float *as_float(const Head *head, const void *row, float *scratch) {
    (void)head, (void)scratch;
    return row;
}

/* The exact float32 logits of the row at the `count` columns col: those columns gathered into one tile and run
 * through f32_matmul.c's block for one tile, over the pairs in its blocks of F32_KP, as the full product runs
 * them; on AMX through its tile product, from the row's split parts (split at the row's `first` call). */
static void exact_logits(Head *head, const void *row, const int32_t *col, int count, int first, float *out) {
    const F32Head *f = (const F32Head *)head;
    const int k = f->k, bf16 = f->bf16;
    const size_t elem = bf16 ? 2 : 4, tile_elems = (size_t)k * TILE;
    char *tile = head->tile;
    memset(tile, 0, elem * tile_elems);
    for (int j = 0; j < count; j++) {
        const int from = col[j] / TILE, lane = col[j] % TILE;
        const char *src = (const char *)f->w + elem * tile_elems * from;
        for (int p = 0; p < k / 2; p++) {
            if (bf16) { /* [K/2][16][2] */
                memcpy(tile + 2 * ((size_t)p * 32 + 2 * j), src + 2 * ((size_t)p * 32 + 2 * lane), 4);
            } else { /* [K/2][2][16] */
                for (int e = 0; e < 2; e++)
                    memcpy(tile + 4 * ((size_t)p * 32 + e * 16 + j), src + 4 * ((size_t)p * 32 + e * 16 + lane), 4);
            }
        }
    }
    float c[F32_LD];
#ifdef __AMX_BF16__
    if (bf16 == F32_AMX) {
        if (first) amx_split(row, k, 0, 1, k, f->hs, (size_t)k);
        amx_group(head->tile, k, 1, f->hs, (size_t)k, 1, c, F32_LD);
        for (int j = 0; j < count; j++) out[j] = c[j];
        return;
    }
#endif
    (void)first;
    for (int p0 = 0; p0 < k / 2; p0 += F32_KP) {
        const int p1 = p0 + F32_KP < k / 2 ? p0 + F32_KP : k / 2;
        F32_BLOCK_FN[bf16 != 0][1][1](tile, k, p0, p1, row, k, c, p0 == 0, NULL);
    }
    for (int j = 0; j < count; j++) out[j] = c[j];
}

static int full_argmax(const Head *head, const void *rows, int m, int32_t *tokens) {
    const F32Head *f = (const F32Head *)head;
    return sluice_f32_matmul(f->w, f->bf16, f->n, f->k, rows, f->k, m, NULL, NULL, 0, tokens);
}

/* tokens[m]: each float32 row h's argmax over the n columns of the head, the same as sluice_f32_matmul(w, ...)
 * gives; the int8 weight as int8_argmax.c takes it. Returns how many rows were computed again in full, or -1
 * when out of memory. */
int sluice_f32_int8_argmax(const int8_t *q, const int32_t *start, const float *scale, const float *err,
                           const float *norm, const void *w, int bf16, int n, int k, float err_w, float norm_w,
                           float norm_q, const float *h, int m, int32_t *tokens) {
    const Weight c = {q, start, scale, err, norm, n, k};
    uint16_t *hs = malloc(sizeof(uint16_t) * 3 * (size_t)k); /* AMX: a row's split parts */
    if (!hs) return -1;
#ifdef __AMX_BF16__
    if (bf16 == F32_AMX) amx_configure(1); /* (this thread's tiles, for exact_logits; the redo sets its own) */
#endif
    /* the slack: the float32 sums' rounding (2 G), and 2^-16 for the screen's own */
    F32Head f = {{sizeof(float) * k, 2, 0x1p-16f, NULL, as_float, exact_logits, full_argmax, k}, w, bf16, n, k, hs};
    const int status = screened_argmax(&f.head, &c, err_w, norm_w, norm_q, h, m, tokens);
    free(hs);
    return status;
}

#if defined(__AVX512BF16__) && defined(__AVX512VNNI__) && !defined(__AMX_BF16__)
#include "bf16_tiles.h"

/* ---- the bf16 screen: the head's own bf16 weight (no int8 copy), on AVX512-BF16 ----
 *
 * Each row x is rounded to bf16 (to nearest even; values under bf16's normal range to zero, as VDPBF16PS takes
 * its inputs), x^, and screened with VDPBF16PS against the packed weight the float32 head multiplies (bf16
 * tiles, [K/2][16][2]): a_v = x^ . w_v, the products exact, summed in float32. The weight is exact in bf16, so
 * |x . w_v - a_v| <= ||x - x^|| ||w_v|| (Cauchy-Schwarz: B_v with e_v = 0, n_v = ||w_v||, in units of 1) plus
 * the screen's own float32 sums' rounding (2 G, of the same G as the exact logits'). x - x^ is at most 2^-9 of
 * each value (an int8 row's error is max |x| / 254 on every value), so B_v is about 0.3 logits on a trained
 * model's rows, and one column or a few are kept: the int8 screen keeps thousands of such rows and stops. */

/* x (k floats) as bf16 pairs into xb and its bounds; -1 where it cannot be screened (not finite, all zero) */
static int bf16_row(const float *x, int k, uint16_t *xb, float norm_w, double rounds, float rel, Row *row) {
    double xx = 0, dd = 0;
    for (int i = 0; i < k; i++) {
        const float v = x[i];
        if (!isfinite(v)) return -1;
        uint32_t bits;
        memcpy(&bits, &v, 4);
        bits += 0x7FFF + ((bits >> 16) & 1); /* (to nearest even; finite values stay finite or become inf) */
        uint16_t b = (uint16_t)(bits >> 16);
        if ((b & 0x7F80) == 0 || (b & 0x7F80) == 0x7F80) b = 0; /* (under the normal range, or rounded to inf) */
        xb[i] = b;
        const uint32_t back = (uint32_t)b << 16;
        float r;
        memcpy(&r, &back, 4);
        const double d = (double)v - (double)r;
        xx += (double)v * v;
        dd += d * d;
    }
    if (!(xx > 0)) return -1;
    const double b = norm_w * sqrt(dd);                             /* the largest B_v */
    const double g = 0x1p-24 * k * norm_w * (sqrt(xx) + sqrt(dd)); /* the float32 sums' rounding, of ||x^|| too */
    row->nx = 0;
    row->ndx = (float)(sqrt(dd) * (1 + 0x1p-10));
    row->fixed = (float)(((rounds + 2) * g + rel * b) * (1 + 0x1p-10) + 1e-30);
    row->rel = rel;
    return 0;
}

/* R bf16 rows u (k values apart) against NT tiles from tile0 of the packed bf16 weight c->q: the screened values
 * into out ([R][NT][16]); returns which (bit r * NT + t) have an upper bound reaching their row's floor. pf: the
 * next group's tiles, to prefetch (or NULL). screen_rows' screen_fn, as int8_screen.h's SCREEN's. */
#define BSCREEN(R, NT)                                                                                       \
    static uint32_t bscreen_##R##_##NT(const Weight *c, const uint8_t *restrict u, int tile0, const Row *rows, \
                                       const Pool *pools, float *restrict out, const int8_t *pf) {           \
        const int k = c->k;                                                                                  \
        __m512 acc[R][NT];                                                                                   \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                                                  \
            _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++) acc[r][t] = _mm512_setzero_ps();            \
        BF16_TILES_DOT(R, NT, acc, (const uint16_t *)c->q, (const uint16_t *)u, k, tile0, (const uint16_t *)pf); \
        uint32_t hits = 0;                                                                                   \
        _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++) {                                               \
            const size_t col = (size_t)(tile0 + t) * TILE;                                                   \
            const __m512 norm = _mm512_loadu_ps(c->norm + col);                                              \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                            \
                _mm512_storeu_ps(out + (r * NT + t) * TILE, acc[r][t]);                                      \
                const __m512 up = _mm512_fmadd_ps(norm, _mm512_set1_ps(rows[r].ndx), acc[r][t]);             \
                if (_mm512_cmp_ps_mask(up, _mm512_set1_ps(pools[r].floor), _CMP_GE_OQ)) hits |= 1u << (r * NT + t); \
            }                                                                                                \
        }                                                                                                    \
        return hits;                                                                                         \
    }
BSCREEN(1, 4) BSCREEN(2, 4) BSCREEN(3, 4) BSCREEN(4, 4) BSCREEN(5, 4) BSCREEN(6, 4)
BSCREEN(1, 1) BSCREEN(2, 1) BSCREEN(3, 1) BSCREEN(4, 1) BSCREEN(5, 1) BSCREEN(6, 1)
static const screen_fn BSCREEN_FULL[S_ROWS + 1] = {0, bscreen_1_4, bscreen_2_4, bscreen_3_4, bscreen_4_4,
                                                   bscreen_5_4, bscreen_6_4};
static const screen_fn BSCREEN_ONE[S_ROWS + 1] = {0, bscreen_1_1, bscreen_2_1, bscreen_3_1, bscreen_4_1,
                                                  bscreen_5_1, bscreen_6_1};

/* tokens[m]: each float32 row h's argmax over the n columns of the head's bf16 weight w (packed as the float32
 * head's: the same tokens as sluice_f32_matmul(w, 1, ...)), screened in bf16 (err: zeros, norm: ||w_v||, both
 * padded to whole tiles; norm_w the largest). Returns how many rows were computed again in full, or -1 when out
 * of memory. */
int sluice_f32_bf16_argmax(const uint16_t *w, const float *err, const float *norm, int n, int k, float norm_w,
                           const float *h, int m, int32_t *tokens) {
    const Weight c = {(const int8_t *)w, NULL, NULL, err, norm, n, k};
    const int threads = omp_get_max_threads();
    F32Head f = {{sizeof(float) * k, 2, 0x1p-16f, NULL, as_float, exact_logits, full_argmax, k}, w, 1, n, k, NULL};
    uint16_t *xb = malloc(sizeof(uint16_t) * (size_t)m * k);
    Row *rows = malloc(sizeof(Row) * m);
    int *bad = malloc(sizeof(int) * m);
    Pool *pools = malloc(sizeof(Pool) * (size_t)threads * m);
    int status = -1;
    if (xb && rows && bad && pools) {
        for (int r = 0; r < m; r++)
            bad[r] = bf16_row(h + (size_t)r * k, k, xb + (size_t)r * k, norm_w, f.head.sums_g, f.head.rel, rows + r);
        init_pools(pools, threads, m, bad);
        screen_rows(&c, 2, (const uint8_t *)xb, sizeof(uint16_t) * k, BSCREEN_FULL, BSCREEN_ONE, m, rows, pools,
                    threads);
        status = settle_rows(&f.head, pools, threads, m, rows, h, tokens);
    }
    free(xb), free(rows), free(bad), free(pools);
    return status;
}
#endif

