/* x @ W^T (+ bias) on CPUs with AVX512-BF16, for bf16 W and x: the LM head, and the small linears of
 * a small model. As the LM head it can also give each row's argmax without writing the logits at all
 * (greedy decoding).
 *
 * With a small model and a 200k vocabulary the LM head is most of a decode step; the small linears
 * cost their call overhead (oneDNN's bf16 matmul ~17 us a call here, MKL's float32 ~10-30 us at 16
 * rows, this kernel 5-15 us). The weight is read
 * once per call, in a layout packed for VDPBF16PS: tiles of 16 vocabulary rows, each [K/2][16][2]
 * (for every pair of hidden columns, the 16 rows' two values side by side). A block of GROUP tiles is
 * multiplied by up to ROWS hidden rows at a time in 24 zmm accumulators, every row chunk reusing the
 * block from L1, while the first chunk prefetches the next block into L2 (into L1, the 16 KB it brings
 * would evict the block in use from the 32 KB L1: batch 16 ran 2.3 against 3.0 ms on the o200k head).
 * Products are accumulated in float32 in the same order whatever the number of rows, so a row's logits
 * do not depend on its batch.
 *
 * The argmax compares each value rounded to bf16 (round to nearest even, as the logits would be
 * stored), keeping the first index of a tie: the same token as an argmax over the stored logits. It
 * never writes them, which at batch 16-64 saves writing and re-reading 6-26 MB a step.
 *
 * Threads: torch's OpenMP threads (this file links the libgomp that torch has loaded) take chunks of
 * CHUNK blocks in column order as they come free, each keeping its own per-lane best values, merged at
 * the end. Handing the work out as it goes, not in halves, matters on a machine whose cores the server's
 * other processes share: a preempted thread no longer leaves the other waiting at the barrier.
 */
#include <omp.h>
#include <stdlib.h>

#include "argmax_fold.h"
#include "bf16_tiles.h"
#include "simd.h"

enum { TILE = 16, GROUP = 4, ROWS = 6, CHUNK = 8 };
/* Multiply-adds below which one thread does it all: waking torch's other thread and meeting it at the
 * barrier costs more than a small linear (in a server, that core is often running another process). */
#define SERIAL_WORK 4e6


static inline __m512i columns(int col0) {
    return _mm512_add_epi32(_mm512_set1_epi32(col0),
                            _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
}

/* Folds `nt` tiles of one row (acc[t]: columns (tile0 + t) * 16 + lane) into that row's per-lane best
 * values `best` and their columns `where`. Strictly greater wins, tiles in column order: each lane
 * keeps the first column of its maximum. */
static inline void fold_max(const __m512 *acc, int nt, int tile0, int n, float *best, int32_t *where) {
    __m512 cur = _mm512_loadu_ps(best);
    __m512 m = acc[0];
    for (int t = 1; t < nt; t++) m = _mm512_max_ps(m, acc[t]);
    /* rounding is monotonic: no lane beats its best unless the rounded max of its tiles does */
    if (!_mm512_cmp_ps_mask(round_bf16(m), cur, _CMP_GT_OQ)) return;
    __m512i idx = _mm512_loadu_si512(where);
    for (int t = 0; t < nt; t++) {
        __m512i cols = columns((tile0 + t) * TILE);
        __mmask16 valid = _mm512_cmplt_epi32_mask(cols, _mm512_set1_epi32(n));
        __m512 v = round_bf16(acc[t]);
        __mmask16 gt = _mm512_mask_cmp_ps_mask(valid, v, cur, _CMP_GT_OQ);
        cur = _mm512_mask_blend_ps(gt, cur, v);
        idx = _mm512_mask_blend_epi32(gt, idx, cols);
    }
    _mm512_storeu_ps(best, cur);
    _mm512_storeu_si512(where, idx);
}

static inline void store_logits(__m512 acc, int tile0, int n, const float *bias, uint16_t *out) {
    if (bias) acc = _mm512_add_ps(acc, _mm512_loadu_ps(bias + (size_t)tile0 * TILE));
    store_bf16(out + (size_t)tile0 * TILE, acc, first_lanes(n - tile0 * TILE));
}

/* R hidden rows against NT tiles from tile0: logits (+ bias, padded to whole tiles, when set) into out
 * (rows ldo apart) when out is set, else
 * folded into best/where (R rows of 16 lanes). pf: the next block, to prefetch (or NULL). */
#define BLOCK(R, NT)                                                                                         \
    static void block_##R##_##NT(const uint16_t *restrict w, const uint16_t *restrict h, int k, int tile0,   \
                                 int n, const float *bias, uint16_t *out, int ldo, float *best, int32_t *where, \
                                 const uint16_t *pf) {                                                       \
        __m512 acc[R][NT];                                                                                   \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                                                  \
            _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++) acc[r][t] = _mm512_setzero_ps();            \
        BF16_TILES_DOT(R, NT, acc, w, h, k, tile0, pf);                                                      \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                                \
            if (out) {                                                                                       \
                _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++)                                         \
                    store_logits(acc[r][t], tile0 + t, n, bias, out + (size_t)r * ldo);                      \
            } else {                                                                                         \
                fold_max(acc[r], NT, tile0, n, best + r * TILE, where + r * TILE);                           \
            }                                                                                                \
        }                                                                                                    \
    }
