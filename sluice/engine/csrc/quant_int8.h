/* int8 activations for quant_blocks.h's product, llama.cpp's scheme (ggml's q8_0 dot products): each row of x
 * quantized once per block of 32 (d = max|x| / 127, xq = round(x / d)), each weight unit's stored values r
 * multiplied by xq as int8 pairs summed exactly in int32 per lane of 4 (VPDPBUSD on AVX512-VNNI, VPMADDUBSW +
 * VPMADDWD without it), each lane then scaled in float32 by its weight group's scale times its block's d, and
 * the stored values' offset (q = r - off) and a type's min taken off per lane: the offset exactly in int32,
 * from -off * (the lane's sum of xq), the min in float32, from d * that sum.
 *
 * Here the tiles on the file's layout: a weight unit decoded once for every QM_R rows of x (QM_NR weight rows a
 * tile, as the float path's), two units a vector with AVX-512BW, one with AVX2. Served weights are repacked at
 * load and run quant_repack.h's tiles (16 weight rows a load; 4-10x these at one row of x), which this file's
 * shims and rows of x serve too; the tiles here run a weight not repacked (tests, benchmarks). Included by
 * quant_blocks.h after its qm_raw_<type>.
 */
#ifndef SLUICE_QUANT_INT8_H
#define SLUICE_QUANT_INT8_H

/* Rows of x as the int8 path reads them: per row, ld values (k padded with zeros to a multiple of 64) and per
 * lane of 4 of them, the block's d, minus the lane's sum of xq, and d times that sum; per block of 32 (the
 * repacked tiles', quant_repack.h), the same three; per half block of 16 (Q6_K's repacked tiles), minus its sum
 * of xq. Per-channel weights' rows (quant_channel.h) are quantized per group of 128 instead: their d and minus
 * their sum of xq in bd and bneg, a group at each block's index. */
typedef struct {
    int8_t *q;     /* [m][ld] */
    float *d;      /* [m][ld / 4] */
    int32_t *neg;  /* [m][ld / 4] */
    float *sum;    /* [m][ld / 4] */
    float *bd;     /* [m][ld / 32] */
    int32_t *bneg; /* [m][ld / 32] */
    float *bsum;   /* [m][ld / 32] */
    int32_t *hneg; /* [m][ld / 16] */
    long ld;
} qm_x8_t;

static inline long qm_x8_ld(int k) { return (k + 63) / 64 * 64; }

/* bytes a workspace for m rows of k values takes (see qm_x8_at) */
static inline size_t qm_x8_bytes(int m, int k) {
    return (size_t)m * (qm_x8_ld(k) * 4 + qm_x8_ld(k) / 32 * 12 + qm_x8_ld(k) / 16 * 4);
}

static inline qm_x8_t qm_x8_at(void *mem, int m, int k) {
    const long ld = qm_x8_ld(k);
    const size_t lane = (size_t)m * ld / 4, block = (size_t)m * ld / 32;
    int8_t *q = mem;
    float *d = (float *)(q + (size_t)m * ld);
    int32_t *neg = (int32_t *)(d + lane);
    float *sum = (float *)(neg + lane), *bd = sum + lane;
    int32_t *bneg = (int32_t *)(bd + block);
    float *bsum = (float *)(bneg + block);
    return (qm_x8_t){q, d, neg, sum, bd, bneg, bsum, (int32_t *)(bsum + block), ld};
}

/* the largest of v's 8 lanes */
static inline float qm_hmax(__m256 v) {
    __m128 t = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    t = _mm_max_ps(t, _mm_movehl_ps(t, t));
    return _mm_cvtss_f32(_mm_max_ss(t, _mm_movehdup_ps(t)));
}

/* the sum of v's 8 lanes */
static inline int32_t qm_hsum(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1)));
}

/* 32 values x times inv rounded to int8 into q (to nearest even, as nearbyintf); returns the sums of each lane's
 * 4 of them (lanes in the order of q) */
static inline __m256i qm_quantize32(const float *x, __m256 inv, int8_t *q) {
    __m256i n[4];
    for (int j = 0; j < 4; j++) n[j] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * j), inv));
    const __m256i packed = _mm256_permutevar8x32_epi32(
        _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]), _mm256_packs_epi32(n[2], n[3])),
        _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)q, packed);
    return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), packed), _mm256_set1_epi16(1));
}

