/* The int8 screen of greedy rows against the LM head, shared by the bf16 head (int8_argmax.c) and the float32
 * one (f32_int8_argmax.c), and their one driver (screened_argmax), which each head parametrises; see
 * int8_argmax.c for the method and its bounds. The file that includes this one defines TILE, GROUP and
 * take_groups() first (its matmul's: blocks of GROUP tiles handed out to the threads).
 *
 * One source for two builds: with AVX512-VNNI (VPDPBUSD, 64 multiply-adds an instruction), else with AVX2
 * (VPMADDUBSW + VPMADDWD, 32 in three). Both give every screened value exactly (int32 sums of the same int8
 * products, scaled the same way), so they keep the same columns and give the same tokens. */
#ifndef SLUICE_INT8_SCREEN_H
#define SLUICE_INT8_SCREEN_H

#include <string.h>

enum { CAP = 128 };

/* The int8 weight: per column (padded to whole tiles, zero past n) -128 sum(q_v) (the VNNI build's), s_v, e_v and
 * n_v. */
typedef struct {
    const int8_t *q;
    const int32_t *start;
    const float *scale, *err, *norm;
    int n, k;
} Weight;

/* A quantized row, its bounds in units of s_x: B_v = e_v nx + n_v ndx; slack = fixed + rel |L|. */
typedef struct {
    float nx, ndx, fixed, rel;
} Row;

/* One row's kept columns, for one thread. */
typedef struct {
    float top;    /* L: the best lower bound A_v - B_v seen (in units of s_x) */
    float floor;  /* L - slack: upper bounds below it are dropped */
    int count, overflow;
    int32_t col[CAP];
    float val[CAP]; /* their upper bounds */
} Pool;

#ifdef __AVX512VNNI__
/* 16 lanes a vector, a tile's 16 columns in one. R rows x NT tiles a call: 6 x 4 (24 accumulators of 32). */
#define SL 16
#define S_ROWS 6
#define S_TILES 4
enum { X_OFFSET = 128 }; /* q_x is fed to VPDPBUSD unsigned, as q_x + 128 */
typedef __m512i si;
typedef __m512 sf;
static inline si s_load(const void *p) { return _mm512_loadu_si512(p); }
/* a column's accumulator starts at -128 sum(q_v) (given), taking the offset of q_x back off */
static inline si s_start(const int32_t *start) { return _mm512_loadu_si512(start); }
/* the four bytes of a row at u, in every lane */
static inline si s_row(const uint8_t *u) { return _mm512_set1_epi32(*(const int32_t *)u); }
/* acc + (the sums of four products of x's unsigned and w's signed bytes), as _mm512_dpbusd_epi32. GCC 12
 * compiles that intrinsic with a copy of the accumulator per use, and with 24 of them spills them all
 * to the stack in the inner loop (a third slower); this is the one instruction. */
static inline si s_dot(si acc, si x, si w) {
    __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(x), "v"(w));
    return acc;
}
static inline sf s_loadf(const float *p) { return _mm512_loadu_ps(p); }
static inline void s_storef(float *p, sf v) { _mm512_storeu_ps(p, v); }
static inline sf s_set1(float x) { return _mm512_set1_ps(x); }
static inline sf s_scaled(si acc, sf scale) { return _mm512_mul_ps(_mm512_cvtepi32_ps(acc), scale); }
static inline sf s_add(sf a, sf b) { return _mm512_add_ps(a, b); }
static inline sf s_mul(sf a, sf b) { return _mm512_mul_ps(a, b); }
static inline sf s_fmadd(sf a, sf b, sf c) { return _mm512_fmadd_ps(a, b, c); }
static inline int s_reaches(sf v, float floor) { return _mm512_cmp_ps_mask(v, _mm512_set1_ps(floor), _CMP_GE_OQ) != 0; }
#else
/* AVX2: 8 lanes a vector, a tile's 16 columns in two. Without VPDPBUSD the sums of four products are VPMADDUBSW's
 * pairs (unsigned |x| by w with x's sign: |q_x|, |q_v| <= 127, so a pair's int16 sum cannot saturate) added by
 * VPMADDWD, as llama.cpp's AVX2 dot products; q_x is signed, so nothing comes off. R rows x 1 tile a call: 4 x 1
 * (8 accumulators of 16 ymm registers, beside the tile's bytes and a row's). */
