/* The integer quantized linear (AVX512-VNNI): y (M, N) = x (M, K) W^T (+ b) on quant_linear.c's blocks,
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
   the type has them, then the values), but with the values in this kernel's lanes' order (native._lanes): four
   k's at a time in 16 lanes of (k, k + 1, k + 2, k + 3), which vpdpbusd multiplies by the row's four broadcast
   bytes; int8 values as 64 bytes a quad, nibbles as 64 bytes an octet (eight k's: a quad the low nibbles, the
   next the high ones). vpdpbusd takes unsigned weights: nibbles (0 .. 15) are; int8 weights are stored biased by
   128 and 128 sum_k qx[k] taken off their integer sum, exactly.

   Or, where `supers`, the K types as native.pack_supers lays them out, as their file holds them: per 16 columns
   and 256 k's (an activation block), 16 fp16 d (and dmin), a byte of sc (and m) a group and column, then the
   values, nibbles as above or 6 bits (q + 32, bias 32) in the quads' order too; s = d sc and o = -(dmin m) are
   made here as quants.py's decoders make them, so the products are the same bit for bit. Or, where `scaling` is
   HALVES, quant_linear.c's blocks with each group's scales (and offsets) as fp16: the legacy types' d (and m), as
   their file holds them (exact in fp16, so the same products as fp32 scales give).

   The threads split the blocks two at a time; a pair's scales of one activation block are made into an L1 buffer,
   then up to 8 rows at a time take its quads straight from the blocks into registers and multiply them at once
   (rows_block): nothing is stored to be read again, and the next pair's bytes are prefetched meanwhile, a few lines
   at a time, so the memory streams while the rows multiply. Past 8 rows, passes as even as they go (9 = 5 + 4,
   17 = 6 + 6 + 5) read the pair from cache and unpack it again (a lone ninth row's pass cost what 4-5 rows' do: the
   1.5B's products at 9 / 10 / 12 / 17 rows 5-8% faster balanced, on a Zen 4). Against quads unpacked once into a
   buffer that tiles of 4 rows read, the 1.5B's products 2-8 rows 9-23% faster, and 8 rows at a time against 4 another
   5-14% from 6 rows on; 12-row register tiles spill and gain nothing (DESIGN).

   A call of one row (plain decoding's every product), or of up to 4 on blocks other than the K types', takes the
   blocks one at a time instead, each over all of K in order with its scales read where they lie and every line AHEAD
   bytes on prefetched as it reads (row_block), as the AVX2 tier's streaming tile does: the pairs' two streams, each
   activation block's scales made ahead into L1 and the next pair's prefetch had left this tier's one-row products
   slower than the AVX2 tier's on the same CPU (Qwen2.5-Coder-0.5B's Q8_0, streamed, on a Zen 4: 17.1 against 15.8
   ms). At 2-4 rows the legacy types' products (memory-bound there) gain too, the K types' (Q4_K, Q6_K: a pair gives
   each broadcast two products, which their arithmetic needs) lose at 3-4 rows: they keep the pairs. The same bits
   (each row's chain is its own). */

#include <cpuid.h>
#include <immintrin.h>
#include <limits.h>
#include <omp.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx512bf16")))

static inline void prefetch(const char *p, int l2) { l2 ? _mm_prefetch(p, _MM_HINT_T2) : _mm_prefetch(p, _MM_HINT_NTA); }

/* 16 values of a row of x from k = at, as fp32 (a bf16 is an fp32's high half: exact) */
TARGET static inline __m512 load_row(const void *x, int bf16, int at) {
    return bf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)x + at))), 16))
                : _mm512_loadu_ps((const float *)x + at);
}

enum { NIBBLES, INT8, SIX }; /* how a block holds its values: nibbles, int8 (biased by 128), 6 bits (q + 32) */
#define ALWAYS __attribute__((always_inline))

/* eight k's of one block as two quads: 64 bytes in the lanes' own order (native._octets: byte 4c + j holds column
   c's k + j low, k + 4 + j high), so a quad is a mask, or a shift and a mask */
TARGET static inline ALWAYS void octet_nibbles(const char *octet, __m512i *quads) {
    const __m512i bytes = _mm512_loadu_si512(octet), low = _mm512_set1_epi8(15);
    quads[0] = _mm512_and_si512(bytes, low), quads[1] = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low);
}

/* sixteen k's of 6-bit values (q + 32), laid out by native.pack_supers in the quads' own order: 64 bytes of low
   nibbles of quads 0 (low) and 1 (high), 64 of quads 2 and 3, then 64 of their high two bits (quad t's at bits
   2t, 2t + 1); each quad is its low nibbles or its high two bits, shifted into bits 4 and 5 */
