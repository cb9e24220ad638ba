/* A model served in float32 on CPUs with AVX-512F, or AVX2 and FMA: a step through a stack of pre-norm Llama-family layers
 * in one call (RMSNorm, one stacked qkv projection, optional per-head q/k RMSNorm (Qwen3), rotary with the
 * KV store, paged grouped-query attention, SwiGLU MLP), and the pieces of it the op-by-op path calls alone.
 *
 * Every tensor is float32 but the weights of the linears, which f32_matmul.c reads packed (bf16 widened in
 * registers, or float32), and the KV cache, which may be 16- or 8-bit (f32_vec.h's KV_* kinds: rounded once as
 * stored, widened as read). The arithmetic is torch's float32 path's up to the order of sums (each linear's
 * products, a norm's squares, attention's dot products) and the exp in attention's softmax and the SwiGLU
 * (exp_nonpositive, ~1e-7 relative). Run op by op from Python, a layer is ~20 torch calls of 10-100 us each
 * on this path; here each step is one call.
 *
 * Shapes, layouts and return codes as decoder_layers.c (the bf16 stack): x [tokens][hidden] updated in place;
 * each row attends as one query over its own keys (a decode, or a prefill chunk's row at its position).
 *
 * One source for both instruction sets: built with AVX-512F its linears are f32_matmul.c's (and AMX's where
 * built for it), built with AVX2 and FMA alone f32_matmul_avx2.c's (the same bits); everything else is
 * written once on f32_vec.h's vectors of the build's width (F32V lanes). A linear whose weight is kept in a
 * GGUF block format runs quant_blocks.h's product instead (the weight dequantized exactly in registers, or, with
 * int8 activations, its rows quantized per block of 32 first: quant_int8.h).
 */
#include <sched.h>

#ifdef __AVX512F__
#include "f32_matmul.c"
#else
#include "f32_matmul_avx2.c"
enum { F32_AMX = 2 }; /* (f32_matmul.c's `bf16` argument for AMX: not this build's, never given to it) */
#endif
#include "f32_vec.h"
#include "quant_blocks.h"

enum { F32_MAX_GROUP = 16, F32_MAX_DIM = 256 }; /* query heads per kv head, head dim (a multiple of 16) */
/* the probabilities @ values loop: query heads x vectors of a value row a pass (accumulators in registers) */
#ifdef __AVX512F__
enum { F32_PV_HEADS = 4, F32_PV_VECS = 4 };
#else
enum { F32_PV_HEADS = 4, F32_PV_VECS = 2 };
#endif
/* attention multiply-adds below which one thread does it all (see decode_attention.c) */
#define F32_ATTENTION_SERIAL 2e5
/* SwiGLU outputs below which one thread does them all */
#define F32_SWIGLU_SERIAL 6e4

typedef struct {
    const void *w;     /* packed (see f32_matmul.c) */
    const float *bias; /* NULL, or n floats */
    int n, k, bf16;
    const quant_part_t *parts; /* num_parts > 0: the weight kept in GGUF's block formats instead (quant_blocks.h) */
    int num_parts, int8;       /* int8: its rows quantized per block of 32 first (quant_int8.h) */
} f32_linear_t;

typedef struct {
    const float *input_norm, *post_norm; /* [hidden] */
    float eps, scale;
    const float *q_norm, *k_norm; /* NULL, or [head_dim]: RMSNorm of each query / key head before rotary */
    f32_linear_t qkv, o, gate_up, down;
    int heads, kv_heads, head_dim;
    const float *cos, *sin; /* rotary tables [num_positions][head_dim / 2] */
    int num_positions;
    void *k_cache, *v_cache; /* [num_slots][kv_heads][head_dim] of f32_vec.h's KV_* kind kv */
    long num_slots;
    const float *sinks; /* NULL, or [heads] */
    int kv;
} f32_layer_t;

typedef struct {
    int tokens, hidden, keys;
    const int64_t *positions, *slot_mapping; /* [tokens] */
    const int64_t *rows;                     /* [tokens]: the row of x each attention query comes from */
    const int64_t *kv_slots;                 /* [tokens][keys] */
    const uint8_t *mask;                     /* [tokens][keys] */
} f32_step_t;

