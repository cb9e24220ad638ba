/* Causal attention for prompts and prompt chunks, float32, on CPUs with AVX-512F, else AVX2 and FMA (f32_vec.h's
 * vectors of F32V lanes, one source; the AVX2 build's register tiles are smaller): the query at position p
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
 * lie (NULL: the dense layouts q, out [B][Lq][H][D] and k, v [B][Lk][Hkv][D]); k and v's elements are of
 * f32_vec.h's KV_* kind kv (a narrower cache's widened as they are copied into the job's blocks). starts[b] is the position of
 * sequence b's first query (NULL: 0, a whole prompt), its query i at starts[b] + i (a query past its
 * sequence's keys, a pad, attends them all). D a multiple of 16 up to 256, H / Hkv at most 16. Returns
 * 0, -1 when out of memory, -2 for shapes it does not take.
 */
#include <float.h>
#include <omp.h>
#include <stdlib.h>

#include "f32_vec.h"

enum { KB = 64, QT = 16, MAX_GROUP = 16, MAX_VECS = 16 }; /* keys a block, positions a tile */
/* scores: rows at once (SR) and vectors of keys a pass (SC), SR * SC accumulators (AVX-512: 24 of 32 registers,
 * the block's 64 keys in one pass; AVX2: 12 of 16, in four) */
#ifdef __AVX512F__
enum { SR = 6, SC = 4 };
#else
enum { SR = 6, SC = 2 };
#endif

/* S[r][0..63] = scale * q_r . key (the block's 64 keys, transposed: kt[d][64]) for rr <= SR rows (inlined, so
 * that a whole SR rows' copy has no test of rr in its loop) */
static inline __attribute__((always_inline)) void scores(const float *const *qrow, int rr, const float *kt, int dim,
                                                         float scale, float *s) {
    for (int c0 = 0; c0 < KB; c0 += SC * F32V) {
        vf acc[SR][SC];
        for (int i = 0; i < SR; i++)
            for (int c = 0; c < SC; c++) acc[i][c] = vf_zero();
        for (int d = 0; d < dim; d++) {
            vf key[SC];
            for (int c = 0; c < SC; c++) key[c] = vf_load(kt + d * KB + c0 + c * F32V);
#pragma GCC unroll 6
            for (int i = 0; i < SR; i++) {
                if (i >= rr) break;
                const vf x = vf_set1(qrow[i][d]);
                for (int c = 0; c < SC; c++) acc[i][c] = vf_fmadd(x, key[c], acc[i][c]);
            }
        }
        const vf sc = vf_set1(scale);
        for (int i = 0; i < rr; i++)
            for (int c = 0; c < SC; c++) vf_store(s + (size_t)i * KB + c0 + c * F32V, vf_mul(acc[i][c], sc));
    }
}

/* acc[r][0..F32V V) = acc[r][0..F32V V) * keep[r] + the sum over the block's `keys` keys of p[r][i] * v_i[0..F32V V),
 * for rr <= R rows (acc's rows `dim` apart): the online softmax's rescaling of a row's sums where its
 * maximum rose, done as they are loaded */
#define PV_FN(V, R)                                                                                            \
    static void pv_##V(const float *p, const float *keep, int rr, int keys, const float *v, size_t v_stride,   \
                       float *acc, int dim) {                                                                  \
        vf a[R][V];                                                                                            \
        _Pragma("GCC unroll 8") for (int i = 0; i < R; i++) {                                                  \
            if (i >= rr) break;                                                                                \
            const vf kp = vf_set1(keep[i]);                                                                    \
            _Pragma("GCC unroll 16") for (int c = 0; c < V; c++)                                               \
                a[i][c] = vf_mul(vf_load(acc + (size_t)i * dim + c * F32V), kp);                               \
        }                                                                                                      \
        for (int k = 0; k < keys; k++) {                                                                       \
            vf x[V];                                                                                           \
            _Pragma("GCC unroll 16") for (int c = 0; c < V; c++) x[c] = vf_load(v + (size_t)k * v_stride + c * F32V); \
            _Pragma("GCC unroll 8") for (int i = 0; i < R; i++) {                                              \
                if (i >= rr) break;                                                                            \
                const vf w = vf_set1(p[(size_t)i * KB + k]);                                                   \
                _Pragma("GCC unroll 16") for (int c = 0; c < V; c++) a[i][c] = vf_fmadd(w, x[c], a[i][c]);     \
            }                                                                                                  \
        }                                                                                                      \
        _Pragma("GCC unroll 8") for (int i = 0; i < R; i++) {                                                  \
            if (i >= rr) break;                                                                                \
            _Pragma("GCC unroll 16") for (int c = 0; c < V; c++) vf_store(acc + (size_t)i * dim + c * F32V, a[i][c]); \
        }                                                                                                      \
    }
typedef void (*pv_fn)(const float *, const float *, int, int, const float *, size_t, float *, int);
/* PV[i] takes 2^i vectors of each row at once, for PV_ROWS[i] rows (R * V accumulators and V values) */
#ifdef __AVX512F__
PV_FN(1, 8) PV_FN(2, 8) PV_FN(4, 6) PV_FN(8, 3) PV_FN(16, 1)
static const pv_fn PV[] = {pv_1, pv_2, pv_4, pv_8, pv_16};
static const int PV_ROWS[] = {8, 8, 6, 3, 1};
#else
PV_FN(1, 8) PV_FN(2, 6) PV_FN(4, 3)
static const pv_fn PV[] = {pv_1, pv_2, pv_4};
static const int PV_ROWS[] = {8, 6, 3};
#endif
enum { PV_MAX = 1 << (sizeof PV_ROWS / sizeof *PV_ROWS - 1) }; /* vectors of a row at once, at most */