TARGET static inline ALWAYS void quartet_planes(const char *unit, __m512i *quads) {
    const __m512i a = _mm512_loadu_si512(unit), b = _mm512_loadu_si512(unit + 64), h = _mm512_loadu_si512(unit + 128);
    const __m512i low = _mm512_set1_epi8(15), two = _mm512_set1_epi8(0x30);
    /* (x & low) | y, y already in bits 4 and 5: vpternlog of (a & c) | b, c = low, is table 0xEC */
    quads[0] = _mm512_ternarylogic_epi32(a, _mm512_and_si512(_mm512_slli_epi16(h, 4), two), low, 0xEC);
    quads[1] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(a, 4), _mm512_and_si512(_mm512_slli_epi16(h, 2), two), low, 0xEC);
    quads[2] = _mm512_ternarylogic_epi32(b, _mm512_and_si512(h, two), low, 0xEC);
    quads[3] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(b, 4), _mm512_and_si512(_mm512_srli_epi16(h, 2), two), low, 0xEC);
}

/* the bytes a quad's values take in a block: 64 (int8, already in the lanes' order: native._quads), 32 (nibbles), 48
   (6 bits) */
static inline int quad_bytes(int kind) { return kind == INT8 ? 64 : kind == SIX ? 48 : 32; }

/* one group's quads of one block (qs of them: 4 or 8) from its values at w */
TARGET static inline ALWAYS void group_quads(int kind, int qs, const char *w, __m512i *quads) {
    _Pragma("GCC unroll 8") for (int i = 0; i < qs; i += kind == SIX ? 4 : kind == NIBBLES ? 2 : 1) {
        const char *at = w + quad_bytes(kind) * i;
        if (kind == SIX) quartet_planes(at, quads + i);
        else if (kind == NIBBLES) octet_nibbles(at, quads + i);
        else quads[i] = _mm512_loadu_si512(at);
    }
}

/* acc + the products of a's unsigned and b's signed bytes, four to a lane: vpdpbusd, in place (gcc's intrinsic
   copied every accumulator twice a step in the rows' loops: a third slower) */
TARGET static inline ALWAYS __m512i dot(__m512i acc, __m512i a, __m512i b) {
    __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
    return acc;
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

/* where row r's group g sits in the per-group arrays (sums, biases) */
static inline size_t group_at(Rows x, int r, int g) { return (size_t)r * (x.k / x.group) + g; }

/* the rows from row r on */
static inline Rows from_row(Rows x, int r) {
    const size_t groups = group_at(x, r, 0);
    return (Rows){x.qx + (size_t)r * x.k, x.dx + (size_t)r * (x.k / x.qblock), x.sums + groups, x.biases + groups, x.k, x.qblock, x.group};
}

/* one row's group g of two blocks: p += its integer sums times the group's scales s (+ its offsets o times the
   group's sum of qx) */
TARGET static inline ALWAYS void scale_group(Rows x, int r, int g, int offsets, __m512i sum0, __m512i sum1,
                                             const __m512 *s, const __m512 *o, __m512 *p0, __m512 *p1) {
    *p0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum0), s[0], *p0), *p1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum1), s[1], *p1);
    if (offsets) {
        const __m512 sum = _mm512_set1_ps(x.sums[group_at(x, r, g)]);
        *p0 = _mm512_fmadd_ps(o[0], sum, *p0), *p1 = _mm512_fmadd_ps(o[1], sum, *p1);
    }
}

/* out (a row's 32 fp32 sums of two blocks) += p times the row's dx of the activation block */
TARGET static inline ALWAYS void add_block(Rows x, int r, int block_index, __m512 p0, __m512 p1, float *out) {
    const __m512 d = _mm512_set1_ps(x.dx[(size_t)r * (x.k / x.qblock) + block_index]);
    _mm512_storeu_ps(out, _mm512_fmadd_ps(p0, d, _mm512_loadu_ps(out)));
    _mm512_storeu_ps(out + 16, _mm512_fmadd_ps(p1, d, _mm512_loadu_ps(out + 16)));
}

/* How far the next pair's prefetch has come: lines sent, and the remainder of lines x steps not yet a line */
typedef struct {
    int line, due;
} Share;

/* the next pair's lines of an activation block (`lines` of each of its two blocks, `block` bytes apart), spread
   evenly over `units` steps of the work on it: after step u, lines (u + 1) / units of them, counted as Bresenham
   counts (a division a step was 3-10% of the products, hot or streamed) */
static inline void prefetch_share(const char *next, size_t block, int lines, int units, Share *share, int l2) {
    for (share->due += lines; share->due >= units; share->due -= units, share->line++)
        prefetch(next + 64 * share->line, l2), prefetch(next + block + 64 * share->line, l2);
}