/* out = x / sqrt(mean(x^2) + eps) * weight over one row of dim */
static inline void f32_rms_row(const float *xr, const float *weight, int dim, float eps, float *o) {
    vf acc = vf_zero();
    for (int c = 0; c < dim; c += F32V) {
        const vf v = vf_loadn(xr + c, dim - c);
        acc = vf_fmadd(v, v, acc);
    }
    const vf scale = vf_set1(1.0f / sqrtf(vf_sum(acc) / (float)dim + eps));
    for (int c = 0; c < dim; c += F32V)
        vf_storen(o + c, dim - c, vf_mul(vf_mul(vf_loadn(xr + c, dim - c), scale), vf_loadn(weight + c, dim - c)));
}

/* the same over rows (ld_x / ld_out apart) */
int sluice_f32_rms_norm(const float *x, long ld_x, const float *weight, int rows, int dim, float eps, float *out,
                        long ld_out) {
#pragma omp parallel for schedule(static) if ((double)rows * dim >= 1e6)
    for (int r = 0; r < rows; r++) f32_rms_row(x + (size_t)r * ld_x, weight, dim, eps, out + (size_t)r * ld_out);
    return 0;
}

static inline void f32_rotate(const float *x, const float *cos, const float *sin, int half, float *out) {
    for (int c = 0; c < half; c += F32V) {
        const int n = half - c;
        const vf x1 = vf_loadn(x + c, n), x2 = vf_loadn(x + half + c, n);
        const vf cs = vf_loadn(cos + c, n), sn = vf_loadn(sin + c, n);
        /* (x1 cos - x2 sin, x2 cos + x1 sin): torch's four products, then the sums */
        vf_storen(out + c, n, vf_sub(vf_mul(x1, cs), vf_mul(x2, sn)));
        vf_storen(out + half + c, n, vf_add(vf_mul(x2, cs), vf_mul(x1, sn)));
    }
}

/* Rotary on one row t of qk [T][H + Hkv][D] (rows qk_stride apart; with q_norm / k_norm set, each head
 * RMS-normed first, in place): its rotated queries into q_out [T][H][D], rotated keys and values v (rows
 * v_stride apart) into the caches (of KV_* kind kv: D a multiple of 16 up to F32_MAX_DIM where not float32) at
 * slots[t]. */
static void f32_rope_row(int t, float *qk, long qk_stride, const float *v, long v_stride, int heads, int kv_heads,
                         int dim, const float *q_norm, const float *k_norm, float eps, const int64_t *positions,
                         const float *cos, const float *sin, const int64_t *slots, float *q_out, void *k_cache,
                         void *v_cache, int kv) {
    const int half = dim / 2;
    float *row = qk + (size_t)t * qk_stride;
    if (q_norm)
        for (int h = 0; h < heads; h++) f32_rms_row(row + (size_t)h * dim, q_norm, dim, eps, row + (size_t)h * dim);
    if (k_norm)
        for (int h = heads; h < heads + kv_heads; h++)
            f32_rms_row(row + (size_t)h * dim, k_norm, dim, eps, row + (size_t)h * dim);
    const float *cs = cos + (size_t)positions[t] * half, *sn = sin + (size_t)positions[t] * half;
    for (int h = 0; h < heads; h++) f32_rotate(row + (size_t)h * dim, cs, sn, half, q_out + ((size_t)t * heads + h) * dim);
    const size_t stride = kv_row(kv, dim), at = (size_t)slots[t] * kv_heads * stride;
    float key[F32_MAX_DIM];
    for (int h = 0; h < kv_heads; h++) {
        float *k = kv == KV_F32 ? (float *)k_cache + at + (size_t)h * dim : key;
        f32_rotate(row + (size_t)(heads + h) * dim, cs, sn, half, k);
        if (kv != KV_F32) kv_put(k_cache, kv, at + (size_t)h * stride, key, dim);
    }
    for (int h = 0; h < kv_heads; h++) /* (a head a row: an int8 row's scale is its own) */
        kv_put(v_cache, kv, at + (size_t)h * stride, v + (size_t)t * v_stride + (size_t)h * dim, dim);
}

