/* csrc/f32_matmul.c's sluice_f32_matmul for CPUs with AVX2 and FMA but no AVX-512F: x @ W^T (+ bias) for
 * float32 rows x, or each row's argmax, on the same packed weight (tiles of 16 output rows, bf16
 * [K/2][16][2] or float32 [K/2][2][16]) with the same results bit for bit: each output is one chain of
 * float32 multiply-adds over k in order, whatever the number of rows, the thread or the blocking.
 *
 * A tile's 16 rows are two ymm vectors a column. AVX2 has 16 ymm registers, so a block holds up to 12
 * accumulators beside its two weight vectors, a broadcast row value and the bf16 mask: one tile by up to 6
 * rows, two tiles by 2 rows, or four tiles by 1 row (a decode's few rows: more independent chains than one
 * tile gives, to hide the multiply-add's latency). The multiply-add is written as the one instruction
 * (f32_fma): with the intrinsic GCC spilled an accumulator of 5 or 6 rows to the stack inside the loop, and
 * 4 rows were the most that ran well (6 rows and the panels below take 0.77-0.91 of the time of 4 rows over
 * every row at 512-2,048 rows, 0.92-0.96 at 16-64). A bf16 pair is widened as in f32_matmul.c: its 32-bit
 * lane shifted left 16 bits is the even column in float32, masked to its high half the odd one.
 *
 * Chunks of pairs, the argmax fold and the threads are f32_matmul.c's (see there), as are the units of work:
 * (a panel of rows, a block of F32_GROUP tiles); only the vectors differ. Tails use AVX2's masked loads and
 * stores.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

enum { F32_TILE = 16, F32_GROUP = 4, F32_ROWS = 6, F32_KP = 64, F32_LD = F32_TILE * F32_GROUP, F32_WIDE = 0 };
/* multiply-adds below which one thread does it all (waking the other costs more) */
#define F32_SERIAL_WORK 1.5e6

/* acc + w * x, one rounding (_mm256_fmadd_ps): the one instruction, so GCC keeps each accumulator in its own
 * register (with the intrinsic it picks other forms of the FMA and moves, and with 10 accumulators spills one) */
static inline __m256 f32_fma(__m256 acc, __m256 w, __m256 x) {
    __asm__("vfmadd231ps %2, %1, %0" : "+x"(acc) : "x"(w), "x"(x));
    return acc;
}

/* R rows x NT tiles over the pairs [p0, p1): acc (R x 2 NT vectors of 8, F32_LD floats a row of c) starts
 * from zero when first, else from c, and is left in c. w: the first tile; k: columns (a tile holds k * 16
 * values); x: rows ldx apart; pf: where to prefetch the same pairs of the next block's tiles, or NULL.
 * BF16 != 0: the weight is packed bf16, else float32. */
#define F32_BLOCK(R, NT, BF16)                                                                                \
    static void f32_block_##R##_##NT##_##BF16(const void *w, int k, int p0, int p1, const float *restrict x,   \
                                              long ldx, float *restrict c, int first, const char *pf) {       \
        __m256 acc[R][2 * NT];                                                                                \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                                                   \
            _Pragma("GCC unroll 8") for (int j = 0; j < 2 * NT; j++)                                          \
                acc[r][j] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(c + r * F32_LD + j * 8);             \
        const __m256i high = _mm256_set1_epi32((int)0xffff0000);                                              \
        const size_t tile = (size_t)k * F32_TILE; /* values a tile */                                         \
        for (int p = p0; p < p1; p++) {                                                                       \
            __m256 wv[2 * NT];                                                                                \
            _Pragma("GCC unroll 8") for (int j = 0; j < 2 * NT; j++) {                                        \
                const size_t at = (j / 2) * tile + (size_t)p * 32; /* the pair in tile j / 2 */               \
                if (BF16) {                                                                                   \
                    const __m256i v = _mm256_loadu_si256((const __m256i *)((const uint16_t *)w + at + (j % 2) * 16)); \
                    wv[j] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));                                    \
                } else {                                                                                      \
                    wv[j] = _mm256_loadu_ps((const float *)w + at + (j % 2) * 8);                             \
                }                                                                                             \
            }                                                                                                 \
            if (pf)                                                                                           \
                _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++)                                          \
                    _mm_prefetch(pf + (t * tile + (size_t)p * 32) * (BF16 ? 2 : 4), _MM_HINT_T1);             \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                             \
                const __m256 xe = _mm256_set1_ps(x[r * ldx + 2 * p]);                                         \
                _Pragma("GCC unroll 8") for (int j = 0; j < 2 * NT; j++) acc[r][j] = f32_fma(acc[r][j], wv[j], xe); \
            }                                                                                                 \
            /* (no code: the odd column's pairs are loaded again, from L1, not kept in registers since the    \
             * even column's loads; with 2 or 4 tiles they would spill accumulators) */                     \
            __asm__ volatile("" ::: "memory");                                                                \
            _Pragma("GCC unroll 8") for (int j = 0; j < 2 * NT; j++) {                                        \
                const size_t at = (j / 2) * tile + (size_t)p * 32;                                            \
                if (BF16) {                                                                                   \
                    const __m256i v = _mm256_loadu_si256((const __m256i *)((const uint16_t *)w + at + (j % 2) * 16)); \
                    wv[j] = _mm256_castsi256_ps(_mm256_and_si256(v, high));                                   \
                } else {                                                                                      \
                    wv[j] = _mm256_loadu_ps((const float *)w + at + 16 + (j % 2) * 8);                        \
                }                                                                                             \
            }                                                                                                 \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                             \
                const __m256 xo = _mm256_set1_ps(x[r * ldx + 2 * p + 1]);                                     \
                _Pragma("GCC unroll 8") for (int j = 0; j < 2 * NT; j++) acc[r][j] = f32_fma(acc[r][j], wv[j], xo); \
            }                                                                                                 \
        }                                                                                                     \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                                                   \
            _Pragma("GCC unroll 8") for (int j = 0; j < 2 * NT; j++)                                          \
                _mm256_storeu_ps(c + r * F32_LD + j * 8, acc[r][j]);                                          \
    }
