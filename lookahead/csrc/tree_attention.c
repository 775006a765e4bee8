/* Attention for a decoding step's few query rows, bf16 in and out, on AVX-512 BF16, for a grouped-query
   model: each K/V head serves H/G query heads, so its query rows are all of theirs (row r = head r / T of the
   group, step row r % T), and a task takes up to 24 of them with one K/V head of one sequence:

       1. s_j = scale q.k_j + mask_j     16 keys at a time: the keys' pairs of d laid side by side, so one
                                         vdpbf16ps multiplies a broadcast pair of q with 16 keys at once;
                                         no mask: causal, row t sees keys j <= S - T + t
       2. p_j = exp(s_j - max_j s_j)     fp32; a masked key (at most -87 after the shift: the mask's dtype
                                         minimum) gets exactly 0
       3. out = sum_j p_j v_j / sum_j p_j    in key order, fp32, rounded to bf16 once

   Every sum over keys runs in key order, and a masked key adds an exact 0 to it, so a row's output depends only
   on its query and the keys it sees, in their order: not on the other rows of the call, nor on where masked keys
   sit between them. With the row-invariant linear (linear.c), a lookahead step's rows are then bit for bit
   the plain loop's, and bf16 lookahead gives the bf16 plain loop's tokens.

   CPU SDPA's flash kernel takes 1.5-2.3x as long on SmolLM2's shapes (9 query heads on 3 K/V heads, D = 64,
   1-32 rows over 128-1000 keys, Zen 5); its bf16 path also rounds p to bf16 before step 3, which this does not. */

#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#define ROWS 8  /* query rows a step-1 tile holds */

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

/* 16 keys' mask for row t from j0: the given mask's (bf16), or causal; -inf past the last key */
static inline __m512 mask_of(const uint16_t *row, int t, int j0, int T, int S) {
    const __m512 none = _mm512_set1_ps(-__builtin_inff());
    __mmask16 in = j0 + 16 <= S ? 0xFFFF : (__mmask16)((1u << (S - j0)) - 1);
    if (!row) {
        int seen = S - T + t + 1 - j0;  /* keys j0 .. S-T+t */
        in &= seen >= 16 ? 0xFFFF : seen <= 0 ? 0 : (__mmask16)((1u << seen) - 1);
        return _mm512_mask_blend_ps(in, none, _mm512_setzero_ps());
    }
    return _mm512_mask_blend_ps(in, none, widen(_mm256_maskz_loadu_epi16(in, row + j0)));
}

