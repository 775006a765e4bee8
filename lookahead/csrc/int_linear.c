/* The integer quantized linear (AVX512-VNNI and VBMI): y (M, N) = x (M, K) W^T (+ b) on quant_linear.c's blocks,
   with each row of x rounded to 8 bits per activation block of B k's (256, else 128, 64, 32: the largest that
   divides K), as llama.cpp's Q8 activations are:

       x[k] ~ dx[k / B] qx[k]     dx = max |x| / 127 over the block, qx = x / dx rounded to the nearest integer

       y[n] = sum over activation blocks b of  dx[b] (sum over its groups g of  s[n][g] (sum_k q[n][k] qx[k])
                                                                               (+ o[n][g] (sum_k qx[k])))

   The integer sums are vpdpbusd's (64 byte products into 16 int32 lanes an instruction: 4x the multiply-adds of
   an fp32 FMA); each group's scales are applied in fp32, an FMA chain a column over the block's groups in order,
   then dx once a block, + bias. So it is another arithmetic than the fp32 kernel's: a dtype of its own
   (``--dtype int8``), whose products differ from the dequantized weights' by the activations' rounding.

   Row-invariant by construction: a row's quantization depends on that row alone, integer sums are exact in any
   order, and its fp32 chain runs the same way whatever M is.

   The blocks are read as quant_linear.c lays them out (16 columns; per group 16 fp32 scales, 16 offsets where
   the type has them, then steps of k's and k + 1's 16 columns), four k's at a time: their 64 values transposed
   by one vpermb into 16 lanes of (k, k + 1, k + 2, k + 3), which vpdpbusd multiplies by the row's four broadcast
   bytes. vpdpbusd takes unsigned weights: nibbles (0 .. 15) are; int8 weights are biased by 128 (an xor) and 128
   sum_k qx[k] taken off their integer sum, exactly.

   Or, where `supers`, the K types as native.pack_supers lays them out, as their file holds them: per 16 columns
   and 256 k's (an activation block), 16 fp32 d (and dmin), a byte of sc (and m) a group and column, then the
   values, nibbles as above or 6 bits (q + 32, bias 32) in the quads' own order; s = d sc and o = -(dmin m) are
   made here as quants.py's decoders make them, so the products are the same bit for bit. Or, where `scaling` is
   HALVES, quant_linear.c's blocks with each group's scales (and offsets) as fp16: the legacy types' d (and m), as
   their file holds them (exact in fp16, so the same products as fp32 scales give).

   The threads split the blocks two at a time; a pair's quads and scales of one activation block are unpacked
   once into L1 buffers, which every tile of up to 4 rows reads, so the unpacking is paid once whatever M; the
   next pair's bytes are prefetched meanwhile, a few lines a unit. */

#include <immintrin.h>
#include <omp.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,avx512bf16")))

static inline void prefetch(const char *p, int l2) { l2 ? _mm_prefetch(p, _MM_HINT_T2) : _mm_prefetch(p, _MM_HINT_NTA); }

/* 16 values of a row of x from k = at, as fp32 (a bf16 is an fp32's high half: exact) */
TARGET static inline __m512 load_row(const void *x, int bf16, int at) {
    return bf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)x + at))), 16))
                : _mm512_loadu_ps((const float *)x + at);
}

/* four k's of one block, 64 bytes transposed to 16 lanes of 4: out byte 4c + j is k + j's column c */
TARGET static inline __m512i quad_int8(const char *step, __m512i order) {
    return _mm512_xor_si512(_mm512_permutexvar_epi8(order, _mm512_loadu_si512(step)), _mm512_set1_epi8((char)0x80));
}
/* eight k's of one block (four steps, 64 bytes: low nibbles k, k + 2, k + 4, k + 6, high k + 1, k + 3, k + 5, k + 7)
   as two quads, each by one two-source vpermb of the low and the high nibbles */
TARGET static inline void octet_nibbles(const char *step, __m512i first, __m512i second, __m512i *a, __m512i *b) {
    const __m512i bytes = _mm512_loadu_si512(step), low = _mm512_set1_epi8(15);
    const __m512i lows = _mm512_and_si512(bytes, low), highs = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low);
    *a = _mm512_permutex2var_epi8(lows, first, highs), *b = _mm512_permutex2var_epi8(lows, second, highs);
}