#define F32_BLOCKS(R, NT) F32_BLOCK(R, NT, 1) F32_BLOCK(R, NT, 0)
F32_BLOCKS(1, 1) F32_BLOCKS(2, 1) F32_BLOCKS(3, 1) F32_BLOCKS(4, 1) F32_BLOCKS(5, 1) F32_BLOCKS(6, 1)
F32_BLOCKS(1, 2) F32_BLOCKS(2, 2) F32_BLOCKS(1, 4)

typedef void (*f32_block_fn)(const void *, int, int, int, const float *, long, float *, int, const char *);
/* [bf16][tiles][rows]: 1 tile for up to 6 rows, 2 for up to 2 rows, 4 for 1 row */
static const f32_block_fn F32_BLOCK_FN[2][F32_GROUP + 1][F32_ROWS + 1] = {
    {{0},
     {0, f32_block_1_1_0, f32_block_2_1_0, f32_block_3_1_0, f32_block_4_1_0, f32_block_5_1_0, f32_block_6_1_0},
     {0, f32_block_1_2_0, f32_block_2_2_0},
     {0},
     {0, f32_block_1_4_0}},
    {{0},
     {0, f32_block_1_1_1, f32_block_2_1_1, f32_block_3_1_1, f32_block_4_1_1, f32_block_5_1_1, f32_block_6_1_1},
     {0, f32_block_1_2_1, f32_block_2_2_1},
     {0},
     {0, f32_block_1_4_1}},
};

/* r rows over a group's nt tiles (wg on, tiles tile_bytes apart, into c from the group's first output), as
 * many tiles at a time as the rows leave registers for. next: the next group's first tile, to prefetch, or
 * NULL. */
static void f32_rows(const char *wg, size_t tile_bytes, int bf16, int nt, int r, int k, int p0, int p1,
                     const float *x, long ldx, float *c, const char *next) {
    const int most = r == 1 ? 4 : r == 2 ? 2 : 1;
    for (int t = 0, step; t < nt; t += step) {
        for (step = most; step > nt - t; step /= 2) {}
        F32_BLOCK_FN[bf16 != 0][step][r](wg + t * tile_bytes, k, p0, p1, x, ldx, c + t * F32_TILE, p0 == 0,
                                         next ? next + t * tile_bytes : NULL);
    }
}

/* The block's rows c [m][F32_LD] (the outputs from tile0 on) as logits (+ bias) into out, or folded into
 * each row's per-lane best values and their columns (strictly greater wins: the first column of a lane's
 * maximum, tiles in column order), 8 lanes at a time. */