/* one task: rows [r0, r1) of K/V head g of sequence b */
static void task(const uint16_t *q, const long *qs, const uint16_t *k, const uint16_t *v, const long *kvs,
                 const uint16_t *mask, const long *ms, uint16_t *out, int H, int G, int T, int S, int D, float scale,
                 int b, int g, int r0, int r1) {
    const int groups = H / G, pairs = D / 2, Sp = (S + 15) / 16 * 16, R = r1 - r0;
    float *p = aligned_alloc(64, (size_t)R * Sp * sizeof(float));  /* scores, then numerators: R x Sp */
    int32_t kp[128 * 16] __attribute__((aligned(64)));  /* 16 keys, pair-major: kp[pair * 16 + key] (D <= 256) */
    const uint16_t *kb = k + b * kvs[0] + g * kvs[1], *vb = v + b * kvs[0] + g * kvs[1];
    const int32_t *qrow[24];
    const uint16_t *mrow[24];
    int trow[24];
    for (int i = 0; i < R; i++) {
        int r = r0 + i;
        trow[i] = r % T;
        qrow[i] = (const int32_t *)(q + b * qs[0] + (g * groups + r / T) * qs[1] + trow[i] * qs[2]);
        mrow[i] = mask ? mask + b * ms[0] + trow[i] * ms[1] : 0;
    }
    /* 1. scores */
    for (int j0 = 0; j0 < Sp; j0 += 16) {
        for (int j = 0; j < 16; j++) {
            const int32_t *key = (const int32_t *)(kb + (size_t)(j0 + j < S ? j0 + j : S - 1) * kvs[2]);
            for (int c = 0; c < pairs; c++) kp[c * 16 + j] = key[c];
        }
        for (int i0 = 0; i0 < R; i0 += ROWS) {
            int n = R - i0 < ROWS ? R - i0 : ROWS;
            __m512 acc[ROWS];
            _Pragma("GCC unroll 8") for (int i = 0; i < ROWS; i++) acc[i] = _mm512_setzero_ps();
            for (int c = 0; c < pairs; c++) {
                __m512i w = _mm512_load_si512(kp + c * 16);
                _Pragma("GCC unroll 8") for (int i = 0; i < ROWS; i++)
                    if (i < n) acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_set1_epi32(qrow[i0 + i][c]), (__m512bh)w);
            }
            for (int i = 0; i < n; i++)
                _mm512_store_ps(p + (size_t)(i0 + i) * Sp + j0,
                                _mm512_fmadd_ps(acc[i], _mm512_set1_ps(scale), mask_of(mrow[i0 + i], trow[i0 + i], j0, T, S)));
        }
    }
    /* 2. numerators in place */
    for (int i = 0; i < R; i++) {
        float *s = p + (size_t)i * Sp;
        __m512 top = _mm512_set1_ps(-__builtin_inff());
        for (int j = 0; j < Sp; j += 16) top = _mm512_max_ps(top, _mm512_load_ps(s + j));
        top = _mm512_set1_ps(_mm512_reduce_max_ps(top));
        for (int j = 0; j < Sp; j += 16) _mm512_store_ps(s + j, exp_ps(_mm512_sub_ps(_mm512_load_ps(s + j), top)));
    }
    /* 3. out, rows in tiles of 24 accumulators' worth (D / 16 each) */
    const int dv = D / 16, tile = 24 / dv > 0 ? 24 / dv : 1;
    for (int i0 = 0; i0 < R; i0 += tile) {
        int n = R - i0 < tile ? R - i0 : tile;
        __m512 acc[24];
        float sum[24] = {0};
        for (int a = 0; a < n * dv; a++) acc[a] = _mm512_setzero_ps();
        for (int j = 0; j < S; j++) {
            const uint16_t *val = vb + (size_t)j * kvs[2];
            __m512 vv[16];
            for (int d = 0; d < dv; d++) vv[d] = widen(_mm256_loadu_si256((const __m256i *)(val + 16 * d)));
            for (int i = 0; i < n; i++) {
                float pj = p[(size_t)(i0 + i) * Sp + j];
                sum[i] += pj;
                for (int d = 0; d < dv; d++) acc[i * dv + d] = _mm512_fmadd_ps(_mm512_set1_ps(pj), vv[d], acc[i * dv + d]);
            }
        }
        for (int i = 0; i < n; i++) {
            int r = r0 + i0 + i;
            uint16_t *o = out + (((size_t)b * T + r % T) * H + g * groups + r / T) * D;
            __m512 inv = _mm512_set1_ps(sum[i] > 0 ? 1.0f / sum[i] : 0.0f);  /* a row that sees no key: 0 */
            for (int d = 0; d < dv; d++)
                _mm256_storeu_si256((__m256i *)(o + 16 * d), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[i * dv + d], inv)));
        }
    }
    free(p);
}

/* q (B, H, T, D) strided (qs: batch, head, row; d contiguous); k, v (B, G, S, D) (kvs: batch, head, key); mask
   (B, 1, T, S) additive bf16 (ms: batch, row) or NULL (causal); out (B, T, H, D) contiguous. D a multiple of 32,
   at most 256. */
void tree_attention(const uint16_t *q, const long *qs, const uint16_t *k, const uint16_t *v, const long *kvs,
                    const uint16_t *mask, const long *ms, uint16_t *out, int B, int H, int G, int T, int S, int D,
                    float scale, int threads) {
    const int R = H / G * T, chunks = (R + 23) / 24, per = (R + chunks - 1) / chunks, tasks = B * G * chunks;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int n = 0; n < tasks; n++) {
        int c = n % chunks, g = n / chunks % G, b = n / chunks / G;
        int r0 = c * per, r1 = r0 + per < R ? r0 + per : R;
        if (r0 < r1) task(q, qs, k, v, kvs, mask, ms, out, H, G, T, S, D, scale, b, g, r0, r1);
    }
}
