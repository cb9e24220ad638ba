/* Float32 rows times a weight kept in GGUF's block formats (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K), the entries
 * engine/cpu/quant.py calls: out[m][n] = sum_k x[m][k] w[n][k] (+ bias[n]).
 *
 * - float activations (sluice_quant_linear, the default): quant_blocks.h's product, the weight dequantized
 *   exactly in registers a tile at a time (the one-call step, f32_layers.c, runs the same tiles);
 * - int8 activations (sluice_quant_matmul_int8): each row of x quantized per block of 32 as llama.cpp's dot
 *   products do (d = max|x| / 127, xq = round(x / d)); products of int8 pairs summed exactly in int32 for
 *   every 4 consecutive k (VPDPBUSD on AVX512-VNNI, VPMADDUBSW + VPMADDWD on AVX2), each such lane then scaled
 *   in float32 by its weight group's scale times its block's d; one weight row unpacked at a time;
 * - sluice_quant_dequantize: a weight's float32 values (the gguf package's, exactly).
 *
 * Built once per instruction set (engine/cpu/kernels.py); K is a multiple of 32 (of 256 for the K-quants).
 */
#include <omp.h>

#include "quant_blocks.h"

int sluice_quant_supported(int type) { return qm_supported(type); }

/* float32 dot of n values (n a multiple of 16) */
static inline float dot_f32(const float *a, const float *b, int n) {
#ifdef __AVX512F__
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    int i = 0;
    for (; i + 32 <= n; i += 32) {
        acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc0);
        acc1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), _mm512_loadu_ps(b + i + 16), acc1);
    }
    for (; i < n; i += 16) acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc0);
    return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
#else
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (int i = 0; i < n; i += 16) {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
    }
    __m256 s = _mm256_add_ps(acc0, acc1);
    __m128 r = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    r = _mm_add_ss(r, _mm_movehdup_ps(r));
    return _mm_cvtss_f32(r);
#endif
}

/* A row of x as the int8 path reads it: per block of 32, d = max|x| / 127 and xq = round(x / d); d per lane
 * of 4 values; -128 times each lane's sum of xq (VPDPBUSD's start: see dot_int8); and, for the types with a
 * min, d * sum(xq) per group of 16. */
static void quantize_row(const float *x, int k, int8_t *xq, float *lane_d, int32_t *lane_corr, float *group_sum) {
    for (int i = 0; i < k; i += 32) {
        float amax = 0.0f;
        for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(x[i + j]));
        const float d = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        int sums[2] = {0, 0};
        for (int j = 0; j < 32; j++) {
            const int v = (int)nearbyintf(x[i + j] * inv);
            sums[j >> 4] += v;
            xq[i + j] = (int8_t)v;
        }
        for (int j = 0; j < 8; j++) {
            lane_d[i / 4 + j] = d;
            const int8_t *l = xq + i + 4 * j;
            lane_corr[i / 4 + j] = -128 * (l[0] + l[1] + l[2] + l[3]);
        }
        group_sum[i / 16] = d * (float)sums[0];
        group_sum[i / 16 + 1] = d * (float)sums[1];
    }
}

/* sum over k of q * xq, each lane of 4 scaled by its group's scale gs times its block's d (the int8 path's dot
 * of one pair of rows); w: q + 128 (unsigned) on AVX512-VNNI, q on AVX2 */
static inline float dot_int8(const uint8_t *w, const float *gs, const int8_t *xq, const float *lane_d,
                             const int32_t *lane_corr, int k) {
#ifdef __AVX512VNNI__
    const __m512i spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    __m512 acc = _mm512_setzero_ps();
    for (int i = 0; i < k; i += 64) {
        const __mmask64 bytes = k - i >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << (k - i)) - 1);
        const __mmask16 lanes = k - i >= 64 ? (__mmask16)0xffff : (__mmask16)((1u << ((k - i) / 4)) - 1);
        /* (q + 128) * xq summed from -128 * sum(xq): exactly sum q * xq in each lane */
        const __m512i s = _mm512_dpbusd_epi32(_mm512_maskz_loadu_epi32(lanes, lane_corr + i / 4),
                                              _mm512_maskz_loadu_epi8(bytes, w + i),
                                              _mm512_maskz_loadu_epi8(bytes, xq + i));
        const __m512 scales = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(
            _mm_maskz_loadu_ps(k - i >= 64 ? 0xf : 0x3, gs + i / 16)));
        const __m512 scale = _mm512_mul_ps(scales, _mm512_maskz_loadu_ps(lanes, lane_d + i / 4));
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), scale, acc);
    }
    return _mm512_reduce_add_ps(acc);
#else
    (void)lane_corr;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc = _mm256_setzero_ps();
    for (int i = 0; i < k; i += 32) {
        const __m256i q = _mm256_loadu_si256((const __m256i *)(w + i));
        const __m256i x = _mm256_loadu_si256((const __m256i *)(xq + i));
        /* |q| <= 128 and |xq| <= 127: each pair's sum fits int16 */
        const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(q, q), _mm256_sign_epi8(x, q)),
                                            ones);
        const __m256 scales = _mm256_set_m128(_mm_set1_ps(gs[i / 16 + 1]), _mm_set1_ps(gs[i / 16]));
        const __m256 scale = _mm256_mul_ps(scales, _mm256_loadu_ps(lane_d + i / 4));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), scale, acc);
    }
    __m128 r = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    r = _mm_add_ss(r, _mm_movehdup_ps(r));
    return _mm_cvtss_f32(r);
