/* float32 vectors of the width the build has: AVX-512F's 16 lanes, or AVX2 + FMA's 8 (built without
 * AVX-512F). What f32_layers.c writes once for both: F32V lanes a vector, loads and stores of the first
 * `count` lanes (the tail of a row), arithmetic, reductions, exp of non-positive values and the SwiGLU, and a
 * mask of lanes (attention's attended keys); what causal_attention.c and exp_blocks.c need beside: 2^y, masks
 * of the first lanes, loads of bf16 or float32.
 *
 * On AVX-512F these are simd.h's helpers as they are; on AVX2 the same methods (the same polynomial and
 * argument reduction for exp, 2^n built in the exponent bits where AVX-512 has scalef), so a value differs
 * between the two only by the order of a reduction's sums.
 */
#ifndef SLUICE_F32_VEC_H
#define SLUICE_F32_VEC_H

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#ifdef __AVX512F__
#include "simd.h"

enum { F32V = 16 };
typedef __m512 vf;
typedef __mmask16 vf_mask;

static inline vf vf_zero(void) { return _mm512_setzero_ps(); }
static inline vf vf_set1(float x) { return _mm512_set1_ps(x); }
static inline vf vf_load(const float *p) { return _mm512_loadu_ps(p); }
static inline void vf_store(float *p, vf v) { _mm512_storeu_ps(p, v); }
/* the first `count` lanes of p (0 in the others; none read past them) */
static inline vf vf_loadn(const float *p, int count) { return _mm512_maskz_loadu_ps(first_lanes(count), p); }
static inline void vf_storen(float *p, int count, vf v) { _mm512_mask_storeu_ps(p, first_lanes(count), v); }
static inline vf vf_add(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vf_sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline vf vf_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vf_fmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf vf_max(vf a, vf b) { return _mm512_max_ps(a, b); }
static inline float vf_sum(vf v) { return _mm512_reduce_add_ps(v); }
static inline float vf_most(vf v) { return _mm512_reduce_max_ps(v); }
static inline vf vf_exp(vf y) { return exp_nonpositive(y); }
static inline vf vf_silu_mul(vf g, vf u) { return silu_mul(g, u); }
/* lane i = the sum of v[i]'s lanes (F32V vectors) */
static inline vf vf_sums(const vf *v) { return sum16(v); }
/* the lanes of the first `count` (<= F32V) flags that are set (bool bytes) */
static inline vf_mask vf_flags(const uint8_t *flags, int count) {
    return _mm_test_epi8_mask(_mm_maskz_loadu_epi8(first_lanes(count), flags), _mm_set1_epi8(1));
}
static inline int vf_any(vf_mask m) { return m != 0; }
/* a in the lanes of m, b elsewhere */
static inline vf vf_where(vf_mask m, vf a, vf b) { return _mm512_mask_blend_ps(m, b, a); }
/* the first `count` lanes (none for count <= 0) */
static inline vf_mask vf_lanes(int count) { return count <= 0 ? 0 : first_lanes(count); }
/* v in the lanes of m, 0 elsewhere */
static inline vf vf_keep(vf_mask m, vf v) { return _mm512_maskz_mov_ps(m, v); }
static inline vf_mask vf_equal(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ); }
/* 2^y for finite y <= 0 (0 or a subnormal far below) */
static inline vf vf_exp2(vf y) { return exp2_finite(y); }
/* F32V values from x + i as float32: bf16 (bf16 != 0) or float32 (scalar: simd.h's load1) */
static inline vf vf_load_any(const void *x, int bf16, size_t i) { return load16(x, bf16, i); }
/* float32 to bf16 bits, rounded to nearest even (a NaN stays a quiet NaN) */
static inline __m256i vf_bf16_bits(vf v) {
#ifdef __AVX512BF16__
    return (__m256i)_mm512_cvtneps_pbh(v);
#else
    const __m512i u = _mm512_castps_si512(v);
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                                     _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc00000));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
#endif
}
static inline vf vf_load_f16(const uint16_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
static inline void vf_store_f16(uint16_t *p, vf v) {
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
static inline void vf_store_bf16(uint16_t *p, vf v) { _mm256_storeu_si256((__m256i *)p, vf_bf16_bits(v)); }
/* fp8 codes (zero-extended to 16 bits) as fp16 bits: e5m2's code is fp16's top byte; e4m3's exponent and
 * mantissa sit one bit lower there, which is 2^-8 of its value, subnormals included */
static inline __m256i fp8_halves(__m256i b, int e4m3) {
    const __m256i w = _mm256_slli_epi16(b, 8);
    if (!e4m3) return w;
    return _mm256_or_si256(_mm256_and_si256(w, _mm256_set1_epi16((short)0x8000)),
                           _mm256_srli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x7f00)), 1));
}
/* F32V int8 codes from p as float32 */
static inline vf vf_load_i8(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
/* v (whole numbers within int8's range) as F32V int8 codes at p */
static inline void vf_store_i8(int8_t *p, vf v) { _mm_storeu_si128((__m128i *)p, _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(v))); }
static inline vf vf_abs(vf v) { return _mm512_abs_ps(v); }
static inline vf vf_div(vf a, vf b) { return _mm512_div_ps(a, b); }
/* F32V fp8 codes from p as float32 */
static inline vf vf_load_fp8(const uint8_t *p, int e4m3) {
    const vf x = _mm512_cvtph_ps(fp8_halves(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p)), e4m3));
    return e4m3 ? vf_mul(x, vf_set1(256.0f)) : x;
}
/* v as F32V fp8 codes at p: the magnitude's bits rounded to the format's mantissa (to nearest even: add half
 * an ulp less one and the kept bits' lowest) and rebiased; below the smallest normal, the magnitude in units of
 * the smallest subnormal rounded by VCVTPS2DQ (to nearest even); at the largest finite value and past it, that
 * value; a NaN 0x7f; then the sign */