/* 16 int8 (sc or m: one a column) as fp32 times a column's fp32 (d or dmin): one product, rounded as numpy rounds it */
TARGET static inline __m512 times(__m512 d, const char *bytes) {
    const __m512 small = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)bytes)));
    return _mm512_mul_round_ps(d, small, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

#define MAX_ROWS 8

/* ROWS (1 .. 8) rows x two blocks of `blocks` activation blocks, straight from the blocks: a unit of each group's quads
   (an octet of nibbles, two int8 quads, a quartet of 6-bit planes) unpacked in registers and multiplied by every row
   at once, so nothing is stored to be read again; where `next`, the next pair's lines prefetched a few each unit, so
   the memory streams while the rows multiply. One row sums in two chains a block (vpdpbusd's latency): integer sums,
   so the same whatever the rows. Each group's sums scaled, then the activation block's, in one order for every row;
   `kind`, `qs` and `ROWS` constants where it is inlined. w0, w1: the blocks' first group's values, a group's
   `stride` bytes after the last's (the activation blocks' groups in a row: up to 256 k's a call, so SmolLM2's K of 576,
   blocks of 64, is three calls a pair, not nine: its products at 1 / 4 rows 2.92 / 3.83 -> 2.76 / 3.50 ms); out: the
   rows' 32 sums, 32 apart. */
TARGET static inline ALWAYS void rows_block(int kind, int qs, int ROWS, Rows x, int block_index, int blocks, const char *w0,
                                            const char *w1, size_t stride, const __m512 *scales, const __m512 *offs, int offsets,
                                            float *out, const char *next, size_t block, int lines, int l2) {
    const int groups = x.qblock / x.group, unit = kind == SIX ? 4 : 2, bytes = quad_bytes(kind);
    const int chains = ROWS == 1 ? 2 : 1, units = blocks * groups * qs / unit;
    __m512 p0[MAX_ROWS], p1[MAX_ROWS];
    Share share = {0, 0};
    for (int bb = 0; bb < blocks; bb++) {
        _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; r++) p0[r] = p1[r] = _mm512_setzero_ps();
        for (int gl = bb * groups; gl < (bb + 1) * groups; gl++) {
            const int g = block_index * groups + gl;
            const int8_t *xq = x.qx + g * x.group;
            __m512i sum0[2 * MAX_ROWS], sum1[2 * MAX_ROWS]; /* a row's first chain starts at minus the weights' bias, exactly:
                                                              no subtraction a group (Q6_K's products 6% faster at 8-16 rows) */
            _Pragma("GCC unroll 16") for (int c = 0; c < ROWS * chains; c++)
                sum0[c] = sum1[c] = kind != NIBBLES && c % chains == 0 ? _mm512_set1_epi32(-x.biases[group_at(x, c / chains, g)])
                                                                       : _mm512_setzero_si512();
            _Pragma("GCC unroll 8") for (int q = 0; q < qs; q += unit) {
                if (next) prefetch_share(next, block, lines, units, &share, l2);
                __m512i u0[4], u1[4];
                group_quads(kind, unit, w0 + gl * stride + bytes * q, u0), group_quads(kind, unit, w1 + gl * stride + bytes * q, u1);
                _Pragma("GCC unroll 4") for (int j = 0; j < unit; j++)
                    _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; r++) {
                        const __m512i xb = _mm512_set1_epi32(*(const int32_t *)(xq + (size_t)r * x.k + 4 * (q + j)));
                        const int c = r * chains + j % chains;
                        sum0[c] = dot(sum0[c], u0[j], xb), sum1[c] = dot(sum1[c], u1[j], xb);
                    }
            }
            _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; r++) {
                __m512i s0 = sum0[r * chains], s1 = sum1[r * chains];
                if (chains == 2) s0 = _mm512_add_epi32(s0, sum0[r * chains + 1]), s1 = _mm512_add_epi32(s1, sum1[r * chains + 1]);
                scale_group(x, r, g, offsets, s0, s1, scales + 2 * gl, offs + 2 * gl, &p0[r], &p1[r]);
            }
        }
        _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; r++) add_block(x, r, block_index + bb, p0[r], p1[r], out + 32 * r);
    }
}
typedef void (*RowsBlock)(Rows, int, int, const char *, const char *, size_t, const __m512 *, const __m512 *, int, float *,
                          const char *, size_t, int, int);
#define ROWS_BLOCK(KIND, QS, ROWS)                                                                                   \
    TARGET static void rows_##KIND##_##QS##_##ROWS(Rows x, int b, int blocks, const char *w0, const char *w1,          \
                                                   size_t stride, const __m512 *s, const __m512 *o, int offsets,      \
                                                   float *out, const char *next, size_t block, int lines, int l2) {   \
        rows_block(KIND, QS, ROWS, x, b, blocks, w0, w1, stride, s, o, offsets, out, next, block, lines, l2);       \
    }
#define ROWS_BLOCKS(KIND, QS) ROWS_BLOCK(KIND, QS, 1) ROWS_BLOCK(KIND, QS, 2) ROWS_BLOCK(KIND, QS, 3) ROWS_BLOCK(KIND, QS, 4) \
    ROWS_BLOCK(KIND, QS, 5) ROWS_BLOCK(KIND, QS, 6) ROWS_BLOCK(KIND, QS, 7) ROWS_BLOCK(KIND, QS, 8)
