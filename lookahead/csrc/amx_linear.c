/* The bf16 linear on AMX tiles (Intel Sapphire Rapids and later): y (M, N) = x (M, K) W^T (+ b), W in the same
   packed blocks as linear.c's. A block's 64-byte lines (16 columns x one pair of k) are exactly AMX's B layout,
   so 16 lines are one B tile, loaded in place:

       block nb, lines 16c .. 16c+15      -> B tile (16 rows of 64 bytes: k pairs 16c.., 16 columns)
       x rows r .. r+15, k 32c .. 32c+31   -> A tile (16 rows of 64 bytes)     C (16 x 16 fp32) += A B

   One tdpbf16ps does 16 x 16 x 32 multiply-adds, so 16 rows cost the arithmetic one row costs the vector units
   (linear.c's tiles are bound by arithmetic from ~9 rows on a 2-core Xeon). The threads split the blocks four at
   a time (four C tiles in flight: two were bound by the products' latency), and the weight streams once as in
   linear.c, the next four blocks prefetched (into L2 or non-temporally, as there).

   Row-invariant by construction: up to 16 rows make tiles of exactly M rows (more: tiles of 16, x copied with
   zero rows after it), every row is multiplied by the same B tiles in the same order of k whatever M is, and
   rows never mix, so row i of an M-row product equals the one-row product bit for bit. It is not bit-equal to
   linear.c's vdpbf16ps path (another order of the pair sums), so a process uses one or the other for every row
   count (native.py). Needs K % 32 == 0; the rest of
   the tiles' fp32 sums are rounded to bf16 as linear.c does.

   amx_quant_linear, further down, runs quant_linear.c's quantized blocks on the same tiles. */

#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* 1 when this process may use AMX tiles (Linux grants them on request), else 0 */
int amx_init(void) { return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0; }

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* Each call configures its threads' tiles and releases them at its end: other code on these threads (oneDNN's
   bf16 kernels) configures and releases tiles of its own, so a configuration cannot be kept between calls. */
static void configure(int rows) { /* tiles 0-3: C (four blocks, rows x 16 fp32); 4: A (rows x 32 bf16); 5, 6: B */
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 7; t++) cfg.rows[t] = t < 5 ? rows : 16, cfg.colsb[t] = 64;
    _tile_loadconfig(&cfg);
}

static inline void prefetch(const char *p, int l2) { l2 ? _mm_prefetch(p, _MM_HINT_T2) : _mm_prefetch(p, _MM_HINT_NTA); }

static void put(uint16_t *y, const float *c, const float *bias, int rows, int n) { /* C (16 x 16 fp32) -> y rows */
    for (int r = 0; r < rows; r++) {
        __m512 s = _mm512_loadu_ps(c + 16 * r);
        if (bias) s = _mm512_add_ps(s, _mm512_loadu_ps(bias));
        _mm256_storeu_si256((__m256i *)(y + (size_t)r * n), (__m256i)_mm512_cvtneps_pbh(s));
    }
}

/* C tile `t` += A x the k chunk `ch` of block `b` of the quad at `w` (if the quad has that block) */
#define STEP(t, b, bt)                                                                                            \
    if (b < count) {                                                                                              \
        _tile_loadd(bt, w + (size_t)b * block + (size_t)ch * 1024, 64);                                          \
        _tile_dpbf16ps(t, 4, bt);                                                                                 \
    }

