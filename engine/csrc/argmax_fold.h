/* The argmax of each row from every thread's candidates: best / where hold, per thread and row, `tile` lanes
 * of (value, column); the highest value wins, the lowest column among equals (torch's argmax). A row with
 * no candidate gets 0. Shared by bf16_matmul.c and f32_drive.h. */
#ifndef SLUICE_ARGMAX_FOLD_H
#define SLUICE_ARGMAX_FOLD_H
#include <math.h>
#include <stdint.h>

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