/* sixteen k's of 6-bit values (q + 32), laid out by native.pack_supers in the quads' own order: 64 bytes of low
   nibbles of quads 0 (low) and 1 (high), 64 of quads 2 and 3, then 64 of their high two bits (quad t's at bits
   2t, 2t + 1); each quad is its low nibbles or its high two bits, shifted into bits 4 and 5 */
TARGET static inline void quartet_planes(const char *unit, __m512i *quads, int stride) {
    const __m512i a = _mm512_loadu_si512(unit), b = _mm512_loadu_si512(unit + 64), h = _mm512_loadu_si512(unit + 128);
    const __m512i low = _mm512_set1_epi8(15), two = _mm512_set1_epi8(0x30);
    /* (x & low) | y, y already in bits 4 and 5: vpternlog of (a & c) | b, c = low, is table 0xEC */
    quads[0] = _mm512_ternarylogic_epi32(a, _mm512_and_si512(_mm512_slli_epi16(h, 4), two), low, 0xEC);
    quads[stride] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(a, 4), _mm512_and_si512(_mm512_slli_epi16(h, 2), two), low, 0xEC);
    quads[2 * stride] = _mm512_ternarylogic_epi32(b, _mm512_and_si512(h, two), low, 0xEC);
    quads[3 * stride] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(b, 4), _mm512_and_si512(_mm512_srli_epi16(h, 2), two), low, 0xEC);
}

/* acc + the products of a's unsigned and b's signed bytes, four to a lane: vpdpbusd, in place (gcc's intrinsic
   copied every accumulator twice a step in the tiles' loops: a third slower) */
TARGET static inline __m512i dot(__m512i acc, __m512i a, __m512i b) {
    __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
    return acc;
}

/* the vpermb index: lane c's byte j from chunk chunks[j] (16 bytes a chunk, 64 a source: 4 and up, the second
   source of a two-source vpermb), column c */
TARGET static __m512i order_of(const int chunks[4]) {
    uint8_t index[64];
    for (int c = 0; c < 16; c++)
        for (int j = 0; j < 4; j++) index[4 * c + j] = (uint8_t)(16 * chunks[j] + c);
    return _mm512_loadu_si512(index);
}

/* the largest of 256, 128, 64, 32 k's that divides k: the k's an activation scale covers (k's alone choose it, so
   every row of every call rounds alike); 0 where none does */
static int qblock_of(int k) {
    for (int b = 256; b >= 32; b /= 2)
        if (k % b == 0) return b;
    return 0;
}

/* a row of x (fp32 or bf16) -> qx (K int8), dx (K / qblock fp32), and per group of `group` k's: their sum of qx as
   a float (for the offsets) and `bias` times it (the weights' bias: 128 for int8, 32 for 6-bit planes) */
TARGET static void quantize_row(const void *x, int bf16, int k, int qblock, int group, int bias, int8_t *qx, float *dx,
                                float *sums, int32_t *biases) {
    for (int b = 0; b < k / qblock; b++) {
        __m512 amax = _mm512_setzero_ps();
        for (int at = b * qblock; at < (b + 1) * qblock; at += 16)
            amax = _mm512_max_ps(amax, _mm512_abs_ps(load_row(x, bf16, at)));
        const float top = _mm512_reduce_max_ps(amax), inverse = top > 0.0f ? 127.0f / top : 0.0f;
        dx[b] = top / 127.0f;
        for (int at = b * qblock; at < (b + 1) * qblock; at += 16) {
            const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(load_row(x, bf16, at), _mm512_set1_ps(inverse))); /* ties to even */
            _mm_storeu_si128((__m128i *)(qx + at), _mm512_cvtepi32_epi8(q));
        }
    }
    for (int g = 0; g < k / group; g++) {
        int32_t total = 0;
        for (int i = g * group; i < (g + 1) * group; i++) total += qx[i];
        sums[g] = (float)total, biases[g] = bias * total;
    }
}

typedef struct {
    const int8_t *qx;
    const float *dx, *sums;
    const int32_t *biases;
    int k, qblock, group;
} Rows; /* the quantized rows (row r's at r K, r K / qblock, r K / group) */