#endif
}

/* out[m][ldo] = x @ W^T (+ bias) for float32 rows x and a weight W [sum of the parts' n][k] (K a multiple of
 * 32, of 256 for the K-quants), each value dequantized exactly as sluice_quant_dequantize gives it and multiplied
 * in float32. Returns 0, or -1 where a part's type is not one of these. */
int sluice_quant_linear(const quant_part_t *parts, int num_parts, int k, const float *x, long ldx, int m,
                        const float *bias, float *out, long ldo) {
    double n = 0;
    for (int p = 0; p < num_parts; p++) {
        if (!sluice_quant_supported(parts[p].type) || k % 32) return -1;
        n += parts[p].n;
    }
    int next = 0;
    const int threads = (double)m * n * k >= QM_SERIAL_WORK ? omp_get_max_threads() : 1;
    const int chunk = qm_chunk(parts, num_parts, threads);
#pragma omp parallel num_threads(threads)
    qm_linear_part(parts, num_parts, k, x, ldx, m, bias, out, ldo, &next, chunk);
    return 0;
}

/* The int8-activation product of one part (n rows of the weight, row_bytes apart) into out's first n columns.
 * Returns 0, or -1 where a workspace could not be allocated or the type is not one of these. */
int sluice_quant_matmul_int8(const uint8_t *w, int type, int n, int k, long row_bytes, const float *x, long ldx,
                             int m, const float *bias, float *out, long ldo) {
    if (!sluice_quant_supported(type) || k % 32) return -1;
    const int groups = k / 16, lanes = k / 4, mins = has_min(type);
    int8_t *xq = malloc((size_t)m * k);
    float *lane_d = malloc((size_t)m * lanes * sizeof(float)), *group_sum = malloc((size_t)m * groups * sizeof(float));
    int32_t *lane_corr = malloc((size_t)m * lanes * sizeof(int32_t));
    if (!xq || !lane_d || !lane_corr || !group_sum) {
        free(xq), free(lane_d), free(lane_corr), free(group_sum);
        return -1;
    }
#pragma omp parallel for schedule(static) if (m > 1)
    for (int r = 0; r < m; r++)
        quantize_row(x + (size_t)r * ldx, k, xq + (size_t)r * k, lane_d + (size_t)r * lanes,
                     lane_corr + (size_t)r * lanes, group_sum + (size_t)r * groups);
    int failed = 0;
#pragma omp parallel reduction(| : failed)
    {
        /* the unpacked row: q, scales and mins per group */
        int8_t *q = malloc((size_t)k);
        float *gs = malloc((size_t)groups * sizeof(float)), *mn = calloc((size_t)groups, sizeof(float));
        const int ok = q && gs && mn;
        failed = !ok;
        {
            /* (every thread reaches the loop's barrier, with its rows skipped where it has no buffers) */
#pragma omp for schedule(static)
            for (int j = 0; j < n; j++) {
                if (!ok) continue;
                unpack_row(type, w + (size_t)j * row_bytes, k, q, gs, mn);
                const float b = bias ? bias[j] : 0.0f;
#ifdef __AVX512VNNI__
                for (int i = 0; i < k; i++) q[i] ^= (int8_t)0x80;  /* q + 128, as VPDPBUSD's unsigned operand */
#endif
                for (int r = 0; r < m; r++) {
                    float s = dot_int8((const uint8_t *)q, gs, xq + (size_t)r * k, lane_d + (size_t)r * lanes,
                                       lane_corr + (size_t)r * lanes, k);
                    if (mins) {
                        const float *xs = group_sum + (size_t)r * groups;
                        if (groups % 16 == 0) {
                            s -= dot_f32(mn, xs, groups);
                        } else {
                            for (int g = 0; g < groups; g++) s -= mn[g] * xs[g];
                        }
                    }
                    out[(size_t)r * ldo + j] = s + b;
                }
            }
        }
        free(q), free(gs), free(mn);
    }
    free(xq), free(lane_d), free(lane_corr), free(group_sum);
    return failed ? -1 : 0;
}

/* The weight dequantized to float32 [n][k] (for the torch path and tests). */
int sluice_quant_dequantize(const uint8_t *w, int type, int n, int k, long row_bytes, float *out) {
    if (!sluice_quant_supported(type) || k % 32) return -1;
    const int groups = k / 16;
    int failed = 0;
#pragma omp parallel reduction(| : failed)
    {
        int8_t *q = malloc((size_t)k);
        float *gs = malloc((size_t)groups * sizeof(float)), *mn = calloc((size_t)groups, sizeof(float));
        const int ok = q && gs && mn;
        failed = !ok;
        {
#pragma omp for schedule(static)
            for (int j = 0; j < n; j++) {
                if (!ok) continue;
                unpack_row(type, w + (size_t)j * row_bytes, k, q, gs, mn);
                dequantize_row(q, gs, mn, k, out + (size_t)j * k);
            }
        }
        free(q), free(gs), free(mn);
    }
    return failed ? -1 : 0;
}
