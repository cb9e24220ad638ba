/* The threads and the argmax fold of sluice_f32_matmul, the same for every instruction set: included by
 * f32_matmul.c (AVX-512F) and f32_matmul_avx2.c after their F32_TILE, F32_GROUP, F32_LD, F32_WIDE (widening
 * scratch, floats: 0 for none), F32_SERIAL_WORK, f32_panel_rows (the rows a thread's scratch holds) and
 * f32_matmul_part (one thread's share of the blocks, taken `chunk` at a time from *next). */
#ifndef SLUICE_F32_DRIVE_H
#define SLUICE_F32_DRIVE_H
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "argmax_fold.h"

/* blocks handed out at a time: a few per thread and round, at most 8 */
static inline int f32_chunk(int n, int threads) {
    const int groups = ((n + F32_TILE - 1) / F32_TILE + F32_GROUP - 1) / F32_GROUP;
    const int chunk = groups / (threads * 8);
    return chunk < 1 ? 1 : chunk > 8 ? 8 : chunk;
}

typedef void (*f32_part_fn)(const void *w, int bf16, int n, int k, const float *x, long ldx, int m,
                            const float *bias, float *out, long ldo, float *best, int32_t *where, float *c,
                            float *wide, int *next, int chunk, const uint16_t *xs, size_t plane);

/* The threads of a product, each running `part` with `scratch` groups' worth of scratch (f32_panel_rows *
 * F32_LD floats each) and F32_WIDE floats to widen weights in, the units of work handed out among them. */
static int f32_run(f32_part_fn part, int scratch, const void *w, int bf16, int n, int k, const float *x, long ldx,
                   int m, const float *bias, float *out, long ldo, int32_t *tokens) {
    const int threads = (double)m * n * k >= F32_SERIAL_WORK ? omp_get_max_threads() : 1;
    const int chunk = f32_chunk(n / scratch, threads);
    float *best = NULL;
    int32_t *where = NULL;
    if (!out && alloc_candidates(threads, m, F32_TILE, &best, &where)) return -1;
    int next = 0, failed = 0;
    uint16_t *xs = NULL; /* AMX: the rows' split parts */
    size_t plane = 0;
#ifdef __AMX_BF16__
    const int own = m <= AMX_OWN_ROWS; /* each thread its own split rows, else one split shared */
    if (bf16 == F32_AMX) {
        plane = (size_t)amx_rows(m) * k;
        if (!(xs = malloc(sizeof(uint16_t) * 3 * plane * (own ? threads : 1)))) {
            free(best);
            free(where);
            return -1;
        }
    }
#endif
#pragma omp parallel num_threads(threads)
    {
        const int th = omp_get_thread_num();
#ifdef __AMX_BF16__
        uint16_t *mine = xs && own ? xs + (size_t)th * 3 * plane : xs;
        if (xs && amx_ready(x, ldx, m, k, th, omp_get_num_threads(), mine, plane)) {
#pragma omp barrier
        }
#else
        uint16_t *mine = NULL;
#endif
        const size_t rows = (size_t)f32_panel_rows(m, k);
        float *c = malloc(sizeof(float) * (scratch * rows * F32_LD + F32_WIDE));
        if (!c) {
#pragma omp atomic write
            failed = 1;
        } else {
            part(w, bf16, n, k, x, ldx, m, bias, out, ldo, best ? best + (size_t)th * m * F32_TILE : NULL,
                 where ? where + (size_t)th * m * F32_TILE : NULL, c,
                 F32_WIDE ? c + scratch * rows * F32_LD : NULL, &next, chunk, mine, plane);
        }
        free(c);
    }
    free(xs);
    if (!out) {
        fold_argmax(best, where, threads, m, F32_TILE, tokens);
        free(best);
        free(where);
    }
    return failed ? -1 : 0;
}

/* w: the packed weight of n outputs (bf16 != 0: bf16 pairs, else float32; zero rows past n to whole
 * tiles); x: m rows of k float32 (k even), ldx apart. With out set, out [m][ldo] = x @ W^T + bias (bias:
 * NULL or n floats); else tokens[m] = each row's argmax (bias ignored). Returns 0, or -1 when out of
 * memory. */
int sluice_f32_matmul(const void *w, int bf16, int n, int k, const float *x, long ldx, int m, const float *bias,
                      float *out, long ldo, int32_t *tokens) {
    return f32_run(f32_matmul_part, 1, w, bf16, n, k, x, ldx, m, bias, out, ldo, tokens);
}
#endif
