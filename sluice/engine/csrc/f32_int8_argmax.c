/* Greedy tokens from a float32 model's LM head (f32_matmul.c's), screened in int8 first: the same tokens.
 *
 * The method and its bounds are int8_argmax.c's (the bf16 head's): each row is screened against an int8
 * copy of the weight with VPDPBUSD (AVX512-VNNI, 64 multiply-adds an instruction against float32 FMA's 16),
 * and only the columns whose logit could still be the row's maximum are computed again exactly as
 * f32_matmul.c computes them (its own block function, in the same order over k, on the same packed weight:
 * the same bits), the first index of a tie winning. Here the logits are float32 and compared unrounded, so
 * the slack below the best lower bound L is the float32 sums' rounding alone (2 G: the token's and L's
 * column's), with 2^-16 of |L| and of the largest bound for the screen's own float rounding.
 */
#include "f32_matmul.c"

enum { TILE = F32_TILE, GROUP = F32_GROUP, ROWS = F32_ROWS, CHUNK = 8 };

static inline __m512i columns(int col0) {
    return _mm512_add_epi32(_mm512_set1_epi32(col0),
                            _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
}

static inline int take_groups(int *next, int groups, int *g0, int *g1) { return f32_take(next, CHUNK, groups, g0, g1); }

#include "int8_screen.h"

/* The exact float32 logits of row h at the `count` (<= 16) columns col of the packed weight w (bf16 pairs or
 * float32): those columns gathered into one tile (`tile`: room for one tile) and run through f32_matmul.c's
 * block for one tile, over the pairs in its blocks of F32_KP, as the full product runs them; on AMX (bf16 ==
 * F32_AMX) through its tile product, from the row's split parts hs (3 x k, planes k apart) with the tiles
 * configured for one row. */
static void exact_logits(const void *w, int bf16, int k, const float *h, const uint16_t *hs, const int32_t *col,
                         int count, void *tile, float *out) {
    const size_t elem = bf16 ? 2 : 4, tile_elems = (size_t)k * TILE;
    memset(tile, 0, elem * tile_elems);
    for (int j = 0; j < count; j++) {
        const int from = col[j] / TILE, lane = col[j] % TILE;
        const char *src = (const char *)w + elem * tile_elems * from;
        for (int p = 0; p < k / 2; p++) {
            if (bf16) { /* [K/2][16][2] */
                memcpy((char *)tile + 2 * ((size_t)p * 32 + 2 * j), src + 2 * ((size_t)p * 32 + 2 * lane), 4);
            } else { /* [K/2][2][16] */
                for (int e = 0; e < 2; e++)
                    memcpy((char *)tile + 4 * ((size_t)p * 32 + e * 16 + j), src + 4 * ((size_t)p * 32 + e * 16 + lane),
                           4);
            }
        }
    }
    float c[F32_LD];
#ifdef __AMX_BF16__
    if (bf16 == F32_AMX) {
        (void)h;
        amx_group(tile, k, 1, hs, (size_t)k, 1, c, F32_LD);
        for (int j = 0; j < count; j++) out[j] = c[j];
        return;
    }
#endif
    (void)hs;
    for (int p0 = 0; p0 < k / 2; p0 += F32_KP) {
        const int p1 = p0 + F32_KP < k / 2 ? p0 + F32_KP : k / 2;
        F32_BLOCK_FN[bf16 != 0][1][1](tile, k, p0, p1, h, k, c, p0 == 0, NULL);
    }
    for (int j = 0; j < count; j++) out[j] = c[j];
}

/* tokens[m]: each float32 row h's argmax over the n columns of the head, the same as sluice_f32_matmul(w, ...)
 * gives; the int8 weight as int8_argmax.c takes it. Returns how many rows were computed again in full, or -1
 * when out of memory. */
int sluice_f32_int8_argmax(const int8_t *q, const int32_t *start, const float *scale, const float *err,
                           const float *norm, const void *w, int bf16, int n, int k, float err_w, float norm_w,
                           float norm_q, const float *h, int m, int32_t *tokens) {
    const Weight c = {q, start, scale, err, norm, n, k};
    const int threads = omp_get_max_threads();
    uint8_t *u = malloc((size_t)m * k);
    Row *rows = malloc(sizeof(Row) * m);
    int *bad = malloc(sizeof(int) * m);
    Pool *pools = malloc(sizeof(Pool) * (size_t)threads * m);
    int *redo = malloc(sizeof(int) * m);
    float *hr = malloc(sizeof(float) * (size_t)m * k);
    int32_t *tr = malloc(sizeof(int32_t) * m);
    int32_t *kept = malloc(sizeof(int32_t) * (size_t)threads * CAP);
    void *tile = malloc(sizeof(float) * (size_t)k * TILE);
    uint16_t *hs = malloc(sizeof(uint16_t) * 3 * (size_t)k); /* AMX: a row's split parts */
    if (!u || !rows || !bad || !pools || !redo || !hr || !tr || !kept || !tile || !hs) {
        free(u), free(rows), free(bad), free(pools), free(redo), free(hr), free(tr), free(kept), free(tile), free(hs);
        return -1;
    }
    for (int r = 0; r < m; r++)
        bad[r] = quantize_row(h + (size_t)r * k, k, u + (size_t)r * k, err_w, norm_w, norm_q, 2, 0x1p-16f, rows + r);
    init_pools(pools, threads, m, bad);
    screen_rows(&c, u, m, rows, pools, threads);
#ifdef __AMX_BF16__
    if (bf16 == F32_AMX) amx_configure(1); /* (this thread's tiles, for exact_logits; the redo sets its own) */
#endif
    int redone = 0;
    for (int r = 0; r < m; r++) {
        const int count = merge_pools(pools, threads, m, r, rows + r, kept);
        const float *hrow = h + (size_t)r * k;
        float best = -INFINITY, vals[TILE];
        int32_t at = INT32_MAX;
#ifdef __AMX_BF16__
        if (bf16 == F32_AMX && count) amx_split(hrow, k, 0, 1, k, hs, (size_t)k);
#endif
        for (int j0 = 0; j0 < count; j0 += TILE) {
            const int some = count - j0 < TILE ? count - j0 : TILE;
            exact_logits(w, bf16, k, hrow, hs, kept + j0, some, tile, vals);
            for (int j = 0; j < some; j++)
                if (vals[j] > best || (vals[j] == best && kept[j0 + j] < at)) {
                    best = vals[j];
                    at = kept[j0 + j];
                }
        }
        if (at == INT32_MAX) { /* overflowed, or not one finite logit among those kept */
            memcpy(hr + (size_t)redone * k, hrow, sizeof(float) * k);
            redo[redone++] = r;
        } else {
            tokens[r] = at;
        }
    }
    int status = redone;
    if (redone && sluice_f32_matmul(w, bf16, n, k, hr, k, redone, NULL, NULL, 0, tr)) status = -1;
    for (int i = 0; status >= 0 && i < redone; i++) tokens[redo[i]] = tr[i];
    free(u), free(rows), free(bad), free(pools), free(redo), free(hr), free(tr), free(kept), free(tile), free(hs);
    return status;
}