#define SL 8
#define S_ROWS 4
#define S_TILES 1
enum { X_OFFSET = 0 };
typedef __m256i si;
typedef __m256 sf;
static inline si s_load(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline si s_start(const int32_t *start) { (void)start; return _mm256_setzero_si256(); }
static inline si s_row(const uint8_t *u) { return _mm256_set1_epi32(*(const int32_t *)u); }
static inline si s_dot(si acc, si x, si w) {
    const si pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(x), _mm256_sign_epi8(w, x));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}
static inline sf s_loadf(const float *p) { return _mm256_loadu_ps(p); }
static inline void s_storef(float *p, sf v) { _mm256_storeu_ps(p, v); }
static inline sf s_set1(float x) { return _mm256_set1_ps(x); }
static inline sf s_scaled(si acc, sf scale) { return _mm256_mul_ps(_mm256_cvtepi32_ps(acc), scale); }
static inline sf s_add(sf a, sf b) { return _mm256_add_ps(a, b); }
static inline sf s_mul(sf a, sf b) { return _mm256_mul_ps(a, b); }
static inline sf s_fmadd(sf a, sf b, sf c) { return _mm256_fmadd_ps(a, b, c); }
static inline int s_reaches(sf v, float floor) {
    return _mm256_movemask_ps(_mm256_cmp_ps(v, _mm256_set1_ps(floor), _CMP_GE_OQ)) != 0;
}
#endif
enum { HALVES = TILE / SL }; /* vectors a tile */

/* The floor of a row whose best lower bound is top. */
static inline float floor_of(float top, const Row *row) { return top - (row->fixed + row->rel * fabsf(top)); }

/* Each column's B_v for row `row`, for the SL columns from col. */
static inline sf bound(const Weight *c, size_t col, const Row *row) {
    return s_fmadd(s_loadf(c->err + col), s_set1(row->nx), s_mul(s_loadf(c->norm + col), s_set1(row->ndx)));
}

/* Takes the screened values a (units of s_x) of the 16 columns of tile t, some of whose upper bounds reach the
 * row's floor, into its pool. */
__attribute__((noinline)) static void keep(Pool *p, const float *a, const Weight *c, int t, const Row *row) {
    float b[TILE];
    for (int h = 0; h < HALVES; h++) s_storef(b + h * SL, bound(c, (size_t)t * TILE + h * SL, row));
    const int valid = c->n - t * TILE < TILE ? c->n - t * TILE : TILE;
    float m = -INFINITY;
    for (int i = 0; i < valid; i++) m = a[i] - b[i] > m ? a[i] - b[i] : m;
    if (m > p->top) {
        p->top = m;
        p->floor = floor_of(m, row);
        int kept = 0; /* what the higher floor drops from the pool */
        for (int i = 0; i < p->count; i++)
            if (p->val[i] >= p->floor) {
                p->col[kept] = p->col[i];
                p->val[kept++] = p->val[i];
            }
        p->count = kept;
    }
    int add = 0;
    for (int i = 0; i < valid; i++) add += a[i] + b[i] >= p->floor;
    if (p->count + add > CAP) {
        p->overflow = 1;
        p->floor = INFINITY; /* this row is computed again in full: keep nothing more */
        return;
    }
    for (int i = 0; i < valid; i++)
        if (a[i] + b[i] >= p->floor) {
            p->col[p->count] = t * TILE + i;
            p->val[p->count++] = a[i] + b[i];
        }
}

/* R quantized rows u (k bytes apart) against NT int8 tiles from tile0: the screened values into out
 * ([R][NT][16]); returns which of them (bit r * NT + t) have an upper bound that reaches its row's floor
 * (that of pools[r]). (Keeping them is left to the caller: a call here would keep the accumulators in
 * memory through the loop.) */
