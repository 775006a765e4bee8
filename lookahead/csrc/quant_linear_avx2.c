/* quant_linear.c's fp32 quantized linear for AVX2 + FMA CPUs (Haswell and later, Zen 1-3): y (M, N) = x (M, K) W^T
   (+ b), W in the same blocks (16 output columns, groups of scales, offsets and integers), each block taken as two
   halves of 8 columns:

       step (32 values: k's 16 columns, then k + 1's)  ->  half h: k's columns 8h .. 8h+7, then k + 1's

   A tile is up to 4 rows x one half (4 sums, the half's two dequantized lines, its scale and offset, a broadcast:
   9 of the 16 registers). Each weight is dequantized as there (a product, then a sum: this file is built with
   -ffp-contract=off, so gcc keeps them two operations) and each output is one FMA chain over k in order, + bias:
   the same bits as the AVX-512 kernel, and row-invariant. The threads split the blocks, prefetching the next one
   while the tiles run (into L2 or non-temporally, native.prefetch_into_l2). */

#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>

static inline void prefetch(const char *p, int l2) { l2 ? _mm_prefetch(p, _MM_HINT_T2) : _mm_prefetch(p, _MM_HINT_NTA); }

/* half h of a step's two lines, as fp32 integers (before scaling) */
static inline void widen(const char *step, int bits, int h, __m256 *a, __m256 *b) {
    if (bits == 8) {
        *a = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(step + 8 * h))));
        *b = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(step + 16 + 8 * h))));
    } else { /* byte i: value i (low nibble) and value i + 16 (high) */
        const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(step + 8 * h)));
        *a = _mm256_cvtepi32_ps(_mm256_and_si256(bytes, _mm256_set1_epi32(15)));
        *b = _mm256_cvtepi32_ps(_mm256_srli_epi32(bytes, 4));
    }
}

#define TILE(ROWS)                                                                                                \
    static void tile##ROWS(const float *x, const char *w, float *y, const float *bias, int n, int k, int bits,    \
                           int group, int offsets, int h, const char *next, int row_tiles, int row_tile, int l2) {\
        const size_t head = offsets ? 128 : 64, step_bytes = bits == 8 ? 32 : 16;                                 \
        const size_t group_bytes = head + (size_t)group / 2 * step_bytes;                                         \
        __m256 sum[ROWS];                                                                                         \
        for (int r = 0; r < ROWS; r++) sum[r] = _mm256_setzero_ps();                                              \
        for (int g = 0; g < k / group; g++) {                                                                     \
            const char *at = w + g * group_bytes;                                                                 \
            if (next && h == 0)                                                                                   \
                for (size_t line = (size_t)row_tile * 64; line < group_bytes; line += (size_t)row_tiles * 64)     \
                    prefetch(next + g * group_bytes + line, l2);                                                  \
            const __m256 s = _mm256_loadu_ps((const float *)at + 8 * h);                                          \
            const __m256 o = offsets ? _mm256_loadu_ps((const float *)at + 16 + 8 * h) : s;                       \
            for (int step = 0; step < group / 2; step++) {                                                        \
                __m256 a, b;                                                                                      \
                widen(at + head + (size_t)step * step_bytes, bits, h, &a, &b);                                    \
                a = _mm256_mul_ps(a, s), b = _mm256_mul_ps(b, s);                                                 \
                if (offsets) a = _mm256_add_ps(a, o), b = _mm256_add_ps(b, o);                                   \
                const float *xk = x + g * group + 2 * step;                                                       \
                for (int r = 0; r < ROWS; r++) {                                                                  \
                    sum[r] = _mm256_fmadd_ps(_mm256_set1_ps(xk[(size_t)r * k]), a, sum[r]);                      \
                    sum[r] = _mm256_fmadd_ps(_mm256_set1_ps(xk[(size_t)r * k + 1]), b, sum[r]);                  \
                }                                                                                                 \
            }                                                                                                     \
        }                                                                                                         \
        for (int r = 0; r < ROWS; r++)                                                                            \
            _mm256_storeu_ps(y + (size_t)r * n + 8 * h, bias ? _mm256_add_ps(sum[r], _mm256_loadu_ps(bias + 8 * h)) : sum[r]); \
    }
TILE(1) TILE(2) TILE(3) TILE(4)
static void (*const tiles[5])(const float *, const char *, float *, const float *, int, int, int, int, int, int,
                              const char *, int, int, int) = {0, tile1, tile2, tile3, tile4};

void quant_fp32_linear(const float *x, const char *packed, const float *bias, float *y, int m, int n, int k, int bits,
                       int group, int offsets, int threads, int l2) {
    const int blocks = n / 16, row_tiles = (m + 3) / 4, per = (m + row_tiles - 1) / row_tiles;
    const size_t block = (size_t)(k / group) * ((offsets ? 128 : 64) + (size_t)group * 16 * bits / 8);
    _Pragma("omp parallel for schedule(static) num_threads(threads)")
    for (int nb = 0; nb < blocks; nb++) {
        const char *w = packed + nb * block, *next = nb + 1 < blocks ? w + block : 0;
        for (int r = 0; r < m; r += per)
            for (int h = 0; h < 2; h++)
                tiles[m - r < per ? m - r : per](x + (size_t)r * k, w, y + (size_t)r * n + 16 * nb, bias ? bias + 16 * nb : 0, n, k,
                                                 bits, group, offsets, h, next, row_tiles, r / per, l2);
    }
}