/* Rows [r0, r1) of x (k values each, ldx apart) quantized into x8. */
static void qm_quantize_row(const float *xr, int r, int k, const qm_x8_t *x8) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    {
        int8_t *q = x8->q + (size_t)r * x8->ld;
        const size_t at = (size_t)r * x8->ld / 4;
        for (int i = 0; i < k; i += 32) {
            const float *xb = xr + i;
            __m256 top = _mm256_setzero_ps();
            for (int j = 0; j < 4; j++) top = _mm256_max_ps(top, _mm256_andnot_ps(sign, _mm256_loadu_ps(xb + 8 * j)));
            const float amax = qm_hmax(top);
            const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f), d = _mm256_set1_ps(amax / 127.0f);
            const __m256i sums = qm_quantize32(xb, inv, q + i);
            _mm256_storeu_ps(x8->d + at + i / 4, d);
            _mm256_storeu_si256((__m256i *)(x8->neg + at + i / 4), _mm256_sub_epi32(_mm256_setzero_si256(), sums));
            _mm256_storeu_ps(x8->sum + at + i / 4, _mm256_mul_ps(d, _mm256_cvtepi32_ps(sums)));
            __m128i lo = _mm256_castsi256_si128(sums), hi = _mm256_extracti128_si256(sums, 1); /* (the halves') */
            lo = _mm_add_epi32(lo, _mm_shuffle_epi32(lo, 0x4e)), hi = _mm_add_epi32(hi, _mm_shuffle_epi32(hi, 0x4e));
            const int32_t first = _mm_cvtsi128_si32(_mm_add_epi32(lo, _mm_shuffle_epi32(lo, 0xb1)));
            const int32_t second = _mm_cvtsi128_si32(_mm_add_epi32(hi, _mm_shuffle_epi32(hi, 0xb1)));
            const int32_t total = first + second;
            x8->bd[at / 8 + i / 32] = amax / 127.0f, x8->bneg[at / 8 + i / 32] = -total;
            x8->bsum[at / 8 + i / 32] = amax / 127.0f * (float)total;
            x8->hneg[at / 4 + i / 16] = -first, x8->hneg[at / 4 + i / 16 + 1] = -second;
        }
        for (long i = k; i < x8->ld; i += 32) { /* (the padding: zeros, which add nothing) */
            memset(q + i, 0, 32);
            memset(x8->d + at + i / 4, 0, 32), memset(x8->neg + at + i / 4, 0, 32), memset(x8->sum + at + i / 4, 0, 32);
            x8->bd[at / 8 + i / 32] = 0.0f, x8->bneg[at / 8 + i / 32] = 0, x8->bsum[at / 8 + i / 32] = 0.0f;
            x8->hneg[at / 4 + i / 16] = x8->hneg[at / 4 + i / 16 + 1] = 0;
        }
    }
}

#if defined(__AVX512BW__)
enum { QI_UNITS = 2 };
typedef __m512i qi_t;
typedef __m512 qf_t;
static inline qi_t qi_load(const void *p) { return _mm512_loadu_si512(p); }
static inline qf_t qf_load(const float *p) { return _mm512_loadu_ps(p); }
static inline qf_t qf_zero(void) { return _mm512_setzero_ps(); }
static inline float qf_sum(qf_t v) { return _mm512_reduce_add_ps(v); }
static inline qf_t qf_fmadd(qf_t a, qf_t b, qf_t c) { return _mm512_fmadd_ps(a, b, c); }
static inline qf_t qf_fnmadd(qf_t a, qf_t b, qf_t c) { return _mm512_fnmadd_ps(a, b, c); }
static inline qf_t qf_scaled(qi_t s, qf_t d) { return _mm512_mul_ps(_mm512_cvtepi32_ps(s), d); }
/* units u and u + 1 (zeros past the row's last unit) */
static inline qi_t qi_pair(__m256i a, __m256i b) { return _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1); }
/* each lane's value of the four (lanes of 4 values: unit u's halves, then unit u + 1's) */
static inline qf_t qi_lanes(float a, float b, float c, float e) {
    const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    return _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_setr_ps(a, b, c, e)));
}
static inline qi_t qi_zero(void) { return _mm512_setzero_si512(); }
static inline qi_t qi_shift(qi_t v, int by) { return _mm512_slli_epi32(v, by); }
static inline qi_t qi_xor80(qi_t v) { return _mm512_xor_si512(v, _mm512_set1_epi8((char)0x80)); }
/* init + the sums of 4 products of unsigned w by signed x a lane, without VPDPBUSD (|w| <= 255 would overflow
 * an int16 pair sum: only types whose w <= 63 come here) */