#define SCREEN(R, NT)                                                                                        \
    static uint32_t screen_##R##_##NT(const Weight *c, const uint8_t *restrict u, int tile0, const Row *rows, \
                                      const Pool *pools, float *restrict out, const int8_t *pf) {            \
        const int k = c->k;                                                                                  \
        si acc[R][NT * HALVES];                                                                              \
        _Pragma("GCC unroll 8") for (int j = 0; j < NT * HALVES; j++) {                                      \
            const si s0 = s_start(c->start + (size_t)tile0 * TILE + j * SL);                                 \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) acc[r][j] = s0;                              \
        }                                                                                                    \
        const int8_t *wt = c->q + (size_t)tile0 * k * TILE;                                                  \
        for (int p = 0; p < k / 4; p++) {                                                                    \
            si wv[NT * HALVES];                                                                              \
            _Pragma("GCC unroll 8") for (int j = 0; j < NT * HALVES; j++)                                    \
                wv[j] = s_load(wt + (size_t)(j / HALVES) * k * TILE + p * 64 + (j % HALVES) * SL * 4);       \
            if (pf)                                                                                          \
                _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++)                                         \
                    _mm_prefetch((const char *)(pf + (size_t)t * k * TILE + p * 64), _MM_HINT_T1);           \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                            \
                const si ub = s_row(u + (size_t)r * k + 4 * p);                                              \
                _Pragma("GCC unroll 8") for (int j = 0; j < NT * HALVES; j++)                                \
                    acc[r][j] = s_dot(acc[r][j], ub, wv[j]);                                                 \
            }                                                                                                \
        }                                                                                                    \
        uint32_t hits = 0;                                                                                   \
        _Pragma("GCC unroll 8") for (int j = 0; j < NT * HALVES; j++) {                                      \
            const size_t col = (size_t)tile0 * TILE + j * SL;                                                \
            const sf sv = s_loadf(c->scale + col);                                                           \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                            \
                const sf a = s_scaled(acc[r][j], sv);                                                        \
                s_storef(out + (r * NT + j / HALVES) * TILE + (j % HALVES) * SL, a);                         \
                if (s_reaches(s_add(a, bound(c, col, rows + r)), pools[r].floor))                            \
                    hits |= 1u << (r * NT + j / HALVES);                                                     \
            }                                                                                                \
        }                                                                                                    \
        return hits;                                                                                         \
    }
#if S_TILES == 1
#define SCREENS(R) SCREEN(R, 1)
#else
#define SCREENS(R) SCREEN(R, 4) SCREEN(R, 1)
#endif
SCREENS(1) SCREENS(2) SCREENS(3) SCREENS(4)
#if S_ROWS == 6
SCREENS(5) SCREENS(6)
#endif

typedef uint32_t (*screen_fn)(const Weight *, const uint8_t *, int, const Row *, const Pool *, float *,
                              const int8_t *);

/* Keeps the `hits` of a block's screened values `out` ([rows][nt][16], tiles from tile0). */
static void offer(uint32_t hits, const float *out, int rows, int nt, const Weight *c, int tile0, const Row *row,
                  Pool *pools) {
    for (int r = 0; r < rows; r++)
        for (int t = 0; t < nt; t++)
            if (hits >> (r * nt + t) & 1)
                keep(pools + r, out + (r * nt + t) * TILE, c, tile0 + t, row + r);
}
/* by rows: S_ROWS x S_TILES tiles, and x 1 tile (a block's last tiles) */
#if S_ROWS == 6
static const screen_fn SCREEN_FULL[S_ROWS + 1] = {0, screen_1_4, screen_2_4, screen_3_4, screen_4_4, screen_5_4,
                                                  screen_6_4};
static const screen_fn SCREEN_ONE[S_ROWS + 1] = {0, screen_1_1, screen_2_1, screen_3_1, screen_4_1, screen_5_1,
                                                 screen_6_1};
#else
static const screen_fn SCREEN_ONE[S_ROWS + 1] = {0, screen_1_1, screen_2_1, screen_3_1, screen_4_1};
#define SCREEN_FULL SCREEN_ONE
#endif

/* Quantizes row h (k float values) into u (q_x + X_OFFSET) and gives its bounds (err_w, norm_w, norm_q: the
 * largest e_v, ||w_v|| and n_v; the exact logits' slack beyond the screen's: rounds * G of their float32
 * sums' rounding G, and rel of the largest bound and of |L|); 0, or -1 when the row cannot be screened (all
 * zero, or not finite). */
