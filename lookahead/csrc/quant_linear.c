/* The weight-only quantized linear (AVX-512): y (M, N) = x (M, K) W^T (+ b), x and y fp32, or bf16 (AVX-512 BF16
   CPUs), W as integers q with a scale s and an offset o per output column and group of G k's (G = 32, or 16 for
   Q6_K):

       W[n][k] = s[n][k / G] * q[n][k] (+ o[n][k / G])     q: int8 (8-, 6- and 5-bit GGUF types) or a nibble (4-bit)

   which is how gguf's dequantization computes every type this engine keeps (Q8_0, Q5_0, Q6_K: d q; Q4_1: d q + m;
   Q4_K: (d sc) q - dmin m), a product, then a sum: never one FMA. The kernel dequantizes in registers with the
   same two fp32 operations, so its weights are the dequantized model's fp32 weights bit for bit, and sums each
   output as linear.c's fp32 tiles do (one FMA chain over k in order): in fp32 its product equals linear.c's on the
   dequantized weights, bit for bit. bf16 activations are widened to fp32 once a call and the sums rounded to bf16
   once, as linear.c does: the weights are never rounded to bf16, so a bf16 product here is closer to the fp32 one
   than the dense bf16 model's. (Widening the weights to bf16 pairs for vdpbf16ps instead, as linear.c's bf16
   tiles, was slower on the 2-core Xeon: lm_head of SmolLM2, 0.97 against 0.65 ms at one row, 5.9 against 3.5 at 16:
   the conversion to bf16 and the scales' permutes cost more than the dot products save. So was vdpbf16ps on the
   integers themselves, each group's sums scaled after as amx_linear.c's quantized kernel does: lm_head q8 1.35 /
   6.3 ms at 1 / 16 rows against 0.80 / 3.6 here; nor does it give the AMX kernel's bits, in either order of a
   pair's two products: 6 and 9 of 60 random products differed, so the two cannot share a product.)

   Blocks of 16 output columns, as linear.c's; a block holds its groups one after another, each group

       | s: 16 fp32 (64 bytes) | o: 16 fp32, only for types with an offset | q: G k's x 16 columns |

   q in steps of 32 values, k's 16 columns then k + 1's: int8 32 bytes a step, nibbles 16 (value i in byte i % 16,
   the high nibble from i = 16). A step's weights are widened once and used by every row of the tile; a tile is up
   to 8 rows x two blocks (two chains of sums a row, so one row is not bound by the FMAs' latency). The threads
   split the blocks two at a time, prefetching the next two while the tiles run (into L2 or non-temporally, as
   linear.c).

   Every row is summed in the same order whatever M is: row-invariant. Where a process runs bf16 on AMX tiles
   (native.amx), its bf16 quantized products run on them too (amx_linear.c's amx_quant_linear, another arithmetic:
   each group's integer sums scaled), for every row count: one kernel a product, so rows never depend on M.
   SmolLM2's Q4_1 forward, Xeon, bf16: 12.4 ms at one row here against 13.6 there, 30.3 against 18.7 at 16. */

#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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

/* s q (+ o), the product rounded before the sum as gguf's numpy does: the explicitly rounded forms, since gcc
   contracts a plain product and sum into one FMA */
static inline __m512 dequantize(__m512 q, __m512 s, const __m512 *o) {
    const __m512 p = _mm512_mul_round_ps(q, s, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return o ? _mm512_add_round_ps(p, *o, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC) : p;
}

/* one step of one block: its 32 values widened and dequantized, then k's and k + 1's products added to the rows' */
#define BLOCK_STEP(BITS, ROWS, step, s, o, sum)                                                                   \
    {                                                                                                             \
        __m512 a, b;                                                                                              \
        widen_##BITS(step, &a, &b);                                                                               \
        a = dequantize(a, s, offsets ? &o : 0), b = dequantize(b, s, offsets ? &o : 0);                           \
        _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; r++) {                                                   \
            sum[r] = _mm512_fmadd_ps(_mm512_set1_ps(xk[(size_t)r * k]), a, sum[r]);                              \
            sum[r] = _mm512_fmadd_ps(_mm512_set1_ps(xk[(size_t)r * k + 1]), b, sum[r]);                          \
        }                                                                                                         \
    }

/* BITS: int8 or nibbles; OUT: fp32 or bf16 (the output's type); a tile of ROWS rows (x: fp32, k a row) times one
   or two blocks (w, and w + block where `two`) */