static int f32_rope_in_range(int tokens, const int64_t *positions, int num_positions, const int64_t *slots,
                             long num_slots) {
    for (int t = 0; t < tokens; t++)
        if (positions[t] < 0 || positions[t] >= num_positions || slots[t] < 0 || slots[t] >= num_slots) return 0;
    return 1;
}

/* Rotary on a step's queries and keys qk [T][H + Hkv][D] and the KV store (f32_rope_row for every row).
 * Returns 0, -2 for a head dim a 16- or 8-bit cache does not take, or -3 (nothing written) when a position or a
 * slot is out of range. */
int sluice_f32_rope_store(float *qk, long qk_stride, const float *v, long v_stride, int tokens, int heads,
                          int kv_heads, int dim, const float *q_norm, const float *k_norm, float eps,
                          const int64_t *positions, const float *cos, const float *sin, int num_positions,
                          const int64_t *slots, long num_slots, float *q_out, void *k_cache, void *v_cache, int kv) {
    if (kv != KV_F32 && (dim % 16 || dim > F32_MAX_DIM)) return -2;
    if (!f32_rope_in_range(tokens, positions, num_positions, slots, num_slots)) return -3;
#pragma omp parallel for schedule(static) if ((double)tokens * (heads + 2 * kv_heads) * dim >= 1e6)
    for (int t = 0; t < tokens; t++)
        f32_rope_row(t, qk, qk_stride, v, v_stride, heads, kv_heads, dim, q_norm, k_norm, eps, positions, cos, sin,
                     slots, q_out, k_cache, v_cache, kv);
    return 0;
}

/* the bytes of a cache row of n elements from element i */
#define f32_prefetch_row(cache, kv, i, n, hint)                                                            \
    for (size_t b_ = 0; b_ < (n) * kv_bytes(kv); b_ += 64)                                                 \
    _mm_prefetch((const char *)(cache) + (i) * kv_bytes(kv) + b_, hint)

/* Decode attention in float32 (see decode_attention.c, the bf16 kernel, for the shapes and the method):
 * scores F32V keys at a time (one transposed reduction for them), each value row read once for all the
 * query heads that share it; the cache's keys and values (of KV_* kind kv) widened to float32 as they are
 * read. One job: sequence b = job / kv_heads, kv head j = job % kv_heads; scores: the group's heads' rows of
 * `padded` floats. (Inlined into f32_attention_job once for each kind.) */
