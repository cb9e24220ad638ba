/* Sampling's vocabulary-sized pass on CPUs with AVX-512F, else AVX2 and FMA (f32_vec.h's vectors, one source):
 * for logits [rows][v] (bf16 or float32) and a 1/temperature per row, probs = exp((x - row max) / temperature)
 * in float32 and each block's sum of `block` columns, in one pass after the max. The inverse-CDF sampler
 * reads one block of probs a row: it can ask for the sums alone and then for that block's probs (the same
 * bits), which saves writing and reading back 4 bytes a column (batch 16: 13 MB).
 *
 * torch's softmax spends its time in Sleef's exp (~2.9 G/s on this project's two-core machine); this
 * exp is a Cody-Waite reduction and a degree-6 polynomial (within ~1e-7 relative error, tested), ~12
 * vector operations a vector of values, and the block sums the inverse-CDF sampler needs come out of the
 * same pass. Values below exp(-87) (float32's smallest normal) are exactly 0, so a masked (-inf) token
 * never has mass.
 *
 * Work is handed out as threads come free (the server's other processes share the cores). A row's
 * results depend on that row alone: blocks are summed in a fixed order whatever the number of
 * rows or threads (a seeded request samples the same tokens in any batch).
 */
#include <omp.h>
#include <stdlib.h>

#include "f32_vec.h"

/* exp((x - top) * scale) of row x's columns [c0, c1) into out (when set; out[i] for column c0 + i), and
 * their sum: the same bits whichever function below asks. */
static float exp_range(const void *x, int bf16, size_t base, int c0, int c1, float top, float scale, float *out) {
    const vf vs = vf_set1(scale), vtop = vf_set1(top);
    vf acc = vf_zero();
    int c = c0;
    for (; c + F32V <= c1; c += F32V) {
        const vf e = vf_exp(vf_mul(vf_sub(vf_load_any(x, bf16, base + c), vtop), vs));
        if (out) vf_store(out + (c - c0), e);
        acc = vf_add(acc, e);
    }
    float total = vf_sum(acc);
    for (; c < c1; c++) {
        const float e = exp1((load1(x, bf16, base + c) - top) * scale);
        if (out) out[c - c0] = e;
        total += e;
    }
    return total;
}

/* probs (when set: NULL gives the sums alone, without writing 4 bytes a column) and each block's sum;
 * row_max[rows]: each row's max, for sluice_exp_block. Returns 0. */
int sluice_exp_blocks(const void *logits, int bf16, int rows, int v, const float *inv_temperature, float *probs,
                      float *sums, int block, float *row_max) {
    const int blocks = (v + block - 1) / block;
#pragma omp parallel
    {
#pragma omp for schedule(dynamic, 1)
        for (int r = 0; r < rows; r++) {
            const size_t base = (size_t)r * v;
            vf m = vf_set1(-INFINITY);
            int c = 0;
            for (; c + F32V <= v; c += F32V) m = vf_max(m, vf_load_any(logits, bf16, base + c));
            float top = vf_most(m);
            for (; c < v; c++) top = fmaxf(top, load1(logits, bf16, base + c));
            row_max[r] = top;
        }
#pragma omp for schedule(dynamic, 4)
        for (long job = 0; job < (long)rows * blocks; job++) {
            const int r = (int)(job / blocks), b = (int)(job % blocks);
            const size_t base = (size_t)r * v;
            const int c0 = b * block, c1 = c0 + block < v ? c0 + block : v;
            sums[(size_t)r * blocks + b] = exp_range(logits, bf16, base, c0, c1, row_max[r], inv_temperature[r],
                                                     probs ? probs + base + c0 : NULL);
        }
    }
    return 0;
}

/* out[rows][block]: the probs sluice_exp_blocks gives of each row's one block chosen[r] (0 past v). */
int sluice_exp_block(const void *logits, int bf16, int rows, int v, const float *inv_temperature,
                     const float *row_max, const int64_t *chosen, int block, float *out) {
    for (int r = 0; r < rows; r++) {
        const int c0 = (int)chosen[r] * block, c1 = c0 + block < v ? c0 + block : v;
        float *o = out + (size_t)r * block;
        memset(o, 0, sizeof(float) * block);
        exp_range(logits, bf16, (size_t)r * v, c0, c1, row_max[r], inv_temperature[r], o);
    }
    return 0;
}
