/* Rotary embedding of a step's queries and keys, and the store of its keys and values into the paged
 * cache, in one pass on CPUs with AVX-512: bf16 in and out, float32 arithmetic, rounded to bf16 once.
 *
 * In torch this is ~15 ops a layer (the cos/sin lookup, halves, four products, a concatenation, two
 * index copies), each a few microseconds at a decode step's size: ~0.1 ms a layer here against ~5 us.
 *
 * qk [T][H + Hkv][D]: each row's query heads then its key heads (rows qk_stride values apart, heads
 * D apart); v [T][Hkv][D] (rows v_stride apart). Rotary is the rotate-half (NeoX) form over a table
 * cos/sin [positions][D/2] in float32 (any scaling already folded in):
 *     out[:D/2] = x[:D/2] cos - x[D/2:] sin,  out[D/2:] = x[D/2:] cos + x[:D/2] sin.
 * The rotated queries go to q_out [T][H][D]; the rotated keys and the values to k_cache and v_cache
 * [slots][Hkv][D] at slots[t] (each row's value heads D apart). D must be even. Returns 0, or -3 (with
 * nothing written) when a position is outside the table's num_positions or a slot outside the cache's
 * num_slots.
 */
#include <omp.h>

#include "simd.h"

static inline void rotate(const uint16_t *x, const float *cos, const float *sin, int half, uint16_t *out) {
    for (int c = 0; c < half; c += 16) {
        const __mmask16 keep = first_lanes(half - c);
        const __m512 x1 = load_bf16(x + c, keep), x2 = load_bf16(x + half + c, keep);
        const __m512 cs = _mm512_maskz_loadu_ps(keep, cos + c), sn = _mm512_maskz_loadu_ps(keep, sin + c);
        store_bf16(out + c, _mm512_fmsub_ps(x1, cs, _mm512_mul_ps(x2, sn)), keep);
        store_bf16(out + half + c, _mm512_fmadd_ps(x2, cs, _mm512_mul_ps(x1, sn)), keep);
    }
}

int sluice_rope_store(const uint16_t *qk, long qk_stride, const uint16_t *v, long v_stride, int tokens, int heads,
                      int kv_heads, int dim, const int64_t *positions, const float *cos, const float *sin,
                      int num_positions, const int64_t *slots, long num_slots, uint16_t *q_out, uint16_t *k_cache,
                      uint16_t *v_cache) {
    const int half = dim / 2;
    for (int t = 0; t < tokens; t++)
        if (positions[t] < 0 || positions[t] >= num_positions || slots[t] < 0 || slots[t] >= num_slots) return -3;
#pragma omp parallel for schedule(static) if ((double)tokens * (heads + 2 * kv_heads) * dim >= 1e6)
    for (int t = 0; t < tokens; t++) {
        const uint16_t *row = qk + (size_t)t * qk_stride;
        const float *cs = cos + (size_t)positions[t] * half, *sn = sin + (size_t)positions[t] * half;
        for (int h = 0; h < heads; h++)
            rotate(row + (size_t)h * dim, cs, sn, half, q_out + ((size_t)t * heads + h) * dim);
        uint16_t *k_slot = k_cache + (size_t)slots[t] * kv_heads * dim;
        for (int h = 0; h < kv_heads; h++)
            rotate(row + (size_t)(heads + h) * dim, cs, sn, half, k_slot + (size_t)h * dim);
        memcpy(v_cache + (size_t)slots[t] * kv_heads * dim, v + (size_t)t * v_stride,
               sizeof(uint16_t) * kv_heads * dim);
    }
    return 0;
}
