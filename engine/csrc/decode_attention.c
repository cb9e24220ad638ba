/* Decode attention over the paged KV cache on CPUs with AVX-512: one query row per sequence, bf16
 * queries and cache, float32 arithmetic.
 *
 * In torch, a step's decodes gather every sequence's keys and values into new tensors, convert them to
 * float32 and run batched matmuls, a mask and a softmax: ~15 ops a layer whose copies grow with the
 * batch and the context. Here each (sequence, kv head) reads its keys and values where they lie in the
 * cache, once for all the query heads that share them (grouped-query attention), and writes the result.
 *
 * q [T][H][D] (rows q_stride values apart) and out [T][H][D] are the flat batch's rows, rows[b] the row
 * of sequence b; slots [B][K]
 * the cache slot of each of its keys, mask [B][K] which of them it attends to (1); k and v caches
 * [slots][Hkv][D]; sinks: NULL, or a per-head logit whose share of the attention goes nowhere (gpt-oss).
 * D must be a multiple of 16. Returns 0, or -1 when out of memory.
 */
#include <float.h>
#include <omp.h>
#include <stdlib.h>

#include "simd.h"

enum { MAX_GROUP = 16, MAX_VECS = 16 }; /* query heads per kv head, D / 16 */
/* Multiply-adds below which one thread does it all (see bf16_matmul.c) */
#define SERIAL_WORK 2e6

int sluice_decode_attention(const uint16_t *q, long q_stride, const uint16_t *k_cache, const uint16_t *v_cache, const int64_t *rows,
                            const int64_t *slots, const uint8_t *mask, const float *sinks, int batch, int heads,
                            int kv_heads, int dim, int keys, float scale, uint16_t *out) {
    const int group = heads / kv_heads, vecs = dim / 16;
    if (group > MAX_GROUP || vecs > MAX_VECS || dim % 16) return -2;
    int failed = 0;
#pragma omp parallel if ((double)batch * heads * keys * dim >= SERIAL_WORK)
    {
        float *scores = malloc(sizeof(float) * (size_t)group * (keys + 16));
        if (!scores) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (long job = 0; job < (long)batch * kv_heads; job++) {
            if (!scores) continue;
            const int b = (int)(job / kv_heads), j = (int)(job % kv_heads);
            const int64_t *slot = slots + (size_t)b * keys;
            const uint8_t *attend = mask + (size_t)b * keys;
            const size_t row = (size_t)rows[b];
            __m512 qv[MAX_GROUP][MAX_VECS];
            for (int g = 0; g < group; g++)
                for (int c = 0; c < vecs; c++)
                    qv[g][c] = _mm512_mul_ps(load16(q, 1, row * q_stride + (size_t)(j * group + g) * dim + c * 16),
                                             _mm512_set1_ps(scale));
            /* scores of every key for each query head of the group ([g][i]) */
            for (int i = 0; i < keys; i++) {
                if (!attend[i]) {
                    for (int g = 0; g < group; g++) scores[(size_t)g * keys + i] = -INFINITY;
                    continue;
                }
                const size_t at = ((size_t)slot[i] * kv_heads + j) * dim;
                __m512 kv[MAX_VECS];
                for (int c = 0; c < vecs; c++) kv[c] = load16(k_cache, 1, at + c * 16);
                for (int g = 0; g < group; g++) {
                    __m512 acc = _mm512_mul_ps(qv[g][0], kv[0]);
                    for (int c = 1; c < vecs; c++) acc = _mm512_fmadd_ps(qv[g][c], kv[c], acc);
                    scores[(size_t)g * keys + i] = _mm512_reduce_add_ps(acc);
                }
            }
            for (int g = 0; g < group; g++) {
                float *s = scores + (size_t)g * keys;
                const int h = j * group + g;
                float top = sinks ? sinks[h] : -INFINITY;
                for (int i = 0; i < keys; i++) top = fmaxf(top, s[i]);
                float total = sinks ? exp1(sinks[h] - top) : 0.0f;
                int i = 0;
                __m512 sum = _mm512_setzero_ps();
                for (; i + 16 <= keys; i += 16) {
                    __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(s + i), _mm512_set1_ps(top)));
                    _mm512_storeu_ps(s + i, e);
                    sum = _mm512_add_ps(sum, e);
                }
                total += _mm512_reduce_add_ps(sum);
                for (; i < keys; i++) {
                    s[i] = exp1(s[i] - top);
                    total += s[i];
                }
                const float inv = 1.0f / total;
                __m512 acc[MAX_VECS];
                for (int c = 0; c < vecs; c++) acc[c] = _mm512_setzero_ps();
                for (i = 0; i < keys; i++) {
                    if (s[i] == 0.0f) continue;
                    const __m512 p = _mm512_set1_ps(s[i]);
                    const size_t at = ((size_t)slot[i] * kv_heads + j) * dim;
                    for (int c = 0; c < vecs; c++) acc[c] = _mm512_fmadd_ps(p, load16(v_cache, 1, at + c * 16), acc[c]);
                }
                for (int c = 0; c < vecs; c++)
                    store_bf16(out + (row * heads + h) * dim + c * 16, _mm512_mul_ps(acc[c], _mm512_set1_ps(inv)), 0xffff);
            }
        }
        free(scores);
    }
    return failed ? -1 : 0;
}
