/* A linear for the few rows of a decoding step, bf16 (AVX-512 BF16) or fp32 (AVX-512F): y (M, N) = x (M, K) W^T
   (+ b). Each weight is packed once, in blocks of 16 output columns; a block is one 64-byte line per step of k,
   exactly what one instruction multiplies with a broadcast 32 bits of x:

       bf16, block nb (columns 16nb .. 16nb+15), K/2 lines, one pair of k each:
         line 0 | W[16nb][0]  W[16nb][1] | W[16nb+1][0]  W[16nb+1][1] | ... | W[16nb+15][0]  W[16nb+15][1] |  x vdpbf16ps
         line 1 | W[16nb][2]  W[16nb][3] | ...
       fp32, K lines, one k each:
         line 0 | W[16nb][0] | W[16nb+1][0] | ... | W[16nb+15][0] |                                              x FMA
       block nb + 1 follows at once                     (lookahead/native.py's ``pack`` lays it out)

   The threads split the blocks two at a time; a tile of up to 12 rows x 32 columns keeps its 24 fp32 sums in
   registers over all of K (more rows take tiles of rows as even as can be), and while the row tiles run they
   prefetch the next two blocks, each tile every row_tiles-th line of them, so the weight streams from memory
   once for all M rows while the arithmetic runs. oneDNN's small-M product streams, then computes. On a Zen 5,
   SmolLM2's products with weights cycled as a forward streams them: bf16 a layer 163 -> 116 us at one row, 265
   -> 174 at 16; fp32 a forward's linears 7.70 -> 6.32 ms and 15.1 -> 10.5. At 16 rows the prefetch spread over
   both row tiles was ~10% faster than all in the first; 16 rows x 16 columns a tile, or prefetching two pairs
   ahead, slower. Tiles of 12 rows instead of 8: a forward of 9-12 rows 13.7-13.9 -> 12.8-13.1 ms (SmolLM2, one
   tile instead of two), the same at other widths.

   The prefetch is non-temporal (l2 = 0) or into L2 (l2 = 1), whichever the CPU ran fastest in the loop
   (``native.prefetch_into_l2``). A weight is read once a forward, and streamed into L1 as other data would be
   it evicted everything else a step touches (activations, the KV cache, the host's Python and drafting
   structures), so every op after it started cold. Non-temporal against into L1, side by side in the loop
   (SmolLM2 bf16, Zen 5): plain loop +7.3%, lookahead +4.7% tokens/s; a step's host work 0.72 -> 0.57 ms. Into
   L2 against non-temporal (Zen 4, whose L1 is 32 KB to Zen 5's 48): plain loop +0.8-1.5%, lookahead +8.3-8.6%,
   a 16-row forward's linears 13.6 -> 12.3 ms. (Alone, a forward after a forward hides the first effect: it is
   what runs between the products that gains.) On an Intel Xeon (AVX-512 BF16 and AMX, 2 cores) non-temporal
   starved the products: into L2, SmolLM2's bf16 forward 34 -> 19.5 ms at one row and 51 -> 35 ms at 16 (no
   prefetch, or into L1: 19.5 and 46 ms), fp32 62.5 -> 31 and 77 -> 43 ms; in the loop (six prompts x 64
   tokens) the plain loop 30 -> 57 tokens/s, lookahead 66 -> 110. Into L2 is the default; non-temporal is kept
   where it was measured best (Zen 5, against L1).

   Every row is summed in the same order whatever M is: row i of an M-row product equals the one-row product bit
   for bit (row-invariant). The fp32 sums (+ bias) are rounded to bf16 once, as oneDNN does; in fp32 each output
   is one FMA chain over k, another order than MKL's (real checkpoints still equal stock generate() up to ties). */

#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __AVX512BF16__ /* the AVX-512F build (native.TIERS) has the fp32 linear only */
static inline __m512 dot_bf16(__m512 sum, __m512i x, __m512i w) { return _mm512_dpbf16_ps(sum, (__m512bh)x, (__m512bh)w); }
static inline void put_bf16(uint16_t *y, __m512 sum) { _mm256_storeu_si256((__m256i *)y, (__m256i)_mm512_cvtneps_pbh(sum)); }
#endif
static inline __m512 dot_fp32(__m512 sum, __m512i x, __m512i w) {
    return _mm512_fmadd_ps(_mm512_castsi512_ps(x), _mm512_castsi512_ps(w), sum);
}
static inline void put_fp32(float *y, __m512 sum) { _mm512_storeu_ps(y, sum); }
static inline void prefetch(const char *p, int l2) { l2 ? _mm_prefetch(p, _MM_HINT_T2) : _mm_prefetch(p, _MM_HINT_NTA); }

/* ROWS rows of x (lines 32-bit units a row) times one or two blocks (w0, w1 = w0 + one block), into y (n a row);
   prefetches the lines kp of `next` (if any) with kp % row_tiles == row_tile: the row tiles of one pair of blocks
   share the next pair's prefetch */