/* ROWS rows x two blocks (their 4-k quads of one activation block unpacked in `quads`, 2 a quad, and each group's
   scales and offsets in `scales` and `offs`, 2 a group; a lone last block is read twice, its twin's sums never
   written out), added to out (fp32, `stride` apart): for each group of the activation block, the integer sums
   scaled by the group's scales (+ the offsets times the group's sum of qx), in order; then those times the
   block's dx */
#define TILE(INT8, ROWS)                                                                                          \
    TARGET static void tile_##INT8##ROWS(Rows x, int r0, int block_index, const __m512i *quads, const __m512 *scales, \
                                         const __m512 *offs, int offsets, float *out, int stride) {               \
        const int groups = x.qblock / x.group, qs = x.group / 4;                                                 \
        const size_t groups_a_row = x.k / x.group;                                                              \
        __m512 p0[ROWS], p1[ROWS];                                                                                \
        _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; r++) p0[r] = p1[r] = _mm512_setzero_ps();               \
        for (int gl = 0; gl < groups; gl++) {                                                                     \
            const int g = block_index * groups + gl;                                                              \
            const int8_t *xq = x.qx + (size_t)r0 * x.k + g * x.group;                                             \
            __m512i sum0[ROWS], sum1[ROWS];                                                                       \
            _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; r++) sum0[r] = sum1[r] = _mm512_setzero_si512();    \
            for (int q = 0; q < qs; q++) {                                                                        \
                const __m512i w0 = quads[2 * (gl * qs + q)], w1 = quads[2 * (gl * qs + q) + 1];                   \
                _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; r++) {                                           \
                    const __m512i xb = _mm512_set1_epi32(*(const int32_t *)(xq + (size_t)r * x.k + 4 * q));       \
                    sum0[r] = dot(sum0[r], w0, xb);                                                               \
                    sum1[r] = dot(sum1[r], w1, xb);                                                               \
                }                                                                                                 \
            }                                                                                                     \
            const __m512 s0 = scales[2 * gl], s1 = scales[2 * gl + 1];                                            \
            _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; r++) {                                               \
                const size_t at = (size_t)(r0 + r) * groups_a_row + g;                                            \
                if (INT8) {                                                                                       \
                    const __m512i bias = _mm512_set1_epi32(x.biases[at]);                                         \
                    sum0[r] = _mm512_sub_epi32(sum0[r], bias), sum1[r] = _mm512_sub_epi32(sum1[r], bias);         \
                }                                                                                                 \
                p0[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum0[r]), s0, p0[r]);                                  \
                p1[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum1[r]), s1, p1[r]);                                  \
            }                                                                                                     \
            if (offsets) {                                                                                        \
                const __m512 o0 = offs[2 * gl], o1 = offs[2 * gl + 1];                                            \
                _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; r++) {                                           \
                    const __m512 sum = _mm512_set1_ps(x.sums[(size_t)(r0 + r) * groups_a_row + g]);               \
                    p0[r] = _mm512_fmadd_ps(o0, sum, p0[r]), p1[r] = _mm512_fmadd_ps(o1, sum, p1[r]);             \
                }                                                                                                 \
            }                                                                                                     \
        }                                                                                                         \
        _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; r++) {                                                   \
            const __m512 d = _mm512_set1_ps(x.dx[(size_t)(r0 + r) * (x.k / x.qblock) + block_index]);             \
            float *y = out + (size_t)(r0 + r) * stride;                                                           \
            _mm512_storeu_ps(y, _mm512_fmadd_ps(p0[r], d, _mm512_loadu_ps(y)));                                   \
            _mm512_storeu_ps(y + 16, _mm512_fmadd_ps(p1[r], d, _mm512_loadu_ps(y + 16)));                         \
        }                                                                                                         \
    }

TILE(0, 1) TILE(0, 2) TILE(0, 3) TILE(0, 4) TILE(1, 1) TILE(1, 2) TILE(1, 3) TILE(1, 4)
typedef void (*Tile)(Rows, int, int, const __m512i *, const __m512 *, const __m512 *, int, float *, int);
static const Tile tiles[2][5] = {{0, tile_01, tile_02, tile_03, tile_04}, {0, tile_11, tile_12, tile_13, tile_14}};
#define MAX_ROWS 4