ROWS_BLOCKS(NIBBLES, 4) ROWS_BLOCKS(NIBBLES, 8) ROWS_BLOCKS(INT8, 4) ROWS_BLOCKS(INT8, 8) ROWS_BLOCKS(SIX, 4) ROWS_BLOCKS(SIX, 8)
#define ROWS_OF(KIND, QS) {rows_##KIND##_##QS##_1, rows_##KIND##_##QS##_2, rows_##KIND##_##QS##_3, rows_##KIND##_##QS##_4, \
    rows_##KIND##_##QS##_5, rows_##KIND##_##QS##_6, rows_##KIND##_##QS##_7, rows_##KIND##_##QS##_8}
static const RowsBlock rows_blocks[3][2][MAX_ROWS] = {{ROWS_OF(NIBBLES, 4), ROWS_OF(NIBBLES, 8)}, {ROWS_OF(INT8, 4), ROWS_OF(INT8, 8)},
                                                      {ROWS_OF(SIX, 4), ROWS_OF(SIX, 8)}};

/* how one call's blocks lie, set once a call (as int_linear_avx2.c's) */
typedef struct {
    int offsets, supers, halves, per_block; /* per_block: groups an activation block */
    size_t head, span, first, stride;       /* a group's scales' bytes, an activation block's, where its first group's
                                               values lie, a group's values' stride (where not `supers`: a group's bytes) */
} Blocks;

/* group gl's scales (and offsets) of one block's activation block at `at` (a group's follow the last's, across
   activation blocks where not `supers`), as fp32: d sc and -(dmin m) of the K types (d, dmin: the activation block's,
   made once), as quants.py's decoders make them; fp16 or fp32 ones as they lie */
TARGET static inline ALWAYS void group_scales(const Blocks *w, const char *at, int gl, __m512 d, __m512 dmin, __m512 *scale, __m512 *off) {
    if (w->supers) {
        *scale = times(d, at + w->head + 16 * gl);
        if (w->offsets)
            *off = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(times(dmin, at + w->head + 16 * (w->per_block + gl))),
                                                        _mm512_set1_epi32((int)0x80000000)));
    } else if (w->halves) {
        const __m256i *h = (const __m256i *)(at + gl * w->stride);
        *scale = _mm512_cvtph_ps(_mm256_loadu_si256(h));
        if (w->offsets) *off = _mm512_cvtph_ps(_mm256_loadu_si256(h + 1));
    } else {
        const float *h = (const float *)(at + gl * w->stride);
        *scale = _mm512_loadu_ps(h);
        if (w->offsets) *off = _mm512_loadu_ps(h + 16);
    }
}

#define AHEAD 4096 /* bytes a one-row call prefetches ahead of what it reads */
#define ROW_CHAINS 4 /* a block's integer sums a group: vpdpbusd's latency (a row's chains: 4 / ROWS) */
#define BLOCK_ROWS 4 /* the most rows a call takes by single blocks, where its blocks are not the K types' */

/* ROWS (1 .. 4) rows x one block over all of K: plain decoding's products, a stream of the weights. The block is read
   in order, each group's scales where its values are, and every line up to AHEAD bytes past the unit prefetched (the
   scales' between the values' too), as int_linear_avx2.c's streaming tile reads it; the rows' sums in registers
   throughout. The same integer sums and fp32 chain as rows_block's for each row (each group's sums scaled in order,
   then each activation block's dx, from zero), so the same bits. `ahead`: the next line to prefetch, carried from
   block to block (a thread's blocks lie in a row). y: the rows' 16 sums of the block. */
