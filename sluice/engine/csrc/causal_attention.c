/* Causal attention for prompts and prompt chunks on CPUs with AVX-512F, float32: the query at position p
 * of a sequence attends its keys at positions 0..p, flash-attention style (the scores of a block of keys
 * at a time, the softmax kept online), so no [queries x keys] matrix is ever made and no key block past
 * the diagonal is read.
 *
 * torch's SDPA multiplies small blocks, and with grouped-query attention each query head reads its kv
 * head again (bench/RESULTS.md#cpu-kernels). Here a job is one (sequence, kv head,
 * tile of QT query positions): the rows are the tile's positions for every query head of the group, so a
 * block of keys, transposed once into [D][64], serves them all. Scores: for each of the D dimensions one
 * broadcast query value times the 64 keys' values (FMAs, no horizontal sums); values: for each key, one
 * broadcast probability times the key's D values.
 *
 * Sequence b's query i is row q_rows[b * Lq + i] of q [rows][H][D] and its output goes to row
 * out_rows[b * Lq + i] of out (none where that is skip_row: a pad's); its key i (at position i) is row
 * kv_rows[b * Lk + i] of k and v [rows][Hkv][D]: a step's rows and the paged cache's slots, read where they
 * lie (NULL: the dense layouts q, out [B][Lq][H][D] and k, v [B][Lk][Hkv][D]). starts[b] is the position of
 * sequence b's first query (NULL: 0, a whole prompt), its query i at starts[b] + i (a query past its
 * sequence's keys, a pad, attends them all). D a multiple of 16 up to 256, H / Hkv at most 16. Returns
 * 0, -1 when out of memory, -2 for shapes it does not take.
 */
#include <float.h>
#include <omp.h>
#include <stdlib.h>

#include "simd.h"

enum { KB = 64, QT = 16, MAX_GROUP = 16, MAX_VECS = 16, SR = 6 }; /* keys a block, positions a tile */

/* the first `count` lanes of 16, none for count <= 0 */
static inline __mmask16 lanes(int count) { return count <= 0 ? 0 : first_lanes(count); }

/* S[r][0..63] = scale * q_r . key (the block's 64 keys, transposed: kt[d][64]) for rr <= SR rows (inlined, so
 * that a whole SR rows' copy has no test of rr in its loop) */
static inline __attribute__((always_inline)) void scores(const float *const *qrow, int rr, const float *kt, int dim,
                                                         float scale, float *s) {
    __m512 acc[SR][4];
    for (int i = 0; i < SR; i++)
        for (int c = 0; c < 4; c++) acc[i][c] = _mm512_setzero_ps();
    for (int d = 0; d < dim; d++) {
        const __m512 k0 = _mm512_loadu_ps(kt + d * KB), k1 = _mm512_loadu_ps(kt + d * KB + 16),
                     k2 = _mm512_loadu_ps(kt + d * KB + 32), k3 = _mm512_loadu_ps(kt + d * KB + 48);
#pragma GCC unroll 6
        for (int i = 0; i < SR; i++) {
            if (i >= rr) break;
            const __m512 x = _mm512_set1_ps(qrow[i][d]);
            acc[i][0] = _mm512_fmadd_ps(x, k0, acc[i][0]);
            acc[i][1] = _mm512_fmadd_ps(x, k1, acc[i][1]);
            acc[i][2] = _mm512_fmadd_ps(x, k2, acc[i][2]);
            acc[i][3] = _mm512_fmadd_ps(x, k3, acc[i][3]);
        }
    }
    const __m512 sc = _mm512_set1_ps(scale);
    for (int i = 0; i < rr; i++)
        for (int c = 0; c < 4; c++) _mm512_storeu_ps(s + (size_t)i * KB + c * 16, _mm512_mul_ps(acc[i][c], sc));
}

/* acc[r][0..16V) = acc[r][0..16V) * keep[r] + the sum over the block's `keys` keys of p[r][i] * v_i[0..16V),
 * for rr <= R rows (acc's rows `dim` apart): the online softmax's rescaling of a row's sums where its
 * maximum rose, done as they are loaded */
