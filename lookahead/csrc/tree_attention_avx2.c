/* tree_attention.c's attention in fp32, on AVX2 + FMA (every tier builds it): a step's few query rows (or a prompt's
   many) of every head that shares a K/V head, under the step's additive fp32 mask, 8 rows a task (a vector's lanes).
   The same three passes, p key-major (p[j * 8 + i]: key j, row i):

       1. s_j = scale q.k_j + mask_j     8 keys at a time, each (row, key) one FMA a d, over d in order: lanes the
                                         rows (a key's d broadcast against the rows' d; the rows' masks transposed
                                         to key-major; no mask: causal), or for a task of at most FEW rows lanes the
                                         keys (8 keys' d transposed, a row's d broadcast against them: the same
                                         FMAs, so the same bits; where it costs less: SmolLM2's one row over 300
                                         keys 19 -> 16.5 us on the Xeon m167)
       2. p_j = exp(s_j - max_j s_j)     summed over keys in key order; a masked key gets exactly 0
       3. out = sum_j p_j v_j / sum_j p_j    4 rows x 16 columns of sums over the keys in key order

   So a row's output depends only on its query and the keys it sees, in their order: not on the other rows of the
   call, nor on masked keys between them. SDPA's is not so (its blocks depend on the rows and keys of the call), and
   where every linear rounds its input to 8 bits (--dtype int8 on the tiers without bf16, whose activations are
   fp32) a last-bit difference there can move a rounding and change the next token: with this attention and the
   row-invariant linears, a lookahead step's rows are the plain loop's bit for bit. */

#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#define TARGET __attribute__((target("avx2,fma")))
#define FEW 6 /* a task's rows at most by keys: their scores' sums and 8 keys' d fill the 16 registers */

/* e^x for x <= 0 as tree_attention.c's exp_ps (the same polynomial), 2^n made in the exponent bits; exactly 0 below
   -87 (and for -inf, NaN) */
TARGET static inline __m256 exp8(__m256 x) {
    const __m256 live = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_GE_OQ);
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), r);
    __m256 p = _mm256_set1_ps(1.0f / 5040);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256 two_n = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
    return _mm256_and_ps(_mm256_mul_ps(p, two_n), live); /* n in -126 .. 0: 2^n a normal float, the product exact */
}

/* 8 x 8 floats transposed in registers: lane i of a[j] -> lane j of a[i] */
TARGET static inline void transpose8(__m256 a[8]) {
    __m256 t[8], u[8];
    for (int i = 0; i < 8; i += 2) t[i] = _mm256_unpacklo_ps(a[i], a[i + 1]), t[i + 1] = _mm256_unpackhi_ps(a[i], a[i + 1]);
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44), u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
        u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44), u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int i = 0; i < 4; i++) a[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20), a[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
}

/* passes 1 and 2 for a task's rows (up to 8, zero queries in the lanes past them), lanes the rows: each of 8 keys' d
   broadcast against the rows' d (qt, d-major), the rows' masks transposed to key-major */