TARGET static inline ALWAYS void row_block(int kind, int qs, int ROWS, Rows x, const Blocks *w, const char *block, const char **ahead, int l2, __m512 *y) {
    const int groups = x.qblock / x.group, unit = kind == SIX ? 4 : 2, bytes = quad_bytes(kind), chains = (ROW_CHAINS + ROWS - 1) / ROWS;
    if (*ahead < block) *ahead = block + AHEAD; /* a thread's first block: its first lines come as they are read */
    _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; r++) y[r] = _mm512_setzero_ps();
    for (int b = 0; b < x.k / x.qblock; b++) {
        const char *at = block + (size_t)b * w->span;
        const __m512 d = w->supers ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)at)) : _mm512_setzero_ps();
        const __m512 dmin = w->supers && w->offsets ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)at + 1)) : d;
        __m512 p[BLOCK_ROWS];
        _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; r++) p[r] = _mm512_setzero_ps();
        for (int gl = 0; gl < groups; gl++) {
            const int g = b * groups + gl;
            const int8_t *xq = x.qx + (size_t)g * x.group;
            const char *values = at + w->first + gl * w->stride;
            __m512i sum[BLOCK_ROWS][ROW_CHAINS];
            _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; r++)
                _Pragma("GCC unroll 4") for (int c = 0; c < chains; c++)
                    sum[r][c] = kind != NIBBLES && c == 0 ? _mm512_set1_epi32(-x.biases[group_at(x, r, g)]) : _mm512_setzero_si512();
            _Pragma("GCC unroll 8") for (int q = 0; q < qs; q += unit) {
                for (const char *end = values + bytes * (q + unit) + AHEAD; *ahead < end; *ahead += 64) prefetch(*ahead, l2);
                __m512i u[4];
                group_quads(kind, unit, values + bytes * q, u);
                _Pragma("GCC unroll 4") for (int j = 0; j < unit; j++)
                    _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; r++)
                        sum[r][(q + j) % chains] = dot(sum[r][(q + j) % chains], u[j], _mm512_set1_epi32(*(const int32_t *)(xq + (size_t)r * x.k + 4 * (q + j))));
            }
            __m512 scale, off = _mm512_setzero_ps();
            group_scales(w, at, gl, d, dmin, &scale, &off);
            _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; r++) {
                __m512i s = sum[r][0];
                _Pragma("GCC unroll 4") for (int c = 1; c < chains; c++) s = _mm512_add_epi32(s, sum[r][c]);
                p[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), scale, p[r]);
                if (w->offsets) p[r] = _mm512_fmadd_ps(off, _mm512_set1_ps(x.sums[group_at(x, r, g)]), p[r]);
            }
        }
        _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; r++) y[r] = _mm512_fmadd_ps(p[r], _mm512_set1_ps(x.dx[(size_t)r * (x.k / x.qblock) + b]), y[r]);
    }
}
typedef void (*RowBlock)(Rows, const Blocks *, const char *, const char **, int, __m512 *);
#define ROW_BLOCK(KIND, QS, ROWS) \
    TARGET static void row_##KIND##_##QS##_##ROWS(Rows x, const Blocks *w, const char *block, const char **ahead, int l2, __m512 *y) { \
        row_block(KIND, QS, ROWS, x, w, block, ahead, l2, y); \
    }
#define ROW_BLOCKS(KIND, QS) ROW_BLOCK(KIND, QS, 1) ROW_BLOCK(KIND, QS, 2) ROW_BLOCK(KIND, QS, 3) ROW_BLOCK(KIND, QS, 4)
ROW_BLOCKS(NIBBLES, 4) ROW_BLOCKS(NIBBLES, 8) ROW_BLOCKS(INT8, 4) ROW_BLOCKS(INT8, 8) ROW_BLOCKS(SIX, 4) ROW_BLOCKS(SIX, 8)
#define ROW_OF(KIND, QS) {row_##KIND##_##QS##_1, row_##KIND##_##QS##_2, row_##KIND##_##QS##_3, row_##KIND##_##QS##_4}
static const RowBlock row_blocks[3][2][BLOCK_ROWS] = {{ROW_OF(NIBBLES, 4), ROW_OF(NIBBLES, 8)}, {ROW_OF(INT8, 4), ROW_OF(INT8, 8)}, {ROW_OF(SIX, 4), ROW_OF(SIX, 8)}};

/* Wide calls on AMX tiles (Intel Sapphire Rapids and later): tdpbssd multiplies a tile of 16 rows of x's signed bytes
   by a tile of a group's quads (a quad is 64 bytes: 16 columns x 4 k's, exactly a B tile's row), 16 x 16 x group
   multiply-adds an instruction. The integer sums are the integers vpdpbusd makes (less the weights' bias), and each row's fp32 chain
   below is rows_block's (a group's sums scaled in order, then the block's dx), so the tiles give rows_block's bits
   for every row: a call may take either path by its rows. A pair's groups are unpacked once a call into L1 (signed:
   the bias taken off), however many rows read them. */

#define TILES __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx512bf16,amx-tile,amx-int8")))

int amx_init(void); /* amx_linear.c: 1 where Linux lets this process use AMX tiles */

/* 1 where this CPU has AMX-INT8 and this process may use its tiles: asked once a process */
static int tiles_ready(void) {
    static int ready = -1;
    unsigned a, b, c, d;
    if (ready < 0) ready = __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d >> 24 & 1) && (d >> 25 & 1) && amx_init();
    return ready;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

/* tiles 0, 1: C (16 rows x 16 int32, one a block); 4: A (16 rows x a group's bytes); 6, 7: B (a group's quads) */
TILES static void configure_tiles(int group) {
    TileConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) cfg.rows[t] = t >= 6 ? group / 4 : 16, cfg.colsb[t] = t == 4 ? group : 64;
    _tile_loadconfig(&cfg);
}

/* a group's qs quads of one block as a B tile's rows in `buffer`, as signed bytes: the weights' bias (128 for int8,
   32 for 6-bit planes) taken off each, so tdpbssd's sums need no correction a row */
