/* A bf16 linear for the few rows of a decoding step, on AVX-512 BF16: y (M, N) = x (M, K) W^T (+ b).

   Each weight is packed once, in blocks of 16 output columns; a block is K/2 lines of 64 bytes, one pair of
   k each, exactly what one vdpbf16ps multiplies with a broadcast pair of x:

       block nb, columns 16nb .. 16nb+15:
         line kp = 0 | W[16nb][0]  W[16nb][1] | W[16nb+1][0]  W[16nb+1][1] | ... | W[16nb+15][0]  W[16nb+15][1] |
         line kp = 1 | W[16nb][2]  W[16nb][3] | ...
         ...
         line K/2-1
       block nb + 1 follows at once                       (lookahead/bf16_linear.py's ``pack`` lays it out)

   The threads split the blocks two at a time; a tile of up to 8 rows x 32 columns keeps its 16 fp32 sums in
   registers over all of K, and while the row tiles run they prefetch the next two blocks, each tile every
   tiles-th line of them (into L1), so the weight streams from memory once for all M rows while the arithmetic
   runs. On a Zen 5, at 16 rows: the prefetch spread over both row tiles ~10% faster than all in the first, into
   L1 ~5% faster than into L2; 16 rows x 16 columns a tile, or prefetching two pairs ahead, slower.

   Every row is summed in the same order whatever M is: row i of an M-row product equals the one-row product bit
   for bit (row-invariant). */

#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>

static inline __m512 dot(__m512 sum, __m512i x, __m512i w) { return _mm512_dpbf16_ps(sum, (__m512bh)x, (__m512bh)w); }

static inline void put(uint16_t *y, __m512 sum, const float *bias) {  /* fp32 sums (+ bias) rounded to bf16 once */
    if (bias) sum = _mm512_add_ps(sum, _mm512_loadu_ps(bias));
    _mm256_storeu_si256((__m256i *)y, (__m256i)_mm512_cvtneps_pbh(sum));
}

/* ROWS rows of x times one or two blocks (w0, w1 = w0 + one block), into y; prefetches the lines kp of `next`
   (if any) with kp % row_tiles == row_tile: the row tiles of one pair of blocks share the next pair's prefetch */
#define TILE(ROWS)                                                                                                \
    static void tile##ROWS(const uint16_t *x, const uint16_t *w0, int two, uint16_t *y, const float *bias,        \
                           int n, int k, const uint16_t *next, int row_tiles, int row_tile) {                     \
        const int lines = k / 2;                                                                                  \
        const int32_t *pairs = (const int32_t *)x;                                                                \
        const uint16_t *w1 = w0 + (size_t)lines * 32;                                                             \
        __m512 s0[ROWS], s1[ROWS];                                                                                \
        _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; r++) s0[r] = s1[r] = _mm512_setzero_ps();               \
        for (int kp = 0; kp < lines; kp++) {                                                                      \
            if (next && kp % row_tiles == row_tile) {                                                             \
                _mm_prefetch((const char *)(next + (size_t)kp * 64), _MM_HINT_T0);                                \
                _mm_prefetch((const char *)(next + (size_t)kp * 64 + 32), _MM_HINT_T0);                           \
            }                                                                                                     \
            __m512i a = _mm512_loadu_si512(w0 + (size_t)kp * 32);                                                 \
            if (two) {                                                                                            \
                __m512i b = _mm512_loadu_si512(w1 + (size_t)kp * 32);                                             \
                _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; r++) {                                          \
                    __m512i p = _mm512_set1_epi32(pairs[(size_t)r * lines + kp]);                                 \
                    s0[r] = dot(s0[r], p, a);                                                                     \
                    s1[r] = dot(s1[r], p, b);                                                                     \
                }                                                                                                 \
            } else {                                                                                              \
                _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; r++)                                            \
                    s0[r] = dot(s0[r], _mm512_set1_epi32(pairs[(size_t)r * lines + kp]), a);                      \
            }                                                                                                     \
        }                                                                                                         \
        _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; r++) {                                                  \
            put(y + (size_t)r * n, s0[r], bias);                                                                  \
            if (two) put(y + (size_t)r * n + 16, s1[r], bias ? bias + 16 : 0);                                    \
        }                                                                                                         \
    }
TILE(1) TILE(2) TILE(3) TILE(4) TILE(5) TILE(6) TILE(7) TILE(8)
typedef void (*tile_fn)(const uint16_t *, const uint16_t *, int, uint16_t *, const float *, int, int, const uint16_t *, int, int);
static const tile_fn tiles[9] = {0, tile1, tile2, tile3, tile4, tile5, tile6, tile7, tile8};

void bf16_linear(const uint16_t *x, const uint16_t *packed, const float *bias, uint16_t *y, int m, int n, int k, int threads) {
    const int blocks = n / 16, pairs = (blocks + 1) / 2;
    const size_t block = (size_t)(k / 2) * 32;  /* bf16 elements in one block */
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int q = 0; q < pairs; q++) {
        const uint16_t *w = packed + 2 * q * block, *next = q + 1 < pairs ? w + 2 * block : 0;
        const int two = 2 * q + 1 < blocks;
        for (int r = 0; r < m; r += 8)
            tiles[m - r < 8 ? m - r : 8](x + (size_t)r * k, w, two, y + (size_t)r * n + 32 * q, bias ? bias + 32 * q : 0,
                                         n, k, next, (m + 7) / 8, r / 8);
    }
}
