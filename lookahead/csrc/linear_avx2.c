/* The fp32 linear of linear.c for AVX2 + FMA CPUs (Haswell and later, Zen 1-3): y (M, N) = x (M, K) W^T (+ b), W
   in the same packed blocks (16 output columns a block, one 64-byte line per k), each line two 8-lane halves:

       line k | W[16nb][k] .. W[16nb+7][k] | W[16nb+8][k] .. W[16nb+15][k] |    x broadcast x[r][k], two FMAs

   Sixteen 256-bit registers hold a tile of up to 5 rows x 16 columns (10 sums, the line's two halves and the
   broadcast); more rows take tiles of rows as even as can be. The threads split the blocks, and while the row
   tiles run they prefetch the next block, each tile every row_tiles-th line of it, into L2 or non-temporally
   (native.prefetch_into_l2), so the weight streams from memory once for all M rows.

   Each output is one FMA chain over k in order, as in linear.c's fp32 tiles, then + bias: the same bits as the
   AVX-512 linear, and row-invariant (row i of an M-row product equals the one-row product). */

#include <immintrin.h>
#include <stddef.h>

static inline void prefetch(const char *p, int l2) { l2 ? _mm_prefetch(p, _MM_HINT_T2) : _mm_prefetch(p, _MM_HINT_NTA); }

#define TILE(ROWS)                                                                                                \
    static void tile##ROWS(const float *x, const char *w, float *y, const float *bias, int n, int k,             \
                           const char *next, int row_tiles, int row_tile, int l2) {                               \
        __m256 lo[ROWS], hi[ROWS];                                                                                \
        _Pragma("GCC unroll 5") for (int r = 0; r < ROWS; r++) lo[r] = hi[r] = _mm256_setzero_ps();               \
        for (int kk = 0; kk < k; kk++) {                                                                          \
            if (next && kk % row_tiles == row_tile) prefetch(next + (size_t)kk * 64, l2);                         \
            const __m256 a = _mm256_loadu_ps((const float *)(w + (size_t)kk * 64));                               \
            const __m256 b = _mm256_loadu_ps((const float *)(w + (size_t)kk * 64 + 32));                          \
            _Pragma("GCC unroll 5") for (int r = 0; r < ROWS; r++) {                                               \
                const __m256 p = _mm256_set1_ps(x[(size_t)r * k + kk]);                                           \
                lo[r] = _mm256_fmadd_ps(p, a, lo[r]);                                                             \
                hi[r] = _mm256_fmadd_ps(p, b, hi[r]);                                                             \
            }                                                                                                     \
        }                                                                                                         \
        _Pragma("GCC unroll 5") for (int r = 0; r < ROWS; r++) {                                                   \
            _mm256_storeu_ps(y + (size_t)r * n, bias ? _mm256_add_ps(lo[r], _mm256_loadu_ps(bias)) : lo[r]);      \
            _mm256_storeu_ps(y + (size_t)r * n + 8, bias ? _mm256_add_ps(hi[r], _mm256_loadu_ps(bias + 8)) : hi[r]); \
        }                                                                                                         \
    }
TILE(1) TILE(2) TILE(3) TILE(4) TILE(5)
static void (*const tiles[6])(const float *, const char *, float *, const float *, int, int, const char *, int, int,
                              int) = {0, tile1, tile2, tile3, tile4, tile5};

void fp32_linear(const void *x, const void *packed, const float *bias, float *y, int m, int n, int k, int threads, int l2) {
    const int blocks = n / 16, row_tiles = (m + 4) / 5, per = (m + row_tiles - 1) / row_tiles; /* rows a tile, as even as can be */
    const size_t block = (size_t)k * 64; /* bytes */
    _Pragma("omp parallel for schedule(static) num_threads(threads)")
    for (int nb = 0; nb < blocks; nb++) {
        const char *w = (const char *)packed + nb * block, *next = nb + 1 < blocks ? w + block : 0;
        for (int r = 0; r < m; r += per)
            tiles[m - r < per ? m - r : per]((const float *)x + (size_t)r * k, w, y + (size_t)r * n + 16 * nb,
                                             bias ? bias + 16 * nb : 0, n, k, next, row_tiles, r / per, l2);
    }
}
