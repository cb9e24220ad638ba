/* A step through a stack of pre-norm decoder layers (Llama-family: RMSNorm, one stacked qkv
 * projection, rotary, paged grouped-query attention, SwiGLU MLP) in one call, on CPUs with AVX512-BF16.
 *
 * Run one op at a time from Python, a small model's decode step is mostly dispatch: ~20 calls a layer,
 * each 10-20 us once the LM head has streamed its 51 MB through the caches, against a few microseconds of
 * arithmetic. This file runs the same kernels in the same order (bf16_matmul.c, rms_norm.c, rope_store.c,
 * decode_attention.c, included below) with the two residual adds and the SwiGLU gate between them, so each
 * layer's output has the bits of the op-by-op path's, bar the SwiGLU's exp (torch's and this file's can
 * differ in float32's last place, which its rounding to bf16 almost always hides).
 *
 * x [tokens][hidden] (bf16, updated in place) holds the step's rows. Each attends as one query over its
 * own keys (a decode, or a prefill chunk's row at its position with its causal mask), so the attention is
 * decode_attention.c's whatever the step holds. Each layer's linears are packed as bf16_matmul.c wants
 * them. Returns 0, -1 when out of memory, -2 when a layer's shape is one the attention kernel does not
 * take, -3 (with that layer's cache untouched) when a position is outside the rotary table or a slot
 * outside the cache.
 */
#include "bf16_matmul.c"
#undef SERIAL_WORK
#include "decode_attention.c"
#include "rms_norm.c"
#include "rope_store.c"

typedef struct {
    const uint16_t *w; /* packed [n/16 tiles][k/2][16][2] */
    const float *bias; /* NULL, or n floats padded to whole tiles */
    int n, k;
} linear_t;

typedef struct {
    const uint16_t *input_norm, *post_norm; /* [hidden] */
    float eps, scale;
    linear_t qkv, o, gate_up, down; /* gate_up: the gate's rows, then the up projection's */
    int heads, kv_heads, head_dim;
    const float *cos, *sin; /* rotary tables [num_positions][head_dim / 2] */
    int num_positions;
    uint16_t *k_cache, *v_cache; /* [num_slots][kv_heads][head_dim] */
    long num_slots;
    const float *sinks; /* NULL, or [heads] */
} layer_t;

typedef struct {
    int tokens, hidden, keys;
    const int64_t *positions, *slot_mapping; /* [tokens]: each row's position and the cache slot it fills */
    const int64_t *rows;                     /* [tokens]: the row of x each attention query comes from */
    const int64_t *kv_slots;                 /* [tokens][keys]: the cache slots of each query's keys */
    const uint8_t *mask;                     /* [tokens][keys]: which of them it attends to */
} step_t;

/* x += y over n bf16 values (float32 sum, rounded once: torch's add) */
static void add_into(uint16_t *x, const uint16_t *y, size_t n) {
    for (size_t i = 0; i < n; i += 16) {
        const __mmask16 keep = first_lanes(n - i < 16 ? (int)(n - i) : 16);
        store_bf16(x + i, _mm512_add_ps(load_bf16(x + i, keep), load_bf16(y + i, keep)), keep);
    }
}

/* out [rows][inter] = silu(gate) * up for gu [rows][2 * inter], the silu rounded to bf16 before the
 * product (torch's F.silu(gate).mul_(up) in bf16) */
static void swiglu(const uint16_t *gu, int rows, int inter, uint16_t *out) {
    const __m512i sign = _mm512_set1_epi32((int)0x80000000);
    const __m512 one = _mm512_set1_ps(1.0f);
    for (int r = 0; r < rows; r++) {
        const uint16_t *gate = gu + (size_t)r * 2 * inter, *up = gate + inter;
        for (int c = 0; c < inter; c += 16) {
            const __mmask16 keep = first_lanes(inter - c);
            const __m512 g = load_bf16(gate + c, keep);
            const __m512 e = exp_nonpositive( /* exp(-|g|): no overflow */
                _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(g), sign)));
            const __mmask16 positive = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_GE_OQ);
            const __m512 sigmoid = _mm512_div_ps(_mm512_mask_blend_ps(positive, e, one), _mm512_add_ps(one, e));
            const __m512 silu = round_bf16(_mm512_mul_ps(g, sigmoid));
            store_bf16(out + (size_t)r * inter + c, _mm512_mul_ps(silu, load_bf16(up + c, keep)), keep);
        }
    }
}

static int linear(const linear_t *l, const uint16_t *in, int rows, uint16_t *out) {
    return sluice_bf16_matmul(l->w, l->n, l->k, in, rows, l->bias, out, l->n, NULL);
}

int sluice_decoder_layers(const layer_t *layers, int count, const step_t *s, uint16_t *x) {
    const int t = s->tokens, d = s->hidden;
    int most_qkv = 0, most_q = 0, most_gu = 0;
    for (int i = 0; i < count; i++) {
        const layer_t *l = layers + i;
        if (l->qkv.n > most_qkv) most_qkv = l->qkv.n;
        if (l->heads * l->head_dim > most_q) most_q = l->heads * l->head_dim;
        if (l->gate_up.n > most_gu) most_gu = l->gate_up.n;
    }
    /* h: a normed input or a projection back to the hidden size; gu then its SwiGLU (half of it) */
    uint16_t *h = malloc(sizeof(uint16_t) * t * (size_t)(d + most_qkv + 2 * most_q + most_gu + most_gu / 2));
    if (!h) return -1;
    uint16_t *qkv = h + (size_t)t * d, *q = qkv + (size_t)t * most_qkv, *attn = q + (size_t)t * most_q,
             *gu = attn + (size_t)t * most_q, *act = gu + (size_t)t * most_gu;
    int status = 0;
    for (int i = 0; i < count && !status; i++) {
        const layer_t *l = layers + i;
        const int hd = l->head_dim, width = l->qkv.n;
        sluice_rms_norm(x, d, l->input_norm, t, d, l->eps, h, d);
        if ((status = linear(&l->qkv, h, t, qkv))) break;
        if ((status = sluice_rope_store(qkv, width, qkv + (size_t)(l->heads + l->kv_heads) * hd, width, t, l->heads,
                                        l->kv_heads, hd, s->positions, l->cos, l->sin, l->num_positions,
                                        s->slot_mapping, l->num_slots, q, l->k_cache, l->v_cache)))
            break;
        if ((status = sluice_decode_attention(q, (long)l->heads * hd, l->k_cache, l->v_cache, s->rows, s->kv_slots,
                                              s->mask, l->sinks, t, l->heads, l->kv_heads, hd, s->keys, l->scale,
                                              attn)))
            break;
        if ((status = linear(&l->o, attn, t, h))) break;
        add_into(x, h, (size_t)t * d);
        sluice_rms_norm(x, d, l->post_norm, t, d, l->eps, h, d);
        if ((status = linear(&l->gate_up, h, t, gu))) break;
        swiglu(gu, t, l->gate_up.n / 2, act);
        if ((status = linear(&l->down, act, t, h))) break;
        add_into(x, h, (size_t)t * d);
    }
    free(h);
    return status;
}
