/* Greedy tokens from the LM head at twice the bf16 kernel's speed, exactly as it would pick them.
 *
 * At batch 16-64 the bf16 argmax (bf16_matmul.c) is compute-bound: one VDPBF16PS does 32 multiply-adds.
 * VPDPBUSD (AVX512-VNNI) does 64 on int8, from half the bytes. So each row is first screened against an
 * int8 copy of the weight (a scale s_v per vocabulary row, symmetric), with the hidden row quantized per
 * row (scale s_x); the few columns whose bf16 logit could still be the row's maximum are then computed
 * again exactly as the bf16 kernel computes them (its own block function, over those columns gathered
 * from its packed weight, rounded to bf16, first index of a tie), and the best of them is the token. A
 * column is dropped only when a rigorous bound says its bf16 logit cannot reach the maximum:
 *
 *   true logit T_v = w_v . x,  screened A_v = s_v s_x (q_v . q_x)
 *   T_v - A_v = (w_v - s_v q_v) . x + s_v q_v . (x - s_x q_x)
 *   |T_v - A_v| <= e_v ||x|| + n_v ||dx|| = B_v
 *
 * with e_v = ||w_v - s_v q_v||, n_v = ||s_v q_v|| (from the weight, once, rounded up) and ||x||, ||dx||
 * per row. The row's best lower bound L = max_u (A_u - B_u) is below the maximum logit; the bf16 kernel's
 * float32 sums differ from T_v by at most G = K 2^-24 W ||x|| (exact bf16 products, W = max_v ||w_v||),
 * and two logits that round to the same bf16 value differ by at most 2^-7 of their size. So the row's
 * token v (the first of those that round to the largest bf16 value) and the column u that gives L have
 * float32 sums E_v >= E_u - 2^-7 |E_u| and E_u >= L - G, and the token's upper bound A_v + B_v >= E_v - G
 * reaches at least L - 3G - 2^-6 (|L| + B) (B the largest B_v; |E_u| <= |L| + 2B + G; the margins also
 * cover the screen's own float rounding): every column that reaches that floor is kept. The slack is
 * arithmetic about the weights and the row, not a tuned tolerance: the tokens are the bf16 kernel's.
 *
 * A row keeps up to CAP columns per thread. One with more (a near tie across many columns, or a hidden
 * row whose quantization is coarse) is computed again in full by the bf16 kernel: the caller learns how
 * many rows that took, and stops screening a model where it rarely pays.
 *
 * The int8 weight: tiles of 16 vocabulary rows, each [K/4][16][4] (for every four hidden columns, the 16
 * rows' four values side by side), read in blocks of GROUP tiles like the bf16 kernel's. q_x is fed to
 * VPDPBUSD unsigned as q_x + 128, so each column's accumulator starts at -128 sum(q_v) (given).
 */
#include "bf16_matmul.c"
#include "int8_screen.h"

/* The bf16 head: its packed weight w, [N/16][K/2][16][2]. */
typedef struct {
    Head head;
    const uint16_t *w;
    int n, k;
} Bf16Head;

static const float *as_float(const Head *head, const void *row, float *scratch) {
    const int k = ((const Bf16Head *)head)->k;
    for (int i = 0; i < k; i++) scratch[i] = load1(row, 1, i);
    return scratch;
}

/* The exact bf16 logits (rounded, as float) of the row at the `count` columns col: those columns gathered into
 * one tile and run through the bf16 kernel's own block, so each lane's arithmetic is the kernel's. */
static void exact_logits(Head *head, const void *row, const int32_t *col, int count, int first, float *out) {
    const Bf16Head *b = (const Bf16Head *)head;
    const int k = b->k;
    uint16_t *tile = head->tile, logits[TILE];
    (void)first;
    memset(tile, 0, sizeof(uint16_t) * k * TILE);
    for (int j = 0; j < count; j++) {
        const int from = col[j] / TILE, lane = col[j] % TILE;
        for (int p = 0; p < k / 2; p++)
            memcpy(tile + ((size_t)p * TILE + j) * 2, b->w + (((size_t)from * (k / 2) + p) * TILE + lane) * 2, 4);
    }
    ONE[1](tile, row, k, 0, count, NULL, logits, TILE, NULL, NULL, NULL);
    for (int j = 0; j < count; j++) out[j] = load1(logits, 1, j);
}

static int full_argmax(const Head *head, const void *rows, int m, int32_t *tokens) {
    const Bf16Head *b = (const Bf16Head *)head;
    return sluice_bf16_matmul(b->w, b->n, b->k, rows, m, NULL, NULL, 0, tokens);
}

/* tokens[m]: each bf16 row h's argmax over the n columns of the LM head, the same as
 * sluice_bf16_matmul(w, ...) gives. q / start / scale / err / norm: the int8 weight and its columns' -128
 * sum(q_v), s_v, e_v and n_v (rounded up; padded to whole tiles, zero past n); err_w, norm_w, norm_q: the
 * largest e_v, ||w_v|| and n_v. K: a multiple of 4. Returns how many rows were computed again in full,
 * or -1 when out of memory. */
int sluice_int8_argmax(const int8_t *q, const int32_t *start, const float *scale, const float *err, const float *norm,
                       const uint16_t *w, int n, int k, float err_w, float norm_w, float norm_q, const uint16_t *h,
                       int m, int32_t *tokens) {
    const Weight c = {q, start, scale, err, norm, n, k};
    /* the slack: the bf16 kernel's float32 sums (3 G: see above) and bf16's rounding of the logits (2^-6) */
    Bf16Head b = {{sizeof(uint16_t) * k, 3, 0x1p-6f, NULL, as_float, exact_logits, full_argmax, k}, w, n, k};
    return screened_argmax(&b.head, &c, err_w, norm_w, norm_q, h, m, tokens);
}
