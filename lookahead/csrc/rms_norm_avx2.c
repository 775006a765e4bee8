/* rms_norm.c's fp32 RMSNorm (and its residual sum) for AVX2 + FMA CPUs (Haswell and later, Zen 1-3): the same
   arithmetic in the same order, so the same bits as the AVX-512 tiers. There the sum of squares runs in 16 lanes
   (an FMA a vector), then _mm512_reduce_add_ps sums the lanes: the upper 8 onto the lower, then the upper 4,
   then lanes 2 apart, then the last two. Here the 16 lanes are two 8-lane halves, reduced in that order. The
   norm's products are separate multiplies (this tier is built with -ffp-contract=off), as there. fp32 only: the
   AVX2 tier has no bf16 kernels (native.rms_norm never gives it bf16). */

#include <immintrin.h>
#include <math.h>

static inline __m256 load8(const float *p, int count) {  /* p[0 .. count), zeros past it (count <= 0: all zeros) */
    if (count >= 8)
        return _mm256_loadu_ps(p);
    return _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(count), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
}

/* one row: y = the norm of x (n,) */
static void norm_row(const float *x, const float *w, float *y, int n, float eps, int offset) {
    __m256 low = _mm256_setzero_ps(), high = _mm256_setzero_ps();  /* lanes 0-7 and 8-15 of rms_norm.c's 16 */
    for (int i = 0; i < n; i += 16) {
        const __m256 a = load8(x + i, n - i), b = load8(x + i + 8, n - i - 8);
        low = _mm256_fmadd_ps(a, a, low), high = _mm256_fmadd_ps(b, b, high);
    }
    const __m256 eight = _mm256_add_ps(high, low);
    const __m128 four = _mm_add_ps(_mm256_extractf128_ps(eight, 1), _mm256_castps256_ps128(eight));
    const __m128 two = _mm_add_ps(four, _mm_shuffle_ps(four, four, _MM_SHUFFLE(1, 0, 3, 2)));
    const float sum = _mm_cvtss_f32(two) + _mm_cvtss_f32(_mm_shuffle_ps(two, two, 1));
    const float scale = 1.0f / sqrtf(sum / (float)n + eps);
    for (int i = 0; i < n; i++) {
        const float h = x[i] * scale;
        y[i] = offset ? h * (1.0f + w[i]) : w[i] * h;
    }
}

/* rms_norm.c's rms_norm, fp32 (bf16 must be 0) */
void rms_norm(const void *x, const void *w, void *y, int bf16, int rows, int n, float eps, int offset, int threads) {
    if (bf16) __builtin_trap();
    #pragma omp parallel for schedule(static) num_threads(threads) if (rows >= 64)
    for (int r = 0; r < rows; r++)
        norm_row((const float *)x + (long)r * n, w, (float *)y + (long)r * n, n, eps, offset);
}

/* rms_norm.c's add_rms_norm, fp32 (bf16 must be 0): s = x + d, y = the norm of s */
void add_rms_norm(const void *x, const void *d, void *s, const void *w, void *y, int bf16, int rows, int n, float eps, int offset,
                  int threads) {
    if (bf16) __builtin_trap();
    #pragma omp parallel for schedule(static) num_threads(threads) if (rows >= 64)
    for (int r = 0; r < rows; r++) {
        const long row = (long)r * n;
        float *sr = (float *)s + row;
        for (int i = 0; i < n; i++) sr[i] = ((const float *)x)[row + i] + ((const float *)d)[row + i];
        norm_row(sr, w, (float *)y + row, n, eps, offset);
    }
}