#define PV_FN(V, R)                                                                                            \
    static void pv_##V(const float *p, const float *keep, int rr, int keys, const float *v, size_t v_stride,   \
                       float *acc, int dim) {                                                                  \
        __m512 a[R][V];                                                                                        \
        _Pragma("GCC unroll 8") for (int i = 0; i < R; i++) {                                                  \
            if (i >= rr) break;                                                                                \
            const __m512 kp = _mm512_set1_ps(keep[i]);                                                         \
            _Pragma("GCC unroll 16") for (int c = 0; c < V; c++)                                               \
                a[i][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + (size_t)i * dim + c * 16), kp);                  \
        }                                                                                                      \
        for (int k = 0; k < keys; k++) {                                                                       \
            __m512 x[V];                                                                                       \
            _Pragma("GCC unroll 16") for (int c = 0; c < V; c++) x[c] = _mm512_loadu_ps(v + (size_t)k * v_stride + c * 16); \
            _Pragma("GCC unroll 8") for (int i = 0; i < R; i++) {                                              \
                if (i >= rr) break;                                                                            \
                const __m512 w = _mm512_set1_ps(p[(size_t)i * KB + k]);                                        \
                _Pragma("GCC unroll 16") for (int c = 0; c < V; c++) a[i][c] = _mm512_fmadd_ps(w, x[c], a[i][c]); \
            }                                                                                                  \
        }                                                                                                      \
        _Pragma("GCC unroll 8") for (int i = 0; i < R; i++) {                                                  \
            if (i >= rr) break;                                                                                \
            _Pragma("GCC unroll 16") for (int c = 0; c < V; c++) _mm512_storeu_ps(acc + (size_t)i * dim + c * 16, a[i][c]); \
        }                                                                                                      \
    }
PV_FN(1, 8) PV_FN(2, 8) PV_FN(4, 6) PV_FN(8, 3) PV_FN(16, 1)

typedef void (*pv_fn)(const float *, const float *, int, int, const float *, size_t, float *, int);
static const pv_fn PV[5] = {pv_1, pv_2, pv_4, pv_8, pv_16};
static const int PV_ROWS[5] = {8, 8, 6, 3, 1};

/* row i of the dense layout, or rows[i] */
static inline size_t row_of(const int64_t *rows, size_t i) { return rows ? (size_t)rows[i] : i; }

/* one job: the queries [p0, p1) of sequence b (the first at position `start`) for kv head j's query heads;
 * kt, vt: its kv head's keys (transposed by blocks) and values ([key][D]). scale: the scores' times log2 e,
 * so that scores and maxima are in log2 units and a probability is 2^(score - max), the same softmax.
 * Scratch: s [rows][KB] (scores, then probabilities), acc [rows][D] (the rows' unnormalised outputs), m
 * [rows] (running maxima), keep [rows + 16] (each row's rescaling this block), l [rows][16] (running sums of
 * probabilities, a vector a row, added across once at the end). */
