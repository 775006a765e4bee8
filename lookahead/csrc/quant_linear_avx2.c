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

/* ROWS (1, 2) rows x HALVES halves (2: a block; 4: two, `block` bytes apart) at once: tile's arithmetic, each output
   the same chain, but HALVES chains a row in flight. A tile's one or two chains wait out each FMA's latency (one
   row of SmolLM2's products: 2 weights a cycle a core). */
#define WIDE(ROWS, HALVES)                                                                                        \
    static void wide##ROWS##_##HALVES(const float *x, const char *w, size_t block, float *y, const float *bias, int n,  \
                                      int k, int bits, int group, int offsets, const char *next, int l2) {        \
        const size_t head = offsets ? 128 : 64, step_bytes = bits == 8 ? 32 : 16;                                 \
        const size_t group_bytes = head + (size_t)group / 2 * step_bytes;                                         \
        __m256 sum[ROWS][HALVES];                                                                                 \
        for (int r = 0; r < ROWS; r++)                                                                            \
            for (int q = 0; q < HALVES; q++) sum[r][q] = _mm256_setzero_ps();                                     \
        for (int g = 0; g < k / group; g++) {                                                                     \
            if (next)                                                                                             \
                for (int b = 0; b < HALVES / 2; b++)                                                              \
                    for (size_t line = 0; line < group_bytes; line += 64) prefetch(next + b * block + g * group_bytes + line, l2); \
            for (int step = 0; step < group / 2; step++) {                                                        \
                const float *xk = x + g * group + 2 * step;                                                       \
                for (int q = 0; q < HALVES; q++) {                                                                \
                    const char *at = w + (q / 2) * block + g * group_bytes;                                       \
                    const __m256 s = _mm256_loadu_ps((const float *)at + 8 * (q % 2));                            \
                    __m256 a, b;                                                                                  \
                    widen(at + head + (size_t)step * step_bytes, bits, q % 2, &a, &b);                            \
                    a = _mm256_mul_ps(a, s), b = _mm256_mul_ps(b, s);                                             \
                    if (offsets) {                                                                                \
                        const __m256 o = _mm256_loadu_ps((const float *)at + 16 + 8 * (q % 2));                   \
                        a = _mm256_add_ps(a, o), b = _mm256_add_ps(b, o);                                         \
                    }                                                                                             \
                    for (int r = 0; r < ROWS; r++) {                                                              \
                        sum[r][q] = _mm256_fmadd_ps(_mm256_set1_ps(xk[(size_t)r * k]), a, sum[r][q]);            \
                        sum[r][q] = _mm256_fmadd_ps(_mm256_set1_ps(xk[(size_t)r * k + 1]), b, sum[r][q]);        \
                    }                                                                                             \
                }                                                                                                 \
            }                                                                                                     \
        }                                                                                                         \
        for (int r = 0; r < ROWS; r++)                                                                            \
            for (int q = 0; q < HALVES; q++)                                                                      \
                _mm256_storeu_ps(y + (size_t)r * n + 8 * q, bias ? _mm256_add_ps(sum[r][q], _mm256_loadu_ps(bias + 8 * q)) : sum[r][q]); \
    }
WIDE(1, 2) WIDE(1, 4) WIDE(2, 2) WIDE(2, 4)
static void (*const wides[3][2])(const float *, const char *, size_t, float *, const float *, int, int, int, int, int,
                                 const char *, int) = {{0, 0}, {wide1_2, wide1_4}, {wide2_2, wide2_4}};

void quant_fp32_linear(const float *x, const char *packed, const float *bias, float *y, int m, int n, int k, int bits,
                       int group, int offsets, int threads, int l2) {
    const int blocks = n / 16, row_tiles = (m + 3) / 4, per = (m + row_tiles - 1) / row_tiles;
    const size_t block = (size_t)(k / group) * ((offsets ? 128 : 64) + (size_t)group * 16 * bits / 8);
    if (m <= 2) { /* blocks two at a time (a lone last one alone), every half's chain in flight */
        _Pragma("omp parallel for schedule(static) num_threads(threads)")
        for (int p = 0; p < (blocks + 1) / 2; p++) {
            const char *w = packed + 2 * p * block, *next = 2 * p + 2 < blocks ? w + 2 * block : 0;
            wides[m][2 * p + 1 < blocks](x, w, block, y + 32 * p, bias ? bias + 32 * p : 0, n, k, bits, group, offsets, next, l2);
        }
        return;
    }
    _Pragma("omp parallel for schedule(static) num_threads(threads)")
    for (int nb = 0; nb < blocks; nb++) {
        const char *w = packed + nb * block, *next = nb + 1 < blocks ? w + block : 0;
        for (int r = 0; r < m; r += per)
            for (int h = 0; h < 2; h++)
                tiles[m - r < per ? m - r : per](x + (size_t)r * k, w, y + (size_t)r * n + 16 * nb, bias ? bias + 16 * nb : 0, n, k,
                                                 bits, group, offsets, h, next, row_tiles, r / per, l2);
    }
}