static TARGET void by_rows(const float *qt, const float *kb, long kstride, const float *const mrow[8], const int32_t last[8],
                           const float *mask, int S, int Sp, int D, float scale, float *p, float sum[8]) {
    const __m256 never = _mm256_set1_ps(-__builtin_inff());
    __m256 top = never;
    for (int j0 = 0; j0 < Sp; j0 += 8) { /* 1. */
        float *pb = p + (size_t)j0 * 8;
        const int in = S - j0 < 8 ? S - j0 : 8; /* keys j0 + j < S */
        if (mask) {
            __m256 m[8];
            for (int i = 0; i < 8; i++) {
                if (mrow[i] && in == 8) m[i] = _mm256_loadu_ps(mrow[i] + j0);
                else {
                    float row[8] = {0};
                    for (int j = 0; mrow[i] && j < in; j++) row[j] = mrow[i][j0 + j];
                    m[i] = _mm256_loadu_ps(row);
                }
            }
            transpose8(m);
            for (int j = 0; j < 8; j++) _mm256_store_ps(pb + 8 * j, j < in ? m[j] : never);
        } else {
            const __m256i lim = _mm256_load_si256((const __m256i *)last);
            for (int j = 0; j < 8; j++) {
                const __m256 past = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(j0 + j), lim));
                _mm256_store_ps(pb + 8 * j, j < in ? _mm256_and_ps(past, never) : never);
            }
        }
        const float *key[8];
        for (int j = 0; j < 8; j++) key[j] = kb + (size_t)(j < in ? j0 + j : S - 1) * kstride;
        __m256 acc[8];
        _Pragma("GCC unroll 8") for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();
        for (int d = 0; d < D; d++) {
            const __m256 w = _mm256_load_ps(qt + d * 8);
            _Pragma("GCC unroll 8") for (int j = 0; j < 8; j++) acc[j] = _mm256_fmadd_ps(_mm256_broadcast_ss(key[j] + d), w, acc[j]);
        }
        _Pragma("GCC unroll 8") for (int j = 0; j < 8; j++) {
            const __m256 s = _mm256_fmadd_ps(acc[j], _mm256_set1_ps(scale), _mm256_load_ps(pb + 8 * j));
            _mm256_store_ps(pb + 8 * j, s);
            top = _mm256_max_ps(top, s);
        }
    }
    __m256 sums = _mm256_setzero_ps(); /* 2. */
    for (int j = 0; j < Sp; j++) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_load_ps(p + (size_t)j * 8), top));
        _mm256_store_ps(p + (size_t)j * 8, e);
        if (j < S) sums = _mm256_add_ps(sums, e);
    }
    _mm256_store_ps(sum, sums);
}

/* passes 1 and 2 for a task's N rows (N <= FEW, known where this is inlined, so the rows' sums stay in registers),
   keys as lanes: 8 keys' next 8 d transposed to a vector a d, each row's d broadcast against them. Each (row, key) is
   the chain of FMAs over d in order that lanes-as-rows makes (the same product, exact inside the FMA, the same sum),
   so these are its bits; a row's max is exact in any order. s: the rows' scores, row-major (N x Sp); the rows' exps
   then go back to key-major p (p[j * 8 + i]) for pass 3, and sum[i] adds them over keys in key order. */