#define TILE(OUT, BITS, STEP_BYTES, ROWS)                                                                         \
    static void tile_##OUT##_##BITS##ROWS(const float *x, const char *w, int two, size_t block, OUT##_t *y,         \
                                          const float *bias, int n, int k, int group, int offsets,               \
                                          const char *next, int row_tiles, int row_tile, int l2) {                \
        const size_t head = offsets ? 128 : 64, group_bytes = head + (size_t)group / 2 * STEP_BYTES;              \
        __m512 sum0[ROWS], sum1[ROWS];                                                                            \
        _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; r++) sum0[r] = sum1[r] = _mm512_setzero_ps();            \
        for (int g = 0; g < k / group; g++) {                                                                     \
            if (next)                                                                                             \
                for (size_t line = (size_t)row_tile * 64; line < 2 * group_bytes; line += (size_t)row_tiles * 64) \
                    prefetch(next + (line < group_bytes ? 0 : block - group_bytes) + g * group_bytes + line, l2); \
            const char *at0 = w + g * group_bytes, *at1 = at0 + block;                                            \
            const __m512 s0 = _mm512_loadu_ps((const float *)at0), s1 = two ? _mm512_loadu_ps((const float *)at1) : s0; \
            const __m512 o0 = offsets ? _mm512_loadu_ps((const float *)at0 + 16) : s0;                            \
            const __m512 o1 = offsets && two ? _mm512_loadu_ps((const float *)at1 + 16) : s0;                     \
            for (int step = 0; step < group / 2; step++) {                                                        \
                const float *xk = x + g * group + 2 * step;                                                       \
                const size_t at = head + (size_t)step * STEP_BYTES;                                               \
                BLOCK_STEP(BITS, ROWS, at0 + at, s0, o0, sum0)                                                    \
                if (two) BLOCK_STEP(BITS, ROWS, at1 + at, s1, o1, sum1)                                           \
            }                                                                                                     \
        }                                                                                                         \
        _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; r++) {                                                   \
            put_##OUT(y + (size_t)r * n, bias ? _mm512_add_ps(sum0[r], _mm512_loadu_ps(bias)) : sum0[r]);         \
            if (two) put_##OUT(y + (size_t)r * n + 16, bias ? _mm512_add_ps(sum1[r], _mm512_loadu_ps(bias + 16)) : sum1[r]); \
        }                                                                                                         \
    }

typedef float fp32_t;
typedef uint16_t bf16_t;
static inline void put_fp32(float *y, __m512 sum) { _mm512_storeu_ps(y, sum); }
#ifdef __AVX512BF16__
static inline void put_bf16(uint16_t *y, __m512 sum) { _mm256_storeu_si256((__m256i *)y, (__m256i)_mm512_cvtneps_pbh(sum)); }
#endif

#define TILES(OUT, BITS, STEP_BYTES)                                                                              \
    TILE(OUT, BITS, STEP_BYTES, 1) TILE(OUT, BITS, STEP_BYTES, 2) TILE(OUT, BITS, STEP_BYTES, 3)                  \
    TILE(OUT, BITS, STEP_BYTES, 4) TILE(OUT, BITS, STEP_BYTES, 5) TILE(OUT, BITS, STEP_BYTES, 6)                  \
    TILE(OUT, BITS, STEP_BYTES, 7) TILE(OUT, BITS, STEP_BYTES, 8)                                                 \
    static void (*const tiles_##OUT##_##BITS[9])(const float *, const char *, int, size_t, OUT##_t *,            \
                                                const float *, int, int, int, int, const char *, int, int, int) = { \
        0, tile_##OUT##_##BITS##1, tile_##OUT##_##BITS##2, tile_##OUT##_##BITS##3, tile_##OUT##_##BITS##4,        \
        tile_##OUT##_##BITS##5, tile_##OUT##_##BITS##6, tile_##OUT##_##BITS##7, tile_##OUT##_##BITS##8};

/* x (m, k) fp32, packed blocks, bias (n) fp32 or NULL -> y (m, n); bits 8 or 4; group | k, group even */
#define LINEAR(OUT)                                                                                               \
    static void linear_##OUT(const float *x, const char *packed, const float *bias, OUT##_t *y, int m, int n,     \
                             int k, int bits, int group, int offsets, int threads, int l2) {                     \
        const int blocks = n / 16, pairs = (blocks + 1) / 2, row_tiles = (m + 7) / 8, per = (m + row_tiles - 1) / row_tiles; \
        const size_t block = (size_t)(k / group) * ((offsets ? 128 : 64) + (size_t)group * 16 * bits / 8);        \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")                                         \
        for (int q = 0; q < pairs; q++) {                                                                         \
            const char *w = packed + 2 * q * block, *next = q + 1 < pairs ? w + 2 * block : 0;                    \
            for (int r = 0; r < m; r += per) {                                                                    \
                const int rows = m - r < per ? m - r : per;                                                       \
                (bits == 8 ? tiles_##OUT##_int8 : tiles_##OUT##_nibbles)[rows](                                   \
                    x + (size_t)r * k, w, 2 * q + 1 < blocks, block, y + (size_t)r * n + 32 * q,                  \
                    bias ? bias + 32 * q : 0, n, k, group, offsets, next, row_tiles, r / per, l2);                \
            }                                                                                                     \
        }                                                                                                         \
    }

TILES(fp32, int8, 32)
TILES(fp32, nibbles, 16)
LINEAR(fp32)

void quant_fp32_linear(const float *x, const char *packed, const float *bias, float *y, int m, int n, int k, int bits,
                       int group, int offsets, int threads, int l2) {
    linear_fp32(x, packed, bias, y, m, n, k, bits, group, offsets, threads, l2);
}

#ifdef __AVX512BF16__
TILES(bf16, int8, 32)
TILES(bf16, nibbles, 16)
LINEAR(bf16)

/* bf16 x, widened to fp32 once (exactly: a bf16 is an fp32's high half); 1 where that copy could not be allocated */
int quant_bf16_linear(const uint16_t *x, const char *packed, const float *bias, uint16_t *y, int m, int n, int k,
                      int bits, int group, int offsets, int threads, int l2) {
    float *wide = aligned_alloc(64, ((size_t)m * k * 4 + 63) / 64 * 64);
    if (!wide) return 1;
    size_t i = 0;
    for (; i + 16 <= (size_t)m * k; i += 16)
        _mm512_store_ps(wide + i, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(x + i))), 16)));
    for (; i < (size_t)m * k; i++) {
        const uint32_t bits32 = (uint32_t)x[i] << 16;
        memcpy(wide + i, &bits32, 4);
    }
    linear_bf16(wide, packed, bias, y, m, n, k, bits, group, offsets, threads, l2);
    free(wide);
    return 0;
}
#endif