static void tile(const float *q, const int64_t *q_rows, const float *kt, const float *vt, float *out,
                 const int64_t *out_rows, long skip_row, int b, int j, int p0, int p1, int q_len, int k_len,
                 long start, int heads, int kv_heads, int dim, float scale, float *s, float *acc, float *m,
                 float *keep, float *l) {
    const int group = heads / kv_heads, np = p1 - p0, rows = group * np;
    const float *qrow[MAX_GROUP * QT];
    float top[MAX_GROUP * QT + 16]; /* this block's new maxima */
    int attends[MAX_GROUP * QT];     /* keys of this block each row attends */
    for (int r = 0; r < rows; r++) {
        const size_t row = row_of(q_rows, (size_t)b * q_len + p0 + r % np);
        qrow[r] = q + (row * heads + (size_t)j * group + r / np) * dim;
        m[r] = -INFINITY;
        _mm512_storeu_ps(l + (size_t)r * 16, _mm512_setzero_ps());
    }
    memset(acc, 0, sizeof(float) * (size_t)rows * dim);
    const long last = start + p1 - 1 < k_len - 1 ? start + p1 - 1 : k_len - 1; /* the tile's last key */
    for (int k0 = 0; k0 <= last; k0 += KB) {
        const float *block = kt + (size_t)(k0 / KB) * dim * KB;
        for (int r0 = 0; r0 < rows; r0 += SR) {
            if (rows - r0 >= SR)
                scores(qrow + r0, SR, block, dim, scale, s + (size_t)r0 * KB);
            else
                scores(qrow + r0, rows - r0, block, dim, scale, s + (size_t)r0 * KB);
        }
        int keys = 0; /* keys of this block any row attends */
        for (int r = 0; r < rows; r++) {
            const float *sr = s + (size_t)r * KB;
            long pos = start + p0 + r % np; /* keys k0..pos */
            pos = pos < k_len - 1 ? pos : k_len - 1;
            const int n = pos - k0 + 1 < KB ? (int)(pos - k0 + 1) : KB;
            attends[r] = n;
            top[r] = m[r];
            if (n <= 0) continue; /* the whole block is above this row's diagonal */
            keys = n > keys ? n : keys;
            __m512 t;
            if (n == KB) {
                t = _mm512_max_ps(_mm512_max_ps(_mm512_loadu_ps(sr), _mm512_loadu_ps(sr + 16)),
                                  _mm512_max_ps(_mm512_loadu_ps(sr + 32), _mm512_loadu_ps(sr + 48)));
            } else {
                t = _mm512_set1_ps(-INFINITY);
                for (int c = 0; c < n; c += 16) t = _mm512_mask_max_ps(t, lanes(n - c), t, _mm512_loadu_ps(sr + c));
            }
            const float most = _mm512_reduce_max_ps(t);
            top[r] = most > m[r] ? most : m[r];
        }
        for (int r = 0; r < rows; r += 16) { /* keep = exp(old max - new max), 16 rows at once (1 where unchanged) */
            const __mmask16 in = lanes(rows - r);
            const __m512 was = _mm512_maskz_loadu_ps(in, m + r), now = _mm512_maskz_loadu_ps(in, top + r);
            const __m512 ln2 = _mm512_set1_ps(0.693147180559945309f);
            const __m512 e = exp_nonpositive(_mm512_mul_ps(_mm512_sub_ps(was, now), ln2));
            _mm512_storeu_ps(keep + r, _mm512_mask_blend_ps(_mm512_cmp_ps_mask(was, now, _CMP_EQ_OQ), e,
                                                            _mm512_set1_ps(1.0f)));
            _mm512_mask_storeu_ps(m + r, in, now);
        }
        for (int r = 0; r < rows; r++) { /* the probabilities, unnormalised, and their running sums */
            float *sr = s + (size_t)r * KB;
            const int n = attends[r];
            if (n <= 0) {
                memset(sr, 0, sizeof(float) * KB);
                continue;
            }
            const __m512 mx = _mm512_set1_ps(m[r]);
            __m512 sum = _mm512_setzero_ps();
            for (int c = 0; c < KB; c += 16) {
                __m512 e = exp2_finite(_mm512_sub_ps(_mm512_loadu_ps(sr + c), mx));
                if (n < KB) e = _mm512_maskz_mov_ps(lanes(n - c), e);
                _mm512_storeu_ps(sr + c, e);
                sum = _mm512_add_ps(sum, e);
            }
            float *lr = l + (size_t)r * 16;
            _mm512_storeu_ps(lr, _mm512_fmadd_ps(_mm512_loadu_ps(lr), _mm512_set1_ps(keep[r]), sum));
        }
        const float *vb = vt + (size_t)k0 * dim;
        for (int off = 0; off < dim;) { /* the head's values in power-of-two runs of vectors (48: 32 + 16) */
            const int lv = 31 - __builtin_clz((dim - off) / 16 < 16 ? (dim - off) / 16 : 16), rows_at_once = PV_ROWS[lv];
            for (int r0 = 0; r0 < rows; r0 += rows_at_once) {
                const int rr = rows - r0 < rows_at_once ? rows - r0 : rows_at_once;
                PV[lv](s + (size_t)r0 * KB, keep + r0, rr, keys, vb + off, dim, acc + (size_t)r0 * dim + off, dim);
            }
            off += 16 << lv;
        }
    }
    for (int r = 0; r < rows; r++) {
        const size_t row = row_of(out_rows, (size_t)b * q_len + p0 + r % np);
        if ((long)row == skip_row) continue;
        const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(_mm512_loadu_ps(l + (size_t)r * 16)));
        float *o = out + (row * heads + (size_t)j * group + r / np) * dim;
        for (int c = 0; c < dim; c += 16) _mm512_storeu_ps(o + c, _mm512_mul_ps(_mm512_loadu_ps(acc + (size_t)r * dim + c), inv));
    }
}

