/* Attention for a decoding step's few query rows (or a prompt's many), bf16 in and out, on AVX-512 BF16, for a
   grouped-query model: each K/V head serves H/G query heads, so its query rows are all of theirs (row r = head r / T of the
   group, step row r % T), and a task takes up to 16 of them, a vector's lanes, with one K/V head of one sequence.
   p is key-major (p[j * 16 + i]: key j, row i):

       1. s_j = scale q.k_j + mask_j     16 keys at a time, each (row, key) one vdpbf16ps a pair of d, over the
                                         pairs in order: lanes the rows (a key's pair broadcast against the rows'),
                                         or for a task of at most FEW rows lanes the keys (16 keys' pairs transposed,
                                         a row's pair broadcast against them: the same operands in the same order,
                                         so the same bits, for a third of the instructions at SmolLM2's 3 rows a
                                         head). No mask: causal, row t sees keys j <= S - T + t, and a task stops
                                         at the last key one of its rows sees (half a prefill's work)
       2. p_j = exp(s_j - max_j s_j)     fp32, summed over keys in key order, a vector of rows a key; a masked
                                         key (at most -87 after the shift: the mask's dtype minimum) gets exactly 0
       3. out = sum_j p_j v_j / sum_j p_j    4 rows x 64 columns of fp32 sums in registers over the keys in key
                                         order, rounded to bf16 once

   Every sum over keys runs in key order, and a masked key adds an exact 0 to it, so a row's output depends only
   on its query and the keys it sees, in their order: not on the other rows of the call, nor on where masked keys
   sit between them. With the row-invariant linear (linear.c), a lookahead step's rows are then bit for bit
   the plain loop's, and bf16 lookahead gives the bf16 plain loop's tokens.

   On SmolLM2's shapes (9 query heads on 3 K/V heads, D = 64, Zen 5, 2 threads) a call over 300 keys took
   12 / 15 / 19 / 32 us for 1 / 4 / 8 / 16 rows by rows alone, 2.2-4x less than CPU SDPA's flash kernel (on the
   Xeon m167, by keys where that is as few tasks: 23 -> 14 us at one row, 27 -> 26 at four, 64 at sixteen either
   way); a causal prefill of 64 / 179 / 1024 rows 22 / 111 / 2572 us, SDPA's 87 / 573 / 10025. SDPA's bf16 path also rounds p to bf16
   before step 3, which this does not. */

#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#define FEW 12 /* a task's rows at most: their scores' sums and a block of keys' pairs fill the 32 registers */

static inline __m512 widen(__m256i h) {  /* 16 bf16 -> 16 fp32 */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* e^x for x <= 0: x = n ln2 + r (ln2 in two parts), e^r by its Taylor series to r^7 (|r| <= ln2 / 2: relative
   error ~2e-7), times 2^n; exactly 0 below -87, where e^x leaves fp32's normal range (and for -inf) */
static inline __m512 exp_ps(__m512 x) {
    const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GE_OQ);
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_maskz_mov_ps(live, _mm512_scalef_ps(p, n));
}

