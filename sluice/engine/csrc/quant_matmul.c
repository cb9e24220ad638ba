/* Float32 rows times a weight kept in GGUF's block formats (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K):
 * out[m][n] = sum_k x[m][k] w[n][k] (+ bias[n]).
 *
 * Every type is read the same way: one weight row at a time is unpacked (in a per-thread buffer of a few
 * KB, held in L1 while every row of x reads it) into int8 values q, one scale per group of 16 and, for the
 * types with an offset, one min per group: w = scale * q - min. Two ways to multiply it:
 *
 * - int8 activations (int8_acts != 0): each row of x quantized per block of 32 as llama.cpp's dot products
 *   do (d = max|x| / 127, xq = round(x / d)); products of int8 pairs summed exactly in int32 for every 4
 *   consecutive k (VPDPBUSD on AVX512-VNNI, VPMADDUBSW + VPMADDWD on AVX2), each such lane then scaled in
 *   float32 by its weight group's scale times its block's d (what depends on x alone is computed once a
 *   call, what depends on the weight row alone once a row);
 * - float activations: the row dequantized to float32 (w as above) and multiplied in float32 (FMA).
 *
 * Built once per instruction set (engine/cpu/kernels.py); K is a multiple of 32 (of 256 for the K-quants).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
    if (exp == 0) {
        if (mant == 0) {
            bits = sign;
        } else {  /* subnormal: normalise */
            exp = 127 - 15 + 1;
            while (!(mant & 0x400)) { mant <<= 1; exp--; }
            bits = sign | (exp << 23) | ((mant & 0x3ff) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline float f16_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return half_to_float(h);
}

static inline void k4_scale_min(int j, const uint8_t *s, int *sc, int *m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
        *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* 16 bytes of nibbles as 32 values minus `off`: the low nibbles, then the high ones */
static inline void nibbles16(const uint8_t *b, int8_t *out, int off) {
    const __m128i v = _mm_loadu_si128((const __m128i *)b), mask = _mm_set1_epi8(0x0F), o = _mm_set1_epi8((char)off);
    _mm_storeu_si128((__m128i *)out, _mm_sub_epi8(_mm_and_si128(v, mask), o));
    _mm_storeu_si128((__m128i *)(out + 16), _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(v, 4), mask), o));
}

/* One weight row of k values: q [k], scale and min [k / 16] (min left alone where the type has none). */
static void unpack_row(int type, const uint8_t *b, int k, int8_t *q, float *gs, float *mn) {
    switch (type) {
    case Q8_0:
        for (int i = 0; i < k; i += 32, b += 34) {
            gs[i / 16] = gs[i / 16 + 1] = f16_at(b);
            memcpy(q + i, b + 2, 32);
        }
        break;
    case Q4_0:
    case Q4_1: {
        const int size = type == Q4_0 ? 18 : 20, off = type == Q4_0 ? 8 : 0;
        for (int i = 0; i < k; i += 32, b += size) {
            gs[i / 16] = gs[i / 16 + 1] = f16_at(b);
            if (type == Q4_1) mn[i / 16] = mn[i / 16 + 1] = -f16_at(b + 2);
            nibbles16(b + size - 16, q + i, off);
        }
        break;
    }
    case Q4_K:
    case Q5_K: {
        const int size = type == Q4_K ? 144 : 176;
        for (int i = 0; i < k; i += 256, b += size) {
            const float d = f16_at(b), dmin = f16_at(b + 2);
            const uint8_t *scales = b + 4, *qh = b + 16, *qs = b + (type == Q4_K ? 16 : 48);
            for (int j = 0; j < 8; j++) {
                int sc, m;
                k4_scale_min(j, scales, &sc, &m);
                gs[(i >> 4) + 2 * j] = gs[(i >> 4) + 2 * j + 1] = d * (float)sc;
                mn[(i >> 4) + 2 * j] = mn[(i >> 4) + 2 * j + 1] = dmin * (float)m;
            }
            for (int c = 0; c < 4; c++) {  /* 64 values: the low nibbles of 32 bytes, then the high ones */
                const __m128i mask = _mm_set1_epi8(0x0F), one = _mm_set1_epi8(1);
                for (int h = 0; h < 32; h += 16) {
                    const __m128i v = _mm_loadu_si128((const __m128i *)(qs + 32 * c + h));
                    __m128i lo = _mm_and_si128(v, mask), hi = _mm_and_si128(_mm_srli_epi16(v, 4), mask);
                    if (type == Q5_K) {  /* (a 16-bit shift, then one bit a byte: each byte's own bit) */
                        const __m128i bits = _mm_loadu_si128((const __m128i *)(qh + h));
                        lo = _mm_or_si128(lo, _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(bits, 2 * c), one), 4));
                        hi = _mm_or_si128(hi, _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(bits, 2 * c + 1), one), 4));
                    }
                    _mm_storeu_si128((__m128i *)(q + i + 64 * c + h), lo);
                    _mm_storeu_si128((__m128i *)(q + i + 64 * c + 32 + h), hi);
                }
            }
        }
        break;
    }
    case Q6_K:
        for (int i = 0; i < k; i += 256, b += 210) {
            const uint8_t *ql = b, *qh = b + 128;
            const int8_t *sc = (const int8_t *)(b + 192);
            const float d = f16_at(b + 208);
            for (int g = 0; g < 16; g++) gs[(i >> 4) + g] = d * (float)sc[g];
            for (int h = 0; h < 2; h++) {
                int8_t *y = q + i + 128 * h;
                const uint8_t *l0 = ql + 64 * h, *h0 = qh + 32 * h;
                for (int l = 0; l < 32; l++) {
                    y[l] = (int8_t)(((l0[l] & 0xF) | ((h0[l] >> 0 & 3) << 4)) - 32);
                    y[l + 32] = (int8_t)(((l0[l + 32] & 0xF) | ((h0[l] >> 2 & 3) << 4)) - 32);
                    y[l + 64] = (int8_t)(((l0[l] >> 4) | ((h0[l] >> 4 & 3) << 4)) - 32);
                    y[l + 96] = (int8_t)(((l0[l + 32] >> 4) | ((h0[l] >> 6 & 3) << 4)) - 32);
                }
            }
        }
        break;
    }
}

