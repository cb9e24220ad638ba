/* Decode attention over the paged KV cache on CPUs with AVX-512: one query row per sequence, bf16
 * queries and cache, float32 arithmetic.
 *
 * In torch, a step's decodes gather every sequence's keys and values into new tensors, convert them to
 * float32 and run batched matmuls, a mask and a softmax: ~15 ops a layer whose copies grow with the
 * batch and the context. Here each (sequence, kv head) reads its keys and values where they lie in the
 * cache, once for all the query heads that share them (grouped-query attention), and writes the result.
 * Scores are made 16 keys at a time: VDPBF16PS multiplies the bf16 query and key pairs and adds them in
 * float32, and one transposed reduction sums the 16 keys' lanes (one key at a time, the reduction cost
 * more than the products: 172 against 104 us a layer for 16 sequences of 352 keys).
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
enum { AHEAD = 1 }; /* blocks of 16 keys whose keys are asked for ahead */
/* Multiply-adds below which one thread does it all (see bf16_matmul.c). The keys and values are read
 * from a cache the LM head has just flushed, and two threads keep twice the reads in flight: a decode
 * step of 16 sequences of 352 keys ran its attention in 0.36 against 0.53 ms on one thread (2 layers). */
#define SERIAL_WORK 2e5

#define prefetch_row(row, dim, hint)                                                                     \
    for (int b_ = 0; b_ < (dim) * 2; b_ += 64) _mm_prefetch((const char *)(row) + b_, hint)

/* out[g] = inv[g] * sum over keys i of s[g * ld + i] * v[i] for GC heads, V vectors of 16 values each
 * (values of key i at v + slot[i] * v_stride); keys the mask drops are skipped */
#define PV_FN(V, GC)                                                                                           \
    static void pv_##V##_##GC(const float *s, int ld, int keys, const uint8_t *attend, const int64_t *slot,      \
                              const uint16_t *v, size_t v_stride, const float *inv, uint16_t *out, int dim) {    \
        __m512 acc[GC][V];                                                                                     \
        _Pragma("GCC unroll 16") for (int g = 0; g < GC; g++)                                                   \
            _Pragma("GCC unroll 16") for (int c = 0; c < V; c++) acc[g][c] = _mm512_setzero_ps();               \
        for (int i = 0; i < keys; i++) {                                                                       \
            if (!attend[i]) continue;                                                                          \
            const uint16_t *vr = v + (size_t)slot[i] * v_stride;                                               \
            __m512 x[V];                                                                                       \
            _Pragma("GCC unroll 16") for (int c = 0; c < V; c++) x[c] = load16(vr, 1, (size_t)c * 16);           \
            _Pragma("GCC unroll 16") for (int g = 0; g < GC; g++) {                                             \
                const __m512 p = _mm512_set1_ps(s[(size_t)g * ld + i]);                                        \
                _Pragma("GCC unroll 16") for (int c = 0; c < V; c++) acc[g][c] = _mm512_fmadd_ps(p, x[c], acc[g][c]); \
            }                                                                                                  \
        }                                                                                                      \
        for (int g = 0; g < GC; g++)                                                                           \
            for (int c = 0; c < V; c++)                                                                        \
                store_bf16(out + (size_t)g * dim + c * 16, _mm512_mul_ps(acc[g][c], _mm512_set1_ps(inv[g])), 0xffff); \
    }
PV_FN(1, 1) PV_FN(1, 2) PV_FN(1, 4) PV_FN(1, 8) PV_FN(1, 16)
PV_FN(2, 1) PV_FN(2, 2) PV_FN(2, 4) PV_FN(2, 8)
PV_FN(4, 1) PV_FN(4, 2) PV_FN(4, 4)
PV_FN(8, 1) PV_FN(8, 2)
PV_FN(16, 1)

typedef void (*pv_fn)(const float *, int, int, const uint8_t *, const int64_t *, const uint16_t *, size_t,
                      const float *, uint16_t *, int);
