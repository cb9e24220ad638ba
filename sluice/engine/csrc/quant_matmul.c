/* Float32 rows times a weight kept in GGUF's block formats (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) or
 * as per-channel int8 (Q8_C, quant_channel.h: repacked, int8 activations per group of 128), the entries
 * engine/cpu/quant.py calls: out[m][n] = sum_k x[m][k] w[n][k] (+ bias[n]).
 *
 * - sluice_quant_linear: quant_blocks.h's product, a tile of weight rows decoded in registers for several rows
 *   of x at a time (the one-call step, f32_layers.c, runs the same tiles), with float activations (the weight
 *   dequantized exactly, multiplied in float32) or int8 ones (x's rows quantized per block of 32 as
 *   llama.cpp's dot products do, quant_int8.h);
 * - sluice_quant_repack: a weight of any of these types interleaved QR_ROWS rows a group for the int8
 *   tiles (quant_repack.h), made once at load; sluice_quant_unpack its inverse;
 * - sluice_quant_dequantize: a weight's float32 values (the gguf package's, exactly).
 *
 * Built once per instruction set (engine/cpu/kernels.py); K is a multiple of 32 (of 256 for the K-quants).
 */
#include <omp.h>

#include "quant_blocks.h"

int sluice_quant_supported(int type) { return qm_supported(type); }

/* out[m][ldo] = x @ W^T (+ bias) for float32 rows x and a weight W [sum of the parts' n][k] (K a multiple of
 * 32, of 256 for the K-quants): with int8 = 0, each value dequantized exactly as sluice_quant_dequantize gives
 * it and multiplied in float32; else x's rows quantized per block of 32 first (quant_int8.h; per group of 128
 * for Q8_C parts, quant_channel.h); x read through the parts' perm where they have one (the same for all).
 * Returns 0, -1 where a part's type is not one of these (or the parts' perms differ), -2 where a workspace
 * could not be allocated. */
int sluice_quant_linear(const quant_part_t *parts, int num_parts, int k, const float *x, long ldx, int m,
                        const float *bias, float *out, long ldo, int int8) {
    double n = 0;
    const int channel = (parts[0].type & ~QR_PACKED) == Q8_C;
    for (int p = 0; p < num_parts; p++) { /* (per-channel parts run repacked, beside no other kind) */
        const int type = parts[p].type & ~QR_PACKED;
        if ((type == Q8_C) != channel || (channel ? !qr_packed(parts[p].type) : !sluice_quant_supported(type)) ||
            k % 32 || (qr_packed(parts[p].type) && !int8) || parts[p].perm != parts[0].perm)
            return -1;
        n += parts[p].n;
    }
    float *gathered = NULL; /* float activations through a perm: x's rows gathered once (int8: as quantized) */
    if (parts[0].perm && !int8) {
        if (!(gathered = malloc(sizeof(float) * (size_t)m * k))) return -2;
        for (int r = 0; r < m; r++)
            for (int c = 0; c < k; c++) gathered[(size_t)r * k + c] = x[(size_t)r * ldx + parts[0].perm[c]];
        x = gathered, ldx = k;
    }
    void *mem = int8 ? malloc(qm_x8_bytes(m, k)) : NULL;
    if (int8 && !mem) return -2;
    const qm_x8_t x8 = int8 ? qm_x8_at(mem, m, k) : (qm_x8_t){0};
    int next = 0;
    const int threads = (double)m * n * k >= QM_SERIAL_WORK ? omp_get_max_threads() : 1;
    const int chunk = qm_chunk(parts, num_parts, threads);
#pragma omp parallel num_threads(threads)
    {
        if (int8) {
            const int th = omp_get_thread_num(), nth = omp_get_num_threads();
            qm_quantize_for(parts, x, ldx, (int)((long)m * th / nth), (int)((long)m * (th + 1) / nth), k, &x8);
#pragma omp barrier
        }
        qm_linear_part(parts, num_parts, k, x, ldx, int8 ? &x8 : NULL, m, bias, out, ldo, &next, chunk);
    }
    free(mem), free(gathered);
    return 0;
}

/* Weight rows a repacked group holds in this build (QR_ROWS): sluice_quant_repack's output takes ceil(n / it)
 * times it rows of sluice_quant_repacked_row_bytes. */
int sluice_quant_group_rows(void) { return QR_ROWS; }

/* A repacked row's bytes for a weight of this type, k values a row, row_bytes a row in the file (the same but
 * for Q4_K's 148 a super-block to the file's 144, Q5_K's 180 to 176). */
long sluice_quant_repacked_row_bytes(int type, int k, long row_bytes) {
    return type == Q8_C ? row_bytes : qr_row_bytes(type, k, row_bytes);
}

/* whether a weight of this type, k values and row_bytes a row, is one sluice_quant_repack takes */
static int qm_repackable(int type, int k, long row_bytes) {
    if (type == Q8_C) return k % 32 == 0 && row_bytes == (long)k + 4;
    return qm_supported(type) && k % (type == Q4_K || type == Q5_K || type == Q6_K ? 256 : 32) == 0;
}

/* w [n][row_bytes] (any of the types above, k values a row) repacked into out for int8 activations: its parts
 * then name it as type | QR_PACKED, their row_bytes the repacked rows' (see quant_repack.h). Returns 0, or -1
 * where the type is not one of these. */
int sluice_quant_repack(const uint8_t *w, int type, int n, int k, long row_bytes, uint8_t *out) {
    if (!qm_repackable(type, k, row_bytes)) return -1;
    if (type == Q8_C)
        qc_repack(w, n, k, out);
    else
        qr_repack(w, type, n, k, row_bytes, out);
    return 0;
}

/* The inverse of sluice_quant_repack: the weight's own rows w [n][row_bytes] (row_bytes: its type's, whole
 * blocks) back from a repacked copy, exactly (a weight held only repacked gives its bytes to whatever reads
 * them as stored). Returns 0, or -1 where the type is not one of these. */
int sluice_quant_unpack(const uint8_t *packed, int type, int n, int k, long row_bytes, uint8_t *w) {
    if (!qm_repackable(type, k, row_bytes)) return -1;
    if (type == Q8_C)
        qc_unpack(packed, n, k, w);
    else
        qr_unpack(packed, type, n, k, row_bytes, w);
    return 0;
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