TILES static inline void tile_rows(int kind, int qs, const char *w, char *buffer) {
    __m512i quads[8];
    group_quads(kind, qs, w, quads);
    const __m512i bias = _mm512_set1_epi8(kind == INT8 ? (char)128 : kind == SIX ? 32 : 0);
    for (int i = 0; i < qs; i++) _mm512_store_si512(buffer + 64 * i, _mm512_sub_epi8(quads[i], bias));
}

/* rows_block for all m rows at once on tiles: each group's quads of both blocks unpacked once (the next pair's
   lines prefetched meanwhile), then per tile of 16 rows every group's integer sums into `sums` (a group's two C
   tiles side by side), then each row's chain as rows_block's. x's rows are padded to a multiple of 16 (zeros). */
TILES static void tiles_block(int kind, int qs, Rows x, int m, int block_index, const char *w0, const char *w1, size_t stride,
                              const __m512 *scales, const __m512 *offs, int offsets, float *out, const char *next, size_t block,
                              int lines, int l2, char *values, int32_t *sums) {
    const int groups = x.qblock / x.group;
    const size_t tile = 64 * (size_t)qs; /* a B tile's bytes */
    Share share = {0, 0};
    for (int gl = 0; gl < groups; gl++) {
        if (next) prefetch_share(next, block, lines, groups, &share, l2);
        tile_rows(kind, qs, w0 + gl * stride, values + 2 * gl * tile), tile_rows(kind, qs, w1 + gl * stride, values + (2 * gl + 1) * tile);
    }
    for (int t = 0; t < m; t += 16) {
        for (int gl = 0; gl < groups; gl++) {
            _tile_loadd(4, x.qx + (size_t)t * x.k + (block_index * groups + gl) * x.group, x.k);
            _tile_loadd(6, values + 2 * gl * tile, 64);
            _tile_loadd(7, values + (2 * gl + 1) * tile, 64);
            _tile_zero(0);
            _tile_zero(1);
            _tile_dpbssd(0, 4, 6);
            _tile_dpbssd(1, 4, 7);
            _tile_stored(0, sums + 512 * gl, 64);
            _tile_stored(1, sums + 512 * gl + 256, 64);
        }
        for (int r = t; r < t + 16 && r < m; r++) {
            __m512 p0 = _mm512_setzero_ps(), p1 = _mm512_setzero_ps();
            for (int gl = 0; gl < groups; gl++) {
                const __m512i s0 = _mm512_load_si512(sums + 512 * gl + 16 * (r - t)), s1 = _mm512_load_si512(sums + 512 * gl + 256 + 16 * (r - t));
                scale_group(x, r, block_index * groups + gl, offsets, s0, s1, scales + 2 * gl, offs + 2 * gl, &p0, &p1);
            }
            add_block(x, r, block_index, p0, p1, out + 32 * r);
        }
    }
}

/* 16 sums of a row into y (fp32, or bf16 where `bf16`) from column c of the row at `row` (+ bias, or NULL) */
TARGET static inline void write_out(__m512 v, const float *bias, void *y, int bf16, size_t row, int c) {
    if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + c));
    if (bf16) _mm256_storeu_si256((__m256i *)((uint16_t *)y + row + c), (__m256i)_mm512_cvtneps_pbh(v));
    else _mm512_storeu_ps((float *)y + row + c, v);
}

enum { GROUPS, SUPERS, HALVES }; /* how the blocks hold their scales (native.SCALINGS): fp32 a group, the K types' per 256
                                    k's, fp16 a group */

/* x (m, k) fp32, or bf16 where `bf16`; packed blocks (as quant_linear.c's, or the K types' per 256 k's where `scaling`
   is SUPERS: see native.pack_supers; fp16 scales where HALVES); bias (n) fp32 or NULL -> y (m, n) fp32 or bf16; k a
   multiple of 32 (of 256 where SUPERS), group 16 or 32. One parallel region a call: the rows quantized, then each thread's pairs of
   blocks summed into its own (m, 32) fp32 sums, in passes of up to 8 rows (rows_block), and written out (+ bias, rounded to
   y's type); on tiles where `tiles` (tiles_block), or each thread's blocks one at a time where few rows (row_block):
   the same bits. 1 where the buffers could not be allocated. */