static int has_min(int type) { return type == Q4_1 || type == Q4_K || type == Q5_K; }

int sluice_quant_supported(int type) {
    return type == Q8_0 || type == Q4_0 || type == Q4_1 || type == Q4_K || type == Q5_K || type == Q6_K;
}

/* an unpacked row's float32 values: scale * q - min, per group of 16 */
static inline void dequantize_row(const int8_t *q, const float *gs, const float *mn, int k, float *out) {
    for (int g = 0; g < k / 16; g++) {
        const __m128i v = _mm_loadu_si128((const __m128i *)(q + 16 * g));
#ifdef __AVX512F__
        _mm512_storeu_ps(out + 16 * g, _mm512_fmsub_ps(_mm512_set1_ps(gs[g]), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v)),
                                                       _mm512_set1_ps(mn[g])));
#else
        const __m256 s = _mm256_set1_ps(gs[g]), m = _mm256_set1_ps(mn[g]);
        _mm256_storeu_ps(out + 16 * g, _mm256_fmsub_ps(s, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)), m));
        _mm256_storeu_ps(out + 16 * g + 8, _mm256_fmsub_ps(s, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
            _mm_srli_si128(v, 8))), m));
#endif
    }
}

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

/* Returns 0, or -1 where a workspace could not be allocated or the type is not one of these. */
int sluice_quant_matmul(const uint8_t *w, int type, int n, int k, long row_bytes, const float *x, long ldx, int m,
                        const float *bias, float *out, long ldo, int int8_acts) {
    if (!sluice_quant_supported(type) || k % 32) return -1;
    const int groups = k / 16, lanes = k / 4, mins = has_min(type);
    int8_t *xq = NULL;
    float *lane_d = NULL, *group_sum = NULL;
    int32_t *lane_corr = NULL;
    if (int8_acts) {
        xq = malloc((size_t)m * k);
        lane_d = malloc((size_t)m * lanes * sizeof(float));
        lane_corr = malloc((size_t)m * lanes * sizeof(int32_t));
        group_sum = malloc((size_t)m * groups * sizeof(float));
        if (!xq || !lane_d || !lane_corr || !group_sum) {
            free(xq), free(lane_d), free(lane_corr), free(group_sum);
            return -1;
        }
#pragma omp parallel for schedule(static) if (m > 1)
        for (int r = 0; r < m; r++)
            quantize_row(x + (size_t)r * ldx, k, xq + (size_t)r * k, lane_d + (size_t)r * lanes,
                         lane_corr + (size_t)r * lanes, group_sum + (size_t)r * groups);
    }
    int failed = 0;
#pragma omp parallel reduction(| : failed)
    {
        /* the unpacked row: q, scales and mins per group, float values (the float path) */
        int8_t *q = malloc((size_t)k);
        float *gs = malloc((size_t)groups * sizeof(float)), *mn = calloc((size_t)groups, sizeof(float));
        float *wf = int8_acts ? NULL : malloc((size_t)k * sizeof(float));
        const int ok = q && gs && mn && (int8_acts || wf);
        failed = !ok;
        {
            /* (every thread reaches the loop's barrier, with its rows skipped where it has no buffers) */
#pragma omp for schedule(static)
            for (int j = 0; j < n; j++) {
                if (!ok) continue;
                unpack_row(type, w + (size_t)j * row_bytes, k, q, gs, mn);
                const float b = bias ? bias[j] : 0.0f;
                if (int8_acts) {
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
                } else {
                    dequantize_row(q, gs, mn, k, wf);
                    for (int r = 0; r < m; r++) out[(size_t)r * ldo + j] = dot_f32(wf, x + (size_t)r * ldx, k) + b;
                }
            }
        }
        free(q), free(gs), free(mn), free(wf);
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
