/* RMSNorm of each row of x (rows, n), bf16 or fp32 in and out, in one call: transformers' RMSNorm modules take
   ~8 torch ops a call (to fp32, pow, mean, add, rsqrt, mul, to, mul), ~15 us, and a SmolLM2 forward makes 61
   of them. The arithmetic is theirs, in fp32:

       r   = 1 / sqrt(sum_i x_i^2 / n + eps)      in 16 lanes, an FMA each x_i, then across the lanes
       y_i = w_i * dtype(x_i r)                   offset 0: Llama, Qwen2 (in bf16 the product is rounded again)
       y_i = dtype(x_i r (1 + w_i))               offset 1: Gemma 3

   Only the order of the sum of squares differs from torch's, so r may differ from the module's in its last bit
   and a bf16 y_i, rarely, by one unit in its last place (the module swap checks this on load). Each row is
   computed alone, so the result does not depend on the other rows of the call. */

#include <immintrin.h>
#include <math.h>
#include <stdint.h>

static inline __m512 load(const void *p, int bf16, long i, __mmask16 m) {
    if (bf16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, (const uint16_t *)p + i)), 16));
    return _mm512_maskz_loadu_ps(m, (const float *)p + i);
}

#ifdef __AVX512BF16__
static inline __m256i bf16_of(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }
#else /* the AVX-512F build (native.TIERS) is for fp32: native.rms_norm never gives it bf16 */
static inline __m256i bf16_of(__m512 v) { (void)v; __builtin_trap(); }
#endif

static inline __m512 to_bf16_and_back(__m512 v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16_of(v)), 16));
}

static inline void store(void *p, int bf16, long i, __mmask16 m, __m512 v) {
    if (bf16)
        _mm256_mask_storeu_epi16((uint16_t *)p + i, m, bf16_of(v));
    else
        _mm512_mask_storeu_ps((float *)p + i, m, v);
}

/* one row: y = the norm of x (n,) */
static inline void norm_row(const void *x, const void *w, void *y, int bf16, long row, int n, float eps, int offset) {
    __m512 sums = _mm512_setzero_ps();
    for (int i = 0; i < n; i += 16) {
        const __mmask16 m = n - i >= 16 ? 0xFFFF : (__mmask16)((1u << (n - i)) - 1);
        const __m512 v = load(x, bf16, row + i, m);
        sums = _mm512_fmadd_ps(v, v, sums);
    }
    const __m512 scale = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(sums) / (float)n + eps));
    for (int i = 0; i < n; i += 16) {
        const __mmask16 m = n - i >= 16 ? 0xFFFF : (__mmask16)((1u << (n - i)) - 1);
        const __m512 h = _mm512_mul_ps(load(x, bf16, row + i, m), scale), wi = load(w, bf16, i, m);
        __m512 out;
        if (offset)
            out = _mm512_mul_ps(h, _mm512_add_ps(_mm512_set1_ps(1.0f), wi));
        else
            out = _mm512_mul_ps(wi, bf16 ? to_bf16_and_back(h) : h);
        store(y, bf16, row + i, m, out);
    }
}

/* x, y (rows, n) contiguous, w (n,), all bf16 (bf16 = 1) or all fp32; offset 0 or 1 (see above) */
void rms_norm(const void *x, const void *w, void *y, int bf16, int rows, int n, float eps, int offset, int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads) if (rows >= 64)
    for (int r = 0; r < rows; r++)
        norm_row(x, w, y, bf16, (long)r * n, n, eps, offset);
}

/* A decoder layer's residual sum and the norm after it in one call: s = x + d, rounded to the dtype as torch's
   sum is, then y = the norm of s. x, d, s, y (rows, n) contiguous. */
void add_rms_norm(const void *x, const void *d, void *s, const void *w, void *y, int bf16, int rows, int n, float eps, int offset,
                  int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads) if (rows >= 64)
    for (int r = 0; r < rows; r++) {
        const long row = (long)r * n;
        for (int i = 0; i < n; i += 16) {
            const __mmask16 m = n - i >= 16 ? 0xFFFF : (__mmask16)((1u << (n - i)) - 1);
            store(s, bf16, row + i, m, _mm512_add_ps(load(x, bf16, row + i, m), load(d, bf16, row + i, m)));
        }
        norm_row(s, w, y, bf16, row, n, eps, offset);
    }
}