static inline qi_t qi_dot_pairs(qi_t init, qi_t w, qi_t x) {
    return _mm512_add_epi32(init, _mm512_madd_epi16(_mm512_maddubs_epi16(w, x), _mm512_set1_epi16(1)));
}
/* the same of signed w (|w| <= 128): as |w| times x with w's sign */
static inline qi_t qi_dot_s(qi_t w, qi_t x) {
    const __mmask64 neg = _mm512_movepi8_mask(w);
    const qi_t sx = _mm512_mask_sub_epi8(x, neg, _mm512_setzero_si512(), x);
    return _mm512_madd_epi16(_mm512_maddubs_epi16(_mm512_abs_epi8(w), sx), _mm512_set1_epi16(1));
}
#else
enum { QI_UNITS = 1 };
typedef __m256i qi_t;
typedef __m256 qf_t;
static inline qi_t qi_load(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline qf_t qf_load(const float *p) { return _mm256_loadu_ps(p); }
static inline qf_t qf_zero(void) { return _mm256_setzero_ps(); }
static inline float qf_sum(qf_t v) {
    __m128 r = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    return _mm_cvtss_f32(_mm_add_ss(r, _mm_movehdup_ps(r)));
}
static inline qf_t qf_fmadd(qf_t a, qf_t b, qf_t c) { return _mm256_fmadd_ps(a, b, c); }
static inline qf_t qf_fnmadd(qf_t a, qf_t b, qf_t c) { return _mm256_fnmadd_ps(a, b, c); }
static inline qf_t qf_scaled(qi_t s, qf_t d) { return _mm256_mul_ps(_mm256_cvtepi32_ps(s), d); }
static inline qf_t qi_lanes(float a, float b, float c, float e) {
    (void)c, (void)e;
    return _mm256_set_m128(_mm_set1_ps(b), _mm_set1_ps(a));
}
static inline qi_t qi_zero(void) { return _mm256_setzero_si256(); }
static inline qi_t qi_shift(qi_t v, int by) { return _mm256_slli_epi32(v, by); }
static inline qi_t qi_xor80(qi_t v) { return _mm256_xor_si256(v, _mm256_set1_epi8((char)0x80)); }
static inline qi_t qi_dot_pairs(qi_t init, qi_t w, qi_t x) {
    return _mm256_add_epi32(init, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
}
static inline qi_t qi_dot_s(qi_t w, qi_t x) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w)),
                             _mm256_set1_epi16(1));
}
#endif

/* V: the tiles' dot, VPDPBUSD (1) or VPMADDUBSW + VPMADDWD (0). Signed stored values (Q8_0) with VPDPBUSD:
 * r + 128 against an offset of 128; without it, signed pairs. */
#define QI_SIGNED(T, V) (!(V) && T == Q8_0)
#define QI_OFF(T, V) ((V) && T == Q8_0 ? 128 : QM_OFF_##T)
#define QI_MIN(T) (T == Q4_1 || T == Q5_1 || T == Q4_K || T == Q5_K)
/* log2 of an offset (8, 16, 32 or 128) */
#define QI_LOG2(o) ((o) == 8 ? 3 : (o) == 16 ? 4 : (o) == 32 ? 5 : 7)

/* QI_UNITS units of a weight row from unit u (of units): the values the dot takes, each lane's scale and min */
#define QI_LOAD(T)                                                                                             \
    static inline qi_t qi_load_##T(const uint8_t *row, int u, int units, qf_t *s, qf_t *m) {                   \
        qm_scale_t a, b = {0.0f, 0.0f, 0.0f, 0.0f};                                                            \
        const __m256i ra = qm_raw_##T(row, u, &a);                                                             \
        qi_t v;                                                                                                \
        if (QI_UNITS == 2) {                                                                                   \
            const __m256i rb = u + 1 < units ? qm_raw_##T(row, u + 1, &b) : _mm256_setzero_si256();            \
            v = QI_PAIR(ra, rb);                                                                               \
        } else {                                                                                               \
            (void)units, v = QI_ONE(ra);                                                                       \
        }                                                                                                      \
        *s = qi_lanes(a.s0, a.s1, b.s0, b.s1);                                                                 \
        if (QI_MIN(T)) *m = qi_lanes(a.m0, a.m1, b.m0, b.m1);                                                  \
        return v;                                                                                              \
    }
#if defined(__AVX512BW__)
#define QI_PAIR(a, b) qi_pair(a, b)
#define QI_ONE(a) _mm512_castsi256_si512(a)
/* Q8_0 / Q4_0 / Q4_1 (a block a unit, its float16 scale first, Q4_1's min after it): the two units' scales
 * (and mins) converted at once (VCVTPH2PS: exact, as qm_half) */