static inline void vf_store_fp8(uint8_t *p, vf v, int e4m3) {
    const __m512i u = _mm512_castps_si512(v), one = _mm512_set1_epi32(1);
    const __m512i a = _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff));
    const vf av = _mm512_castsi512_ps(a);
    const __m512i r = _mm512_add_epi32(a, _mm512_add_epi32(_mm512_set1_epi32(e4m3 ? 0x7ffff : 0xfffff),
                                                           _mm512_and_si512(_mm512_srli_epi32(a, e4m3 ? 20 : 21), one)));
    __m512i code = _mm512_sub_epi32(_mm512_srli_epi32(r, e4m3 ? 20 : 21), _mm512_set1_epi32(e4m3 ? 120 << 3 : 112 << 2));
    code = _mm512_mask_mov_epi32(code, _mm512_cmp_ps_mask(av, vf_set1(e4m3 ? 0x1p-6f : 0x1p-14f), _CMP_LT_OQ),
                                 _mm512_cvtps_epi32(vf_mul(av, vf_set1(e4m3 ? 0x1p9f : 0x1p16f))));
    code = _mm512_mask_mov_epi32(code, _mm512_cmp_ps_mask(av, vf_set1(e4m3 ? 448.0f : 57344.0f), _CMP_NLT_UQ),
                                 _mm512_set1_epi32(e4m3 ? 0x7e : 0x7b));
    code = _mm512_mask_mov_epi32(code, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7f));
    code = _mm512_or_si512(code, _mm512_and_si512(_mm512_srli_epi32(u, 24), _mm512_set1_epi32(0x80)));
    _mm_storeu_si128((__m128i *)p, _mm512_cvtepi32_epi8(code));
}

#else /* AVX2 + FMA */

enum { F32V = 8 };
typedef __m256 vf;
typedef __m256 vf_mask; /* all ones in a lane that is in */