static TARGET inline __attribute__((always_inline)) void by_keys_of(const int N, const float *const qrow[8], const float *kb,
                                                                    long kstride, const float *const mrow[8],
                                                                    const int32_t last[8], int S, int Sp, int D, float scale,
                                                                    float *s, float *p, float sum[8]) {
    const __m256 never = _mm256_set1_ps(-__builtin_inff());
    const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256 top[FEW];
    _Pragma("GCC unroll 8") for (int i = 0; i < N; i++) top[i] = never;
    for (int j0 = 0; j0 < Sp; j0 += 8) { /* 1. */
        const int in = S - j0 < 8 ? S - j0 : 8; /* keys j0 + j < S */
        const float *key[8];
        for (int j = 0; j < 8; j++) key[j] = kb + (size_t)(j < in ? j0 + j : S - 1) * kstride;
        __m256 acc[FEW];
        _Pragma("GCC unroll 8") for (int i = 0; i < N; i++) acc[i] = _mm256_setzero_ps();
        for (int d0 = 0; d0 < D; d0 += 8) {
            __m256 a[8];
            _Pragma("GCC unroll 8") for (int j = 0; j < 8; j++) a[j] = _mm256_loadu_ps(key[j] + d0);
            transpose8(a); /* a[d]: d0 + d of the 8 keys */
            _Pragma("GCC unroll 8") for (int d = 0; d < 8; d++)
                _Pragma("GCC unroll 8") for (int i = 0; i < N; i++) acc[i] = _mm256_fmadd_ps(a[d], _mm256_broadcast_ss(qrow[i] + d0 + d), acc[i]);
        }
        const __m256i live = _mm256_cmpgt_epi32(_mm256_set1_epi32(in), iota); /* lanes j < in */
        _Pragma("GCC unroll 8") for (int i = 0; i < N; i++) {
            __m256 m; /* the row's mask on these keys (causal: 0 to its last key), and -inf past S */
            if (mrow[i]) {
                float row[8];
                for (int j = 0; j < 8; j++) row[j] = j < in ? mrow[i][j0 + j] : 0.0f;
                m = _mm256_blendv_ps(never, _mm256_loadu_ps(row), _mm256_castsi256_ps(live));
            } else {
                const __m256i sees = _mm256_andnot_si256(_mm256_cmpgt_epi32(_mm256_add_epi32(_mm256_set1_epi32(j0), iota), _mm256_set1_epi32(last[i])), live);
                m = _mm256_blendv_ps(never, _mm256_setzero_ps(), _mm256_castsi256_ps(sees));
            }
            const __m256 si = _mm256_fmadd_ps(acc[i], _mm256_set1_ps(scale), m);
            _mm256_store_ps(s + (size_t)i * Sp + j0, si);
            top[i] = _mm256_max_ps(top[i], si);
        }
    }
    __m256 t[FEW];
    _Pragma("GCC unroll 8") for (int i = 0; i < N; i++) { /* each row's max, exact in any order */
        __m256 x = _mm256_max_ps(top[i], _mm256_permute2f128_ps(top[i], top[i], 1));
        x = _mm256_max_ps(x, _mm256_shuffle_ps(x, x, 0x4E));
        t[i] = _mm256_max_ps(x, _mm256_shuffle_ps(x, x, 0xB1));
    }
    __m256 sums = _mm256_setzero_ps(); /* 2. */
    for (int j0 = 0; j0 < Sp; j0 += 8) {
        __m256 e[8];
        _Pragma("GCC unroll 8") for (int i = 0; i < 8; i++)
            e[i] = i < N ? exp8(_mm256_sub_ps(_mm256_load_ps(s + (size_t)i * Sp + j0), t[i])) : _mm256_setzero_ps();
        transpose8(e); /* e[j]: key j0 + j's, a row a lane */
        for (int j = 0; j < 8; j++) {
            _mm256_store_ps(p + (size_t)(j0 + j) * 8, e[j]);
            if (j0 + j < S) sums = _mm256_add_ps(sums, e[j]);
        }
    }
    _mm256_store_ps(sum, sums);
}

/* one task: rows [r0, r1) (at most 8: a vector's lanes; at most FEW by_keys) of K/V head g of sequence b; 1 if out
   of memory */
