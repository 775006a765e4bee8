/* int_linear.c's integer quantized linear for CPUs without AVX-512 BF16: the AVX2 tier's (Haswell and later, Zen 1-3),
   the AVX-VNNI tier's (Intel's client chips from Alder Lake) and the AVX-512F tier's. The same blocks, the same
   rounding of each activation row to 8 bits and the same fp32 chain of each column's scales (see int_linear.c), so
   the same bits as the AVX-512 kernel; fp32 activations only (these tiers have no bf16 kernels: 2 if asked).

   But for the K types without VNNI (the AVX2 and AVX-512F tiers: native.SUB_SCALES), an arithmetic of their own, as
   ggml's AVX2 kernels do it: the vpmaddwd that widens the int16 pair sums multiplies them by the group's sc (an int8
   a column, twice a lane) in place of ones, so each column's integer sum over a super-block (an activation block:
   256 k's) is sum_g sc[g] sum_k q qx, exact in int32 (at most 256 x 63 x 127 x 128); the 6-bit planes' bias (32
   sum_g sc[g] sum qx) and the offsets' integer sum_g m[g] sum qx come two groups a vpmaddwd; then one fp32 step a
   super-block, d sum - dmin sum_m, times dx. Row-invariant as ever (integers, then one chain the same at any width),
   and within fp32 rounding of the other tiers; no fp32 chain a group (Qwen2.5-Coder-1.5B's products on the Xeon's
   AVX2 tier, interleaved, hot: 8-9% faster at 1-16 rows). VNNI's vpdpbusd leaves no vpmaddwd to carry the scales
   (a vpmulld a group instead, tried on the Xeon: 11-20% slower at 1-9 rows), so the VNNI tiers keep the fp32 chain.

   Each block of 16 columns is taken as two halves of 8: a quad's first 32 bytes hold columns 0-7 (byte 4c + j),
   its last 32 columns 8-15, so every unpacking of int_linear.c works on a half as it is. The integer sums:
   vpdpbusd on 8 lanes where the build has AVX-VNNI (or AVX512-VNNI with VL: the same instruction, EVEX-encoded, so
   the tests run this code on AVX-512 CPUs), else vpmaddubsw (pairs of unsigned x signed byte products summed into
   int16) then vpmaddwd by ones (into int32), as ggml's AVX2 kernels do. vpmaddubsw saturates at 2^15: nibbles
   (15 x 127 x 2) and 6-bit planes (63 x 127 x 2) never reach it, int8 weights biased to 0 .. 255 could, so here
   int8 weights are multiplied as |w| times x with w's sign (at most 128 x 127 x 2) on both paths, with no bias to
   take off; and up to 8 quads of nibbles (2 of 6-bit planes) are summed in int16 before one vpmaddwd widens them,
   still below 2^15. Integer sums are exact: the AVX-512 kernel's, whatever the instruction or order.

   A tile is up to 4 rows x both halves (each row's broadcast bytes serve two products), or, for 6-bit planes,
   3-4 rows x one half (`tile_halves`), over all of K (`tile`): its integer sums and a unit of quads within the 16
   registers, the fp32 sums spilled once a group where they must (4 x 2 tiles: Q4_K and int8 products at 4-16 rows
   ~8% faster than 4 x 1). The K types on integer sub-scales keep no fp32 sums in the group loop, and take up to 6 rows
   a tile, in as few tiles as hold a call's rows, as even as they go (the 1.5B's AVX2 products on the Xeon, hot, 5 / 9
   / 12 rows -15 / -3 / -11%, 4, 8 and 16 equal; tiles of 2 rows were 25% slower). The threads split the blocks of
   16 columns; each streams its blocks in order, the first tile of a block prefetching AHEAD bytes past what it reads
   (against the earlier kernel, one call an activation block and a half of 4 rows, whose prefetches gcc had left
   out: benchmarks.kernel_ab on a 2-core Zen 3, a forward's products streamed, SmolLM2 7.8 -> 5.3 ms at one row and
   52.2 -> 32.5 at 16; Qwen2.5-Coder-0.5B's Q8_0 32.8 -> 18.8 and 191 -> 117; the same bits): every line up to there,
   the scales' among the values' (a prefetch a unit at a fixed distance past the values had skipped each group's or
   super-block's scales, and a 6-bit unit's third line, so those came from memory when read: on a 2-core Zen 4 held
   to AVX2, the 1.5B's products 1 / 4 / 8 / 16 rows 49.8 / 69.2 / 101.7 / 168.7 -> 34.2 / 46.0 / 77.8 / 145.6 ms,
   SmolLM2's 1 / 5 rows 5.55 / 8.38 -> 3.74 / 6.60, the 0.5B's 21.3 / 34.6 -> 13.5 / 25.7). */