static void f32_finish(const float *c, int m, int tile0, int nt, int n, const float *bias, float *out, long ldo,
                       float *best, int32_t *where) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int r = 0; r < m; r++) {
        for (int j = 0; j < 2 * nt; j++) {
            const int col0 = tile0 * F32_TILE + j * 8, count = n - col0;
            if (count <= 0) break;
            const __m256i valid = _mm256_cmpgt_epi32(_mm256_set1_epi32(count), lane); /* lanes < count */
            __m256 v = _mm256_loadu_ps(c + (size_t)r * F32_LD + j * 8);
            if (out) {
                float *o = out + (size_t)r * ldo + col0;
                if (count >= 8) {
                    if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + col0));
                    _mm256_storeu_ps(o, v);
                } else {
                    if (bias) v = _mm256_add_ps(v, _mm256_maskload_ps(bias + col0, valid));
                    _mm256_maskstore_ps(o, valid, v);
                }
            } else {
                float *b = best + (size_t)r * F32_TILE + (j % 2) * 8;
                int32_t *wh = where + (size_t)r * F32_TILE + (j % 2) * 8;
                const __m256 cur = _mm256_loadu_ps(b);
                const __m256 gt = _mm256_and_ps(_mm256_cmp_ps(v, cur, _CMP_GT_OQ), _mm256_castsi256_ps(valid));
                if (!_mm256_movemask_ps(gt)) continue;
                const __m256 cols = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_set1_epi32(col0), lane));
                _mm256_storeu_ps(b, _mm256_blendv_ps(cur, v, gt));
                const __m256 was = _mm256_castsi256_ps(_mm256_loadu_si256((const __m256i *)wh));
                _mm256_storeu_si256((__m256i *)wh, _mm256_castps_si256(_mm256_blendv_ps(was, cols, gt)));
            }
        }
    }
}

/* The next `chunk` blocks for the calling thread, [g0, g1) (shared counter *next): 0 when none are left. */
static inline int f32_take(int *next, int chunk, int groups, int *g0, int *g1) {
    int g;
#pragma omp atomic capture
    {
        g = *next;
        *next += chunk;
    }
    *g0 = g;
    *g1 = g + chunk < groups ? g + chunk : groups;
    return g < groups;
}

/* bytes of input rows a panel holds: each group's weights are read once a panel and each panel's rows once for
 * all the groups (a long prompt's rows are megabytes: all of them for each group would stream them from memory
 * again and again); half of a Zen 2 / 3 core's L2, beside the panel's scratch */
#define F32_PANEL_BYTES (256 << 10)

/* Rows a panel takes (of m, each k floats): whole F32_ROWS blocks within F32_PANEL_BYTES, at least 16 blocks. */
static inline int f32_panel_rows(int m, int k) {
    int rows = (int)(F32_PANEL_BYTES / (4 * (long)k)) / F32_ROWS * F32_ROWS;
    rows = rows < 16 * F32_ROWS ? 16 * F32_ROWS : rows;
    return rows < m ? rows : m;
}

/* The calling thread's share of a product: units of (a panel of rows, a block of F32_GROUP tiles), panel by
 * panel, taken from the shared counter *next as they come, `chunk` at a time (a prompt's many rows are shared
 * out by panels too: a few blocks of columns would leave a thread idle for one block in several). c:
 * f32_panel_rows * F32_LD floats of scratch; best / where: this thread's (argmax only). */
static void f32_matmul_part(const void *w, int bf16, int n, int k, const float *x, long ldx, int m, const float *bias,
                            float *out, long ldo, float *best, int32_t *where, float *c, float *wide, int *next,
                            int chunk, const uint16_t *xs, size_t plane) {
    (void)wide, (void)xs, (void)plane; /* (F32_WIDE is 0 here; no AMX) */
    const int tiles = (n + F32_TILE - 1) / F32_TILE, groups = (tiles + F32_GROUP - 1) / F32_GROUP, pairs = k / 2;
    const int panel = f32_panel_rows(m, k), units = (m + panel - 1) / panel * groups;
    const size_t tile_bytes = (size_t)k * F32_TILE * (bf16 ? 2 : 4);
    for (int u0, u1; f32_take(next, chunk, units, &u0, &u1);) {
        for (int u = u0; u < u1; u++) {
            const int g = u % groups, m0 = u / groups * panel, rows = m - m0 < panel ? m - m0 : panel;
            const int tile0 = g * F32_GROUP, nt = tiles - tile0 < F32_GROUP ? tiles - tile0 : F32_GROUP;
            const char *wg = (const char *)w + (size_t)tile0 * tile_bytes;
            const float *xp = x + (size_t)m0 * ldx;
            for (int p0 = 0; p0 < pairs; p0 += F32_KP) {
                const int p1 = p0 + F32_KP < pairs ? p0 + F32_KP : pairs;
                for (int r0 = 0; r0 < rows; r0 += F32_ROWS) {
                    const int r = rows - r0 < F32_ROWS ? rows - r0 : F32_ROWS;
                    const char *next_w = r0 == 0 && nt == F32_GROUP && g + 1 < groups
                                             ? wg + F32_GROUP * tile_bytes : NULL;
                    f32_rows(wg, tile_bytes, bf16, nt, r, k, p0, p1, xp + (size_t)r0 * ldx, ldx,
                             c + (size_t)r0 * F32_LD, next_w);
                }
            }
            f32_finish(c, rows, tile0, nt, n, bias, out ? out + (size_t)m0 * ldo : NULL, ldo,
                       best ? best + (size_t)m0 * F32_TILE : NULL, where ? where + (size_t)m0 * F32_TILE : NULL);
        }
    }
}

#include "f32_drive.h"