static inline __m256i vf_first(int count) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(count), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
static inline vf vf_zero(void) { return _mm256_setzero_ps(); }
static inline vf vf_set1(float x) { return _mm256_set1_ps(x); }
static inline vf vf_load(const float *p) { return _mm256_loadu_ps(p); }
static inline void vf_store(float *p, vf v) { _mm256_storeu_ps(p, v); }
/* (a masked move only for a tail: on AMD's cores before Zen 3 a masked store is microcoded) */
static inline vf vf_loadn(const float *p, int count) {
    return count >= F32V ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, vf_first(count));
}
static inline void vf_storen(float *p, int count, vf v) {
    if (count >= F32V)
        _mm256_storeu_ps(p, v);
    else
        _mm256_maskstore_ps(p, vf_first(count), v);
}
static inline vf vf_add(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf vf_sub(vf a, vf b) { return _mm256_sub_ps(a, b); }
static inline vf vf_mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf vf_fmadd(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf vf_max(vf a, vf b) { return _mm256_max_ps(a, b); }
static inline float vf_sum(vf v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
static inline float vf_most(vf v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

/* e^r for |r| <= ln 2 / 2: simd.h's degree-6 polynomial, highest coefficient first */
static const float VF_EXP_POLY[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                                     4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
static inline vf vf_exp_reduced(vf r) {
    vf p = vf_set1(VF_EXP_POLY[0]);
    for (int i = 1; i < 6; i++) p = vf_fmadd(p, r, vf_set1(VF_EXP_POLY[i]));
    return vf_fmadd(p, vf_mul(r, r), vf_add(r, vf_set1(1.0f)));
}

/* exp(y) for y <= 0; 0 below -87 (and for -inf): simd.h's exp_nonpositive, 2^n as exponent bits (n >= -126
 * wherever the result is kept) */
static inline vf vf_exp(vf y) {
    const vf normal = _mm256_cmp_ps(y, vf_set1(-87.0f), _CMP_GE_OQ);
    y = vf_max(y, vf_set1(-88.0f));
    const vf n = _mm256_round_ps(vf_mul(y, vf_set1(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    vf r = _mm256_fnmadd_ps(n, vf_set1(0.693359375f), y); /* y - n ln2, ln2 in two parts */
    r = _mm256_fnmadd_ps(n, vf_set1(-2.12194440e-4f), r);
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(vf_mul(vf_exp_reduced(r), _mm256_castsi256_ps(bits)), normal);
}

/* silu(g) * u = g * sigmoid(g) * u, the sigmoid from exp(-|g|) */
static inline vf vf_silu_mul(vf g, vf u) {
    const vf one = vf_set1(1.0f), e = vf_exp(_mm256_or_ps(g, vf_set1(-0.0f)));
    const vf sigmoid = _mm256_div_ps(_mm256_blendv_ps(e, one, _mm256_cmp_ps(g, vf_zero(), _CMP_GE_OQ)), vf_add(one, e));
    return vf_mul(vf_mul(g, sigmoid), u);
}

/* lane i = the sum of v[i]'s lanes (8 vectors): pairs added across, then the 128-bit halves */
static inline vf vf_sums(const vf *v) {
    const vf a0 = _mm256_hadd_ps(v[0], v[1]), a1 = _mm256_hadd_ps(v[2], v[3]);
    const vf a2 = _mm256_hadd_ps(v[4], v[5]), a3 = _mm256_hadd_ps(v[6], v[7]);
    const vf b0 = _mm256_hadd_ps(a0, a1), b1 = _mm256_hadd_ps(a2, a3); /* halves: v0..v3, v4..v7 */
    return vf_add(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31));
}

static inline vf_mask vf_flags(const uint8_t *flags, int count) {
    uint8_t bytes[8] = {0};
    memcpy(bytes, flags, (size_t)count);
    long long packed;
    memcpy(&packed, bytes, sizeof packed);
    const __m256i one = _mm256_set1_epi32(1);
    const __m256i x = _mm256_and_si256(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(packed)), one);
    return _mm256_castsi256_ps(_mm256_cmpeq_epi32(x, one));
}
static inline int vf_any(vf_mask m) { return _mm256_movemask_ps(m) != 0; }
static inline vf vf_where(vf_mask m, vf a, vf b) { return _mm256_blendv_ps(b, a, m); }

/* exp of one value */
static inline float exp1(float y) { return _mm_cvtss_f32(_mm256_castps256_ps128(vf_exp(vf_set1(y)))); }

static inline vf_mask vf_lanes(int count) { return _mm256_castsi256_ps(vf_first(count)); }
static inline vf vf_keep(vf_mask m, vf v) { return _mm256_and_ps(m, v); }
static inline vf_mask vf_equal(vf a, vf b) { return _mm256_cmp_ps(a, b, _CMP_EQ_OQ); }

/* 2^y for finite y <= 0, y = n + f, |f| <= 1/2 (exact): 2^n as exponent bits, so 0 from n = -127 down (where
 * AVX-512's scalef keeps a subnormal) */
static inline vf vf_exp2(vf y) {
    y = vf_max(y, vf_set1(-127.0f));
    const vf n = _mm256_round_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    const vf f = vf_mul(vf_sub(y, n), vf_set1(0.693147180559945309f));
    return vf_mul(vf_exp_reduced(f), _mm256_castsi256_ps(bits));
}

static inline vf vf_load_any(const void *x, int bf16, size_t i) {
    if (!bf16) return _mm256_loadu_ps((const float *)x + i);
    const __m128i b = _mm_loadu_si128((const __m128i *)((const uint16_t *)x + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16));
}

static inline vf vf_load_f16(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
static inline void vf_store_f16(uint16_t *p, vf v) {
    _mm_storeu_si128((__m128i *)p, _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
/* rounded to bf16, to nearest even (a NaN stays a quiet NaN) */
static inline void vf_store_bf16(uint16_t *p, vf v) {
    const __m256i u = _mm256_castps_si256(v), one = _mm256_set1_epi32(1);
    __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff),
                                                     _mm256_and_si256(_mm256_srli_epi32(u, 16), one)));
    r = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000)),
                                             _mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
    r = _mm256_srli_epi32(r, 16);
    /* the 8 halves packed within each 128-bit lane, then the two lanes' first 64 bits side by side */
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
    _mm_storeu_si128((__m128i *)p, _mm256_castsi256_si128(packed));
}

static inline vf vf_load_i8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
static inline void vf_store_i8(int8_t *p, vf v) {
    const __m256i c = _mm256_cvtps_epi32(v);
    const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
    _mm_storel_epi64((__m128i *)p, _mm_packs_epi16(w, w));
}
static inline vf vf_abs(vf v) { return _mm256_and_ps(v, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff))); }
static inline vf vf_div(vf a, vf b) { return _mm256_div_ps(a, b); }
static inline __m128i fp8_halves(__m128i b, int e4m3) {
    const __m128i w = _mm_slli_epi16(b, 8);
    if (!e4m3) return w;
    return _mm_or_si128(_mm_and_si128(w, _mm_set1_epi16((short)0x8000)),
                        _mm_srli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x7f00)), 1));
}
static inline vf vf_load_fp8(const uint8_t *p, int e4m3) {
    const vf x = _mm256_cvtph_ps(fp8_halves(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)p)), e4m3));
    return e4m3 ? vf_mul(x, vf_set1(256.0f)) : x;
}
static inline void vf_store_fp8(uint8_t *p, vf v, int e4m3) {
    const __m256i u = _mm256_castps_si256(v), one = _mm256_set1_epi32(1);
    const __m256i a = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff));
    const vf av = _mm256_castsi256_ps(a);
    const __m256i r = _mm256_add_epi32(a, _mm256_add_epi32(_mm256_set1_epi32(e4m3 ? 0x7ffff : 0xfffff),
                                                           _mm256_and_si256(_mm256_srli_epi32(a, e4m3 ? 20 : 21), one)));
    vf code = _mm256_castsi256_ps(
        _mm256_sub_epi32(_mm256_srli_epi32(r, e4m3 ? 20 : 21), _mm256_set1_epi32(e4m3 ? 120 << 3 : 112 << 2)));
    code = _mm256_blendv_ps(code, _mm256_castsi256_ps(_mm256_cvtps_epi32(vf_mul(av, vf_set1(e4m3 ? 0x1p9f : 0x1p16f)))),
                            _mm256_cmp_ps(av, vf_set1(e4m3 ? 0x1p-6f : 0x1p-14f), _CMP_LT_OQ));
    code = _mm256_blendv_ps(code, _mm256_castsi256_ps(_mm256_set1_epi32(e4m3 ? 0x7e : 0x7b)),
                            _mm256_cmp_ps(av, vf_set1(e4m3 ? 448.0f : 57344.0f), _CMP_NLT_UQ));
    code = _mm256_blendv_ps(code, _mm256_castsi256_ps(_mm256_set1_epi32(0x7f)), _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    const __m256i c = _mm256_or_si256(_mm256_castps_si256(code),
                                      _mm256_and_si256(_mm256_srli_epi32(u, 24), _mm256_set1_epi32(0x80)));
    const __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
    _mm_storel_epi64((__m128i *)p, _mm_packus_epi16(w, w));
}