TARGET static int task(const float *q, const long *qs, const float *k, const float *v, const long *kvs, const float *mask,
                       const long *ms, float *out, int H, int G, int T, int S, int D, float scale, int b, int g, int r0, int r1,
                       int by_keys) {
    const int groups = H / G, R = r1 - r0;
    const float *qrow[8];
    int32_t last[8] __attribute__((aligned(32))); /* causal: the last key row i sees */
    const float *kb = k + b * kvs[0] + g * kvs[1], *vb = v + b * kvs[0] + g * kvs[1];
    const float *mrow[8];
    int seen = 0; /* causal: keys past every row's last are skipped (each would add an exact 0) */
    for (int i = 0; i < 8; i++) { /* lanes past R: a zero query that sees every key it is given, never stored */
        const int r = r0 + i, t = r % T;
        qrow[i] = i < R ? q + b * qs[0] + (g * groups + r / T) * qs[1] + t * qs[2] : 0;
        mrow[i] = mask && i < R ? mask + b * ms[0] + t * ms[1] : 0;
        last[i] = i < R ? S - T + t : S - 1;
        if (i < R && last[i] + 1 > seen) seen = last[i] + 1;
    }
    if (!mask) S = seen;
    const int Sp = (S + 7) / 8 * 8;
    /* p[j * 8 + i]: mask, then score, then numerator, key-major; by keys, after it the rows' scores row-major; by
       rows, the rows' q d-major (qt[d * 8 + i]) */
    const size_t more = by_keys ? (size_t)Sp * R : (size_t)D * 8;
    float *p = aligned_alloc(32, ((size_t)Sp * 8 + more) * sizeof(float)), *s = p + (size_t)Sp * 8;
    if (!p) return 1;
    float sum[8] __attribute__((aligned(32)));
    if (by_keys) {
        switch (R) { /* passes 1 and 2, made for each row count */
#define ROWS(N) case N: by_keys_of(N, qrow, kb, kvs[2], mrow, last, S, Sp, D, scale, s, p, sum); break;
            ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6)
#undef ROWS
        }
    } else {
        for (int i = 0; i < 8; i++)
            for (int d = 0; d < D; d++) s[d * 8 + i] = i < R ? qrow[i][d] : 0.0f;
        by_rows(s, kb, kvs[2], mrow, last, mask, S, Sp, D, scale, p, sum);
    }
    for (int i0 = 0; i0 < R; i0 += 4) /* 3. */
        for (int d0 = 0; d0 < D; d0 += 16) {
            __m256 acc[8];
            _Pragma("GCC unroll 8") for (int a = 0; a < 8; a++) acc[a] = _mm256_setzero_ps();
            for (int j = 0; j < S; j++) {
                const float *val = vb + (size_t)j * kvs[2] + d0;
                const __m256 v0 = _mm256_loadu_ps(val), v1 = _mm256_loadu_ps(val + 8);
                _Pragma("GCC unroll 4") for (int i = 0; i < 4; i++) {
                    const __m256 pj = _mm256_broadcast_ss(p + (size_t)j * 8 + i0 + i);
                    acc[2 * i] = _mm256_fmadd_ps(pj, v0, acc[2 * i]), acc[2 * i + 1] = _mm256_fmadd_ps(pj, v1, acc[2 * i + 1]);
                }
            }
            for (int i = 0; i < 4 && i0 + i < R; i++) {
                const int r = r0 + i0 + i;
                float *o = out + (((size_t)b * T + r % T) * H + g * groups + r / T) * D + d0;
                const __m256 inv = _mm256_set1_ps(sum[i0 + i] > 0 ? 1.0f / sum[i0 + i] : 0.0f); /* a row that sees no key: 0 */
                _mm256_storeu_ps(o, _mm256_mul_ps(acc[2 * i], inv)), _mm256_storeu_ps(o + 8, _mm256_mul_ps(acc[2 * i + 1], inv));
            }
        }
    free(p);
    return 0;
}

/* tree_attention.c's tree_attention in fp32: q (B, H, T, D) strided; k, v (B, G, S, D); mask (B, 1, T, S) additive
   fp32 or NULL (causal); out (B, T, H, D) contiguous. D a multiple of 16, at most 256. 0, or 1 out of memory. */
int tree_attention_fp32(const float *q, const long *qs, const float *k, const float *v, const long *kvs, const float *mask,
                        const long *ms, float *out, int B, int H, int G, int T, int S, int D, float scale, int threads) {
    /* a K/V head's R rows in tasks of at most 8 by rows, or of at most FEW by keys (the same bits): whichever costs
       less, a task's cost in rows of FMAs (by rows, 8 lanes whatever its rows; by keys, its rows + 3 for the
       transposes) times the rounds its tasks take on the threads (tree_attention.c's rule) */
    const int R = H / G * T, wide = (R + 7) / 8, few = (R + FEW - 1) / FEW, workers = threads > 0 ? threads : 1;
    const int rows_cost = (B * G * wide + workers - 1) / workers * 8, keys_cost = (B * G * few + workers - 1) / workers * ((R + few - 1) / few + 3);
    const int by_keys = keys_cost <= rows_cost, chunks = by_keys ? few : wide;
    const int per = (R + chunks - 1) / chunks, tasks = B * G * chunks;
    int failed = 0;
    _Pragma("omp parallel for schedule(static) num_threads(threads) reduction(|: failed)")
    for (int n = 0; n < tasks; n++) {
        const int c = n % chunks, g = n / chunks % G, b = n / chunks / G, r0 = c * per, r1 = r0 + per < R ? r0 + per : R;
        if (r0 < r1) failed |= task(q, qs, k, v, kvs, mask, ms, out, H, G, T, S, D, scale, b, g, r0, r1, by_keys);
    }
    return failed;
}
