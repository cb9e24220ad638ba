/* RMSNorm of bf16 rows on CPUs with AVX-512: out = x / sqrt(mean(x^2) + eps) * weight, in float32,
 * rounded to bf16 once (as torch's kernel does it, which on the CPU runs as ~10 ops a call: ~30 us for
 * a decode step's 16 rows of 128, against ~2 us here).
 *
 * x and out: [rows][dim] (rows x_stride / out_stride values apart), weight [dim]. Returns 0.
 */
#include <omp.h>

#include "simd.h"

int sluice_rms_norm(const uint16_t *x, long x_stride, const uint16_t *weight, int rows, int dim, float eps,
                    uint16_t *out, long out_stride) {
#pragma omp parallel for schedule(static) if ((double)rows * dim >= 1e6)
    for (int r = 0; r < rows; r++) {
        const uint16_t *xr = x + (size_t)r * x_stride;
        __m512 acc = _mm512_setzero_ps();
        for (int c = 0; c < dim; c += 16) {
            const __mmask16 keep = first_lanes(dim - c);
            const __m512 v = load_bf16(xr + c, keep);
            acc = _mm512_fmadd_ps(v, v, acc);
        }
        const __m512 scale = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(acc) / (float)dim + eps));
        uint16_t *o = out + (size_t)r * out_stride;
        for (int c = 0; c < dim; c += 16) {
            const __mmask16 keep = first_lanes(dim - c);
            store_bf16(o + c, _mm512_mul_ps(_mm512_mul_ps(load_bf16(xr + c, keep), scale), load_bf16(weight + c, keep)),
                       keep);
        }
    }
    return 0;
}