int sluice_f32_causal_attention(const float *q, const int64_t *q_rows, const float *k, const float *v,
                                const int64_t *kv_rows, const int64_t *starts, int batch, int q_len, int k_len,
                                int heads, int kv_heads, int dim, float scale, float *out, const int64_t *out_rows,
                                long skip_row) {
    if (dim % 16 || dim > 16 * MAX_VECS || heads % kv_heads || heads / kv_heads > MAX_GROUP || k_len <= 0)
        return q_len == 0 ? 0 : -2;
    const int blocks = (k_len + KB - 1) / KB, tiles = (q_len + QT - 1) / QT, group = heads / kv_heads;
    const size_t per_head = (size_t)blocks * dim * KB; /* one (sequence, kv head)'s keys or values */
    float *kt = malloc(sizeof(float) * per_head * batch * kv_heads);
    float *vt = malloc(sizeof(float) * per_head * batch * kv_heads);
    if (!kt || !vt) {
        free(kt);
        free(vt);
        return -1;
    }
    int failed = 0;
#pragma omp parallel
    {
#pragma omp for schedule(static)
        /* kt[b][j][block][d][64], vt[b][j][key][d] */
        for (long job = 0; job < (long)batch * kv_heads * blocks; job++) {
            const int b = (int)(job / ((long)kv_heads * blocks)), j = (int)(job / blocks % kv_heads),
                      blk = (int)(job % blocks);
            float *kdst = kt + ((size_t)b * kv_heads + j) * per_head + (size_t)blk * dim * KB;
            float *vdst = vt + ((size_t)b * kv_heads + j) * per_head + (size_t)blk * dim * KB;
            for (int i = 0; i < KB; i++) {
                const int key = blk * KB + i;
                if (key >= k_len) {
                    for (int d = 0; d < dim; d++) kdst[(size_t)d * KB + i] = 0.0f;
                    memset(vdst + (size_t)i * dim, 0, sizeof(float) * dim);
                    continue;
                }
                const size_t at = (row_of(kv_rows, (size_t)b * k_len + key) * kv_heads + j) * dim;
                for (int d = 0; d < dim; d++) kdst[(size_t)d * KB + i] = k[at + d];
                memcpy(vdst + (size_t)i * dim, v + at, sizeof(float) * dim);
            }
        }
        float *s = malloc(sizeof(float) * (size_t)group * QT * KB);
        float *acc = malloc(sizeof(float) * (size_t)group * QT * dim);
        float *m = malloc(sizeof(float) * (group * QT * 18 + 16)); /* m, keep, l: see tile */
        if (!s || !acc || !m) {
#pragma omp atomic write
            failed = 1;
        }
        /* the longest tiles (the last positions) first: the dynamic schedule then evens out the threads */
#pragma omp for schedule(dynamic, 1)
        for (long job = 0; job < (long)batch * kv_heads * tiles; job++) {
            if (!s || !acc || !m) continue;
            const int t = tiles - 1 - (int)(job / ((long)batch * kv_heads)), rest = (int)(job % ((long)batch * kv_heads));
            const int b = rest / kv_heads, j = rest % kv_heads, p0 = t * QT, p1 = p0 + QT < q_len ? p0 + QT : q_len;
            const size_t head = ((size_t)b * kv_heads + j) * per_head;
            tile(q, q_rows, kt + head, vt + head, out, out_rows, skip_row, b, j, p0, p1, q_len, k_len,
                 starts ? (long)starts[b] : 0, heads, kv_heads, dim, scale * 1.44269504088896341f, s, acc, m,
                 m + group * QT, m + 2 * group * QT + 16);
        }
        free(s);
        free(acc);
        free(m);
    }
    free(kt);
    free(vt);
    return failed ? -1 : 0;
}