#include <immintrin.h>
#include <omp.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define TARGET __attribute__((target("avx2,fma,f16c")))
#define ALWAYS __attribute__((always_inline))

#define AHEAD 4096 /* bytes a streaming tile prefetches ahead of what it reads */

/* the line at p into L2 (prefetcht2) or non-temporally: __builtin_prefetch, as gcc 12 left out every _mm_prefetch of
   this file's inlined tiles */
static inline ALWAYS void prefetch(const char *p, int l2) {
    if (l2) __builtin_prefetch(p, 0, 1);
    else __builtin_prefetch(p, 0, 0);
}

enum { NIBBLES, INT8, SIX };     /* how a block holds its values, as int_linear.c's */
enum { GROUPS, SUPERS, HALVES }; /* how it holds its scales */

static inline int quad_bytes(int kind) { return kind == INT8 ? 64 : kind == SIX ? 48 : 32; }

#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
#define VNNI 1
#else
#define VNNI 0
#endif

/* acc + v in 16-bit lanes, in place: as an asm, so gcc keeps each row's chain (reassociated, its products were all
   made first and spilled) */
TARGET static inline ALWAYS __m256i add16(__m256i acc, __m256i v) {
    __asm__("vpaddw %1, %0, %0" : "+x"(acc) : "x"(v));
    return acc;
}

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

/* a row of x (fp32) -> qx, dx and each group's sum of qx (as a float, times `bias`, and as an int16: at most 32 x 127),
   as int_linear.c's */
TARGET static void quantize_row(const float *x, int k, int qblock, int group, int bias, int8_t *qx, float *dx, float *sums,
                                int32_t *biases, int16_t *totals) {
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
        sums[g] = (float)total, biases[g] = bias * total, totals[g] = (int16_t)total;
    }
}

/* 8 int8 (sc or m: one a column) as fp32 times a column's fp32 (d or dmin): one product, as int_linear.c's times */
TARGET static inline __m256 times(__m256 d, const char *bytes) {
    return _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)bytes))));
}

typedef struct {
    const int8_t *qx;
    const float *dx, *sums;
    const int32_t *biases;
    const int16_t *totals;
    int k, qblock, group;
} Rows; /* the quantized rows (row r's at r K, r K / qblock, r K / group) */

static inline Rows from_row(Rows x, int r) {
    const size_t groups = (size_t)r * (x.k / x.group);
    return (Rows){x.qx + (size_t)r * x.k, x.dx + (size_t)r * (x.k / x.qblock), x.sums + groups, x.biases + groups, x.totals + groups,
                  x.k, x.qblock, x.group};
}

typedef struct {
    int offsets, supers, halves, per_block; /* per_block: groups an activation block */
    size_t head, group_bytes, span, first, stride; /* as int_linear.c's: a group's scales' bytes, a group's, an activation
                                                      block's, where its first group's values lie, a group's values' stride */
} Blocks; /* how one call's blocks lie, set once a call */

/* one group's scales (and offsets) of half h of a block's activation block at `at`, as fp32: d sc and -(dmin m) of the
   K types (d, dmin: the activation block's, made once), fp16 or fp32 ones as they lie */
TARGET static inline ALWAYS void group_scales(const Blocks *w, const char *at, int h, int gl, __m256 d, __m256 dmin, __m256 *scale,
                                              __m256 *off) {
    const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32((int)0x80000000));
    if (w->supers) {
        *scale = times(d, at + w->head + 16 * gl + 8 * h);
        if (w->offsets) *off = _mm256_xor_ps(times(dmin, at + w->head + 16 * (w->per_block + gl) + 8 * h), sign);
    } else if (w->halves) {
        const char *g = at + gl * w->group_bytes;
        *scale = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(g + 16 * h)));
        if (w->offsets) *off = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(g + 32 + 16 * h)));
    } else {
        const float *g = (const float *)(at + gl * w->group_bytes);
        *scale = _mm256_loadu_ps(g + 8 * h);
        if (w->offsets) *off = _mm256_loadu_ps(g + 16 + 8 * h);
    }
}