#define QI_LOAD_SIMPLE(T, BYTES, VALUES)                                                                       \
    static inline __m256i qi_values_##T(const uint8_t *b) { return VALUES; }                                   \
    static inline qi_t qi_load_##T(const uint8_t *row, int u, int units, qf_t *s, qf_t *m) {                   \
        const int two = u + 1 < units;                                                                         \
        const uint8_t *a = row + (size_t)(BYTES) * u, *b = two ? a + (BYTES) : a;                              \
        int32_t ha, hb;                                                                                        \
        memcpy(&ha, a, 4), memcpy(&hb, b, 4);                                                                  \
        const __m512 f = _mm512_cvtph_ps(_mm256_castsi128_si256(_mm_insert_epi32(_mm_cvtsi32_si128(ha), hb, 1))); \
        *s = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2), f);         \
        if (QI_MIN(T)) /* (m = -min) */                                                                        \
            *m = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_permutexvar_ps(                                     \
                _mm512_setr_epi32(1, 1, 1, 1, 1, 1, 1, 1, 3, 3, 3, 3, 3, 3, 3, 3), f));                        \
        const qi_t v = qi_pair(qi_values_##T(a), two ? qi_values_##T(b) : _mm256_setzero_si256());            \
        return v;                                                                                              \
    }
QI_LOAD_SIMPLE(Q8_0, 34, _mm256_loadu_si256((const __m256i *)(b + 2)))
QI_LOAD_SIMPLE(Q4_0, 18, qm_nibbles16(b + 2)) QI_LOAD_SIMPLE(Q4_1, 20, qm_nibbles16(b + 4))
#else
#define QI_PAIR(a, b) ((void)(b), (a))
#define QI_ONE(a) (a)
QI_LOAD(Q8_0) QI_LOAD(Q4_0) QI_LOAD(Q4_1)
#endif
QI_LOAD(Q5_0) QI_LOAD(Q5_1) QI_LOAD(Q4_K) QI_LOAD(Q5_K) QI_LOAD(Q6_K)

/* sums[r][i] = row i of the weight (rows[i]) . row r0 + r of x8, over `units` units of 32, for R rows of x */
#define QI_TILE(NAME, V, DOT, T, R)                                                                            \
    static void NAME##_##T##_##R(const uint8_t *const *rows, int units, const qm_x8_t *x8, int r0, float *sums) { \
        qf_t acc[R][QM_NR];                                                                                    \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                                                    \
            _Pragma("GCC unroll 8") for (int i = 0; i < QM_NR; i++) acc[r][i] = qf_zero();                     \
        for (int u = 0; u < units; u += QI_UNITS) {                                                            \
            qi_t w[QM_NR];                                                                                     \
            qf_t s[QM_NR], m[QM_NR];                                                                           \
            _Pragma("GCC unroll 8") for (int i = 0; i < QM_NR; i++) {                                          \
                w[i] = qi_load_##T(rows[i], u, units, s + i, m + i);                                           \
                if ((V) && T == Q8_0) w[i] = qi_xor80(w[i]);                                                   \
            }                                                                                                  \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                              \
                const size_t at = (size_t)(r0 + r) * x8->ld / 4 + 8 * u;                                      \
                const qi_t xq = qi_load(x8->q + (size_t)(r0 + r) * x8->ld + 32 * u);                           \
                const qi_t init = QI_OFF(T, V) ? qi_shift(qi_load(x8->neg + at), QI_LOG2(QI_OFF(T, V))) : qi_zero(); \
                const qf_t d = qf_load(x8->d + at);                                                            \
                _Pragma("GCC unroll 8") for (int i = 0; i < QM_NR; i++) {                                      \
                    const qi_t dot = QI_SIGNED(T, V) ? qi_dot_s(w[i], xq) : DOT(init, w[i], xq);               \
                    acc[r][i] = qf_fmadd(qf_scaled(dot, d), s[i], acc[r][i]);                                  \
                    if (QI_MIN(T)) acc[r][i] = qf_fnmadd(m[i], qf_load(x8->sum + at), acc[r][i]);              \
                }                                                                                              \
            }                                                                                                  \
        }                                                                                                      \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                                                    \
            _Pragma("GCC unroll 8") for (int i = 0; i < QM_NR; i++) sums[r * QM_NR + i] = qf_sum(acc[r][i]);   \
    }
typedef void (*qi_tile_fn)(const uint8_t *const *, int, const qm_x8_t *, int, float *);
#if defined(__AVX512F__)
#define QI_TILES(NAME, V, DOT, T)                                                                              \
    QI_TILE(NAME, V, DOT, T, 1) QI_TILE(NAME, V, DOT, T, 2) QI_TILE(NAME, V, DOT, T, 3) QI_TILE(NAME, V, DOT, T, 4) \
    QI_TILE(NAME, V, DOT, T, 5) QI_TILE(NAME, V, DOT, T, 6) QI_TILE(NAME, V, DOT, T, 7) QI_TILE(NAME, V, DOT, T, 8)