static inline __attribute__((always_inline)) void f32_attention_kv(
    long job, float *scores, const float *q, long q_stride, const void *k_cache, const void *v_cache,
    const int64_t *rows, const int64_t *slots, const uint8_t *mask, const float *sinks, int heads, int kv_heads,
    int dim, int keys, float scale, float *out, int kv) {
    const int group = heads / kv_heads, vecs = dim / F32V, padded = (keys + 15) / 16 * 16;
    const int b = (int)(job / kv_heads), j = (int)(job % kv_heads);
    const size_t stride = kv_row(kv, dim);
    const int64_t *slot = slots + (size_t)b * keys;
    const uint8_t *attend = mask + (size_t)b * keys;
    int used = keys;
    while (used > 1 && !attend[used - 1]) used--;
    const size_t row = (size_t)rows[b];
    const float *qh = q + row * q_stride + (size_t)j * group * dim;
    vf top[F32_MAX_GROUP];
    float widened[F32V * F32_MAX_DIM]; /* a narrower cache's block of keys as float32 */
    for (int g = 0; g < group; g++) top[g] = vf_set1(-INFINITY);
    for (int i0 = 0; i0 < used; i0 += F32V) {
        const int n = used - i0 < F32V ? used - i0 : F32V;
        const vf_mask live = vf_flags(attend + i0, n);
        const int any = vf_any(live);
        /* the next block's keys into the L2 (into the L1, sixteen rows ahead: a 64-sequence step of SmolLM2's
         * shape over a float32 cache took 55 against 32 ms, float16 22 against 15.5, two sequences of 2,000 keys
         * 26-30 against 15) */
        for (int l = i0 == 0 ? 0 : i0 + F32V; l < i0 + 2 * F32V && l < used; l++)
            f32_prefetch_row(k_cache, kv, ((size_t)slot[l] * kv_heads + j) * stride, stride, _MM_HINT_T1);
        for (int l = i0; l < i0 + n; l++)
            f32_prefetch_row(v_cache, kv, ((size_t)slot[l] * kv_heads + j) * stride, stride, _MM_HINT_T1);
        /* each key's row, as float32: a narrower cache's widened once here for all the group's heads (widened for
         * each head as it was read, fp16's VCVTPH2PS left it behind bf16's shift: ITL 79 against 72 ms on the
         * Qwen3-0.6B shape at 16 sequences; now even) */
        const float *key[F32V];
        if (any)
            for (int l = 0; l < F32V; l++) {
                const size_t at = ((size_t)slot[i0 + (l < n ? l : 0)] * kv_heads + j) * stride;
                if (kv == KV_F32) {
                    key[l] = (const float *)k_cache + at;
                } else if (l >= n) {
                    key[l] = key[0];
                } else {
                    const vf ks = vf_set1(kv_scale(k_cache, kv, at, dim));
                    for (int c = 0; c < vecs; c++) {
                        const vf x = vf_load_kv(k_cache, kv, at + c * F32V);
                        vf_store(widened + l * dim + c * F32V, kv == KV_I8 ? vf_mul(x, ks) : x);
                    }
                    key[l] = widened + l * dim;
                }
            }
        for (int g = 0; g < group; g++) {
            vf sc = vf_set1(-INFINITY);
            if (any) {
                vf acc[F32V];
                const float *qg = qh + (size_t)g * dim;
                _Pragma("GCC unroll 16") for (int l = 0; l < F32V; l++) acc[l] = vf_zero();
                for (int c = 0; c < vecs; c++) {
                    const vf qv = vf_load(qg + c * F32V);
                    _Pragma("GCC unroll 16") for (int l = 0; l < F32V; l++)
                        acc[l] = vf_fmadd(vf_load(key[l] + c * F32V), qv, acc[l]);
                }
                sc = vf_where(live, vf_mul(vf_sums(acc), vf_set1(scale)), sc);
            }
            vf_store(scores + (size_t)g * padded + i0, sc);
            top[g] = vf_max(top[g], sc);
        }
    }
    float inv[F32_MAX_GROUP];
    for (int g = 0; g < group; g++) {
        float *s = scores + (size_t)g * padded;
        const int h = j * group + g;
        const float most = vf_most(top[g]), top_g = sinks && sinks[h] > most ? sinks[h] : most;
        float total = sinks ? exp1(sinks[h] - top_g) : 0.0f;
        vf sum = vf_zero();
        for (int i = 0; i < used; i += F32V) {
            const vf e = vf_exp(vf_sub(vf_load(s + i), vf_set1(top_g)));
            vf_store(s + i, e);
            sum = vf_add(sum, e);
        }
        total += vf_sum(sum);
        inv[g] = 1.0f / total;
    }
    /* probabilities @ values: a value row read once for up to F32_PV_HEADS heads of the group at a time */
    float *o = out + (row * heads + (size_t)j * group) * dim;
    for (int c0 = 0; c0 < vecs; c0 += F32_PV_VECS) {
        const int nc = vecs - c0 < F32_PV_VECS ? vecs - c0 : F32_PV_VECS;
        for (int g0 = 0; g0 < group; g0 += F32_PV_HEADS) {
            const int ng = group - g0 < F32_PV_HEADS ? group - g0 : F32_PV_HEADS;
            vf acc[F32_PV_HEADS][F32_PV_VECS];
            for (int g = 0; g < F32_PV_HEADS; g++)
                for (int c = 0; c < F32_PV_VECS; c++) acc[g][c] = vf_zero();
            for (int i = 0; i < used; i++) {
                if (!attend[i]) continue;
                const size_t vrow = ((size_t)slot[i] * kv_heads + j) * stride, vr = vrow + c0 * F32V;
                const float vs = kv_scale(v_cache, kv, vrow, dim); /* (an int8 row's scale, in p) */
                /* (the loops' bounds constant, the tails skipped: bounded by nc and ng, GCC copied a float32 row's
                 * vectors to the stack with REP MOVSQ and kept the sums there; a 64-sequence step of SmolLM2's
                 * shape took 36.4 against 24.5 ms with AVX-512, Qwen3's 0.61x the time) */
                vf x[F32_PV_VECS];
                _Pragma("GCC unroll 8") for (int c = 0; c < F32_PV_VECS; c++) x[c] =
                    c < nc ? vf_load_kv(v_cache, kv, vr + c * F32V) : vf_zero();
                _Pragma("GCC unroll 8") for (int g = 0; g < F32_PV_HEADS; g++) {
                    if (g >= ng) break;
                    const vf p = vf_set1(kv == KV_I8 ? scores[(size_t)(g0 + g) * padded + i] * vs
                                                     : scores[(size_t)(g0 + g) * padded + i]);
                    _Pragma("GCC unroll 8") for (int c = 0; c < F32_PV_VECS; c++) acc[g][c] =
                        vf_fmadd(p, x[c], acc[g][c]);
                }
            }
            for (int g = 0; g < ng; g++)
                for (int c = 0; c < nc; c++)
                    vf_store(o + (size_t)(g0 + g) * dim + (c0 + c) * F32V, vf_mul(acc[g][c], vf_set1(inv[g0 + g])));
        }
    }
}

