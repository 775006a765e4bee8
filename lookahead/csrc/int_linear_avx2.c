/* int_linear.c's integer quantized linear for CPUs without AVX-512 BF16: the AVX2 tier's (Haswell and later, Zen 1-3),
   the AVX-VNNI tier's (Intel's client chips from Alder Lake) and the AVX-512F tier's. The same blocks, the same
   rounding of each activation row to 8 bits and the same fp32 chain of each column's scales (see int_linear.c), so
   the same bits as the AVX-512 kernel; fp32 activations only (these tiers have no bf16 kernels: 2 if asked).

   Each block of 16 columns is taken as two halves of 8: a quad's first 32 bytes hold columns 0-7 (byte 4c + j),
   its last 32 columns 8-15, so every unpacking of int_linear.c works on a half as it is. The integer sums:
   vpdpbusd on 8 lanes where the build has AVX-VNNI (or AVX512-VNNI with VL: the same instruction, EVEX-encoded, so
   the tests run this code on AVX-512 CPUs), else vpmaddubsw (pairs of unsigned x signed byte products summed into
   int16) then vpmaddwd by ones (into int32), as ggml's AVX2 kernels do. vpmaddubsw saturates at 2^15: nibbles
   (15 x 127 x 2) and 6-bit planes (63 x 127 x 2) never reach it, int8 weights biased to 0 .. 255 could, so here
   int8 weights are multiplied as |w| times x with w's sign (at most 128 x 127 x 2) on both paths, with no bias to
   take off; and up to 8 quads of nibbles (2 of 6-bit planes) are summed in int16 before one vpmaddwd widens them,
   still below 2^15. Integer sums are exact: the AVX-512 kernel's, whatever the instruction or order.

   A tile is up to 4 rows x one half over an activation block: 4 integer sums, 4 fp32 partial sums, a unit of quads
   and a row's broadcast bytes, within the 16 registers. The threads split the blocks; the first tile of each
   activation block prefetches the next block's share of it, a few lines a unit. */

#include <immintrin.h>
#include <omp.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define TARGET __attribute__((target("avx2,fma,f16c")))
#define ALWAYS __attribute__((always_inline))

static inline void prefetch(const char *p, int l2) { l2 ? _mm_prefetch(p, _MM_HINT_T2) : _mm_prefetch(p, _MM_HINT_NTA); }

enum { NIBBLES, INT8, SIX };     /* how a block holds its values, as int_linear.c's */
enum { GROUPS, SUPERS, HALVES }; /* how it holds its scales */

static inline int quad_bytes(int kind) { return kind == INT8 ? 64 : kind == SIX ? 48 : 32; }

#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
#define VNNI 1
#else
#define VNNI 0
#endif

/* acc + the products of u's unsigned and s's signed bytes, four to a lane (vpdpbusd) */
TARGET static inline ALWAYS __m256i dot(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#elif VNNI
    return _mm256_dpbusd_epi32(acc, u, s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

/* without VNNI, how many quads' vpmaddubsw pairs (each at most 2 x 15 x 127, 2 x 63 x 127 or 2 x 128 x 127) an
   int16 lane sums before one vpmaddwd widens them: the most that stay below 2^15 */
static inline int pairs_span(int kind) { return kind == NIBBLES ? 8 : kind == SIX ? 2 : 1; }

/* a unit of one group's quads (an octet's two, two int8 quads as signed bytes, a quartet's four), half h, from at */
TARGET static inline ALWAYS void unit_quads(int kind, const char *at, int h, __m256i *quads) {
    const __m256i low = _mm256_set1_epi8(15);
    if (kind == NIBBLES) {
        const __m256i bytes = _mm256_loadu_si256((const __m256i *)(at + 32 * h));
        quads[0] = _mm256_and_si256(bytes, low), quads[1] = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low);
    } else if (kind == INT8) { /* stored + 128: the sign bit flipped back */
        const __m256i flip = _mm256_set1_epi8((char)0x80);
        quads[0] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(at + 32 * h)), flip);
        quads[1] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(at + 64 + 32 * h)), flip);
    } else { /* int_linear.c's quartet_planes */
        const __m256i a = _mm256_loadu_si256((const __m256i *)(at + 32 * h)), b = _mm256_loadu_si256((const __m256i *)(at + 64 + 32 * h));
        const __m256i t = _mm256_loadu_si256((const __m256i *)(at + 128 + 32 * h)), two = _mm256_set1_epi8(0x30);
        quads[0] = _mm256_or_si256(_mm256_and_si256(a, low), _mm256_and_si256(_mm256_slli_epi16(t, 4), two));
        quads[1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 4), low), _mm256_and_si256(_mm256_slli_epi16(t, 2), two));
        quads[2] = _mm256_or_si256(_mm256_and_si256(b, low), _mm256_and_si256(t, two));
        quads[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(b, 4), low), _mm256_and_si256(_mm256_srli_epi16(t, 2), two));
    }
}