/* 16 int8 (sc or m: one a column) as fp32 times a column's fp32 (d or dmin): one product, rounded as numpy rounds it */
TARGET static inline __m512 times(__m512 d, const char *bytes) {
    const __m512 small = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)bytes)));
    return _mm512_mul_round_ps(d, small, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

enum { GROUPS, SUPERS, HALVES }; /* how the blocks hold their scales (native.SCALINGS): fp32 a group, the K types' per 256
                                    k's, fp16 a group */

/* x (m, k) fp32, or bf16 where `bf16`; packed blocks (as quant_linear.c's, or the K types' per 256 k's where `scaling`
   is SUPERS: see native.pack_supers; fp16 scales where HALVES); bias (n) fp32 or NULL -> y (m, n) fp32 or bf16; k a
   multiple of 32 (of 256 where SUPERS), group 16 or 32. One parallel region a call: the rows quantized, then each thread's pairs of
   blocks summed into its own (m, 32) fp32 sums and written out (+ bias, rounded to y's type). 1 where the buffers
   could not be allocated. */
TARGET int int_linear(const void *x, const char *packed, const float *bias, void *y, int m, int n, int k, int bits,
                      int group, int offsets, int scaling, int threads, int l2, int bf16) {
    const int qblock = qblock_of(k), supers = scaling == SUPERS, halves = scaling == HALVES;
    const size_t rows = (size_t)m, width = (size_t)k, groups = width / group;
    char *buffer = malloc(rows * width + rows * (width / qblock) * 4 + rows * groups * 8 + (size_t)threads * rows * 32 * 4 + 64);
    if (!buffer) return 1;
    int8_t *qx = (int8_t *)buffer;
    float *dx = (float *)(buffer + (rows * width + 3) / 4 * 4), *sums = dx + rows * (width / qblock);
    int32_t *biases = (int32_t *)(sums + rows * groups);
    float *outs = (float *)(biases + rows * groups); /* a thread's (m, 32) sums of its current pair */
    const Rows part = {qx, dx, sums, biases, k, qblock, group};
    const int int8 = bits == 8, six = bits == 6, quad_bytes = int8 ? 64 : 32, per_block = qblock / group; /* groups an activation block */
    const int quad_shift = __builtin_ctz(group / 4); /* a group's quads: 4 or 8 */
    /* int8: a quad's four steps in place; nibbles: k, k + 1, k + 2, k + 3 from the lows' and highs' chunks 0, 1,
       then k + 4 ... from their chunks 2, 3 */
    const __m512i order = order_of((const int[4]){0, 1, 2, 3}), first = order_of((const int[4]){0, 4, 1, 5}),
                  second = order_of((const int[4]){2, 6, 3, 7});
    const int blocks = n / 16, pairs = (blocks + 1) / 2;
    /* a group's fp32 (or fp16) scales (and offsets), then its quads; or, where `supers`, an activation block's (a
       super-block's) fp32 d (and dmin), its groups' int8 sc (and m), then its quads */
    const size_t head = (offsets ? 2 : 1) * (halves ? 32 : 64), group_bytes = head + (size_t)group / 4 * quad_bytes;
    const size_t super_head = head + (size_t)per_block * 16 * (offsets ? 2 : 1);
    const size_t quads_bytes = six ? (size_t)qblock / 16 * 192 : (size_t)qblock / 4 * quad_bytes; /* 6 bits: 192 bytes a 16 k's */
    const size_t span = supers ? super_head + quads_bytes : per_block * group_bytes; /* an activation block's */
    const size_t block = (size_t)(k / qblock) * span;
    _Pragma("omp parallel num_threads(threads)") {
        _Pragma("omp for schedule(static)")
        for (int r = 0; r < m; r++)
            quantize_row((const char *)x + (size_t)r * k * (bf16 ? 2 : 4), bf16, k, qblock, group, int8 ? 128 : six ? 32 : 0, qx + (size_t)r * k,
                         dx + (size_t)r * (k / qblock), sums + (size_t)r * groups, biases + (size_t)r * groups);
        float *out = outs + (size_t)omp_get_thread_num() * rows * 32;
        __m512i quads[2 * 256 / 4];
        __m512 scales[2 * 256 / 16], offs[2 * 256 / 16];
        _Pragma("omp for schedule(static)")
        for (int q = 0; q < pairs; q++) {
            const char *w0 = packed + 2 * q * block, *w1 = 2 * q + 1 < blocks ? w0 + block : w0;
            const char *next = q + 1 < pairs ? w0 + 2 * block : 0;
            memset(out, 0, rows * 32 * 4);
            for (int b = 0; b < k / qblock; b++) {
                const size_t start = (size_t)b * span;
                /* the next pair's lines of this activation block, spread over its units (not in one burst): after
                   unit u, (u + 1) lines / units of them, counted without a division */
                const int unit = six ? 4 : 2, units = qblock / 4 / unit; /* quads unpacked at a time: 16 k's of 6 bits, else 8 */
                size_t line = 0, owed = 0;
                for (int u = 0; u < units; u++) {
                    if (next)
                        for (owed += span / 64; owed >= (size_t)units; owed -= units, line++)
                            prefetch(next + start + 64 * line, l2), prefetch(next + block + start + 64 * line, l2);
                    const int i = u * unit;
                    if (six) {
                        for (int half = 0; half < 2; half++)
                            quartet_planes((half && w1 != w0 ? w1 : w0) + start + super_head + (size_t)u * 192, quads + 2 * i + half, 2);
                        continue;
                    }
                    const int g = i >> quad_shift, j = i - (g << quad_shift); /* a group holds whole units */
                    const size_t at = start + (supers ? super_head + (size_t)i * quad_bytes : (size_t)g * group_bytes + head + (size_t)j * quad_bytes);
                    for (int half = 0; half < 2; half++) { /* w0's quads, then w1's (a lone last block's twin: its own) */
                        const char *w = half && w1 != w0 ? w1 : w0;
                        if (int8)
                            quads[2 * i + half] = quad_int8(w + at, order), quads[2 * i + 2 + half] = quad_int8(w + at + 64, order);
                        else
                            octet_nibbles(w + at, first, second, &quads[2 * i + half], &quads[2 * i + 2 + half]);
                    }
                }
                for (int half = 0; half < 2; half++) {
                    const char *w = (half && w1 != w0 ? w1 : w0) + start;
                    for (int gl = 0; gl < per_block; gl++) {
                        if (supers) { /* d sc and -(dmin m): the fp32 scales and offsets quants.py's decoders compute */
                            scales[2 * gl + half] = times(_mm512_loadu_ps((const float *)w), w + head + 16 * gl);
                            if (offsets)
                                offs[2 * gl + half] = _mm512_castsi512_ps(_mm512_xor_si512(
                                    _mm512_castps_si512(times(_mm512_loadu_ps((const float *)w + 16), w + head + 16 * (per_block + gl))),
                                    _mm512_set1_epi32((int)0x80000000)));
                        } else if (halves) {
                            const __m256i *h = (const __m256i *)(w + gl * group_bytes);
                            scales[2 * gl + half] = _mm512_cvtph_ps(_mm256_loadu_si256(h));
                            if (offsets) offs[2 * gl + half] = _mm512_cvtph_ps(_mm256_loadu_si256(h + 1));
                        } else {
                            const float *h = (const float *)(w + gl * group_bytes);
                            scales[2 * gl + half] = _mm512_loadu_ps(h);
                            if (offsets) offs[2 * gl + half] = _mm512_loadu_ps(h + 16);
                        }
                    }
                }
                for (int r = 0; r < m; r += MAX_ROWS)
                    tiles[int8 || six][m - r < MAX_ROWS ? m - r : MAX_ROWS](part, r, b, quads, scales, offs, offsets, out, 32);
            }
            for (int r = 0; r < m; r++)
                for (int c = 32 * q; c < 32 * q + 32 && c < n; c += 16) { /* a lone last block's twin is not written */
                    __m512 v = _mm512_loadu_ps(out + (size_t)r * 32 + c - 32 * q);
                    if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + c));
                    if (bf16) _mm256_storeu_si256((__m256i *)((uint16_t *)y + (size_t)r * n + c), (__m256i)_mm512_cvtneps_pbh(v));
                    else _mm512_storeu_ps((float *)y + (size_t)r * n + c, v);
                }
        }
    }
    free(buffer);
    return 0;
}
