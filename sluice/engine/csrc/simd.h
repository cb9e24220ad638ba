/* Vector helpers the CPU kernels share (AVX-512). */
#ifndef SLUICE_SIMD_H
#define SLUICE_SIMD_H

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

/* a mask of the first `count` lanes (all 16 from 16 up) */
static inline __mmask16 first_lanes(int count) {
    return count >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << count) - 1);
}

/* 16 bf16 values as float32 */
static inline __m512 widen_bf16(__m256i b) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}

/* the lanes of x in `keep` as float32 (0 elsewhere) */
static inline __m512 load_bf16(const uint16_t *x, __mmask16 keep) {
    return widen_bf16(_mm256_maskz_loadu_epi16(keep, x));
}

/* v rounded to bf16 (to nearest even), into the lanes of out in `keep` */
static inline void store_bf16(uint16_t *out, __m512 v, __mmask16 keep) {
    _mm256_mask_storeu_epi16(out, keep, (__m256i)_mm512_cvtneps_pbh(v));
}

/* v rounded to bf16, as float32 */
static inline __m512 round_bf16(__m512 v) {
    return widen_bf16((__m256i)_mm512_cvtneps_pbh(v));
}

/* 16 values from x + i as float32: bf16 (bf16 != 0) or float32 */
static inline __m512 load16(const void *x, int bf16, size_t i) {
    if (!bf16) return _mm512_loadu_ps((const float *)x + i);
    return widen_bf16(_mm256_loadu_si256((const __m256i *)((const uint16_t *)x + i)));
}

static inline float load1(const void *x, int bf16, size_t i) {
    if (!bf16) return ((const float *)x)[i];
    uint32_t bits = (uint32_t)((const uint16_t *)x)[i] << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* e^r for |r| <= ln 2 / 2: a degree-6 polynomial */
static inline __m512 exp_reduced(__m512 r) {
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    return _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
}

/* exp(y) for y <= 0; 0 below -87 (and for -inf) */
static inline __m512 exp_nonpositive(__m512 y) {
    const __mmask16 normal = _mm512_cmp_ps_mask(y, _mm512_set1_ps(-87.0f), _CMP_GE_OQ);
    y = _mm512_max_ps(y, _mm512_set1_ps(-88.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(y, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), y);  /* y - n ln2, ln2 in two parts */
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    return _mm512_maskz_mov_ps(normal, _mm512_scalef_ps(exp_reduced(r), n));
}

/* 2^y for finite y <= 0 (no clamp, no mask: 0 or a subnormal far below, where scalef takes it): y = n + f,
 * |f| <= 1/2 (exact), 2^f = e^(f ln 2) */
static inline __m512 exp2_finite(__m512 y) {
    const __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm512_scalef_ps(exp_reduced(_mm512_mul_ps(_mm512_sub_ps(y, n), _mm512_set1_ps(0.693147180559945309f))), n);
}

/* silu(g) * u = g * sigmoid(g) * u, the sigmoid from exp(-|g|) (no overflow for any g) */
static inline __m512 silu_mul(__m512 g, __m512 u) {
    const __m512 one = _mm512_set1_ps(1.0f);
    const __m512 e = exp_nonpositive(_mm512_castsi512_ps(
        _mm512_or_si512(_mm512_castps_si512(g), _mm512_set1_epi32((int)0x80000000))));
    const __mmask16 positive = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_GE_OQ);
    const __m512 sigmoid = _mm512_div_ps(_mm512_mask_blend_ps(positive, e, one), _mm512_add_ps(one, e));
    return _mm512_mul_ps(_mm512_mul_ps(g, sigmoid), u);
}

/* exp_nonpositive of one value */
static inline float exp1(float y) {
    float out[16];
    _mm512_storeu_ps(out, exp_nonpositive(_mm512_set1_ps(y)));
    return out[0];
}

/* lane i = the sum of v[i]'s 16 lanes: pairs of vectors folded into one, four times (45 instructions for
 * 16 sums, against ~8 a sum one at a time) */
static inline __m512 sum16(const __m512 *v) {
    __m512 a[8], b[4], c[2];
    for (int i = 0; i < 8; i++) /* per 128-bit lane: [x0+x2, y0+y2, x1+x3, y1+y3] of x = v[2i], y = v[2i+1] */
        a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) { /* per 128-bit lane: the partial sums of v[4i .. 4i+3] */
        const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
        b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    for (int i = 0; i < 2; i++) /* 128-bit lanes: v[8i..8i+3] (halves 0+1, 2+3), v[8i+4..8i+7] (the same) */
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

#endif