#define BLOCKS(R) BLOCK(R, 4) BLOCK(R, 1)
BLOCKS(1) BLOCKS(2) BLOCKS(3) BLOCKS(4) BLOCKS(5) BLOCKS(6)

/* The next CHUNK block groups for the calling thread, [g0, g1) (shared counter *next): 0 when none are left. */
static inline int take_groups(int *next, int groups, int *g0, int *g1) {
    int g;
#pragma omp atomic capture
    {
        g = *next;
        *next += CHUNK;
    }
    *g0 = g;
    *g1 = g + CHUNK < groups ? g + CHUNK : groups;
    return g < groups;
}

typedef void (*block_fn)(const uint16_t *, const uint16_t *, int, int, int, const float *, uint16_t *, int, float *,
                         int32_t *, const uint16_t *);
static const block_fn FULL[ROWS + 1] = {0, block_1_4, block_2_4, block_3_4, block_4_4, block_5_4, block_6_4};
static const block_fn ONE[ROWS + 1] = {0, block_1_1, block_2_1, block_3_1, block_4_1, block_5_1, block_6_1};

/* w: the packed weight of n output rows (n rounded up to tiles of 16, zero rows past n); h: m rows of k
 * bf16 (k even). With logits set, writes bf16 h @ W^T + bias (bias: NULL, or n floats padded to whole
 * tiles) as [m][ldo]; else tokens[m] = each row's argmax (without the bias). Returns 0, or -1 when out
 * of memory. */
int sluice_bf16_matmul(const uint16_t *w, int n, int k, const uint16_t *h, int m, const float *bias, uint16_t *logits,
                       int ldo, int32_t *tokens) {
    const int tiles = (n + TILE - 1) / TILE, groups = (tiles + GROUP - 1) / GROUP;
    const int threads = omp_get_max_threads();
    float *best = NULL;
    int32_t *where = NULL;
    if (!logits && alloc_candidates(threads, m, TILE, &best, &where)) return -1;
    int next = 0; /* the next block group to hand out */
#pragma omp parallel num_threads(threads) if ((double)m * n * k >= SERIAL_WORK)
    {
        const int th = omp_get_thread_num();
        float *my_best = best ? best + (size_t)th * m * TILE : NULL;
        int32_t *my_where = where ? where + (size_t)th * m * TILE : NULL;
        for (int g0, g1; take_groups(&next, groups, &g0, &g1);) {
            for (int g = g0; g < g1; g++) {
                const int tile0 = g * GROUP, nt = tiles - tile0 < GROUP ? tiles - tile0 : GROUP;
                for (int r0 = 0; r0 < m; r0 += ROWS) {
                    const int r = m - r0 < ROWS ? m - r0 : ROWS;
                    const uint16_t *hr = h + (size_t)r0 * k;
                    uint16_t *out = logits ? logits + (size_t)r0 * ldo : NULL;
                    float *b = my_best ? my_best + (size_t)r0 * TILE : NULL;
                    int32_t *wh = my_where ? my_where + (size_t)r0 * TILE : NULL;
                    if (nt == GROUP) {
                        const uint16_t *pf = r0 == 0 && g + 1 < groups ? w + (size_t)(tile0 + GROUP) * k * TILE : NULL;
                        FULL[r](w, hr, k, tile0, n, bias, out, ldo, b, wh, pf);
                    } else {
                        for (int t = 0; t < nt; t++) ONE[r](w, hr, k, tile0 + t, n, bias, out, ldo, b, wh, NULL);
                    }
                }
            }
        }
    }
    if (!logits) {
        fold_argmax(best, where, threads, m, TILE, tokens);
        free(best);
        free(where);
    }
    return 0;
}