/* one value from x + i as float32 (simd.h's load1) */
static inline float load1(const void *x, int bf16, size_t i) {
    if (!bf16) return ((const float *)x)[i];
    const uint32_t bits = (uint32_t)((const uint16_t *)x)[i] << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}
#endif

/* A KV cache's elements: float32, bf16, fp16 (llama.cpp's default cache), int8 with a scale a row, or fp8
 * (vLLM's `fp8` cache: e4m3fn, or e5m2), the arithmetic float32 whichever they are. A 16-bit cache halves what a
 * step's attention reads, which at a few hundred keys a sequence is more than a small model's weights
 * (bench/RESULTS.md#kv-cache-dtype), an 8-bit one halves it again.
 *
 * An int8 cache's (slot, kv head) row is its D codes and then their scale, a float32's 4 bytes (kv_row: the row's
 * elements, kv_scale: its scale): a value is code * scale, the scale max |x| / 127 of the row's D values as
 * stored, each code round(x / scale) to nearest even (a row of zeros: codes 0, scale 0). fp8 has no scale
 * (vLLM's default of 1.0): a value is rounded to nearest even and saturates at the format's largest finite
 * value (448 for e4m3, 57,344 for e5m2), as torch's own conversion of a value clamped to that range (and NaN is
 * 0x7f). sluice/engine/attention.py's store_rows writes the same bytes. */
