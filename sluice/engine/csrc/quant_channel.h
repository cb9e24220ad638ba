/* Per-channel int8 weights (Q8_C: not a GGUF type): rows of K int8 values, one float32 scale a row, w = scale * q,
 * as compressed-tensors' W8A8 checkpoints store them (a scale per output channel, or one for the tensor), run with
 * x's rows quantized per group of QC_GROUP = 128 values: d = max |x| / 127 over the group, xq = round(x / d).
 *
 * Those checkpoints' activations are dynamic per token (one d a row, as vLLM's int8 kernels run them); a row's
 * few large values then coarsen all of its others: on the trained SmolLM2-135M in that layout, per token costs
 * 1.7% of perplexity against the float product of the same weights, groups of 256 0.8%, of 128 0.3%, Q8_0's
 * blocks of 32 0.1% (bench/RESULTS.md#w8a8-channel). Per group of 128, each group's int8 pairs are summed exactly
 * in int32 (VPDPBUSD on w + 128 from minus 128 times the group's sum of xq; VPMADDUBSW + VPMADDWD on |w| and x
 * with w's sign without it), then converted and multiplied-added by the group's d, the weight rows' scales once at
 * the end: one float step per 128 values where the Q8_0 tiles (quant_repack.h) take three per 32, 1.4-1.7x their
 * speed at a prompt's rows.
 *
 * A weight's row as stored (quant_part_t, unpacked): its scale (float32), then its K values (int8): K + 4 bytes.
 * Repacked (the only form the kernels read), a group of QR_ROWS rows takes the same bytes as:
 *   scales [QR_ROWS] float32, then values [K / 4 chunks][QR_ROWS][4] int8 (values 4c..4c+3 of each row).
 * Included by quant_repack.h after its shims: its QR_ALL makes these tiles beside the block formats' (qr_tiles).
 */
#ifndef SLUICE_QUANT_CHANNEL_H
#define SLUICE_QUANT_CHANNEL_H

enum { Q8_C = 64, QC_GROUP = 128 };

/* w [n][k + 4] (a float32 scale, then k int8 values a row) as ceil(n / QR_ROWS) groups into out (the last
 * group's missing rows zero) */
static inline void qc_repack(const uint8_t *w, int n, int k, uint8_t *out) {
    const long row = (long)k + 4;
    const long groups = (n + QR_ROWS - 1) / QR_ROWS;
    memset(out, 0, (size_t)groups * QR_ROWS * row);
    for (int j = 0; j < n; j++) {
        uint8_t *g = out + (size_t)(j / QR_ROWS) * QR_ROWS * row;
        const int i = j % QR_ROWS;
        memcpy(g + (size_t)i * 4, w + (size_t)j * row, 4);
        for (int c = 0; c < k / 4; c++) memcpy(g + QR_ROWS * 4 + ((size_t)c * QR_ROWS + i) * 4, w + (size_t)j * row + 4 + 4 * c, 4);
    }
}

/* The inverse of qc_repack: the rows w [n][k + 4] of the groups at packed */
static inline void qc_unpack(const uint8_t *packed, int n, int k, uint8_t *w) {
    const long row = (long)k + 4;
    for (int j = 0; j < n; j++) {
        const uint8_t *g = packed + (size_t)(j / QR_ROWS) * QR_ROWS * row;
        const int i = j % QR_ROWS;
        memcpy(w + (size_t)j * row, g + (size_t)i * 4, 4);
        for (int c = 0; c < k / 4; c++) memcpy(w + (size_t)j * row + 4 + 4 * c, g + QR_ROWS * 4 + ((size_t)c * QR_ROWS + i) * 4, 4);
    }
}

/* Rows [r0, r1) of x (k values each, ldx apart) quantized per group of QC_GROUP values (the last one shorter
 * where k is not whole groups) into x8: q (k values), and per group (at the row's blocks' index g, lb = ld / 32
 * a row) bd (d) and bneg (minus the group's sum of q). */