static void f32_attention_job(long job, float *scores, const float *q, long q_stride, const void *k_cache,
                              const void *v_cache, const int64_t *rows, const int64_t *slots, const uint8_t *mask,
                              const float *sinks, int heads, int kv_heads, int dim, int keys, float scale, float *out,
                              int kv) {
    /* (each kind its own inlined copy: the widening is the kind's, without a branch a row) */
#define F32_ATTENTION_KIND(K)                                                                                    \
    case K:                                                                                                      \
        f32_attention_kv(job, scores, q, q_stride, k_cache, v_cache, rows, slots, mask, sinks, heads, kv_heads, dim, \
                         keys, scale, out, K);                                                                   \
        break;
    switch (kv) {
        F32_ATTENTION_KIND(KV_BF16) F32_ATTENTION_KIND(KV_F16) F32_ATTENTION_KIND(KV_E4M3)
        F32_ATTENTION_KIND(KV_E5M2) F32_ATTENTION_KIND(KV_I8) default : F32_ATTENTION_KIND(KV_F32)
    }
#undef F32_ATTENTION_KIND
}

int sluice_f32_decode_attention(const float *q, long q_stride, const void *k_cache, const void *v_cache,
                                const int64_t *rows, const int64_t *slots, const uint8_t *mask, const float *sinks,
                                int batch, int heads, int kv_heads, int dim, int keys, float scale, float *out,
                                int kv) {
    const int group = heads / kv_heads, padded = (keys + 15) / 16 * 16;
    if (group > F32_MAX_GROUP || dim > F32_MAX_DIM || dim % 16) return -2;
    int failed = 0;
#pragma omp parallel if ((double)batch * heads * keys * dim >= F32_ATTENTION_SERIAL)
    {
        float *scores = malloc(sizeof(float) * (size_t)group * padded);
        if (!scores) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (long job = 0; job < (long)batch * kv_heads; job++)
            if (scores)
                f32_attention_job(job, scores, q, q_stride, k_cache, v_cache, rows, slots, mask, sinks, heads, kv_heads,
                                  dim, keys, scale, out, kv);
        free(scores);
    }
    return failed ? -1 : 0;
}

/* out [rows][inter] = silu(gate) * up for gu [rows][2 * inter] (gate columns, then up) */
static void f32_swiglu(const float *gu, int rows, int inter, float *out) {
    for (int r = 0; r < rows; r++) {
        const float *gate = gu + (size_t)r * 2 * inter, *up = gate + inter;
        for (int c = 0; c < inter; c += F32V)
            vf_storen(out + (size_t)r * inter + c, inter - c, vf_silu_mul(vf_loadn(gate + c, inter - c), vf_loadn(up + c, inter - c)));
    }
}