TILES static int integer_linear(const void *x, const char *packed, const float *bias, void *y, int m, int n, int k, int bits,
                                int group, int offsets, int scaling, int threads, int l2, int bf16, int tiles) {
    const int qblock = qblock_of(k), supers = scaling == SUPERS, halves = scaling == HALVES;
    const size_t padded = tiles ? (size_t)(m + 15) / 16 * 16 : (size_t)m; /* x's rows as the tiles read them */
    const size_t rows = (size_t)m, width = (size_t)k, groups = width / group;
    /* a thread's (m, 32) sums of its current pair: whole cache lines of its own, read and written at every step
       (sharing a line with the other thread's, as malloc's alignment of the moment decided, cost a third of a step) */
    const size_t own = (rows * 32 * 4 + 63) / 64 * 64;
    char *buffer = malloc(padded * width + rows * (width / qblock) * 4 + rows * groups * 8 + (size_t)threads * own + 128);
    if (!buffer) return 1;
    int8_t *qx = (int8_t *)buffer;
    memset(qx + rows * width, 0, (padded - rows) * width);
    float *dx = (float *)(buffer + (padded * width + 3) / 4 * 4), *sums = dx + rows * (width / qblock);
    int32_t *biases = (int32_t *)(sums + rows * groups);
    char *outs = (char *)(((uintptr_t)(biases + rows * groups) + 63) & ~(uintptr_t)63);
    const Rows part = {qx, dx, sums, biases, k, qblock, group};
    const int kind = bits == 8 ? INT8 : bits == 6 ? SIX : NIBBLES, per_block = qblock / group; /* groups an activation block */
    const int qs = group / 4;
    const int blocks = n / 16, pairs = (blocks + 1) / 2;
    /* a group's fp32 (or fp16) scales (and offsets), then its quads; or, where `supers`, an activation block's (a
       super-block's) fp16 d (and dmin), its groups' int8 sc (and m), then its groups' quads */
    const size_t head = (offsets ? 2 : 1) * (halves || supers ? 32 : 64), values = (size_t)qs * quad_bytes(kind), group_bytes = head + values;
    const size_t super_head = head + (size_t)per_block * 16 * (offsets ? 2 : 1);
    const size_t span = supers ? super_head + per_block * values : per_block * group_bytes; /* an activation block's */
    const size_t first = supers ? super_head : head, stride = supers ? values : group_bytes; /* a group's values: at first + gl stride */
    const size_t block = (size_t)(k / qblock) * span;
    const int lines = (int)((span + 63) / 64), chunk = 256 / qblock; /* activation blocks a step: 256 k's (the scales' room) */
    const Blocks w = {offsets, supers, halves, per_block, head, span, first, stride};
    _Pragma("omp parallel num_threads(threads)") {
        _Pragma("omp for schedule(static)")
        for (int r = 0; r < m; r++)
            quantize_row((const char *)x + (size_t)r * k * (bf16 ? 2 : 4), bf16, k, qblock, group, kind == INT8 ? 128 : kind == SIX ? 32 : 0,
                         qx + (size_t)r * k, dx + (size_t)r * (k / qblock), sums + (size_t)r * groups, biases + (size_t)r * groups);
        float *out = (float *)(outs + (size_t)omp_get_thread_num() * own);
        __m512 scales[2 * 256 / 16], offs[2 * 256 / 16];
        char values[2 * 256 * 16] __attribute__((aligned(64)));     /* tiles: a pair's groups' quads, unpacked */
        int32_t tile_sums[2 * 256 / 16 * 256] __attribute__((aligned(64))); /* tiles: 16 rows' sums of a pair's groups */
        if (tiles) configure_tiles(group);
        if (m == 1 || (m <= BLOCK_ROWS && !supers)) { /* each block over all of K, in order (row_block) */
            const char *ahead = 0;
            _Pragma("omp for schedule(static)")
            for (int c = 0; c < blocks; c++) {
                __m512 v[BLOCK_ROWS];
                row_blocks[kind][qs == 8][m - 1](part, &w, packed + c * block, &ahead, l2, v);
                for (int r = 0; r < m; r++) write_out(v[r], bias, y, bf16, (size_t)r * n, 16 * c);
            }
        } else
        _Pragma("omp for schedule(static)")
        for (int q = 0; q < pairs; q++) {
            const char *w0 = packed + 2 * q * block, *w1 = 2 * q + 1 < blocks ? w0 + block : w0;
            const char *next = q + 1 < pairs ? w0 + 2 * block : 0;
            memset(out, 0, rows * 32 * 4);
            for (int b = 0; b < k / qblock; b += chunk) {
                const int nb = k / qblock - b < chunk ? k / qblock - b : chunk; /* activation blocks this step */
                const size_t start = (size_t)b * span;
                for (int half = 0; half < 2; half++) {
                    const char *at = (half ? w1 : w0) + start;
                    const __m512 d = supers ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)at)) : _mm512_setzero_ps();
                    const __m512 dmin = supers && offsets ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)at + 1)) : d;
                    for (int gl = 0; gl < nb * per_block; gl++) group_scales(&w, at, gl, d, dmin, &scales[2 * gl + half], &offs[2 * gl + half]);
                }
                if (tiles)
                    for (int i = 0; i < nb; i++)
                        tiles_block(kind, qs, part, m, b + i, w0 + start + i * span + first, w1 + start + i * span + first, stride,
                                    scales + 2 * i * per_block, offs + 2 * i * per_block, offsets, out,
                                    next ? next + start + i * span : 0, block, lines, l2, values, tile_sums);
                else
                    for (int r = 0, left = (m + MAX_ROWS - 1) / MAX_ROWS; r < m; left--) { /* passes left: 9 rows as 5 + 4 */
                        const int here = (m - r + left - 1) / left; /* the first pass prefetches; the others read the pair from cache */
                        rows_blocks[kind][qs == 8][here - 1](
                            from_row(part, r), b, nb, w0 + start + first, w1 + start + first, stride, scales, offs, offsets, out + 32 * r,
                            r ? 0 : next ? next + start : 0, block, nb * lines, l2);
                        r += here;
                    }
            }
            for (int r = 0; r < m; r++)
                for (int c = 32 * q; c < 32 * q + 32 && c < n; c += 16) /* a lone last block's twin is not written */
                    write_out(_mm512_loadu_ps(out + (size_t)r * 32 + c - 32 * q), bias, y, bf16, (size_t)r * n, c);
        }
        if (tiles) _tile_release();
    }
    free(buffer);
    return 0;
}