/* row i of the dense layout, or rows[i] */
static inline size_t row_of(const int64_t *rows, size_t i) { return rows ? (size_t)rows[i] : i; }

/* one job: the queries [p0, p1) of sequence b (the first at position `start`) for kv head j's query heads;
 * kt, vt: its kv head's keys (transposed by blocks) and values ([key][D]). scale: the scores' times log2 e,
 * so that scores and maxima are in log2 units and a probability is 2^(score - max), the same softmax.
 * Scratch: s [rows][KB] (scores, then probabilities), acc [rows][D] (the rows' unnormalised outputs), m
 * [rows] (running maxima), keep [rows + 16] (each row's rescaling this block), l [rows][F32V] (running sums of
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
        vf_store(l + (size_t)r * F32V, vf_zero());
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
            vf t;
            if (n == KB) {
                t = vf_load(sr);
                for (int c = F32V; c < KB; c += F32V) t = vf_max(t, vf_load(sr + c));
            } else {
                t = vf_set1(-INFINITY);
                for (int c = 0; c < n; c += F32V) t = vf_where(vf_lanes(n - c), vf_max(t, vf_load(sr + c)), t);
            }
            const float most = vf_most(t);
            top[r] = most > m[r] ? most : m[r];
        }
        for (int r = 0; r < rows; r += F32V) { /* keep = exp(old max - new max), F32V rows at once (1 where unchanged) */
            const vf was = vf_loadn(m + r, rows - r), now = vf_loadn(top + r, rows - r);
            const vf e = vf_exp(vf_mul(vf_sub(was, now), vf_set1(0.693147180559945309f)));
            vf_store(keep + r, vf_where(vf_equal(was, now), vf_set1(1.0f), e));
            vf_storen(m + r, rows - r, now);
        }
        for (int r = 0; r < rows; r++) { /* the probabilities, unnormalised, and their running sums */
            float *sr = s + (size_t)r * KB;
            const int n = attends[r];
            if (n <= 0) {
                memset(sr, 0, sizeof(float) * KB);
                continue;
            }
            const vf mx = vf_set1(m[r]);
            vf sum = vf_zero();
            for (int c = 0; c < KB; c += F32V) {
                vf e = vf_exp2(vf_sub(vf_load(sr + c), mx));
                if (n < KB) e = vf_keep(vf_lanes(n - c), e);
                vf_store(sr + c, e);
                sum = vf_add(sum, e);
            }
            float *lr = l + (size_t)r * F32V;
            vf_store(lr, vf_fmadd(vf_load(lr), vf_set1(keep[r]), sum));
        }
        const float *vb = vt + (size_t)k0 * dim;
        for (int off = 0; off < dim;) { /* the head's values in power-of-two runs of vectors (48: 32 + 16) */
            const int vecs = (dim - off) / F32V, lv = 31 - __builtin_clz(vecs < PV_MAX ? vecs : PV_MAX);
            const int rows_at_once = PV_ROWS[lv];
            for (int r0 = 0; r0 < rows; r0 += rows_at_once) {
                const int rr = rows - r0 < rows_at_once ? rows - r0 : rows_at_once;
                PV[lv](s + (size_t)r0 * KB, keep + r0, rr, keys, vb + off, dim, acc + (size_t)r0 * dim + off, dim);
            }
            off += F32V << lv;
        }
    }
    for (int r = 0; r < rows; r++) {
        const size_t row = row_of(out_rows, (size_t)b * q_len + p0 + r % np);
        if ((long)row == skip_row) continue;
        const vf inv = vf_set1(1.0f / vf_sum(vf_load(l + (size_t)r * F32V)));
        float *o = out + (row * heads + (size_t)j * group + r / np) * dim;
        for (int c = 0; c < dim; c += F32V) vf_store(o + c, vf_mul(vf_load(acc + (size_t)r * dim + c), inv));
    }
}

int sluice_f32_causal_attention(const float *q, const int64_t *q_rows, const void *k, const void *v,
                                const int64_t *kv_rows, const int64_t *starts, int batch, int q_len, int k_len,
                                int heads, int kv_heads, int dim, float scale, float *out, const int64_t *out_rows,
                                long skip_row, int kv) {
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
                const size_t at = (row_of(kv_rows, (size_t)b * k_len + key) * kv_heads + j) * kv_row(kv, dim);
                const vf ks = vf_set1(kv_scale(k, kv, at, dim)), vs = vf_set1(kv_scale(v, kv, at, dim));
                float row[16 * MAX_VECS];
                for (int c = 0; c < dim; c += F32V) {
                    vf_store(row + c, vf_mul(vf_load_kv(k, kv, at + c), ks));
                    vf_store(vdst + (size_t)i * dim + c, vf_mul(vf_load_kv(v, kv, at + c), vs));
                }
                for (int d = 0; d < dim; d++) kdst[(size_t)d * KB + i] = row[d];
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