/* The same over rows on the team's threads, for the op-by-op path (a prompt's MLP) where the gate-and-up product has
 * no SwiGLU epilogue (f32_matmul_avx2.c's; f32_matmul.c's for halves of whole groups of 64 only); gu rows 2 * inter
 * apart. Returns 0. */
int sluice_f32_swiglu(const float *gu, int rows, int inter, float *out) {
#pragma omp parallel for schedule(static) if ((double)rows * inter >= F32_SWIGLU_SERIAL)
    for (int r = 0; r < rows; r++) f32_swiglu(gu + (size_t)r * 2 * inter, 1, inter, out + (size_t)r * inter);
    return 0;
}

static void f32_add_into(float *x, const float *y, size_t n) {
    for (size_t i = 0; i < n; i += F32V) {
        const int keep = n - i < F32V ? (int)(n - i) : F32V;
        vf_storen(x + i, keep, vf_add(vf_loadn(x + i, keep), vf_loadn(y + i, keep)));
    }
}

/* A barrier for the threads of one parallel region (sense-reversing). Waiting threads spin briefly, then yield
 * the core: the steps between barriers are short and usually balanced, and a thread put to sleep (libgomp's
 * barrier under OMP_WAIT_POLICY=PASSIVE, as the server runs) takes tens of microseconds to wake, ~150 times
 * a step (each linear and attention of every layer its own parallel region: ~5 of ~33 ms at batch 16 on the
 * 135M shape); spinning without end would take the core from the server's other processes. */
typedef struct {
    int count, sense, threads;
} f32_barrier_t;

static void f32_barrier(f32_barrier_t *b, int *sense) {
    *sense = !*sense;
    if (__atomic_add_fetch(&b->count, 1, __ATOMIC_ACQ_REL) == b->threads) {
        __atomic_store_n(&b->count, 0, __ATOMIC_RELAXED);
        __atomic_store_n(&b->sense, *sense, __ATOMIC_RELEASE);
        return;
    }
    for (int spins = 0; __atomic_load_n(&b->sense, __ATOMIC_ACQUIRE) != *sense; spins++) {
        if (spins < 4000)
            _mm_pause();
        else
            sched_yield();
    }
}

/* rows [r0, r1) of t for thread th of nth */
static inline void f32_share(int t, int th, int nth, int *r0, int *r1) {
    *r0 = (int)((long)t * th / nth);
    *r1 = (int)((long)t * (th + 1) / nth);
}

/* Whether a linear starts with each thread quantizing its own share of the rows (f32_share's, int8
 * activations) and then waits for the others: a step that made those rows in the same shares needs no barrier
 * before it (the one after the quantization orders them). */
static inline int f32_own_rows(const f32_linear_t *l) { return l->num_parts && l->int8; }

/* this thread's share of in @ l^T into out [rows][l->n] (the block counter *next, shared by the team). On
 * AMX (l->bf16 == F32_AMX) the rows are readied in xs first (amx_ready: room for 3 * amx_rows(rows) * l->k,
 * the thread's own up to AMX_OWN_ROWS rows, else the team's, which waits at the barrier); a quantized linear
 * with int8 activations quantizes its share of the rows into x8 (room for rows of l->k) and waits there. */
