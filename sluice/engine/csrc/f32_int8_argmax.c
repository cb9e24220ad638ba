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
    F32Head f = {{sizeof(float) * k, 2, 0x1p-16f, NULL, as_float, exact_logits, full_argmax}, w, bf16, n, k, hs};
    const int status = screened_argmax(&f.head, &c, err_w, norm_w, norm_q, h, m, tokens);
    free(hs);
    return status;
}
