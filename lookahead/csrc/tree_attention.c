/* Attention for a decoding step's few query rows (or a prompt's many), bf16 in and out, on AVX-512 BF16, for a
   grouped-query model: each K/V head serves H/G query heads, so its query rows are all of theirs (row r = head r / T of the
   group, step row r % T), and a task takes up to 16 of them, a vector's lanes, with one K/V head of one sequence.
   Lanes are rows, p is key-major (p[j * 16 + i]: key j, row i):

       1. s_j = scale q.k_j + mask_j     16 keys at a time: a key's pair of d broadcast against the rows' pairs,
                                         one vdpbf16ps each; the rows' masks transposed to key-major (no mask:
                                         causal, row t sees keys j <= S - T + t, and a task stops at
                                         the last key one of its rows sees: half a prefill's work)
       2. p_j = exp(s_j - max_j s_j)     fp32, a vector of rows per key, summed over keys in key order; a masked
                                         key (at most -87 after the shift: the mask's dtype minimum) gets exactly 0
       3. out = sum_j p_j v_j / sum_j p_j    4 rows x 64 columns of fp32 sums in registers over the keys in key
                                         order, rounded to bf16 once

   Every sum over keys runs in key order, and a masked key adds an exact 0 to it, so a row's output depends only
   on its query and the keys it sees, in their order: not on the other rows of the call, nor on where masked keys
   sit between them. With the row-invariant linear (linear.c), a lookahead step's rows are then bit for bit
   the plain loop's, and bf16 lookahead gives the bf16 plain loop's tokens.

   On SmolLM2's shapes (9 query heads on 3 K/V heads, D = 64, Zen 5, 2 threads) a call over 300 keys takes
   12 / 15 / 19 / 32 us for 1 / 4 / 8 / 16 rows, 2.2-4x less than CPU SDPA's flash kernel; a causal prefill of
   64 / 179 / 1024 rows 22 / 111 / 2572 us, SDPA's 87 / 573 / 10025. SDPA's bf16 path also rounds p to bf16
   before step 3, which this does not. */

#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

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

/* one task: rows [r0, r1) (at most 16: a vector's lanes) of K/V head g of sequence b; 1 if out of memory */
static int task(const uint16_t *q, const long *qs, const uint16_t *k, const uint16_t *v, const long *kvs,
                 const uint16_t *mask, const long *ms, uint16_t *out, int H, int G, int T, int S, int D, float scale,
                 int b, int g, int r0, int r1) {
    const int groups = H / G, pairs = D / 2, R = r1 - r0;
    int32_t qt[128 * 16] __attribute__((aligned(64)));  /* the rows' q, pair-major: qt[pair * 16 + i] (D <= 256) */
    int32_t last[16] __attribute__((aligned(64)));  /* causal: the last key row i sees */
    const uint16_t *kb = k + b * kvs[0] + g * kvs[1], *vb = v + b * kvs[0] + g * kvs[1];
    const uint16_t *mrow[16];
    int seen = 0;  /* causal: keys past every row's last are skipped (each would add an exact 0) */
    for (int i = 0; i < 16; i++) {  /* lanes past R: a zero query that sees every key it is given, never stored */
        int r = r0 + i, t = r % T;
        const int32_t *qrow = (const int32_t *)(q + b * qs[0] + (g * groups + r / T) * qs[1] + t * qs[2]);
        for (int c = 0; c < pairs; c++) qt[c * 16 + i] = i < R ? qrow[c] : 0;
        mrow[i] = mask && i < R ? mask + b * ms[0] + t * ms[1] : 0;
        last[i] = i < R ? S - T + t : S - 1;
        if (i < R && last[i] + 1 > seen) seen = last[i] + 1;
    }
    if (!mask) S = seen;  /* from here on, the keys this task reads */
    const int Sp = (S + 15) / 16 * 16;
    float *p = aligned_alloc(64, (size_t)Sp * 16 * sizeof(float));  /* p[j * 16 + i]: mask, then score, then numerator */
    if (!p) return 1;
    /* 1. s_j = scale q.k_j + mask_j, lanes the rows: each of 16 keys' pairs broadcast against the rows' */
    const long ks = kvs[2] / 2;  /* a key's stride in pairs */
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
        const int32_t *key = (const int32_t *)kb + (size_t)j0 * ks;
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
    float sum[16] __attribute__((aligned(64)));
    _mm512_store_ps(sum, sums);
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
    const int R = H / G * T, chunks = (R + 15) / 16, per = (R + chunks - 1) / chunks, tasks = B * G * chunks;
    int failed = 0;
    #pragma omp parallel for schedule(static) num_threads(threads) reduction(|: failed)
    for (int n = 0; n < tasks; n++) {
        int c = n % chunks, g = n / chunks % G, b = n / chunks / G;
        int r0 = c * per, r1 = r0 + per < R ? r0 + per : R;
        if (r0 < r1) failed |= task(q, qs, k, v, kvs, mask, ms, out, H, G, T, S, D, scale, b, g, r0, r1);
    }
    return failed;
}