/* 8 int8 (sc or m: one a column of a half) of group g at `a` and of group g + 1 at `b`, as vpmaddwd's int16 pairs:
   lane c (a[c], b[c]); a group's own pairs, (a[c], a[c]), where b is a */
TARGET static inline ALWAYS __m256i small_pairs(const char *a, const char *b) {
    return _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(_mm_loadl_epi64((const __m128i *)a), _mm_loadl_epi64((const __m128i *)b)));
}

/* a row's int16 sums of qx of groups g and g + 1 (`totals` + g, g even) as one int32, broadcast: vpmaddwd's other pair */
TARGET static inline ALWAYS __m256i total_pairs(const int16_t *totals) {
    int32_t both;
    memcpy(&both, totals, sizeof both);
    return _mm256_set1_epi32(both);
}

#define MAX_ROWS 6

/* ROWS (1 .. 6; 4 but for the K types' integer path) rows x HALVES (1 or 2) halves of one block (from half h0), over all of K: each unit of quads unpacked
   once and multiplied by every row (a row's four bytes broadcast once for both halves); without VNNI, `span` quads'
   vpmaddubsw pairs summed in int16, then widened by one vpmaddwd; each group's integer sums scaled (less the 6-bit
   planes' bias; + offsets times the group's sum of qx), each activation block's by its dx, in int_linear.c's order
   for every row and column, so any tile gives a row the same bits. Everything stays in registers but the tile's
   sums of earlier activation blocks. y: the rows' outputs at this block's first column, `n` apart
   (+ bias, likewise, or NULL); where `stream` (the block's first tile), AHEAD bytes on prefetched as it reads. */
