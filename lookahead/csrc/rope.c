/* Rotary position embedding on a step's queries and keys in place, as transformers' apply_rotary_pos_emb
   computes it (Llama, Qwen2: rotate_half), each product and the sum rounded to the dtype as torch's ops round
   them, with no fused multiply-add (``mul``), so the result is the stock one bit for bit:

       y_i = x_i c_i + (-x_{i + D/2}) s_i      i <  D/2
       y_i = x_i c_i + x_{i - D/2} s_i         i >= D/2

   x: the first `heads` heads of each row of a (rows, width) product (q's heads, then k's), D = head_dim;
   c, s (rows, D): that row's cos and sin. Each row alone: the result does not depend on the other rows. */

#include <immintrin.h>
#include <stdint.h>

static inline __m512 load(const void *p, int bf16, long i, __mmask16 m) {
    if (bf16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, (const uint16_t *)p + i)), 16));
    return _mm512_maskz_loadu_ps(m, (const float *)p + i);
}

#ifdef __AVX512BF16__
static inline __m512 rounded(__m512 v, int bf16) {
    if (!bf16)
        return v;
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}
static inline void store(void *p, int bf16, long i, __mmask16 m, __m512 v) {
    if (bf16)
        _mm256_mask_storeu_epi16((uint16_t *)p + i, m, (__m256i)_mm512_cvtneps_pbh(v));
    else
        _mm512_mask_storeu_ps((float *)p + i, m, v);
}
#else /* the AVX-512F build (native.TIERS) is for fp32: native.rope never gives it bf16 */
static inline __m512 rounded(__m512 v, int bf16) { if (bf16) __builtin_trap(); return v; }
static inline void store(void *p, int bf16, long i, __mmask16 m, __m512 v) { if (bf16) __builtin_trap(); _mm512_mask_storeu_ps((float *)p + i, m, v); }
#endif

static inline __m512 mul(__m512 a, __m512 b) {  /* a product gcc cannot fuse with the sum after it (fp32) */
    return _mm512_mul_round_ps(a, b, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

static inline __m512 negated(__m512 v) {  /* as torch's neg: the sign bit flipped, zeros included */
    return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(v), _mm512_set1_epi32((int)0x80000000)));
}

void rope(void *x, const void *c, const void *s, int bf16, int rows, int width, int heads, int d) {
    const int half = d / 2;
    for (int r = 0; r < rows; r++)
        for (int h = 0; h < heads; h++) {
            const long at = (long)r * width + (long)h * d, cs = (long)r * d;
            for (int i = 0; i < half; i += 16) {
                const __mmask16 m = half - i >= 16 ? 0xFFFF : (__mmask16)((1u << (half - i)) - 1);
                const __m512 a = load(x, bf16, at + i, m), b = load(x, bf16, at + half + i, m);
                const __m512 c1 = load(c, bf16, cs + i, m), c2 = load(c, bf16, cs + half + i, m);
                const __m512 s1 = load(s, bf16, cs + i, m), s2 = load(s, bf16, cs + half + i, m);
                const __m512 low = _mm512_add_ps(rounded(mul(a, c1), bf16), rounded(mul(negated(b), s1), bf16));
                const __m512 high = _mm512_add_ps(rounded(mul(b, c2), bf16), rounded(mul(a, s2), bf16));
                store(x, bf16, at + i, m, low);
                store(x, bf16, at + half + i, m, high);
            }
        }
}