void amx_bf16_linear(const uint16_t *x, const char *packed, const float *bias, uint16_t *y, int m, int n, int k,
                     int threads, int l2) {
    const int lines = k / 2, chunks = k / 32, blocks = n / 16, quads = (blocks + 3) / 4, tiles = (m + 15) / 16;
    const int rows_a_tile = m < 16 ? m : 16; /* up to 16 rows: tiles of exactly m rows; more: 16, zero-padded */
    const size_t block = (size_t)lines * 64; /* bytes */
    const uint16_t *a = x;
    uint16_t *padded = 0;
    if (m > 16) {
        padded = aligned_alloc(64, (size_t)tiles * 16 * k * 2);
        if (!padded) return;
        memcpy(padded, x, (size_t)m * k * 2);
        memset(padded + (size_t)m * k, 0, (size_t)(tiles * 16 - m) * k * 2);
        a = padded;
    }
    _Pragma("omp parallel num_threads(threads)") {
        configure(rows_a_tile);
        float c[256] __attribute__((aligned(64)));
        _Pragma("omp for schedule(static)") for (int q = 0; q < quads; q++) {
            const char *w = packed + 4 * q * block, *next = q + 1 < quads ? w + 4 * block : 0;
            const int count = blocks - 4 * q < 4 ? blocks - 4 * q : 4, after = q + 1 < quads ? (blocks - 4 * q - 4 < 4 ? blocks - 4 * q - 4 : 4) : 0;
            for (int t = 0; t < tiles; t++) {
                const uint16_t *at = a + (size_t)t * 16 * k;
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                for (int ch = 0; ch < chunks; ch++) {
                    if (next && t == 0)
                        for (int p = 0; p < 16 * after; p++) prefetch(next + (size_t)(p >> 4) * block + (size_t)ch * 1024 + (p & 15) * 64, l2);
                    _tile_loadd(4, at + 32 * ch, k * 2);
                    STEP(0, 0, 5) STEP(1, 1, 6) STEP(2, 2, 5) STEP(3, 3, 6)
                }
                const int rows = m - 16 * t < 16 ? m - 16 * t : 16;
                uint16_t *yt = y + (size_t)16 * t * n + 64 * q;
                const float *bq = bias ? bias + 64 * q : 0;
#define PUT(b)                                                                                                    \
    if (b < count) {                                                                                              \
        _tile_stored(b, c, 64);                                                                                   \
        put(yt + 16 * b, c, bq ? bq + 16 * b : 0, rows, n);                                                       \
    }
                PUT(0) PUT(1) PUT(2) PUT(3)
            }
        }
        _tile_release();
    }
    free(padded);
}

/* The quantized linear (quant_linear.c's blocks) on AMX tiles, bf16 x and y: per block and group of k's, the tile
   product of x and the integers q themselves (exact in bf16: |q| < 128), then scaled in fp32 as the group's sums:

       y[r][n] = sum over groups g of  s[n][g] * (x[r] . q[n])_g  (+ o[n][g] * (sum of x[r] over g))

   A B tile is a chunk of 32 k's of 16 columns, q widened to bf16 (a step of 32 values: k's 16 columns, then
   k + 1's, as the tiles' pairs want them: column c's k, k + 1 side by side); a group of 16 k's (Q6_K) takes the
   chunk's tile with an A tile whose other half is zero. The weights are never rounded (only x is bf16), and
   each row's sums are made in the same order whatever M is: row-invariant. The threads split the blocks four at a
   time (two for groups of 16: four C tiles, one a block and group), the next ones prefetched chunk by chunk.

   Measured on the 2-core Xeon, SmolLM2's lm_head (49152 x 576, Q8_0), bf16, one row / 16 rows: 1.05 / 1.29 ms
   (the dense bf16 weight on AMX: 1.17 / 1.22; quant_linear.c's tiles: 0.64 / 3.5). Dequantizing into bf16
   weights in the B tile instead (~13 instructions for 32 weights against ~6 here, and every weight rounded) took
   1.23 / 1.47 ms; one C tile instead of four (each chunk's product, store and scaling in one dependent chain),
   1.25 ms at one row. */

static const uint16_t NIBBLES[32] __attribute__((aligned(64))) = { /* bf16 of 0 .. 15 (then unused) */
    0x0000, 0x3f80, 0x4000, 0x4040, 0x4080, 0x40a0, 0x40c0, 0x40e0, 0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170};