/* [log2 V][log2 GC] */
static const pv_fn PV[5][5] = {{pv_1_1, pv_1_2, pv_1_4, pv_1_8, pv_1_16}, {pv_2_1, pv_2_2, pv_2_4, pv_2_8},
                               {pv_4_1, pv_4_2, pv_4_4}, {pv_8_1, pv_8_2}, {pv_16_1}};

/* the same for one head, any number of vectors */
static void pv_any(const float *s, int keys, const uint8_t *attend, const int64_t *slot, const uint16_t *v,
                   size_t v_stride, int vecs, float inv, uint16_t *out) {
    __m512 acc[MAX_VECS];
    for (int c = 0; c < vecs; c++) acc[c] = _mm512_setzero_ps();
    for (int i = 0; i < keys; i++) {
        if (!attend[i]) continue;
        const __m512 p = _mm512_set1_ps(s[i]);
        const uint16_t *vr = v + (size_t)slot[i] * v_stride;
        for (int c = 0; c < vecs; c++) acc[c] = _mm512_fmadd_ps(p, load16(vr, 1, (size_t)c * 16), acc[c]);
    }
    for (int c = 0; c < vecs; c++) store_bf16(out + c * 16, _mm512_mul_ps(acc[c], _mm512_set1_ps(inv)), 0xffff);
}

static int log2_exact(int n) { /* log2 of a power of two, else -1 */
    return n > 0 && !(n & (n - 1)) ? __builtin_ctz(n) : -1;
}