TARGET static inline ALWAYS void tile(int kind, int qs, int ROWS, int HALVES, int integer, const Blocks *w, Rows x, const char *block,
                                      int h0, const float *bias, float *y, int n, int stream, int l2) {
    const int unit = kind == SIX ? 4 : 2, bytes = quad_bytes(kind), groups = x.qblock / x.group, tiles = ROWS * HALVES;
    const size_t row_groups = x.k / x.group, row_blocks = x.k / x.qblock; /* a row's groups and activation blocks */
    const int span = pairs_span(kind) < qs ? pairs_span(kind) : qs;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 out[MAX_ROWS * 2];
    const char *ahead = block + AHEAD; /* the next line to prefetch, where `stream`: the lines before, the block before's tile's */
    _Pragma("GCC unroll 12") for (int t = 0; t < tiles; t++) out[t] = _mm256_setzero_ps();
    for (int b = 0; b < (int)row_blocks; b++) {
        const char *at = block + (size_t)b * w->span;
        __m256 d[2], dmin[2], p[MAX_ROWS * 2];
        _Pragma("GCC unroll 2") for (int hh = 0; hh < HALVES; hh++) {
            d[hh] = w->supers ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(at + 16 * (h0 + hh)))) : _mm256_setzero_ps();
            dmin[hh] = w->supers && w->offsets ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(at + 32 + 16 * (h0 + hh)))) : d[hh];
        }
        _Pragma("GCC unroll 12") for (int t = 0; t < tiles; t++) p[t] = _mm256_setzero_ps();
        __m256i sum[MAX_ROWS * 2], pairs[MAX_ROWS * 2]; /* integer: the activation block's sums of sc times its groups' */
        for (int gl = 0; gl < groups; gl++) {
            const int g = b * groups + gl;
            const int8_t *xq = x.qx + (size_t)g * x.group;
            const char *values = at + w->first + gl * w->stride;
            __m256i scales16[2]; /* integer: each column's sc of this group, twice a lane (vpmaddwd's pairs, in place of ones) */
            if (integer) _Pragma("GCC unroll 2") for (int hh = 0; hh < HALVES; hh++) {
                const char *sc = at + w->head + 16 * gl + 8 * (h0 + hh);
                scales16[hh] = small_pairs(sc, sc);
            }
            if (!integer || gl == 0) _Pragma("GCC unroll 12") for (int t = 0; t < tiles; t++) sum[t] = _mm256_setzero_si256();
            _Pragma("GCC unroll 8") for (int q = 0; q < qs; q += unit) {
                if (stream) /* every line up to AHEAD bytes past this unit's, the scales' between the values' too */
                    for (const char *end = values + bytes * (q + unit) + AHEAD; ahead < end; ahead += 64) prefetch(ahead, l2);
                __m256i u[2][4];
                _Pragma("GCC unroll 2") for (int hh = 0; hh < HALVES; hh++) unit_quads(kind, values + bytes * q, h0 + hh, u[hh]);
                _Pragma("GCC unroll 4") for (int j = 0; j < unit; j++) {
                    __m256i a[2];
                    _Pragma("GCC unroll 2") for (int hh = 0; hh < HALVES; hh++) a[hh] = kind == INT8 ? _mm256_abs_epi8(u[hh][j]) : u[hh][j];
                    _Pragma("GCC unroll 6") for (int r = 0; r < ROWS; r++) {
                        const __m256i xb = _mm256_set1_epi32(*(const int32_t *)(xq + (size_t)r * x.k + 4 * (q + j)));
                        _Pragma("GCC unroll 2") for (int hh = 0; hh < HALVES; hh++) {
                            const int t = r * HALVES + hh;
                            const __m256i xs = kind == INT8 ? _mm256_sign_epi8(xb, u[hh][j]) : xb;
                            if (VNNI) sum[t] = dot(sum[t], a[hh], xs);
                            else { /* int16 sums of `span` quads, widened once */
                                const __m256i products = _mm256_maddubs_epi16(a[hh], xs);
                                pairs[t] = (q + j) % span ? add16(pairs[t], products) : products;
                                if ((q + j) % span == span - 1)
                                    sum[t] = _mm256_add_epi32(sum[t], _mm256_madd_epi16(pairs[t], integer ? scales16[hh] : ones));
                            }
                        }
                    }
                }
            }
            if (integer) continue;
            __m256 scale[2], off[2];
            _Pragma("GCC unroll 2") for (int hh = 0; hh < HALVES; hh++) group_scales(w, at, h0 + hh, gl, d[hh], dmin[hh], &scale[hh], &off[hh]);
            _Pragma("GCC unroll 6") for (int r = 0; r < ROWS; r++) {
                const size_t row_g = r * row_groups + g;
                _Pragma("GCC unroll 2") for (int hh = 0; hh < HALVES; hh++) {
                    const int t = r * HALVES + hh;
                    const __m256i s = kind == SIX ? _mm256_sub_epi32(sum[t], _mm256_set1_epi32(x.biases[row_g])) : sum[t];
                    p[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), scale[hh], p[t]);
                    if (w->offsets) p[t] = _mm256_fmadd_ps(off[hh], _mm256_set1_ps(x.sums[row_g]), p[t]);
                }
            }
        }
        if (integer) { /* the 6-bit planes' bias (32 sum sc qx) and the offsets' sum m qx, two groups a vpmaddwd; then
                          d and dmin, once an activation block (a K type's super-block) */
            __m256i less[MAX_ROWS * 2], mins[MAX_ROWS * 2];
            _Pragma("GCC unroll 12") for (int t = 0; t < tiles; t++) less[t] = mins[t] = _mm256_setzero_si256();
            for (int gl = 0; gl < groups; gl += 2) {
                __m256i sc[2], m[2];
                _Pragma("GCC unroll 2") for (int hh = 0; hh < HALVES; hh++) {
                    const char *at_sc = at + w->head + 16 * gl + 8 * (h0 + hh), *at_m = at_sc + 16 * w->per_block;
                    sc[hh] = kind == SIX ? small_pairs(at_sc, at_sc + 16) : _mm256_setzero_si256();
                    m[hh] = w->offsets ? small_pairs(at_m, at_m + 16) : _mm256_setzero_si256();
                }
                _Pragma("GCC unroll 6") for (int r = 0; r < ROWS; r++) {
                    const __m256i totals = total_pairs(x.totals + r * row_groups + b * groups + gl);
                    _Pragma("GCC unroll 2") for (int hh = 0; hh < HALVES; hh++) {
                        const int t = r * HALVES + hh;
                        if (kind == SIX) less[t] = _mm256_add_epi32(less[t], _mm256_madd_epi16(sc[hh], totals));
                        if (w->offsets) mins[t] = _mm256_add_epi32(mins[t], _mm256_madd_epi16(m[hh], totals));
                    }
                }
            }
            _Pragma("GCC unroll 12") for (int t = 0; t < tiles; t++) {
                const __m256i s = kind == SIX ? _mm256_sub_epi32(sum[t], _mm256_slli_epi32(less[t], 5)) : sum[t]; /* bias 32 */
                p[t] = _mm256_mul_ps(_mm256_cvtepi32_ps(s), d[t % HALVES]);
                if (w->offsets) p[t] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(mins[t]), dmin[t % HALVES], p[t]);
            }
        }
        _Pragma("GCC unroll 6") for (int r = 0; r < ROWS; r++) {
            const __m256 dx = _mm256_set1_ps(x.dx[r * row_blocks + b]);
            _Pragma("GCC unroll 2") for (int hh = 0; hh < HALVES; hh++) out[r * HALVES + hh] = _mm256_fmadd_ps(p[r * HALVES + hh], dx, out[r * HALVES + hh]);
        }
    }
    _Pragma("GCC unroll 6") for (int r = 0; r < ROWS; r++)
        _Pragma("GCC unroll 2") for (int hh = 0; hh < HALVES; hh++) {
            const int h = h0 + hh;
            __m256 v = out[r * HALVES + hh];
            if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + 8 * h));
            _mm256_storeu_ps(y + (size_t)r * n + 8 * h, v);
        }
}
/* the halves a tile of `rows` takes at once: both, but 3-4 rows of 6-bit planes one (their unit of four quads a half
   fills four registers: both halves were 4% slower) */