/* `lines` lines of a B tile: as many steps (32 values, int8 or nibbles) widened to bf16 integers, in pairs */
static inline void integers(const char *steps, int bits, uint16_t *tile, int lines) {
    const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21, 5,
                                           20, 4, 19, 3, 18, 2, 17, 1, 16, 0); /* k's column c and k + 1's, side by side */
    const __m512i table = _mm512_load_si512(NIBBLES);
    for (int line = 0; line < lines; line++) {
        __m512i v;
        if (bits == 8) {
            const __m512 a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(steps + 32 * line))));
            const __m512 b = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(steps + 32 * line + 16))));
            v = _mm512_permutexvar_epi16(pairs, (__m512i)_mm512_cvtne2ps_pbh(b, a));
        } else {
            const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(steps + 16 * line)));
            const __m512i nib = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(bytes, _mm256_set1_epi16(15))),
                                                   _mm256_srli_epi16(bytes, 4), 1);
            v = _mm512_permutexvar_epi16(_mm512_permutexvar_epi16(pairs, nib), table);
        }
        _mm512_store_si512(tile + 32 * line, v);
    }
}

static void configure_quant(int rows) { /* tiles 0-3: C (rows x 16 fp32); 4, 5: A (rows x 32 bf16); 6, 7: B */
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) cfg.rows[t] = t < 6 ? rows : 16, cfg.colsb[t] = 64;
    _tile_loadconfig(&cfg);
}

/* C tile `t` (slot t: block t / halves of the pass, half t % halves of the chunk) = A of that half x its block's B
   tile, in tile 6 or 7 by the block's parity (loaded when the slot is its block's first) */
#define DOT(t, bt)                                                                                                \
    {                                                                                                             \
        if (t % halves == 0) _tile_loadd(bt, tile[t / halves], 64);                                               \
        _tile_zero(t);                                                                                            \
        if (t % halves == 0)                                                                                      \
            _tile_dpbf16ps(t, 4, bt);                                                                             \
        else                                                                                                      \
            _tile_dpbf16ps(t, 5, bt);                                                                             \
    }
#define SLOT(t)                                                                                                   \
    if (t / halves < count) {                                                                                     \
        if ((t / halves) % 2 == 0)                                                                                \
            DOT(t, 6)                                                                                             \
        else                                                                                                      \
            DOT(t, 7)                                                                                             \
    }
#define STORE(t)                                                                                                  \
    if (t / halves < count) _tile_stored(t, c[t], 64);