static void qc_quantize_row(const float *xr, int r, int k, const qm_x8_t *x8) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const long lb = x8->ld / 32;
    {
        int8_t *q = x8->q + (size_t)r * x8->ld;
        for (int g0 = 0; g0 < k; g0 += QC_GROUP) {
            const int g1 = g0 + QC_GROUP < k ? g0 + QC_GROUP : k;
            __m256 top = _mm256_setzero_ps();
            for (int i = g0; i < g1; i += 8) top = _mm256_max_ps(top, _mm256_andnot_ps(sign, _mm256_loadu_ps(xr + i)));
            const float amax = qm_hmax(top);
            const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
            int32_t total = 0;
            for (int i = g0; i < g1; i += 32) total += qm_hsum(qm_quantize32(xr + i, inv, q + i));
            const long at = (size_t)r * lb + g0 / QC_GROUP;
            x8->bd[at] = amax / 127.0f, x8->bneg[at] = -total;
        }
    }
}

/* sums[r][i] = row half * QR_VL + i of the group . row r0 + r of x8, over `blocks` blocks of 32, for R rows of x:
 * each group of x's int8 products summed in int32, scaled by its d in float32, the weight rows' scales at the
 * end */
#define QC_TILE(NAME, V, DOT, R)                                                                               \
    static void NAME##_##R(const uint8_t *group, int blocks, int half, const qm_x8_t *x8, int r0, float *sums) { \
        const float *scales = (const float *)group + half * QR_VL;                                             \
        const uint8_t *values = group + QR_ROWS * 4 + half * QR_VL * 4;                                        \
        QR_ROWS_OF_X(R)                                                                                        \
        for (int c0 = 0, g = 0; c0 < 8 * blocks; c0 += QC_GROUP / 4, g++) {                                    \
            const int c1 = c0 + QC_GROUP / 4 < 8 * blocks ? c0 + QC_GROUP / 4 : 8 * blocks;                    \
            qi_t dot[R];                                                                                       \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                                                \
                dot[r] = (V) ? qr_set1(128 * x8->bneg[(size_t)(r0 + r) * lb + g]) : qi_zero();                 \
            for (int c = c0; c < c1; c++) {                                                                    \
                const uint8_t *vc = values + (size_t)c * QR_ROWS * 4;                                          \
                _mm_prefetch((const char *)(vc + QR_AHEAD), _MM_HINT_T1);                                      \
                const qi_t raw = qi_load(vc);                                                                  \
                const qi_t w = (V) ? qi_xor80(raw) : qr_abs(raw);                                              \
                _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                          \
                    const qi_t xb = qr_bcast(xq[r] + 4 * c);                                                   \
                    dot[r] = (V) ? DOT(dot[r], w, xb) : qr_add32(dot[r], qr_dot_signed(w, raw, xb));           \
                }                                                                                              \
            }                                                                                                  \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                                                \
                acc[r] = qf_fmadd(qr_cvt(dot[r]), qr_setf(x8->bd[(size_t)(r0 + r) * lb + g]), acc[r]);          \
        }                                                                                                      \
        const qf_t ws = qf_load(scales);                                                                       \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) qr_store(sums + r * QR_VL, qr_mul(acc[r], ws));     \
    }
#if defined(__AVX512BW__)
#define QC_ALL(NAME, V, DOT)                                                                                   \
    QC_TILE(NAME, V, DOT, 1) QC_TILE(NAME, V, DOT, 2) QC_TILE(NAME, V, DOT, 3) QC_TILE(NAME, V, DOT, 4)             \
    QC_TILE(NAME, V, DOT, 5) QC_TILE(NAME, V, DOT, 6) QC_TILE(NAME, V, DOT, 7) QC_TILE(NAME, V, DOT, 8)             \
    static const qr_tile_fn NAME##s[] = {0, NAME##_1, NAME##_2, NAME##_3, NAME##_4, NAME##_5, NAME##_6, NAME##_7, NAME##_8};
#else
#define QC_ALL(NAME, V, DOT)                                                                                   \
    QC_TILE(NAME, V, DOT, 1) QC_TILE(NAME, V, DOT, 2) QC_TILE(NAME, V, DOT, 3) QC_TILE(NAME, V, DOT, 4)             \
    static const qr_tile_fn NAME##s[] = {0, NAME##_1, NAME##_2, NAME##_3, NAME##_4};
#endif

#endif