/* the largest of 256, 128, 64, 32 k's that divides k (int_linear.c's qblock_of) */
static int qblock_of(int k) {
    for (int b = 256; b >= 32; b /= 2)
        if (k % b == 0) return b;
    return 0;
}

/* a row of x (fp32) -> qx, dx and each group's sum of qx (as a float, and times `bias`), as int_linear.c's */
TARGET static void quantize_row(const float *x, int k, int qblock, int group, int bias, int8_t *qx, float *dx, float *sums,
                                int32_t *biases) {
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int b = 0; b < k / qblock; b++) {
        __m256 amax = _mm256_setzero_ps();
        for (int at = b * qblock; at < (b + 1) * qblock; at += 8) amax = _mm256_max_ps(amax, _mm256_and_ps(_mm256_loadu_ps(x + at), magnitude));
        __m128 top4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        top4 = _mm_max_ps(top4, _mm_movehl_ps(top4, top4));
        const float top = _mm_cvtss_f32(_mm_max_ss(top4, _mm_shuffle_ps(top4, top4, 1))), inverse = top > 0.0f ? 127.0f / top : 0.0f;
        dx[b] = top / 127.0f;
        for (int at = b * qblock; at < (b + 1) * qblock; at += 8) {
            const __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + at), _mm256_set1_ps(inverse))); /* ties to even */
            const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
            _mm_storel_epi64((__m128i *)(qx + at), _mm_packs_epi16(words, words));
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

static inline Rows from_row(Rows x, int r) {
    const size_t groups = (size_t)r * (x.k / x.group);
    return (Rows){x.qx + (size_t)r * x.k, x.dx + (size_t)r * (x.k / x.qblock), x.sums + groups, x.biases + groups, x.k, x.qblock, x.group};
}

#define MAX_ROWS 4

/* ROWS (1 .. 4) rows x half h of a block over activation block `block_index`: each unit of quads unpacked once and
   multiplied by every row (one row in two chains: vpdpbusd's latency), each group's sums scaled (less the 6-bit
   planes' bias; + offsets times the group's sum of qx), then the block's dx, as int_linear.c's rows_block does a
   column. w: the block's first group's values, a group's `stride` bytes after the last's; out: the rows' 16 sums,
   16 apart; where `next`, the next block's `lines` of this activation block are prefetched over the units. */
