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
   the tiles' fp32 sums are rounded to bf16 as linear.c does. */

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

void quant_bf16_chunk(const char *w, int chunk, int bits, int group, int offsets, uint16_t *tile); /* quant_linear.c */

/* C tile `t` += A x the k chunk `ch` of block `b` of the quad at `w` (if the quad has that block): the block's
   lines in place, or a quantized block's chunk dequantized into `tile` first */
#define STEP(t, b, bt)                                                                                            \
    if (b < count) {                                                                                              \
        if (bits) {                                                                                               \
            quant_bf16_chunk(w + (size_t)b * block, ch, bits, group, offsets, tile[b]);                          \
            _tile_loadd(bt, tile[b], 64);                                                                         \
        } else                                                                                                    \
            _tile_loadd(bt, w + (size_t)b * block + (size_t)ch * 1024, 64);                                      \
        _tile_dpbf16ps(t, 4, bt);                                                                                 \
    }

/* bits 0: packed as linear.c's blocks; 8 or 4: quant_linear.c's (groups of `group` k's, `offsets` or not) */
static void amx_linear(const uint16_t *x, const char *packed, const float *bias, uint16_t *y, int m, int n, int k,
                       int bits, int group, int offsets, int threads, int l2) {
    const int chunks = k / 32, blocks = n / 16, quads = (blocks + 3) / 4, tiles = (m + 15) / 16;
    const int rows_a_tile = m < 16 ? m : 16; /* up to 16 rows: tiles of exactly m rows; more: 16, zero-padded */
    const size_t block = bits ? (size_t)(k / group) * ((offsets ? 128 : 64) + (size_t)group * 16 * bits / 8) : (size_t)k * 32;
    const size_t chunk_bytes = block / chunks; /* bytes */
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
        uint16_t tile[4][512] __attribute__((aligned(64))); /* one a block: a block's B tile is written while the last loads */
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
                        for (int b = 0; b < after; b++)
                            for (size_t line = 0; line < chunk_bytes; line += 64) prefetch(next + (size_t)b * block + ch * chunk_bytes + line, l2);
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

void amx_bf16_linear(const uint16_t *x, const char *packed, const float *bias, uint16_t *y, int m, int n, int k,
                     int threads, int l2) {
    amx_linear(x, packed, bias, y, m, n, k, 0, 0, 0, threads, l2);
}

/* quant_linear.c's weights on AMX tiles: each chunk of 32 k's dequantized to bf16 (rounded once) into a B tile */
void amx_quant_linear(const uint16_t *x, const char *packed, const float *bias, uint16_t *y, int m, int n, int k,
                      int bits, int group, int offsets, int threads, int l2) {
    amx_linear(x, packed, bias, y, m, n, k, bits, group, offsets, threads, l2);
}
