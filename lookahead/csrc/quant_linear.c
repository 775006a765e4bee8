/* The weight-only quantized linear (AVX-512): y (M, N) = x (M, K) W^T (+ b), x and y bf16 (AVX-512 BF16) or fp32,
   W as integers q with a scale s and an offset o per output column and group of G k's (G = 32, or 16 for Q6_K):

       W[n][k] = s[n][k / G] * q[n][k] (+ o[n][k / G])     q: int8 (8-, 6- and 5-bit GGUF types) or a nibble (4-bit)

   which is how gguf's dequantization computes every type this engine keeps (Q8_0, Q5_0, Q6_K: d q; Q4_1: d q + m;
   Q4_K: (d sc) q - dmin m), a product, then a sum: never one FMA. The kernel dequantizes in registers with the
   same two fp32 operations, so its weights are the dequantized model's fp32 weights bit for bit (in bf16, rounded
   to nearest even as torch casts them), and it sums them in linear.c's order: its product equals linear.c's on
   the dequantized weights, bit for bit (fp32, and bf16's vdpbf16ps path; AMX sums in another order).

   Blocks of 16 output columns, as linear.c's; a block holds its groups one after another, each group

       | s: 16 fp32 (64 bytes) | o: 16 fp32, only for types with an offset | q: G k's x 16 columns |

   q in steps of 32 values, one step two k's: bf16 a line of linear.c's (column c's pair of k at 2c, 2c + 1),
   fp32 two of its lines (k, then k + 1); int8 32 bytes a step, nibbles 16 (value i in byte i % 16, high nibble
   from i = 16). A step's weights are widened once and used by every row of the tile, and the threads split the
   blocks, prefetching the next one while the tiles run (into L2 or non-temporally, as linear.c).

   Every row is summed in the same order whatever M is: row-invariant. Each step converts 32 values with ~8
   instructions, so the arithmetic is heavier than linear.c's per row, and the bytes streamed a step 2-4x fewer. */

#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>

static inline void prefetch(const char *p, int l2) { l2 ? _mm_prefetch(p, _MM_HINT_T2) : _mm_prefetch(p, _MM_HINT_NTA); }

/* a step's 32 values as two fp32 vectors (before scaling) */
static inline void widen_int8(const char *q, __m512 *a, __m512 *b) {
    *a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q)));
    *b = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 16))));
}
static inline void widen_nibbles(const char *q, __m512 *a, __m512 *b) {
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)q));
    *a = _mm512_cvtepi32_ps(_mm512_and_si512(bytes, _mm512_set1_epi32(15)));
    *b = _mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4));
}

/* s q (+ o), the product rounded before the sum as gguf's numpy does (no contraction into an FMA) */
static inline __m512 dequantize(__m512 q, __m512 s, const __m512 *o) {
    const __m512 p = _mm512_mul_ps(q, s);
    return o ? _mm512_add_ps(p, *o) : p;
}

/* TYPE: bf16 or fp32 (the activations); BITS: int8 or nibbles; a tile of ROWS rows x one block */
#define TILE(TYPE, OUT, BITS, STEP_BYTES, ROWS)                                                                   \
    static void tile_##TYPE##_##BITS##ROWS(const OUT *x, const char *w, OUT *y, const float *bias, int n, int k,    \
                                           int group, int offsets, const char *next, int row_tiles, int row_tile, \
                                           int l2) {                                                              \
        const size_t head = offsets ? 128 : 64, group_bytes = head + (size_t)group / 2 * STEP_BYTES;              \
        __m512 sum[ROWS];                                                                                         \
        _Pragma("GCC unroll 16") for (int r = 0; r < ROWS; r++) sum[r] = _mm512_setzero_ps();                      \
        for (int g = 0; g < k / group; g++) {                                                                     \
            const char *at = w + g * group_bytes;                                                                 \
            if (next)                                                                                             \
                for (size_t line = (size_t)row_tile * 64; line < group_bytes; line += (size_t)row_tiles * 64)     \
                    prefetch(next + g * group_bytes + line, l2);                                                  \
            __m512 s0, s1, o0, o1;                                                                                \
            SCALES_##TYPE(at, offsets, &s0, &s1, &o0, &o1);                                                       \
            for (int step = 0; step < group / 2; step++) {                                                        \
                __m512 a, b;                                                                                      \
                widen_##BITS(at + head + (size_t)step * STEP_BYTES, &a, &b);                                      \
                a = dequantize(a, s0, offsets ? &o0 : 0);                                                         \
                b = dequantize(b, s1, offsets ? &o1 : 0);                                                         \
                const int kk = g * group + 2 * step;                                                              \
                DOTS_##TYPE(ROWS)                                                                                 \
            }                                                                                                     \
        }                                                                                                         \
        _Pragma("GCC unroll 16") for (int r = 0; r < ROWS; r++)                                                    \
            put_##TYPE(y + (size_t)r * n, bias ? _mm512_add_ps(sum[r], _mm512_loadu_ps(bias)) : sum[r]);          \
    }

/* bf16: a step is one line of pairs, columns 0-7 in a, 8-15 in b: each scale twice */
#define SCALES_bf16(at, offsets, s0, s1, o0, o1)                                                                  \
    {                                                                                                             \
        const __m512i lo = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);                     \
        const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(8));                                            \
        const __m512 s = _mm512_loadu_ps((const float *)(at));                                                    \
        *s0 = _mm512_permutexvar_ps(lo, s), *s1 = _mm512_permutexvar_ps(hi, s);                                   \
        if (offsets) {                                                                                            \
            const __m512 o = _mm512_loadu_ps((const float *)(at) + 16);                                           \
            *o0 = _mm512_permutexvar_ps(lo, o), *o1 = _mm512_permutexvar_ps(hi, o);                               \
        }                                                                                                         \
    }