static void f32_linear_part(const f32_linear_t *l, const float *in, int rows, float *out, float *c, int *next, int th,
                            int nth, uint16_t *xs, void *x8, f32_barrier_t *barrier, int *sense) {
    if (l->num_parts) {
        qm_x8_t q8;
        if (l->int8) {
            int r0, r1;
            f32_share(rows, th, nth, &r0, &r1);
            q8 = qm_x8_at(x8, rows, l->k);
            qm_quantize_for(l->parts, in, l->k, r0, r1, l->k, &q8);
            f32_barrier(barrier, sense);
        }
        qm_linear_part(l->parts, l->num_parts, l->k, in, l->k, l->int8 ? &q8 : NULL, rows, l->bias, out, l->n, next,
                       qm_chunk(l->parts, l->num_parts, nth));
        return;
    }
    size_t plane = 0;
#ifdef __AMX_BF16__
    if (l->bf16 == F32_AMX) {
        plane = (size_t)amx_rows(rows) * l->k;
        if (amx_ready(in, l->k, rows, l->k, th, nth, xs, plane)) f32_barrier(barrier, sense);
    } else {
        xs = NULL;
    }
#else
    (void)th, (void)barrier, (void)sense;
    xs = NULL;
#endif
    f32_matmul_part(l->w, l->bf16, l->n, l->k, in, l->k, rows, l->bias, out, l->n, NULL, NULL, c, NULL, next,
                    f32_chunk(l->n, nth), xs, plane);
}