/* 1 where a buffer could not be allocated */
int amx_quant_linear(const uint16_t *x, const char *packed, const float *bias, uint16_t *y, int m, int n, int k, int bits,
                     int group, int offsets, int threads, int l2) {
    const int chunks = k / 32, blocks = n / 16, tiles = (m + 15) / 16, halves = 32 / group, groups = k / group;
    const int per = 4 / halves, passes = (blocks + per - 1) / per; /* blocks a pass: four C tiles, one a block and half */
    const int rows_a_tile = m < 16 ? m : 16;
    const size_t head = offsets ? 128 : 64, group_bytes = head + (size_t)group * 16 * bits / 8;
    const size_t block = (size_t)groups * group_bytes, chunk_bytes = block / chunks;
    /* A: x itself for up to 16 rows and groups of 32 (tiles of exactly m rows); else a copy with each row tile's
       rows (16, zero-padded past m), once per half of a chunk (the other half zero for groups of 16). sums: each
       row's sum over each group (for the offsets), in order */
    const int copied = halves == 2 || m > 16;
    uint16_t *copy = copied ? aligned_alloc(64, (size_t)halves * tiles * 16 * k * 2) : 0;
    float *sums = offsets ? aligned_alloc(64, ((size_t)tiles * 16 * groups * 4 + 63) / 64 * 64) : 0;
    if ((copied && !copy) || (offsets && !sums)) {
        free(copy), free(sums);
        return 1;
    }
    const uint16_t *a = copied ? copy : x;
    if (copied) {
        memset(copy, 0, (size_t)halves * tiles * 16 * k * 2);
        for (int h = 0; h < halves; h++)
            for (int r = 0; r < m; r++)
                for (int kk = 0; kk < k; kk++)
                    if (halves == 1 || (kk % 32 < 16) == (h == 0)) copy[((size_t)h * tiles * 16 + r) * k + kk] = x[(size_t)r * k + kk];
    }
    if (offsets)
        for (int r = 0; r < m; r++)
            for (int g = 0; g < groups; g++) {
                float sum = 0;
                for (int kk = g * group; kk < (g + 1) * group; kk++) {
                    const uint32_t bits32 = (uint32_t)x[(size_t)r * k + kk] << 16;
                    float v;
                    memcpy(&v, &bits32, 4);
                    sum += v;
                }
                sums[(size_t)r * groups + g] = sum;
            }
    _Pragma("omp parallel num_threads(threads)") {
        configure_quant(rows_a_tile);
        float c[4][256] __attribute__((aligned(64))), acc[4][256] __attribute__((aligned(64)));
        uint16_t tile[4][512] __attribute__((aligned(64)));
        _Pragma("omp for schedule(static)") for (int p = 0; p < passes; p++) {
            const char *w = packed + (size_t)p * per * block;
            const int count = blocks - p * per < per ? blocks - p * per : per;
            const int after = p + 1 < passes ? (blocks - (p + 1) * per < per ? blocks - (p + 1) * per : per) : 0;
            for (int t = 0; t < tiles; t++) {
                const int rows = m - 16 * t < 16 ? m - 16 * t : 16;
                memset(acc, 0, sizeof acc);
                for (int ch = 0; ch < chunks; ch++) {
                    if (t == 0)
                        for (int b = 0; b < after; b++)
                            for (size_t line = 0; line < chunk_bytes; line += 64) prefetch(w + (size_t)(per + b) * block + ch * chunk_bytes + line, l2);
                    for (int b = 0; b < count; b++) /* the chunk's steps: one group's 16, or two groups' 8 each */
                        for (int i = 0; i < halves; i++)
                            integers(w + (size_t)b * block + (size_t)(ch * halves + i) * group_bytes + head, bits, tile[b] + 512 / halves * i, 16 / halves);
                    for (int h = 0; h < halves; h++)
                        if (h == 0)
                            _tile_loadd(4, a + (size_t)t * 16 * k + 32 * ch, k * 2);
                        else
                            _tile_loadd(5, a + ((size_t)tiles * 16 + (size_t)t * 16) * k + 32 * ch, k * 2);
                    SLOT(0) SLOT(1) SLOT(2) SLOT(3)
                    STORE(0) STORE(1) STORE(2) STORE(3)
                    for (int sl = 0; sl < count * halves; sl++) { /* each slot's sums, scaled into its block's */
                        const int b = sl / halves, g = ch * halves + sl % halves;
                        const char *at = w + (size_t)b * block + (size_t)g * group_bytes;
                        const __m512 s = _mm512_loadu_ps((const float *)at), o = offsets ? _mm512_loadu_ps((const float *)at + 16) : s;
                        for (int r = 0; r < rows; r++) {
                            __m512 v = _mm512_fmadd_ps(_mm512_load_ps(c[sl] + 16 * r), s, _mm512_load_ps(acc[b] + 16 * r));
                            if (offsets) v = _mm512_fmadd_ps(_mm512_set1_ps(sums[(size_t)(16 * t + r) * groups + g]), o, v);
                            _mm512_store_ps(acc[b] + 16 * r, v);
                        }
                    }
                }
                for (int b = 0; b < count; b++)
                    put(y + (size_t)16 * t * n + 16 * (p * per + b), acc[b], bias ? bias + 16 * (p * per + b) : 0, rows, n);
            }
        }
        _tile_release();
    }
    free(copy), free(sums);
    return 0;
}