static int quantize_row(const float *h, int k, uint8_t *u, float err_w, float norm_w, float norm_q, double rounds,
                        float rel, Row *row) {
    float amax = 0;
    for (int i = 0; i < k; i++) {
        const float x = h[i];
        if (!(fabsf(x) <= amax)) amax = fabsf(x); /* (NaN lands here and stays: caught below) */
    }
    if (!(amax > 0) || !isfinite(amax)) return -1;
    const float sx = amax / 127;
    double xx = 0, dd = 0;
    for (int i = 0; i < k; i++) {
        const float x = h[i];
        float q = nearbyintf(x / sx);
        q = q > 127 ? 127 : q < -127 ? -127 : q;
        u[i] = (uint8_t)((int)q + X_OFFSET);
        const double d = (double)x - (double)sx * q;
        xx += (double)x * x;
        dd += d * d;
    }
    const double b = err_w * sqrt(xx) + norm_q * sqrt(dd); /* the largest B_v */
    const double g = 0x1p-24 * k * norm_w * sqrt(xx);      /* the float32 sums' rounding */
    row->nx = (float)(sqrt(xx) / sx);
    row->ndx = (float)(sqrt(dd) / sx);
    row->fixed = (float)(((rounds * g + rel * b) * (1 + 0x1p-10) + 1e-30) / sx);
    row->rel = rel;
    return 0;
}

/* The kept columns of row r, merged over the threads' pools (those that reach the floor of the best lower
 * bound any thread saw) into kept; -1 when a pool overflowed. */
static int merge_pools(const Pool *pools, int threads, int m, int r, const Row *row, int32_t *kept) {
    float top = -INFINITY;
    for (int th = 0; th < threads; th++) {
        const Pool *p = pools + (size_t)th * m + r;
        if (p->overflow) return -1;
        if (p->top > top) top = p->top;
    }
    const float floor = floor_of(top, row);
    int count = 0;
    for (int th = 0; th < threads; th++) {
        const Pool *p = pools + (size_t)th * m + r;
        for (int i = 0; i < p->count; i++)
            if (p->val[i] >= floor) kept[count++] = p->col[i];
    }
    return count;
}

/* Screens m rows u (row_bytes apart) against the weight c (c->q, elem bytes a value) on the team's threads
 * (pools: threads * m), with a screen's tiles: full (S_ROWS rows x S_TILES tiles) and one (x 1 tile); the
 * int8 screen's are SCREEN_FULL / SCREEN_ONE. */
static void screen_rows(const Weight *c, int elem, const uint8_t *u, size_t row_bytes, const screen_fn *full,
                        const screen_fn *one, int m, const Row *rows, Pool *pools, int threads) {
    const int tiles = (c->n + TILE - 1) / TILE, groups = (tiles + GROUP - 1) / GROUP, k = c->k;
    int next = 0;
#pragma omp parallel num_threads(threads)
    {
        Pool *mine = pools + (size_t)omp_get_thread_num() * m;
        float out[S_ROWS * S_TILES * TILE];
        for (int g0, g1; take_groups(&next, groups, &g0, &g1);) {
            for (int g = g0; g < g1; g++) {
                const int tile0 = g * GROUP, nt = tiles - tile0 < GROUP ? tiles - tile0 : GROUP;
                for (int r0 = 0; r0 < m; r0 += S_ROWS) {
                    const int r = m - r0 < S_ROWS ? m - r0 : S_ROWS;
                    const uint8_t *ur = u + (size_t)r0 * row_bytes;
                    for (int t = 0, step; t < nt; t += step) {
                        step = nt - t < S_TILES ? 1 : S_TILES;
                        const int8_t *pf = r0 == 0 && nt == GROUP && g + 1 < groups
                                               ? c->q + (size_t)(tile0 + t + GROUP) * k * TILE * elem : NULL;
                        const uint32_t hits = (step == S_TILES ? full : one)[r](c, ur, tile0 + t, rows + r0,
                                                                               mine + r0, out, pf);
                        if (hits) offer(hits, out, r, step, c, tile0 + t, rows + r0, mine + r0);
                    }
                }
            }
        }
    }
}

/* Fresh pools for m rows (a row that could not be quantized, bad[r], is redone whole). */
static void init_pools(Pool *pools, int threads, int m, const int *bad) {
    for (size_t i = 0; i < (size_t)threads * m; i++) {
        pools[i].top = -INFINITY;
        pools[i].floor = bad[i % m] ? INFINITY : -INFINITY;
        pools[i].count = 0;
        pools[i].overflow = bad[i % m];
    }
}

/* What the screened argmax asks of the LM head it stands in for (int8_argmax.c's bf16 head, f32_int8_argmax.c's
 * float32 one); a head's own context begins with this. */