enum { KV_F32 = 0, KV_BF16 = 1, KV_F16 = 2, KV_E4M3 = 3, KV_E5M2 = 4, KV_I8 = 5 };

static inline size_t kv_bytes(int kind) { return kind == KV_F32 ? 4 : kind >= KV_E4M3 ? 1 : 2; }

/* the elements of a (slot, kv head) row of D values */
static inline size_t kv_row(int kind, int dim) { return kind == KV_I8 ? (size_t)dim + 4 : (size_t)dim; }

/* the scale of the row from element `row` (1 but for int8) */
static inline float kv_scale(const void *p, int kind, size_t row, int dim) {
    if (kind != KV_I8) return 1.0f;
    float s;
    memcpy(&s, (const uint8_t *)p + row + dim, sizeof s);
    return s;
}

/* F32V values of a cache from element i, as float32 (an int8 cache's codes: times kv_scale) */
static inline vf vf_load_kv(const void *p, int kind, size_t i) {
    if (kind == KV_F16) return vf_load_f16((const uint16_t *)p + i);
    if (kind == KV_I8) return vf_load_i8((const int8_t *)p + i);
    if (kind >= KV_E4M3) return vf_load_fp8((const uint8_t *)p + i, kind == KV_E4M3);
    return vf_load_any(p, kind == KV_BF16, i);
}

/* n values (a multiple of F32V; for int8, one row's D, its scale after them) of src into a cache from element i */
static inline void kv_put(void *p, int kind, size_t i, const float *src, int n) {
    if (kind == KV_F32) {
        memcpy((float *)p + i, src, sizeof(float) * n);
        return;
    }
    if (kind == KV_I8) {
        vf most = vf_zero();
        for (int c = 0; c < n; c += F32V) most = vf_max(most, vf_abs(vf_load(src + c)));
        const float scale = vf_most(most) / 127.0f;
        int8_t *o = (int8_t *)p + i;
        for (int c = 0; c < n; c += F32V)
            vf_store_i8(o + c, scale > 0.0f ? vf_div(vf_load(src + c), vf_set1(scale)) : vf_zero());
        memcpy(o + n, &scale, sizeof scale);
        return;
    }
    if (kind >= KV_E4M3) {
        for (int c = 0; c < n; c += F32V) vf_store_fp8((uint8_t *)p + i + c, vf_load(src + c), kind == KV_E4M3);
        return;
    }
    uint16_t *o = (uint16_t *)p + i;
    for (int c = 0; c < n; c += F32V) {
        if (kind == KV_F16)
            vf_store_f16(o + c, vf_load(src + c));
        else
            vf_store_bf16(o + c, vf_load(src + c));
    }
}

#endif