int sluice_f32_layers(const f32_layer_t *layers, int count, const f32_step_t *s, float *x) {
    const int t = s->tokens, d = s->hidden, padded = (s->keys + 15) / 16 * 16;
    int most_qkv = 0, most_q = 0, most_gu = 0, most_group = 1, most_k = 0, most_k8 = 0, amx = 0;
    for (int i = 0; i < count; i++) {
        const f32_layer_t *l = layers + i;
        if (l->heads % l->kv_heads || l->heads / l->kv_heads > F32_MAX_GROUP || l->head_dim % 16 ||
            l->head_dim > F32_MAX_DIM)
            return -2;
        if (!f32_rope_in_range(t, s->positions, l->num_positions, s->slot_mapping, l->num_slots)) return -3;
        if (l->qkv.n > most_qkv) most_qkv = l->qkv.n;
        if (l->heads * l->head_dim > most_q) most_q = l->heads * l->head_dim;
        if (l->gate_up.n > most_gu) most_gu = l->gate_up.n;
        if (l->heads / l->kv_heads > most_group) most_group = l->heads / l->kv_heads;
        const f32_linear_t *linears[4] = {&l->qkv, &l->o, &l->gate_up, &l->down};
        for (int j = 0; j < 4; j++) {
            if (linears[j]->k > most_k) most_k = linears[j]->k;
            if (linears[j]->num_parts && linears[j]->int8 && linears[j]->k > most_k8) most_k8 = linears[j]->k;
            amx |= linears[j]->bf16 == F32_AMX;
        }
    }
    float *h = malloc(sizeof(float) * t * (size_t)(d + most_qkv + 2 * most_q + most_gu + most_gu / 2));
    int *counters = calloc((size_t)count * 5, sizeof(int)); /* each layer's four linears and attention */
    void *x8 = most_k8 ? malloc(qm_x8_bytes(t, most_k8)) : NULL; /* int8 activations: a linear's rows */
    uint16_t *xs = NULL; /* AMX: a linear's rows split (see f32_linear_part) */
#ifdef __AMX_BF16__
    const size_t xs_each = 3 * (size_t)amx_rows(t) * most_k; /* each thread's own below AMX_OWN_ROWS rows */
    if (amx) xs = malloc(sizeof(uint16_t) * xs_each * (t <= AMX_OWN_ROWS ? omp_get_max_threads() : 1));
#else
    (void)most_k, (void)amx;
#endif
    if (!h || !counters || (amx && !xs) || (most_k8 && !x8)) {
        free(h);
        free(counters);
        free(xs);
        free(x8);
        return -1;
    }
    float *qkv = h + (size_t)t * d, *q = qkv + (size_t)t * most_qkv, *attn = q + (size_t)t * most_q,
          *gu = attn + (size_t)t * most_q, *act = gu + (size_t)t * most_gu;
    /* one thread for a step too small to share (waking the other costs more than it saves) */
    double work = 0;
    for (int i = 0; i < count; i++)
        work += (double)t * (layers[i].qkv.n * (double)layers[i].qkv.k + layers[i].o.n * (double)layers[i].o.k +
                             layers[i].gate_up.n * (double)layers[i].gate_up.k + layers[i].down.n * (double)layers[i].down.k);
    const int threads = work >= F32_SERIAL_WORK * count ? omp_get_max_threads() : 1;
    f32_barrier_t barrier = {0, 0, 0};
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        const int th = omp_get_thread_num(), nth = omp_get_num_threads();
#pragma omp single
        barrier.threads = nth; /* (the single's own barrier publishes it) */
        int sense = 0, r0, r1;
        f32_share(t, th, nth, &r0, &r1);
        float *c = malloc(sizeof(float) * (size_t)t * F32_LD);
        float *scores = malloc(sizeof(float) * (size_t)most_group * padded);
        if (!c || !scores) __atomic_store_n(&failed, 1, __ATOMIC_RELAXED);
        f32_barrier(&barrier, &sense);
        const int ok = !__atomic_load_n(&failed, __ATOMIC_RELAXED); /* the same for every thread, after the barrier */
#ifdef __AMX_BF16__
        uint16_t *mine = xs && t <= AMX_OWN_ROWS ? xs + (size_t)th * xs_each : xs;
#else
        uint16_t *mine = NULL;
#endif
        for (int i = 0; i < count && ok; i++) {
            const f32_layer_t *l = layers + i;
            int *next = counters + (size_t)i * 5;
            const int hd = l->head_dim, width = l->qkv.n;
            for (int r = r0; r < r1; r++) f32_rms_row(x + (size_t)r * d, l->input_norm, d, l->eps, h + (size_t)r * d);
            if (!f32_own_rows(&l->qkv)) f32_barrier(&barrier, &sense);
            f32_linear_part(&l->qkv, h, t, qkv, c, next, th, nth, mine, x8, &barrier, &sense);
            f32_barrier(&barrier, &sense);
            for (int r = r0; r < r1; r++)
                f32_rope_row(r, qkv, width, qkv + (size_t)(l->heads + l->kv_heads) * hd, width, l->heads, l->kv_heads, hd,
                             l->q_norm, l->k_norm, l->eps, s->positions, l->cos, l->sin, s->slot_mapping, q, l->k_cache,
                             l->v_cache, l->kv);
            f32_barrier(&barrier, &sense);
            for (long job; (job = __atomic_fetch_add(next + 4, 1, __ATOMIC_RELAXED)) < (long)t * l->kv_heads;)
                f32_attention_job(job, scores, q, (long)l->heads * hd, l->k_cache, l->v_cache, s->rows, s->kv_slots,
                                  s->mask, l->sinks, l->heads, l->kv_heads, hd, s->keys, l->scale, attn, l->kv);
            f32_barrier(&barrier, &sense);
            f32_linear_part(&l->o, attn, t, h, c, next + 1, th, nth, mine, x8, &barrier, &sense);
            f32_barrier(&barrier, &sense);
            for (int r = r0; r < r1; r++) { /* the residual, then the MLP's norm of it */
                f32_add_into(x + (size_t)r * d, h + (size_t)r * d, d);
                f32_rms_row(x + (size_t)r * d, l->post_norm, d, l->eps, h + (size_t)r * d);
            }
            if (!f32_own_rows(&l->gate_up)) f32_barrier(&barrier, &sense);
            f32_linear_part(&l->gate_up, h, t, gu, c, next + 2, th, nth, mine, x8, &barrier, &sense);
            f32_barrier(&barrier, &sense);
            f32_swiglu(gu + (size_t)r0 * l->gate_up.n, r1 - r0, l->gate_up.n / 2, act + (size_t)r0 * (l->gate_up.n / 2));
            if (!f32_own_rows(&l->down)) f32_barrier(&barrier, &sense);
            f32_linear_part(&l->down, act, t, h, c, next + 3, th, nth, mine, x8, &barrier, &sense);
            f32_barrier(&barrier, &sense);
            /* (no barrier after: the next layer's norm reads and writes only this thread's rows, and waits at its
             * linear's start, or the region's end) */
            for (int r = r0; r < r1; r++) f32_add_into(x + (size_t)r * d, h + (size_t)r * d, d);
        }
        free(c);
        free(scores);
    }
    free(h);
    free(counters);
    free(xs);
    free(x8);
    return failed ? -1 : 0;
}