static double seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

static const int tile_candidates[] = {24, 48, 96, 192};
#define CANDIDATES (int)(sizeof tile_candidates / sizeof *tile_candidates)

/* The fewest rows from which int_linear runs a call on tiles (INT_MAX: never), measured once a process on the
   threads of its first call that could take them: what tiles cost against the registers is the CPU's. A model's
   products, tiles / registers, on a Xeon (m167): the 1.5B (Q4_K, Q6_K) 24 rows 130 / 139 ms, 128 rows 467 / 587,
   SmolLM2 (Q8_0) 24 rows 13.0 / 17.3, 64 rows 26.4 / 37.1, the 0.5B 24 rows 44.6 / 56.4; at 16 rows the kinds
   disagree (the 1.5B 99 / 84, the 0.5B 33.9 / 36.1), so 24 rows are the fewest tried. On an Emerald Rapids VM: the
   1.5B 16 rows 201 / 158, 128 rows 1116 / 1058, 192 rows 960 / 1054. The candidates' rows are timed both ways in
   turn (the fastest of 3, interleaved) on a 1024 x 1024 product of int8 blocks whose every byte is 0x3C (fp32 scales
   of 0.0115, normal), and the first where the tiles won is the answer (the tiles' lead grows with the rows): ~2 ms
   where that is 24 rows, as here, so a command's first prefill hardly waits. The same bits either way, so nothing but
   speed rides on it. */
static int tiles_from(int threads, int l2) {
    static int rows = 0;
    if (rows) return rows;
    if (!tiles_ready()) return rows = INT_MAX;
    const int n = 1024, k = 1024, most = tile_candidates[CANDIDATES - 1];
    const size_t weights = (size_t)n / 16 * (k / 32) * (64 + 8 * 64);
    char *packed = malloc(weights);
    float *x = malloc((size_t)most * k * 4), *y = malloc((size_t)most * n * 4);
    int from = INT_MAX;
    if (packed && x && y) {
        memset(packed, 0x3C, weights), memset(x, 0x3C, (size_t)most * k * 4);
        for (int c = 0; c < CANDIDATES && from == INT_MAX; c++) {
            double best[2] = {1e30, 1e30};
            for (int round = 0; round < 3; round++)
                for (int tiles = 0; tiles < 2; tiles++) {
                    const double start = seconds();
                    integer_linear(x, packed, 0, y, tile_candidates[c], n, k, 8, 32, 0, GROUPS, threads, l2, 0, tiles);
                    const double took = seconds() - start;
                    if (took < best[tiles]) best[tiles] = took;
                }
            if (best[1] < best[0]) from = tile_candidates[c];
        }
    }
    free(packed), free(x), free(y);
    return rows = from;
}

/* x (m, k) W^T (+ b): calls of tiles_from rows or more on AMX tiles where this process may use them, the rest in passes
   of up to 8 rows in registers: the same bits either way */
int int_linear(const void *x, const char *packed, const float *bias, void *y, int m, int n, int k, int bits, int group,
               int offsets, int scaling, int threads, int l2, int bf16) {
    const int tiles = m >= tile_candidates[0] && m >= tiles_from(threads, l2);
    return integer_linear(x, packed, bias, y, m, n, k, bits, group, offsets, scaling, threads, l2, bf16, tiles);
}

/* the rows from which int_linear takes tiles here, on `threads` threads (INT_MAX: never): tests, benchmarks */
int int_tile_rows(int threads) { return tiles_from(threads, 1); }

/* int_linear on tiles whatever the rows (tests, benchmarks); 2 where this CPU or process has no AMX-INT8 tiles */
int amx_int_linear(const void *x, const char *packed, const float *bias, void *y, int m, int n, int k, int bits, int group,
                   int offsets, int scaling, int threads, int l2, int bf16) {
    return tiles_ready() ? integer_linear(x, packed, bias, y, m, n, k, bits, group, offsets, scaling, threads, l2, bf16, 1) : 2;
}