static inline int tile_halves(int kind, int rows) { return kind == SIX && rows > 2 ? 1 : 2; }

typedef void (*Tile)(const Blocks *, Rows, const char *, int, const float *, float *, int, int, int);
#define TILE(KIND, QS, ROWS, INTEGER)                                                                                      \
    TARGET static void tile_##KIND##_##QS##_##ROWS##_##INTEGER(const Blocks *w, Rows x, const char *block, int h0,          \
                                                               const float *bias, float *y, int n, int stream, int l2) {   \
        tile(KIND, QS, ROWS, tile_halves(KIND, ROWS), INTEGER, w, x, block, h0, bias, y, n, stream, l2);                    \
    }
#define TILES(KIND, QS, INTEGER) TILE(KIND, QS, 1, INTEGER) TILE(KIND, QS, 2, INTEGER) TILE(KIND, QS, 3, INTEGER) TILE(KIND, QS, 4, INTEGER) \
    TILE(KIND, QS, 5, INTEGER) TILE(KIND, QS, 6, INTEGER)
TILES(NIBBLES, 4, 0) TILES(NIBBLES, 8, 0) TILES(INT8, 4, 0) TILES(INT8, 8, 0) TILES(SIX, 4, 0) TILES(SIX, 8, 0)
#define TILES_OF(KIND, QS, INTEGER) {tile_##KIND##_##QS##_1_##INTEGER, tile_##KIND##_##QS##_2_##INTEGER, \
                                     tile_##KIND##_##QS##_3_##INTEGER, tile_##KIND##_##QS##_4_##INTEGER, \
                                     tile_##KIND##_##QS##_5_##INTEGER, tile_##KIND##_##QS##_6_##INTEGER}
#if !VNNI /* the K types (nibbles and 6-bit planes) with their sub-block scales on the integer sums; with VNNI they keep
            int_linear.c's fp32 chain: vpdpbusd leaves no vpmaddwd to carry the scales */