TARGET static inline ALWAYS void rows_half(int kind, int qs, int ROWS, Rows x, int block_index, const char *w, int h, size_t stride,
                                           const __m256 *scales, const __m256 *offs, int offsets, float *out, const char *next,
                                           int lines, int l2) {
    const int groups = x.qblock / x.group, unit = kind == SIX ? 4 : 2, bytes = quad_bytes(kind), chains = VNNI && ROWS == 1 ? 2 : 1;
    const int span = pairs_span(kind) < qs ? pairs_span(kind) : qs;
    const int units = groups * qs / unit;
    __m256 p[MAX_ROWS];
    _Pragma("GCC unroll 4") for (int r = 0; r < ROWS; r++) p[r] = _mm256_setzero_ps();
    int line = 0;
    for (int gl = 0; gl < groups; gl++) {
        const int g = block_index * groups + gl;
        const int8_t *xq = x.qx + g * x.group;
        __m256i sum[MAX_ROWS + 1], pairs[MAX_ROWS];
        _Pragma("GCC unroll 5") for (int c = 0; c < ROWS + chains - 1; c++) sum[c] = _mm256_setzero_si256();
        _Pragma("GCC unroll 8") for (int q = 0; q < qs; q += unit) {
            if (next)
                for (const int until = lines * ((gl * qs + q) / unit + 1) / units; line < until; line++) prefetch(next + 64 * line, l2);
            __m256i u[4];
            unit_quads(kind, w + gl * stride + bytes * q, h, u);
            _Pragma("GCC unroll 4") for (int j = 0; j < unit; j++) {
                const __m256i a = kind == INT8 ? _mm256_abs_epi8(u[j]) : u[j];
                _Pragma("GCC unroll 4") for (int r = 0; r < ROWS; r++) {
                    __m256i xb = _mm256_set1_epi32(*(const int32_t *)(xq + (size_t)r * x.k + 4 * (q + j)));
                    if (kind == INT8) xb = _mm256_sign_epi8(xb, u[j]);
                    if (VNNI) {
                        const int c = r + (chains == 2 ? j % 2 : 0);
                        sum[c] = dot(sum[c], a, xb);
                    } else { /* int16 sums of `span` quads, widened once */
                        const __m256i products = _mm256_maddubs_epi16(a, xb);
                        pairs[r] = (q + j) % span ? _mm256_add_epi16(pairs[r], products) : products;
                        if ((q + j) % span == span - 1) sum[r] = _mm256_add_epi32(sum[r], _mm256_madd_epi16(pairs[r], _mm256_set1_epi16(1)));
                    }
                }
            }
        }
        if (chains == 2) sum[0] = _mm256_add_epi32(sum[0], sum[1]);
        _Pragma("GCC unroll 4") for (int r = 0; r < ROWS; r++) {
            const size_t at = (size_t)r * (x.k / x.group) + g;
            const __m256i s = kind == SIX ? _mm256_sub_epi32(sum[r], _mm256_set1_epi32(x.biases[at])) : sum[r];
            p[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), scales[gl], p[r]);
            if (offsets) p[r] = _mm256_fmadd_ps(offs[gl], _mm256_set1_ps(x.sums[at]), p[r]);
        }
    }
    _Pragma("GCC unroll 4") for (int r = 0; r < ROWS; r++) {
        const __m256 d = _mm256_set1_ps(x.dx[(size_t)r * (x.k / x.qblock) + block_index]);
        _mm256_storeu_ps(out + 16 * r + 8 * h, _mm256_fmadd_ps(p[r], d, _mm256_loadu_ps(out + 16 * r + 8 * h)));
    }
}
typedef void (*RowsHalf)(Rows, int, const char *, int, size_t, const __m256 *, const __m256 *, int, float *, const char *, int, int);
#define ROWS_HALF(KIND, QS, ROWS)                                                                                        \
    TARGET static void rows_##KIND##_##QS##_##ROWS(Rows x, int b, const char *w, int h, size_t stride, const __m256 *s,     \
                                                   const __m256 *o, int offsets, float *out, const char *next, int lines, \
                                                   int l2) {                                                              \
        rows_half(KIND, QS, ROWS, x, b, w, h, stride, s, o, offsets, out, next, lines, l2);                              \
    }
#define ROWS_HALVES(KIND, QS) ROWS_HALF(KIND, QS, 1) ROWS_HALF(KIND, QS, 2) ROWS_HALF(KIND, QS, 3) ROWS_HALF(KIND, QS, 4)
ROWS_HALVES(NIBBLES, 4) ROWS_HALVES(NIBBLES, 8) ROWS_HALVES(INT8, 4) ROWS_HALVES(INT8, 8) ROWS_HALVES(SIX, 4) ROWS_HALVES(SIX, 8)
#define ROWS_OF(KIND, QS) {rows_##KIND##_##QS##_1, rows_##KIND##_##QS##_2, rows_##KIND##_##QS##_3, rows_##KIND##_##QS##_4}
static const RowsHalf rows_halves[3][2][MAX_ROWS] = {{ROWS_OF(NIBBLES, 4), ROWS_OF(NIBBLES, 8)}, {ROWS_OF(INT8, 4), ROWS_OF(INT8, 8)},
                                                     {ROWS_OF(SIX, 4), ROWS_OF(SIX, 8)}};

/* 8 int8 (sc or m: one a column) as fp32 times a column's fp32 (d or dmin): one product, as int_linear.c's times */
TARGET static inline __m256 times(__m256 d, const char *bytes) {
    return _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)bytes))));
}