/* 16 x 16 floats transposed in registers: lane i of a[j] -> lane j of a[i] */
static inline void transpose16(__m512 a[16]) {
    __m512 t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(a[i], a[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(a[i], a[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        a[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
        a[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
        a[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
        a[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_f32x4(a[i], a[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_f32x4(a[i], a[i + 4], 0xDD);
        t[i + 8] = _mm512_shuffle_f32x4(a[i + 8], a[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_f32x4(a[i + 8], a[i + 12], 0xDD);
    }
    for (int i = 0; i < 4; i++) {
        a[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
        a[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xDD);
        a[i + 4] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0x88);
        a[i + 12] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0xDD);
    }
}

/* step 3 for rows i0 .. i0 + 3 and columns d0 .. d0 + 16 DV of one task: p key-major (p[j * 16 + i]) */
#define PV(DV)                                                                                                     \
    static inline void pv##DV(const float *p, const uint16_t *vb, long vs, int S, int i0, int d0, __m512 acc[4 * DV]) { \
        _Pragma("GCC unroll 16") for (int a = 0; a < 4 * DV; a++) acc[a] = _mm512_setzero_ps();                     \
        for (int j = 0; j < S; j++) {                                                                             \
            const uint16_t *val = vb + (size_t)j * vs + d0;                                                       \
            __m512 vv[DV];                                                                                        \
            _Pragma("GCC unroll 4") for (int d = 0; d < DV; d++) vv[d] = widen(_mm256_loadu_si256((const __m256i *)(val + 16 * d))); \
            _Pragma("GCC unroll 4") for (int i = 0; i < 4; i++) {                                                 \
                __m512 pj = _mm512_set1_ps(p[(size_t)j * 16 + i0 + i]);                                           \
                _Pragma("GCC unroll 4") for (int d = 0; d < DV; d++) acc[i * DV + d] = _mm512_fmadd_ps(pj, vv[d], acc[i * DV + d]); \
            }                                                                                                     \
        }                                                                                                         \
    }
PV(4)
PV(2)

/* passes 1 and 2 for a task's N rows (N <= FEW, known where this is inlined, so the rows' sums stay in registers),
   keys as lanes: 16 keys' first 16 pairs transposed to a vector a pair, each row's pair broadcast against them, then
   the next 16 pairs. Each (row, key) is the chain of vdpbf16ps over the pairs in order that lanes-as-rows makes (the
   same operands: a product of two bf16 is exact either way round), so these are its bits; a row's max is exact in any
   order. s: the rows' scores, row-major (N x Sp); the rows' exps then go back to key-major p (p[j * 16 + i]) for
   pass 3, and sum[i] adds them over keys in key order. */
static inline __attribute__((always_inline)) void by_keys_of(const int N, const int32_t *const qrow[16], const int32_t *kb,
                                                          long ks, const uint16_t *const mrow[16], const int32_t last[16],
                                                          int S, int Sp, int pairs, float scale, float *s, float *p, float sum[16]) {
    const __m512 never = _mm512_set1_ps(-__builtin_inff());
    const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 top[FEW];
    _Pragma("GCC unroll 12") for (int i = 0; i < N; i++) top[i] = never;
    for (int j0 = 0; j0 < Sp; j0 += 16) { /* 1. */
        const __mmask16 in = j0 + 16 <= S ? 0xFFFF : (__mmask16)((1u << (S - j0)) - 1); /* keys j0 + j < S */
        const int32_t *key[16];
        for (int j = 0; j < 16; j++) key[j] = kb + (size_t)(j0 + j < S ? j0 + j : S - 1) * ks;
        __m512 acc[FEW];
        _Pragma("GCC unroll 12") for (int i = 0; i < N; i++) acc[i] = _mm512_setzero_ps();
        for (int c0 = 0; c0 < pairs; c0 += 16) {
            __m512 a[16];
            _Pragma("GCC unroll 16") for (int j = 0; j < 16; j++) a[j] = _mm512_castsi512_ps(_mm512_loadu_si512(key[j] + c0));
            transpose16(a); /* a[c]: pair c0 + c of the 16 keys */
            _Pragma("GCC unroll 16") for (int c = 0; c < 16; c++)
                _Pragma("GCC unroll 12") for (int i = 0; i < N; i++)
                    acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_castps_si512(a[c]), (__m512bh)_mm512_set1_epi32(qrow[i][c0 + c]));
        }
        _Pragma("GCC unroll 12") for (int i = 0; i < N; i++) {
            __m512 m; /* the row's mask on these keys (causal: 0 to its last key), and -inf past S */
            if (mrow[i]) m = _mm512_mask_blend_ps(in, never, widen(_mm256_maskz_loadu_epi16(in, mrow[i] + j0)));
            else m = _mm512_mask_blend_ps(in & _mm512_cmp_epi32_mask(_mm512_add_epi32(_mm512_set1_epi32(j0), iota), _mm512_set1_epi32(last[i]), _MM_CMPINT_LE),
                                          never, _mm512_setzero_ps());
            const __m512 si = _mm512_fmadd_ps(acc[i], _mm512_set1_ps(scale), m);
            _mm512_store_ps(s + (size_t)i * Sp + j0, si);
            top[i] = _mm512_max_ps(top[i], si);
        }
    }
    __m512 t[FEW];
    _Pragma("GCC unroll 12") for (int i = 0; i < N; i++) t[i] = _mm512_set1_ps(_mm512_reduce_max_ps(top[i]));
    __m512 sums = _mm512_setzero_ps(); /* 2. */
    for (int j0 = 0; j0 < Sp; j0 += 16) {
        __m512 e[16];
        _Pragma("GCC unroll 16") for (int i = 0; i < 16; i++)
            e[i] = i < N ? exp_ps(_mm512_sub_ps(_mm512_load_ps(s + (size_t)i * Sp + j0), t[i])) : _mm512_setzero_ps();
        transpose16(e); /* e[j]: key j0 + j's, a row a lane */
        for (int j = 0; j < 16; j++) {
            _mm512_store_ps(p + (size_t)(j0 + j) * 16, e[j]);
            if (j0 + j < S) sums = _mm512_add_ps(sums, e[j]);
        }
    }
    _mm512_store_ps(sum, sums);
}

/* passes 1 and 2 for a task's rows (up to 16, zero queries in the lanes past them), lanes the rows: each of 16 keys'
   pairs broadcast against the rows' pairs (qt, pair-major), the rows' masks transposed to key-major */
static void by_rows(const int32_t *qt, const int32_t *kb32, long ks, const uint16_t *const mrow[16], const int32_t last[16],
                    int mask, int S, int Sp, int pairs, float scale, float *p, float sum[16]) {
    /* 1. s_j = scale q.k_j + mask_j, lanes the rows: each of 16 keys' pairs broadcast against the rows' */
    __m512 top = _mm512_set1_ps(-__builtin_inff());
    for (int j0 = 0; j0 < Sp; j0 += 16) {
        float *pb = p + (size_t)j0 * 16;
        const __mmask16 in = j0 + 16 <= S ? 0xFFFF : (__mmask16)((1u << (S - j0)) - 1);  /* keys j0 + j < S */
        if (mask) {  /* the rows' masks, transposed to key-major */
            __m512 m[16];
            for (int i = 0; i < 16; i++) m[i] = mrow[i] ? widen(_mm256_maskz_loadu_epi16(in, mrow[i] + j0)) : _mm512_setzero_ps();
            transpose16(m);
            for (int j = 0; j < 16; j++) _mm512_store_ps(pb + 16 * j, in >> j & 1 ? m[j] : _mm512_set1_ps(-__builtin_inff()));
        } else {
            const __m512i lim = _mm512_load_si512(last);
            for (int j = 0; j < 16; j++) {
                __mmask16 sees = in >> j & 1 ? _mm512_cmp_epi32_mask(_mm512_set1_epi32(j0 + j), lim, _MM_CMPINT_LE) : 0;
                _mm512_store_ps(pb + 16 * j, _mm512_mask_blend_ps(sees, _mm512_set1_ps(-__builtin_inff()), _mm512_setzero_ps()));
            }
        }
        const int32_t *key = kb32 + (size_t)j0 * ks;
        long off[16];
        for (int j = 0; j < 16; j++) off[j] = (j0 + j < S ? j : S - 1 - j0) * ks;
        __m512 acc[16];
        _Pragma("GCC unroll 16") for (int j = 0; j < 16; j++) acc[j] = _mm512_setzero_ps();
        for (int c = 0; c < pairs; c++) {
            __m512bh w = (__m512bh)_mm512_load_si512(qt + c * 16);
            _Pragma("GCC unroll 16") for (int j = 0; j < 16; j++)
                acc[j] = _mm512_dpbf16_ps(acc[j], (__m512bh)_mm512_set1_epi32(key[off[j] + c]), w);
        }
        _Pragma("GCC unroll 16") for (int j = 0; j < 16; j++) {
            __m512 s = _mm512_fmadd_ps(acc[j], _mm512_set1_ps(scale), _mm512_load_ps(pb + 16 * j));
            _mm512_store_ps(pb + 16 * j, s);
            top = _mm512_max_ps(top, s);
        }
    }
    /* 2. p_j = exp(s_j - max), and their sum in key order */
    __m512 sums = _mm512_setzero_ps();
    for (int j = 0; j < Sp; j++) {
        __m512 e = exp_ps(_mm512_sub_ps(_mm512_load_ps(p + (size_t)j * 16), top));
        _mm512_store_ps(p + (size_t)j * 16, e);
        if (j < S) sums = _mm512_add_ps(sums, e);
    }
    _mm512_store_ps(sum, sums);
}

/* one task: rows [r0, r1) (at most 16: a vector's lanes; at most FEW by_keys) of K/V head g of sequence b; 1 if out
   of memory */
static int task(const uint16_t *q, const long *qs, const uint16_t *k, const uint16_t *v, const long *kvs,
                 const uint16_t *mask, const long *ms, uint16_t *out, int H, int G, int T, int S, int D, float scale,
                 int b, int g, int r0, int r1, int by_keys) {
    const int groups = H / G, pairs = D / 2, R = r1 - r0;
    const int32_t *qrow[16]; /* the rows' q, as pairs */
    int32_t last[16] __attribute__((aligned(64)));  /* causal: the last key row i sees */
    const uint16_t *kb = k + b * kvs[0] + g * kvs[1], *vb = v + b * kvs[0] + g * kvs[1];
    const uint16_t *mrow[16];
    int seen = 0;  /* causal: keys past every row's last are skipped (each would add an exact 0) */
    for (int i = 0; i < 16; i++) {  /* lanes past R: a zero query that sees every key it is given, never stored */
        const int r = r0 + i, t = r % T;
        qrow[i] = i < R ? (const int32_t *)(q + b * qs[0] + (g * groups + r / T) * qs[1] + t * qs[2]) : 0;
        mrow[i] = mask && i < R ? mask + b * ms[0] + t * ms[1] : 0;
        last[i] = i < R ? S - T + t : S - 1;
        if (i < R && last[i] + 1 > seen) seen = last[i] + 1;
    }
    if (!mask) S = seen;  /* from here on, the keys this task reads */
    const int Sp = (S + 15) / 16 * 16;
    /* p[j * 16 + i]: mask, then score, then numerator, key-major (lanes past R: never stored); by_keys, after it the
       rows' scores row-major; by rows, the rows' q pair-major (qt[pair * 16 + i]) */
    const size_t more = by_keys ? (size_t)Sp * R : (size_t)pairs * 16;
    float *p = aligned_alloc(64, ((size_t)Sp * 16 + more) * sizeof(float)), *s = p + (size_t)Sp * 16;
    if (!p) return 1;
    float sum[16] __attribute__((aligned(64)));
    const int32_t *kb32 = (const int32_t *)kb;
    const long ks = kvs[2] / 2;  /* a key's stride in pairs */
    if (by_keys) {
        switch (R) {  /* passes 1 and 2, made for each row count */
#define ROWS(N) case N: by_keys_of(N, qrow, kb32, ks, mrow, last, S, Sp, pairs, scale, s, p, sum); break;
            ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6) ROWS(7) ROWS(8) ROWS(9) ROWS(10) ROWS(11) ROWS(12)
#undef ROWS
        }
    } else {
        int32_t *qt = (int32_t *)s;
        for (int i = 0; i < 16; i++)
            for (int c = 0; c < pairs; c++) qt[c * 16 + i] = i < R ? qrow[i][c] : 0;
        by_rows(qt, kb32, ks, mrow, last, mask != 0, S, Sp, pairs, scale, p, sum);
    }
    /* 3. out = sum_j p_j v_j / sum_j p_j, in key order: 4 rows x 64 (or 32) columns at a time */
    for (int i0 = 0; i0 < R; i0 += 4) {
        for (int d0 = 0; d0 < D; d0 += 64) {
            const int dv = D - d0 >= 64 ? 4 : 2;
            __m512 acc[16];
            if (dv == 4) pv4(p, vb, kvs[2], S, i0, d0, acc); else pv2(p, vb, kvs[2], S, i0, d0, acc);
            for (int i = 0; i < 4 && i0 + i < R; i++) {
                int r = r0 + i0 + i;
                uint16_t *o = out + (((size_t)b * T + r % T) * H + g * groups + r / T) * D + d0;
                __m512 inv = _mm512_set1_ps(sum[i0 + i] > 0 ? 1.0f / sum[i0 + i] : 0.0f);  /* a row that sees no key: 0 */
                for (int d = 0; d < dv; d++)
                    _mm256_storeu_si256((__m256i *)(o + 16 * d), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[i * dv + d], inv)));
            }
        }
    }
    free(p);
    return 0;
}

/* q (B, H, T, D) strided (qs: batch, head, row; d contiguous); k, v (B, G, S, D) (kvs: batch, head, key); mask
   (B, 1, T, S) additive bf16 (ms: batch, row) or NULL (causal); out (B, T, H, D) contiguous. D a multiple of 32,
   at most 256. Returns 0, or 1 where a task's buffer (64 bytes a key) could not be allocated. */
int tree_attention(const uint16_t *q, const long *qs, const uint16_t *k, const uint16_t *v, const long *kvs,
                   const uint16_t *mask, const long *ms, uint16_t *out, int B, int H, int G, int T, int S, int D,
                   float scale, int threads) {
    /* a K/V head's R rows in tasks of at most 16 by rows, or of at most FEW by keys (the same bits): whichever costs
       less, a task's cost in rows of dot products (by rows, 16 lanes whatever its rows; by keys, its rows + 2 for the
       transposes) times the rounds its tasks take on the threads. Measured (Xeon m167, 2 threads, 300 keys): SmolLM2's
       one row (3 a head) by keys 14 us, by rows 23; 5 rows (15: 6 tasks by keys, 3 by rows) 27 against 30; 9 rows
       (27: 9 tasks against 6) 48 against 41 */
    const int R = H / G * T, wide = (R + 15) / 16, few = (R + FEW - 1) / FEW, workers = threads > 0 ? threads : 1;
    const int rows_cost = (B * G * wide + workers - 1) / workers * 16, keys_cost = (B * G * few + workers - 1) / workers * ((R + few - 1) / few + 2);
    const int by_keys = keys_cost <= rows_cost, chunks = by_keys ? few : wide;
    const int per = (R + chunks - 1) / chunks, tasks = B * G * chunks;
    int failed = 0;
    #pragma omp parallel for schedule(static) num_threads(threads) reduction(|: failed)
    for (int n = 0; n < tasks; n++) {
        int c = n % chunks, g = n / chunks % G, b = n / chunks / G;
        int r0 = c * per, r1 = r0 + per < R ? r0 + per : R;
        if (r0 < r1) failed |= task(q, qs, k, v, kvs, mask, ms, out, H, G, T, S, D, scale, b, g, r0, r1, by_keys);
    }
    return failed;
}
