/* The bf16 product's inner loop, shared by the bf16 LM head (bf16_matmul.c) and the float32 head's bf16 screen
 * (f32_int8_argmax.c): R rows of bf16 values times NT tiles of a bf16 weight packed [K/2][16][2] a tile (TILE = 16
 * columns, defined by the includer), all K / 2 pairs, VDPBF16PS (products exact, sums in float32). */
#ifndef SLUICE_BF16_TILES_H
#define SLUICE_BF16_TILES_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

/* acc[r][t] (__m512, R x NT) += row r of h (k values apart) . tile tile0 + t of w (tiles k * TILE values apart);
 * pf (or NULL): the matching tiles elsewhere (the next group's), prefetched into L2 a pair at a time */
#define BF16_TILES_DOT(R, NT, acc, w, h, k, tile0, pf)                                                       \
    do {                                                                                                     \
        const uint16_t *wt_ = (w) + (size_t)(tile0) * (k) * TILE;                                            \
        for (int p = 0; p < (k) / 2; p++) {                                                                  \
            __m512bh wv[NT];                                                                                 \
            _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++)                                             \
                wv[t] = (__m512bh)_mm512_loadu_si512(wt_ + (size_t)t * (k) * TILE + (size_t)p * 32);         \
            if (pf)                                                                                          \
                _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++)                                         \
                    _mm_prefetch((const char *)((pf) + (size_t)t * (k) * TILE + (size_t)p * 32), _MM_HINT_T1); \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                            \
                int32_t pair;                                                                                \
                memcpy(&pair, (h) + (size_t)r * (k) + 2 * p, 4);                                             \
                const __m512bh hb = (__m512bh)_mm512_set1_epi32(pair);                                       \
                _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++)                                         \
                    acc[r][t] = _mm512_dpbf16_ps(acc[r][t], wv[t], hb);                                      \
            }                                                                                                \
        }                                                                                                    \
    } while (0)

#endif