/* int_linear.c's int_linear, on fp32 x and y (bf16: 2); 1 where the buffers could not be allocated */
TARGET int int_linear(const void *x, const char *packed, const float *bias, void *y, int m, int n, int k, int bits, int group,
                      int offsets, int scaling, int threads, int l2, int bf16) {
    if (bf16) return 2;
    const int qblock = qblock_of(k), supers = scaling == SUPERS, halves = scaling == HALVES;
    const size_t rows = (size_t)m, width = (size_t)k, groups = width / group;
    /* a thread's (m, 16) sums of its current block: whole cache lines of its own, read and written at every step
       (sharing a line with the other thread's, as malloc's alignment of the moment decided, cost a third of a step) */
    const size_t own = (rows * 16 * 4 + 63) / 64 * 64;
    char *buffer = malloc(rows * width + rows * (width / qblock) * 4 + rows * groups * 8 + (size_t)threads * own + 128);
    if (!buffer) return 1;
    int8_t *qx = (int8_t *)buffer;
    float *dx = (float *)(buffer + (rows * width + 3) / 4 * 4), *sums = dx + rows * (width / qblock);
    int32_t *biases = (int32_t *)(sums + rows * groups);
    char *outs = (char *)(((uintptr_t)(biases + rows * groups) + 63) & ~(uintptr_t)63);
    const Rows part = {qx, dx, sums, biases, k, qblock, group};
    const int kind = bits == 8 ? INT8 : bits == 6 ? SIX : NIBBLES, per_block = qblock / group, qs = group / 4, blocks = n / 16;
    /* where each activation block's scales and values lie in a block: as int_linear.c reads them */
    const size_t head = (offsets ? 2 : 1) * (halves || supers ? 32 : 64), values = (size_t)qs * quad_bytes(kind), group_bytes = head + values;
    const size_t super_head = head + (size_t)per_block * 16 * (offsets ? 2 : 1);
    const size_t span = supers ? super_head + per_block * values : per_block * group_bytes;
    const size_t first = supers ? super_head : head, stride = supers ? values : group_bytes;
    const size_t block = (size_t)(k / qblock) * span;
    const int lines = (int)((span + 63) / 64);
    const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32((int)0x80000000));
    _Pragma("omp parallel num_threads(threads)") {
        _Pragma("omp for schedule(static)")
        for (int r = 0; r < m; r++)
            quantize_row((const float *)x + (size_t)r * k, k, qblock, group, kind == SIX ? 32 : 0, qx + (size_t)r * k,
                         dx + (size_t)r * (k / qblock), sums + (size_t)r * groups, biases + (size_t)r * groups);
        float *out = (float *)(outs + (size_t)omp_get_thread_num() * own);
        __m256 scales[256 / 16], offs[256 / 16];
        _Pragma("omp for schedule(static)")
        for (int c = 0; c < blocks; c++) {
            const char *w = packed + c * block, *next = c + 1 < blocks ? w + block : 0;
            memset(out, 0, rows * 16 * 4);
            for (int b = 0; b < k / qblock; b++) {
                const char *at = w + (size_t)b * span;
                for (int h = 0; h < 2; h++) {
                    for (int gl = 0; gl < per_block; gl++) {
                        if (supers) { /* d sc and -(dmin m), as quants.py's decoders make them */
                            scales[gl] = times(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(at + 16 * h))), at + head + 16 * gl + 8 * h);
                            if (offsets)
                                offs[gl] = _mm256_xor_ps(times(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(at + 32 + 16 * h))),
                                                               at + head + 16 * (per_block + gl) + 8 * h), sign);
                        } else if (halves) {
                            const char *g = at + gl * group_bytes;
                            scales[gl] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(g + 16 * h)));
                            if (offsets) offs[gl] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(g + 32 + 16 * h)));
                        } else {
                            const float *g = (const float *)(at + gl * group_bytes);
                            scales[gl] = _mm256_loadu_ps(g + 8 * h);
                            if (offsets) offs[gl] = _mm256_loadu_ps(g + 16 + 8 * h);
                        }
                    }
                    for (int r = 0; r < m; r += MAX_ROWS) /* the first tile prefetches; the others read the block from cache */
                        rows_halves[kind][qs == 8][(m - r < MAX_ROWS ? m - r : MAX_ROWS) - 1](
                            from_row(part, r), b, at + first, h, stride, scales, offs, offsets, out + 16 * r,
                            r == 0 && h == 0 && next ? next + (size_t)b * span : 0, lines, l2);
                }
            }
            for (int r = 0; r < m; r++)
                for (int half = 0; half < 16; half += 8) {
                    __m256 v = _mm256_loadu_ps(out + (size_t)r * 16 + half);
                    if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + 16 * c + half));
                    _mm256_storeu_ps((float *)y + (size_t)r * n + 16 * c + half, v);
                }
        }
    }
    free(buffer);
    return 0;
}
