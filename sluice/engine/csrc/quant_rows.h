/* GGUF's block formats (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) a whole row at a time: unpack_row gives a row's
 * int8 values and its scale and min per group of 16 (w = scale * q - min), dequantize_row their float32
 * values, exactly the gguf package's (what sluice_quant_dequantize gives, and the buffer quant_blocks.h's
 * product reads past QM_DIRECT_ROWS rows of x). */
#ifndef SLUICE_QUANT_ROWS_H
#define SLUICE_QUANT_ROWS_H

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

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
    case Q5_0:
    case Q5_1: { /* (d, Q5_1's m, 32 fifth bits, then Q4's nibbles) */
        const int size = type == Q5_0 ? 22 : 24, head = type == Q5_0 ? 2 : 4, off = type == Q5_0 ? 16 : 0;
        for (int i = 0; i < k; i += 32, b += size) {
            gs[i / 16] = gs[i / 16 + 1] = f16_at(b);
            if (type == Q5_1) mn[i / 16] = mn[i / 16 + 1] = -f16_at(b + 2);
            uint32_t fifth;
            memcpy(&fifth, b + head, 4);
            nibbles16(b + head + 4, q + i, 0);
            for (int j = 0; j < 32; j++) q[i + j] = (int8_t)((q[i + j] | (int)((fifth >> j & 1) << 4)) - off);
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

static int has_min(int type) { return type == Q4_1 || type == Q5_1 || type == Q4_K || type == Q5_K; }

static inline int qm_supported(int type) {
    return type == Q8_0 || type == Q4_0 || type == Q4_1 || type == Q5_0 || type == Q5_1 || type == Q4_K ||
           type == Q5_K || type == Q6_K;
}

/* an unpacked row's float32 values: scale * q - min, per group of 16 */
static inline void dequantize_row(const int8_t *q, const float *gs, const float *mn, int k, float *out) {
    for (int g = 0; g < k / 16; g++) {
        const __m128i v = _mm_loadu_si128((const __m128i *)(q + 16 * g));
#ifdef __AVX512F__
        const __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v));
        _mm512_storeu_ps(out + 16 * g, _mm512_fmsub_ps(_mm512_set1_ps(gs[g]), q, _mm512_set1_ps(mn[g])));
#else
        const __m256 s = _mm256_set1_ps(gs[g]), m = _mm256_set1_ps(mn[g]);
        _mm256_storeu_ps(out + 16 * g, _mm256_fmsub_ps(s, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)), m));
        _mm256_storeu_ps(out + 16 * g + 8, _mm256_fmsub_ps(s, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
            _mm_srli_si128(v, 8))), m));
#endif
    }
}

#endif