int sluice_decode_attention(const uint16_t *q, long q_stride, const uint16_t *k_cache, const uint16_t *v_cache,
                            const int64_t *rows, const int64_t *slots, const uint8_t *mask, const float *sinks,
                            int batch, int heads, int kv_heads, int dim, int keys, float scale, uint16_t *out) {
    const int group = heads / kv_heads, vecs = dim / 16, chunks = (dim + 31) / 32, padded = (keys + 15) / 16 * 16;
    const __mmask32 tail = dim % 32 ? 0xffffu : ~0u; /* the lanes of the last 32-value chunk of a head */
    if (group > MAX_GROUP || vecs > MAX_VECS || dim % 16) return -2;
    int failed = 0;
#pragma omp parallel if ((double)batch * heads * keys * dim >= SERIAL_WORK)
    {
        float *scores = malloc(sizeof(float) * (size_t)group * padded);
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
            /* keys past the last one attended are not read: a prefill chunk's early rows, a sequence shorter
             * than the batch's longest */
            int used = keys;
            while (used > 1 && !attend[used - 1]) used--;
            const size_t row = (size_t)rows[b];
            __m512bh qb[MAX_GROUP][MAX_VECS / 2]; /* the group's query heads, 32 bf16 a vector */
            __m512 top[MAX_GROUP];
            for (int g = 0; g < group; g++) {
                for (int c = 0; c < chunks; c++)
                    qb[g][c] = (__m512bh)_mm512_maskz_loadu_epi16(
                        c + 1 < chunks ? ~0u : tail, q + row * q_stride + (size_t)(j * group + g) * dim + c * 32);
                top[g] = _mm512_set1_ps(-INFINITY);
            }
            /* scores of every key for each query head of the group ([g][i]), 16 keys at a time: each key's
             * products with the query, pairs of bf16 multiplied and added in float32 (VDPBF16PS), summed
             * across lanes for the 16 keys at once */
            for (int i0 = 0; i0 < used; i0 += 16) {
                const int n = used - i0 < 16 ? used - i0 : 16;
                const __mmask16 live = _mm_test_epi8_mask(_mm_maskz_loadu_epi8(first_lanes(n), attend + i0),
                                                          _mm_set1_epi8(1));
                /* the cache is cold after the LM head streamed through: ask for the next block's keys and this
                 * block's values (read after the softmax) ahead of use (16 sequences of 352 keys, one
                 * thread: 361 us a layer from a cold cache without, ~215 with, 68 warm); the keys into the L2, not
                 * the L1 (16 rows ahead there: 64 sequences of 200 keys, SmolLM2's 30 layers, 22.3-23.1 ms against
                 * 13.1-14.3: bench.kv_attention --activations bfloat16) */
                for (int l = i0 == 0 ? 0 : i0 + 16 * AHEAD; l < i0 + 16 * (AHEAD + 1) && l < used; l++)
                    prefetch_row(k_cache + ((size_t)slot[l] * kv_heads + j) * dim, dim, _MM_HINT_T1);
                for (int l = i0; l < i0 + n; l++)
                    prefetch_row(v_cache + ((size_t)slot[l] * kv_heads + j) * dim, dim, _MM_HINT_T1);
                const uint16_t *key[16]; /* lanes past the last key read the first (their scores are dropped) */
                if (live)
                    for (int l = 0; l < 16; l++)
                        key[l] = k_cache + ((size_t)slot[i0 + (l < n ? l : 0)] * kv_heads + j) * dim;
                for (int g = 0; g < group; g++) {
                    __m512 sc = _mm512_set1_ps(-INFINITY);
                    if (live) {
                        __m512 acc[16];
                        _Pragma("GCC unroll 16") for (int l = 0; l < 16; l++) acc[l] = _mm512_setzero_ps();
                        for (int c = 0; c < chunks; c++) {
                            const __mmask32 lanes = c + 1 < chunks ? ~0u : tail;
                            _Pragma("GCC unroll 16") for (int l = 0; l < 16; l++) acc[l] = _mm512_dpbf16_ps(
                                acc[l], (__m512bh)_mm512_maskz_loadu_epi16(lanes, key[l] + c * 32), qb[g][c]);
                        }
                        sc = _mm512_mask_mul_ps(sc, live, sum16(acc), _mm512_set1_ps(scale));
                    }
                    _mm512_storeu_ps(scores + (size_t)g * padded + i0, sc);
                    top[g] = _mm512_max_ps(top[g], sc);
                }
            }
            float inv[MAX_GROUP]; /* 1 / each head's softmax denominator */
            for (int g = 0; g < group; g++) {
                float *s = scores + (size_t)g * padded;
                const int h = j * group + g;
                const float most = _mm512_reduce_max_ps(top[g]), top_g = sinks && sinks[h] > most ? sinks[h] : most;
                float total = sinks ? exp1(sinks[h] - top_g) : 0.0f;
                __m512 sum = _mm512_setzero_ps();
                for (int i = 0; i < used; i += 16) { /* masked keys and those past the last: exp(-inf) = 0 */
                    __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(s + i), _mm512_set1_ps(top_g)));
                    _mm512_storeu_ps(s + i, e);
                    sum = _mm512_add_ps(sum, e);
                }
                total += _mm512_reduce_add_ps(sum);
                inv[g] = 1.0f / total;
            }
            /* probabilities @ values: each value row read (and widened) once for a chunk of the group's heads
             * whose sums stay in registers; a head width that is not a power-of-two multiple of 16 takes
             * one head at a time */
            uint16_t *o = out + (row * heads + (size_t)j * group) * dim;
            const int lv = log2_exact(vecs);
            for (int g0 = 0; g0 < group;) {
                int lg = lv < 0 ? -1 : 4 - lv; /* the largest power-of-two chunk that fits in 16 registers */
                while (lg > 0 && (1 << lg) > group - g0) lg--;
                if (lv < 0) {
                    pv_any(scores + (size_t)g0 * padded, used, attend, slot, v_cache + (size_t)j * dim,
                           kv_heads * dim, vecs,
                           inv[g0], o + (size_t)g0 * dim);
                    g0++;
                } else {
                    PV[lv][lg](scores + (size_t)g0 * padded, padded, used, attend, slot, v_cache + (size_t)j * dim,
                               kv_heads * dim, inv + g0, o + (size_t)g0 * dim, dim);
                    g0 += 1 << lg;
                }
            }
        }
        free(scores);
    }
    return failed ? -1 : 0;
}