#define DOTS_bf16(ROWS)                                                                                           \
    const __m512i wt = (__m512i)_mm512_cvtne2ps_pbh(b, a);                                                        \
    _Pragma("GCC unroll 16") for (int r = 0; r < ROWS; r++) {                                                      \
        const __m512i p = _mm512_set1_epi32(*(const int32_t *)(x + (size_t)r * k + kk));                         \
        sum[r] = _mm512_dpbf16_ps(sum[r], (__m512bh)p, (__m512bh)wt);                                             \
    }
/* fp32: a step is two lines, k in a and k + 1 in b: one scale a column */
#define SCALES_fp32(at, offsets, s0, s1, o0, o1)                                                                  \
    {                                                                                                             \
        *s0 = *s1 = _mm512_loadu_ps((const float *)(at));                                                         \
        if (offsets) *o0 = *o1 = _mm512_loadu_ps((const float *)(at) + 16);                                      \
    }
#define DOTS_fp32(ROWS)                                                                                           \
    _Pragma("GCC unroll 16") for (int r = 0; r < ROWS; r++) {                                                      \
        sum[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[(size_t)r * k + kk]), a, sum[r]);                              \
        sum[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[(size_t)r * k + kk + 1]), b, sum[r]);                          \
    }

static inline void put_fp32(float *y, __m512 sum) { _mm512_storeu_ps(y, sum); }
#ifdef __AVX512BF16__
static inline void put_bf16(uint16_t *y, __m512 sum) { _mm256_storeu_si256((__m256i *)y, (__m256i)_mm512_cvtneps_pbh(sum)); }
#endif

#define TILES(TYPE, OUT, BITS, STEP_BYTES)                                                                        \
    TILE(TYPE, OUT, BITS, STEP_BYTES, 1) TILE(TYPE, OUT, BITS, STEP_BYTES, 2) TILE(TYPE, OUT, BITS, STEP_BYTES, 3) \
    TILE(TYPE, OUT, BITS, STEP_BYTES, 4) TILE(TYPE, OUT, BITS, STEP_BYTES, 5) TILE(TYPE, OUT, BITS, STEP_BYTES, 6) \
    TILE(TYPE, OUT, BITS, STEP_BYTES, 7) TILE(TYPE, OUT, BITS, STEP_BYTES, 8) TILE(TYPE, OUT, BITS, STEP_BYTES, 9) \
    TILE(TYPE, OUT, BITS, STEP_BYTES, 10) TILE(TYPE, OUT, BITS, STEP_BYTES, 11)                                   \
    TILE(TYPE, OUT, BITS, STEP_BYTES, 12) TILE(TYPE, OUT, BITS, STEP_BYTES, 13)                                   \
    TILE(TYPE, OUT, BITS, STEP_BYTES, 14) TILE(TYPE, OUT, BITS, STEP_BYTES, 15)                                   \
    TILE(TYPE, OUT, BITS, STEP_BYTES, 16)                                                                         \
    static void (*const tiles_##TYPE##_##BITS[17])(const OUT *, const char *, OUT *, const float *, int, int, int, \
                                                  int, const char *, int, int, int) = {0,                          \
        tile_##TYPE##_##BITS##1, tile_##TYPE##_##BITS##2, tile_##TYPE##_##BITS##3, tile_##TYPE##_##BITS##4,       \
        tile_##TYPE##_##BITS##5, tile_##TYPE##_##BITS##6, tile_##TYPE##_##BITS##7, tile_##TYPE##_##BITS##8,       \
        tile_##TYPE##_##BITS##9, tile_##TYPE##_##BITS##10, tile_##TYPE##_##BITS##11, tile_##TYPE##_##BITS##12,    \
        tile_##TYPE##_##BITS##13, tile_##TYPE##_##BITS##14, tile_##TYPE##_##BITS##15, tile_##TYPE##_##BITS##16};

/* x (m, k), packed blocks, bias (n) fp32 or NULL -> y (m, n); bits 8 or 4; group | k, group even */
#define LINEAR(TYPE, OUT)                                                                                         \
    void quant_##TYPE##_linear(const OUT *x, const char *packed, const float *bias, OUT *y, int m, int n, int k,   \
                               int bits, int group, int offsets, int threads, int l2) {                          \
        const int blocks = n / 16, row_tiles = (m + 15) / 16, per = (m + row_tiles - 1) / row_tiles;             \
        const size_t block = (size_t)(k / group) * ((offsets ? 128 : 64) + (size_t)group * 16 * bits / 8);        \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")                                         \
        for (int nb = 0; nb < blocks; nb++) {                                                                     \
            const char *w = packed + nb * block, *next = nb + 1 < blocks ? w + block : 0;                         \
            for (int r = 0; r < m; r += per) {                                                                    \
                const int rows = m - r < per ? m - r : per;                                                       \
                (bits == 8 ? tiles_##TYPE##_int8 : tiles_##TYPE##_nibbles)[rows](                                 \
                    x + (size_t)r * k, w, y + (size_t)r * n + 16 * nb, bias ? bias + 16 * nb : 0, n, k, group,    \
                    offsets, next, row_tiles, r / per, l2);                                                       \
            }                                                                                                     \
        }                                                                                                         \
    }

TILES(fp32, float, int8, 32)
TILES(fp32, float, nibbles, 16)
LINEAR(fp32, float) /* quant_fp32_linear */
#ifdef __AVX512BF16__
TILES(bf16, uint16_t, int8, 32)
TILES(bf16, uint16_t, nibbles, 16)
LINEAR(bf16, uint16_t) /* quant_bf16_linear */
#endif