TILES(NIBBLES, 8, 1) TILES(SIX, 4, 1) TILES(SIX, 8, 1)
#endif
static const Tile tiles[1 + !VNNI][3][2][MAX_ROWS] = { /* [integer][kind][qs == 8][rows - 1] */
    {{TILES_OF(NIBBLES, 4, 0), TILES_OF(NIBBLES, 8, 0)}, {TILES_OF(INT8, 4, 0), TILES_OF(INT8, 8, 0)}, {TILES_OF(SIX, 4, 0), TILES_OF(SIX, 8, 0)}},
#if !VNNI
    {{TILES_OF(NIBBLES, 4, 0), TILES_OF(NIBBLES, 8, 1)}, {TILES_OF(INT8, 4, 0), TILES_OF(INT8, 8, 0)}, {TILES_OF(SIX, 4, 1), TILES_OF(SIX, 8, 1)}},
#endif
};

/* int_linear.c's int_linear, on fp32 x and y (bf16: 2); 1 where the buffers could not be allocated */
TARGET int int_linear(const void *x, const char *packed, const float *bias, void *y, int m, int n, int k, int bits, int group,
                      int offsets, int scaling, int threads, int l2, int bf16) {
    if (bf16) return 2;
    const int qblock = qblock_of(k), supers = scaling == SUPERS, halves = scaling == HALVES;
    const size_t rows = (size_t)m, width = (size_t)k, groups = width / group;
    char *buffer = malloc(rows * width + rows * (width / qblock) * 4 + rows * groups * 10 + 16);
    if (!buffer) return 1;
    int8_t *qx = (int8_t *)buffer;
    float *dx = (float *)(buffer + (rows * width + 3) / 4 * 4), *sums = dx + rows * (width / qblock);
    int32_t *biases = (int32_t *)(sums + rows * groups);
    int16_t *totals = (int16_t *)(biases + rows * groups);
    const Rows part = {qx, dx, sums, biases, totals, k, qblock, group};
    const int kind = bits == 8 ? INT8 : bits == 6 ? SIX : NIBBLES, per_block = qblock / group, qs = group / 4, blocks = n / 16;
    /* where each activation block's scales and values lie in a block: as int_linear.c reads them */
    const size_t head = (offsets ? 2 : 1) * (halves || supers ? 32 : 64), values = (size_t)qs * quad_bytes(kind), group_bytes = head + values;
    const size_t super_head = head + (size_t)per_block * 16 * (offsets ? 2 : 1);
    const size_t span = supers ? super_head + per_block * values : per_block * group_bytes;
    const Blocks w = {offsets, supers, halves, per_block, head, group_bytes, span, supers ? super_head : head, supers ? values : group_bytes};
    const size_t block = (size_t)(k / qblock) * span;
    const int integer = supers && !VNNI, split = (m + MAX_ROWS - 1) / MAX_ROWS; /* the K types on integer sub-scales: their tiles */
    _Pragma("omp parallel num_threads(threads)") {
        _Pragma("omp for schedule(static)")
        for (int r = 0; r < m; r++)
            quantize_row((const float *)x + (size_t)r * k, k, qblock, group, kind == SIX ? 32 : 0, qx + (size_t)r * k,
                         dx + (size_t)r * (k / qblock), sums + (size_t)r * groups, biases + (size_t)r * groups, totals + (size_t)r * groups);
        _Pragma("omp for schedule(static)")
        for (int c = 0; c < blocks; c++) {
            const char *at = packed + c * block;
            const float *b = bias ? bias + 16 * c : 0;
            float *out = (float *)y + 16 * c;
            for (int r = 0, i = 0; r < m; i++) { /* 4 rows at a time through both halves (6-bit planes: 3-4 through one, then
                                                    the other); the K types' on integer sub-scales in as few tiles of up to 6
                                                    as hold them, as even as they go (8 = 4 + 4, 9 = 5 + 4, 16 = 6 + 5 + 5) */
                const int rows = integer ? m / split + (i < m % split) : m - r < 4 ? m - r : 4;
                for (int h = 0; h < 2; h += tile_halves(kind, rows)) /* the first tile streams the block; the others read it from cache */
                    tiles[integer][kind][qs == 8][rows - 1](&w, from_row(part, r), at, h, b, out + (size_t)r * n, n, r == 0 && h == 0, l2);
                r += rows;
            }
        }
    }
    free(buffer);
    return 0;
}