#define QI_BY_ROWS(NAME, T)                                                                                    \
    {0, NAME##_##T##_1, NAME##_##T##_2, NAME##_##T##_3, NAME##_##T##_4, NAME##_##T##_5, NAME##_##T##_6,          \
     NAME##_##T##_7, NAME##_##T##_8}
#else
#define QI_TILES(NAME, V, DOT, T) QI_TILE(NAME, V, DOT, T, 1) QI_TILE(NAME, V, DOT, T, 2) QI_TILE(NAME, V, DOT, T, 3)
#define QI_BY_ROWS(NAME, T) {0, NAME##_##T##_1, NAME##_##T##_2, NAME##_##T##_3}
#endif
/* NAME##s(type): the table of that type's tiles by rows of x (BY_ROWS(NAME, type); Q6_K's for any other) */
#define QX_BY_TYPE(FN, BY_ROWS, NAME)                                                                          \
    static const FN *NAME##s(int type) {                                                                       \
        static const FN q8_0[] = BY_ROWS(NAME, Q8_0), q4_0[] = BY_ROWS(NAME, Q4_0), q4_1[] = BY_ROWS(NAME, Q4_1), \
                        q5_0[] = BY_ROWS(NAME, Q5_0), q5_1[] = BY_ROWS(NAME, Q5_1), q4_k[] = BY_ROWS(NAME, Q4_K), \
                        q5_k[] = BY_ROWS(NAME, Q5_K), q6_k[] = BY_ROWS(NAME, Q6_K);                            \
        switch (type) {                                                                                        \
        case Q8_0: return q8_0;                                                                                \
        case Q4_0: return q4_0;                                                                                \
        case Q4_1: return q4_1;                                                                                \
        case Q5_0: return q5_0;                                                                                \
        case Q5_1: return q5_1;                                                                                \
        case Q4_K: return q4_k;                                                                                \
        case Q5_K: return q5_k;                                                                                \
        default: return q6_k;                                                                                  \
        }                                                                                                      \
    }
#define QI_ALL(NAME, V, DOT)                                                                                   \
    QI_TILES(NAME, V, DOT, Q8_0) QI_TILES(NAME, V, DOT, Q4_0) QI_TILES(NAME, V, DOT, Q4_1)                     \
    QI_TILES(NAME, V, DOT, Q5_0) QI_TILES(NAME, V, DOT, Q5_1)                                                  \
    QI_TILES(NAME, V, DOT, Q4_K) QI_TILES(NAME, V, DOT, Q5_K) QI_TILES(NAME, V, DOT, Q6_K)                     \
    QX_BY_TYPE(qi_tile_fn, QI_BY_ROWS, NAME)

/* init + the sums of four products of w's unsigned and x's signed bytes, as _mm512_dpbusd_epi32 (which GCC
 * 12 compiles with a register copy of the accumulator per use: 16 moves beside 8 VPDPBUSD in an 8-row tile's
 * loop); the one instruction, as int8_screen.h's s_dot (an AVX-512BW build runs it only where the CPU has it) */
#if defined(__AVX512BW__)
static inline __attribute__((always_inline)) qi_t qi_dot_vnni(qi_t init, qi_t w, qi_t x) {
    __asm__("vpdpbusd %2, %1, %0" : "+v"(init) : "v"(w), "v"(x));
    return init;
}
#endif

/* The tiles of a type: with VPDPBUSD where the build has it, or (an AVX-512BW build without it, as
 * f32_layers.c's) where this CPU has it, built for it here; else VPMADDUBSW + VPMADDWD (the same sums). */
#if defined(__AVX512VNNI__)
QI_ALL(qi_vnni_tile, 1, qi_dot_vnni)
static const qi_tile_fn *qi_tiles(int type) { return qi_vnni_tiles(type); }
#else
QI_ALL(qi_mtile, 0, qi_dot_pairs)
#if defined(__AVX512BW__)
#pragma GCC push_options
#pragma GCC target("avx512vnni")
QI_ALL(qi_vnni_tile, 1, qi_dot_vnni)
#pragma GCC pop_options
static const qi_tile_fn *qi_tiles(int type) {
    return __builtin_cpu_supports("avx512vnni") ? qi_vnni_tiles(type) : qi_mtiles(type);
}
#else
static const qi_tile_fn *qi_tiles(int type) { return qi_mtiles(type); }
#endif
#endif

#include "quant_repack.h"

#endif
