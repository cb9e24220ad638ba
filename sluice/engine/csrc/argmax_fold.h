/* The argmax of each row from every thread's candidates: best / where hold, per thread and row, `tile` lanes
 * of (value, column); the highest value wins, the lowest column among equals (torch's argmax). A row with
 * no candidate gets 0. Shared by bf16_matmul.c and f32_drive.h, with the candidates' allocation. */
#ifndef SLUICE_ARGMAX_FOLD_H
#define SLUICE_ARGMAX_FOLD_H
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

/* Each thread's candidates, empty (-inf at column INT32_MAX): 0, or -1 when out of memory (nothing held). */
static int alloc_candidates(int threads, int m, int tile, float **best, int32_t **where) {
    const size_t count = (size_t)threads * m * tile;
    *best = malloc(sizeof(float) * count);
    *where = malloc(sizeof(int32_t) * count);
    if (!*best || !*where) {
        free(*best);
        free(*where);
        *best = NULL;
        *where = NULL;
        return -1;
    }
    for (size_t i = 0; i < count; i++) {
        (*best)[i] = -INFINITY;
        (*where)[i] = INT32_MAX;
    }
    return 0;
}

static void fold_argmax(const float *best, const int32_t *where, int threads, int m, int tile, int32_t *tokens) {
    for (int r = 0; r < m; r++) {
        float top = -INFINITY;
        int32_t at = INT32_MAX;
        for (int th = 0; th < threads; th++) {
            const float *b = best + ((size_t)th * m + r) * tile;
            const int32_t *wh = where + ((size_t)th * m + r) * tile;
            for (int l = 0; l < tile; l++)
                if (b[l] > top || (b[l] == top && wh[l] < at)) {
                    top = b[l];
                    at = wh[l];
                }
        }
        tokens[r] = at == INT32_MAX ? 0 : at;
    }
}
#endif