#define TILE(TYPE, OUT, ROWS)                                                                                     \
    static void tile_##TYPE##ROWS(const int32_t *x, const char *w0, int two, OUT *y, const float *bias, int n,    \
                                  int lines, const char *next, int row_tiles, int row_tile, int l2) {             \
        const char *w1 = w0 + (size_t)lines * 64;                                                                 \
        __m512 s0[ROWS], s1[ROWS];                                                                                \
        _Pragma("GCC unroll 12") for (int r = 0; r < ROWS; r++) s0[r] = s1[r] = _mm512_setzero_ps();               \
        for (int kp = 0; kp < lines; kp++) {                                                                      \
            if (next && kp % row_tiles == row_tile) {                                                             \
                prefetch(next + (size_t)kp * 128, l2);                                                            \
                prefetch(next + (size_t)kp * 128 + 64, l2);                                                       \
            }                                                                                                     \
            __m512i a = _mm512_loadu_si512(w0 + (size_t)kp * 64);                                                 \
            if (two) {                                                                                            \
                __m512i b = _mm512_loadu_si512(w1 + (size_t)kp * 64);                                             \
                _Pragma("GCC unroll 12") for (int r = 0; r < ROWS; r++) {                                          \
                    __m512i p = _mm512_set1_epi32(x[(size_t)r * lines + kp]);                                     \
                    s0[r] = dot_##TYPE(s0[r], p, a);                                                              \
                    s1[r] = dot_##TYPE(s1[r], p, b);                                                              \
                }                                                                                                 \
            } else {                                                                                              \
                _Pragma("GCC unroll 12") for (int r = 0; r < ROWS; r++)                                            \
                    s0[r] = dot_##TYPE(s0[r], _mm512_set1_epi32(x[(size_t)r * lines + kp]), a);                   \
            }                                                                                                     \
        }                                                                                                         \
        _Pragma("GCC unroll 12") for (int r = 0; r < ROWS; r++) {                                                  \
            put_##TYPE(y + (size_t)r * n, bias ? _mm512_add_ps(s0[r], _mm512_loadu_ps(bias)) : s0[r]);           \
            if (two) put_##TYPE(y + (size_t)r * n + 16, bias ? _mm512_add_ps(s1[r], _mm512_loadu_ps(bias + 16)) : s1[r]); \
        }                                                                                                         \
    }
#define TILES(TYPE, OUT)                                                                                          \
    TILE(TYPE, OUT, 1) TILE(TYPE, OUT, 2) TILE(TYPE, OUT, 3) TILE(TYPE, OUT, 4)                                   \
    TILE(TYPE, OUT, 5) TILE(TYPE, OUT, 6) TILE(TYPE, OUT, 7) TILE(TYPE, OUT, 8)                                   \
    TILE(TYPE, OUT, 9) TILE(TYPE, OUT, 10) TILE(TYPE, OUT, 11) TILE(TYPE, OUT, 12)                                \
    static void (*const tiles_##TYPE[13])(const int32_t *, const char *, int, OUT *, const float *, int, int,      \
                                         const char *, int, int, int) = {0, tile_##TYPE##1, tile_##TYPE##2,        \
        tile_##TYPE##3, tile_##TYPE##4, tile_##TYPE##5, tile_##TYPE##6, tile_##TYPE##7, tile_##TYPE##8,           \
        tile_##TYPE##9, tile_##TYPE##10, tile_##TYPE##11, tile_##TYPE##12};                                      \
    void TYPE##_linear(const void *x, const void *packed, const float *bias, OUT *y, int m, int n, int k,         \
                       int threads, int l2) {                                                                     \
        const int lines = (int)(k * sizeof(OUT) / 4), blocks = n / 16, pairs = (blocks + 1) / 2;                  \
        const size_t block = (size_t)lines * 64; /* bytes */                                                     \
        const int row_tiles = (m + 11) / 12, per = (m + row_tiles - 1) / row_tiles; /* rows a tile, as even as can be */ \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")                                         \
        for (int q = 0; q < pairs; q++) {                                                                         \
            const char *w = (const char *)packed + 2 * q * block, *next = q + 1 < pairs ? w + 2 * block : 0;      \
            for (int r = 0; r < m; r += per)                                                                      \
                tiles_##TYPE[m - r < per ? m - r : per]((const int32_t *)x + (size_t)r * lines, w, 2 * q + 1 < blocks, \
                                                   y + (size_t)r * n + 32 * q, bias ? bias + 32 * q : 0, n, lines, \
                                                   next, row_tiles, r / per, l2);                                 \
        }                                                                                                         \
    }

#ifdef __AVX512BF16__
TILES(bf16, uint16_t)  /* bf16_linear: x, y bf16 */
#endif
TILES(fp32, float)     /* fp32_linear: x, y fp32 */