typedef struct Head {
    size_t row_bytes;                /* one hidden row's */
    double sums_g;                   /* the slack for the head's float32 sums, in G (quantize_row's `rounds`) */
    float rel;                       /* and for its rounding of the logits, of their size */
    void *tile;                      /* exact's workspace: room for k * TILE floats */
    /* row in float32, for the screen; `scratch`: room for k floats. Returns where it is. */
    const float *(*as_float)(const struct Head *, const void *row, float *scratch);
    /* the exact logits of row at the `count` (<= TILE, > 0) columns col, as the head computes them; `first`: the
     * row's first call */
    void (*exact)(struct Head *, const void *row, const int32_t *col, int count, int first, float *out);
    /* the head's own argmax of the m rows (contiguous): 0, or nonzero when out of memory */
    int (*full)(const struct Head *, const void *rows, int m, int32_t *tokens);
    int k;                           /* values a row */
} Head;

/* Settles the m screened rows h (row_bytes apart: pools, threads * m, hold each thread's kept columns): each
 * row's token, the first index of the best exact logit among the columns kept, or the row computed again in full
 * where its pool overflowed. Returns how many rows were redone, or -1 when out of memory. */
static int settle_rows(Head *head, const Pool *pools, int threads, int m, const Row *rows, const void *h,
                       int32_t *tokens) {
    const size_t rb = head->row_bytes;
    int *redo = malloc(sizeof(int) * m);
    char *hr = malloc(rb * m);
    int32_t *tr = malloc(sizeof(int32_t) * m);
    int32_t *kept = malloc(sizeof(int32_t) * (size_t)threads * CAP);
    head->tile = malloc(sizeof(float) * (size_t)head->k * TILE);
    if (!redo || !hr || !tr || !kept || !head->tile) {
        free(redo), free(hr), free(tr), free(kept), free(head->tile);
        return -1;
    }
    int redone = 0;
    for (int r = 0; r < m; r++) {
        const int count = merge_pools(pools, threads, m, r, rows + r, kept);
        const void *hrow = (const char *)h + rb * r;
        float best = -INFINITY, vals[TILE];
        int32_t at = INT32_MAX;
        for (int j0 = 0; j0 < count; j0 += TILE) {
            const int some = count - j0 < TILE ? count - j0 : TILE;
            head->exact(head, hrow, kept + j0, some, j0 == 0, vals);
            for (int j = 0; j < some; j++)
                if (vals[j] > best || (vals[j] == best && kept[j0 + j] < at)) {
                    best = vals[j];
                    at = kept[j0 + j];
                }
        }
        if (at == INT32_MAX) { /* overflowed, or not one finite logit among those kept */
            memcpy(hr + rb * redone, hrow, rb);
            redo[redone++] = r;
        } else {
            tokens[r] = at;
        }
    }
    int status = redone;
    if (redone && head->full(head, hr, redone, tr)) status = -1;
    for (int i = 0; status >= 0 && i < redone; i++) tokens[redo[i]] = tr[i];
    free(redo), free(hr), free(tr), free(kept), free(head->tile);
    return status;
}

/* tokens[m]: each row h's (m x k, row_bytes apart) argmax over the n columns of head's weight, screened on its
 * int8 copy c (err_w, norm_w, norm_q: the largest e_v, ||w_v|| and n_v) and settled on the exact logits of the
 * columns kept, the first index of a tie winning: the head's own tokens. Returns how many rows were computed
 * again in full, or -1 when out of memory. */
static int screened_argmax(Head *head, const Weight *c, float err_w, float norm_w, float norm_q, const void *h, int m,
                           int32_t *tokens) {
    const int threads = omp_get_max_threads(), k = c->k;
    const size_t rb = head->row_bytes;
    uint8_t *u = malloc((size_t)m * k);
    Row *rows = malloc(sizeof(Row) * m);
    int *bad = malloc(sizeof(int) * m);
    Pool *pools = malloc(sizeof(Pool) * (size_t)threads * m);
    float *hf = malloc(sizeof(float) * k);
    int status = -1;
    if (u && rows && bad && pools && hf) {
        for (int r = 0; r < m; r++)
            bad[r] = quantize_row(head->as_float(head, (const char *)h + rb * r, hf), k, u + (size_t)r * k, err_w,
                                  norm_w, norm_q, head->sums_g, head->rel, rows + r);
        init_pools(pools, threads, m, bad);
        screen_rows(c, 1, u, k, SCREEN_FULL, SCREEN_ONE, m, rows, pools, threads);
        status = settle_rows(head, pools, threads, m, rows, h, tokens);
    }
    free(u), free(rows), free(bad), free(pools), free(hf);
    return status;
}

#endif
