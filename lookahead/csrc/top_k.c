/* The k largest of each row of scores (fp32 or bf16), largest first (a tie: the lower index first; a NaN above all, as
   torch.argmax ranks it, so a row's first is its argmax: greedy verification reads it), for the step's recycled top-k over
   ~50k-token vocabularies: a running floor (the k-th largest so far) skips a vector of
   scores a compare, and the few that pass are sorted in. torch.topk took ~30 us a row (Zen 5, 49152 scores, k = 8).

   The threads split the columns as linear.c splits a product's (32 columns at a time, as OpenMP's static
   schedule does), so each reads the part of the logits its own core wrote, and the threads' lists of each row
   are merged (a tie: the lower thread's, whose columns come first). Right after lm_head's product, which has
   streamed its weights through the caches, the logits are mostly out of them, so the scan prefetches 2 KB
   ahead: 12 rows of 49152 bf16 scores 104 -> 46 us (30 once in cache), one row 36 -> 30 us (8).

   One code for both widths: 16 lanes and mask registers where the tier has AVX-512F, else 8 lanes of AVX2 with
   masks taken from the compare's sign bits (the AVX2 tiers, where torch.topk and
   numpy's argmax served before). The lanes past a row's end read as zero and are masked out of every compare. */

#include <immintrin.h>
#include <omp.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#if defined(__AVX512F__)
#define LANES 16
typedef __m512 vec;
typedef __mmask16 lanes_t;
static inline lanes_t lanes_in(int j, int n) { return j + LANES <= n ? 0xFFFF : (lanes_t)((1u << (n - j)) - 1); }
static inline vec load_fp32(const float *x, lanes_t in) { return _mm512_maskz_loadu_ps(in, x); }
static inline vec load_bf16(const uint16_t *x, lanes_t in) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(in, x)), 16));
}
static inline vec splat(float v) { return _mm512_set1_ps(v); }
static inline lanes_t above(vec v, vec floor, lanes_t in) { return _mm512_mask_cmp_ps_mask(in, v, floor, _CMP_NLE_UQ); } /* or NaN */
static inline lanes_t equal(vec v, vec w, lanes_t in) { return _mm512_mask_cmp_ps_mask(in, v, w, _CMP_EQ_OQ); }
static inline lanes_t unordered(vec v, lanes_t in) { return _mm512_mask_cmp_ps_mask(in, v, v, _CMP_UNORD_Q); }
static inline vec only(vec v, lanes_t in) { return _mm512_mask_blend_ps(in, splat(-__builtin_inff()), v); }
static inline vec larger(vec a, vec b) { return _mm512_max_ps(a, b); }
static inline float largest(vec v) { return _mm512_reduce_max_ps(v); }
#else
#define LANES 8
typedef __m256 vec;
typedef unsigned lanes_t;  /* bit i: lane i, as _mm256_movemask_ps gives them */
static inline lanes_t lanes_in(int j, int n) { return j + LANES <= n ? 0xFF : (1u << (n - j)) - 1; }
static inline __m256i lane_mask(lanes_t in) {  /* lane i all ones where bit i is set */
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(__builtin_popcount(in)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
static inline vec load_fp32(const float *x, lanes_t in) { return in == 0xFF ? _mm256_loadu_ps(x) : _mm256_maskload_ps(x, lane_mask(in)); }
static inline vec load_bf16(const uint16_t *x, lanes_t in) {
    uint16_t tail[LANES] = {0};
    if (in != 0xFF)
        for (int i = 0; i < __builtin_popcount(in); i++) tail[i] = x[i];
    const __m128i h = _mm_loadu_si128((const __m128i *)(in == 0xFF ? x : tail));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
static inline vec splat(float v) { return _mm256_set1_ps(v); }
static inline lanes_t above(vec v, vec floor, lanes_t in) { return (lanes_t)_mm256_movemask_ps(_mm256_cmp_ps(v, floor, _CMP_NLE_UQ)) & in; }
static inline lanes_t equal(vec v, vec w, lanes_t in) { return (lanes_t)_mm256_movemask_ps(_mm256_cmp_ps(v, w, _CMP_EQ_OQ)) & in; }
static inline lanes_t unordered(vec v, lanes_t in) { return (lanes_t)_mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)) & in; }
static inline vec only(vec v, lanes_t in) {
    return in == 0xFF ? v : _mm256_blendv_ps(splat(-__builtin_inff()), v, _mm256_castsi256_ps(lane_mask(in)));
}
static inline vec larger(vec a, vec b) { return _mm256_max_ps(a, b); }
static inline float largest(vec v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
#endif

/* whether a ranks above b: larger, or a NaN over a number (NaNs: the first above the others, as equals) */
static inline int greater(float a, float b) { return a > b || (a != a && b == b); }

static inline float bf16_float(uint16_t h) {
    union { uint32_t u; float f; } v = {(uint32_t)h << 16};
    return v.f;
}

/* the top-k of columns [j0, j1) of one row into (val, at), largest first; returns how many (k, or fewer columns) */
#define SCAN(TYPE, IN, SCALAR)                                                                                    \
    static int scan_##TYPE(const IN *x, int j0, int j1, int k, float *val, int64_t *at) {                      \
        int have = 0;                                                                                            \
        vec floor = splat(-__builtin_inff());                                                                    \
        for (int j = j0; j < j1; j += LANES) {                                                                   \
            _mm_prefetch((const char *)(x + j) + 2048, _MM_HINT_T0);                                            \
            const lanes_t in = lanes_in(j, j1);                                                                  \
            lanes_t pass = have < k ? in : above(load_##TYPE(x + j, in), floor, in);                            \
            while (pass) {                                                                                       \
                int c = j + __builtin_ctz(pass);                                                                 \
                pass &= pass - 1;                                                                                \
                float v = SCALAR;                                                                                \
                if (have == k && !greater(v, val[k - 1])) continue; /* the floor rose in these lanes */        \
                int i = have < k ? have++ : k - 1;            /* the slot it takes: the end, or the last one's */ \
                while (i > 0 && greater(v, val[i - 1])) { val[i] = val[i - 1]; at[i] = at[i - 1]; i--; }       \
                val[i] = v;                                                                                      \
                at[i] = c;                                                                                       \
                if (have == k) floor = splat(val[k - 1]);                                                        \
            }                                                                                                    \
        }                                                                                                        \
        return have;                                                                                             \
    }
SCAN(fp32, float, x[c])
SCAN(bf16, uint16_t, bf16_float(x[c]))

/* x (rows, n) contiguous, bf16 if `bf16` else fp32 -> out (rows, k) indices; k <= 64 and k <= n. Returns 0, or 1
   where its buffers could not be allocated. */
int top_k(const void *x, int bf16, int rows, int n, int k, int64_t *out, int threads) {
    const int pairs = (n + 31) / 32;  /* linear.c's unit of work: two blocks of 16 columns */
    float *val = malloc((size_t)threads * rows * k * sizeof(float));
    int64_t *at = malloc((size_t)threads * rows * k * sizeof(int64_t));
    int *have = calloc((size_t)threads * rows, sizeof(int));  /* a thread the team lacks keeps 0 */
    if (!val || !at || !have) {
        free(val), free(at), free(have);
        return 1;
    }
    #pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), n_t = omp_get_num_threads();
        const int share = pairs / n_t, extra = pairs % n_t;  /* the static schedule's: the first `extra` take one more */
        const int q0 = t * share + (t < extra ? t : extra), q1 = q0 + share + (t < extra);
        const int j0 = 32 * q0, j1 = 32 * q1 < n ? 32 * q1 : n;
        for (int r = 0; r < rows; r++) {
            const size_t mine = ((size_t)t * rows + r) * k;
            have[(size_t)t * rows + r] = bf16 ? scan_bf16((const uint16_t *)x + (size_t)r * n, j0, j1, k, val + mine, at + mine)
                                              : scan_fp32((const float *)x + (size_t)r * n, j0, j1, k, val + mine, at + mine);
        }
    }
    for (int r = 0; r < rows; r++) {  /* merge: each time the largest head, the lower thread's on a tie */
        int next[threads];
        for (int t = 0; t < threads; t++) next[t] = 0;
        for (int i = 0; i < k; i++) {
            int best = -1;
            for (int t = 0; t < threads; t++) {
                size_t list = ((size_t)t * rows + r) * k;
                if (next[t] < have[(size_t)t * rows + r] &&
                    (best < 0 || greater(val[list + next[t]], val[((size_t)best * rows + r) * k + next[best]])))
                    best = t;
            }
            out[(size_t)r * k + i] = at[((size_t)best * rows + r) * k + next[best]++];
        }
    }
    free(val), free(at), free(have);
    return 0;
}

/* The index of the largest of each row of x (rows, n), bf16 if `bf16` else fp32, as torch.argmax picks it: the first
   of equal ones, and the first NaN above all. For greedy verification, straight from the logits as the forward left
   them (no fp32 copy of a bf16 row): one pass for the row's largest (and whether it holds a NaN), one to find it. */
#define ARGMAX(TYPE, IN)                                                                                          \
    static int64_t argmax_##TYPE(const IN *x, int n) {                                                           \
        vec top = splat(-__builtin_inff());                                                                       \
        lanes_t nan = 0;                                                                                          \
        for (int j = 0; j < n; j += LANES) {                                                                      \
            const lanes_t in = lanes_in(j, n);                                                                    \
            const vec v = only(load_##TYPE(x + j, in), in);                                                       \
            nan |= unordered(v, in);                                                                              \
            top = larger(top, v);                                                                                 \
        }                                                                                                         \
        const vec best = splat(largest(top));                                                                     \
        for (int j = 0; j < n; j += LANES) {                                                                      \
            const lanes_t in = lanes_in(j, n);                                                                    \
            const vec v = load_##TYPE(x + j, in);                                                                 \
            const lanes_t hit = nan ? unordered(v, in) : equal(v, best, in);                                      \
            if (hit) return j + __builtin_ctz(hit);                                                               \
        }                                                                                                         \
        return 0; /* n == 0, or -inf throughout: the first */                                                     \
    }
ARGMAX(fp32, float)
ARGMAX(bf16, uint16_t)

/* Each row's into `out`, and the first row's returned: a greedy step's one row needs no output buffer (a numpy array's
   address alone, `.ctypes.data`, cost ~35 us of Python cold after a forward; `out` may then be NULL). */
int64_t argmax(const void *x, int bf16, int rows, int n, int64_t *out) {
    int64_t first = 0;
    for (int r = 0; r < rows; r++) {
        const int64_t i = bf16 ? argmax_bf16((const uint16_t *)x + (size_t)r * n, n) : argmax_fp32((const float *)x + (size_t)r * n, n);
        if (r == 0) first = i;
        if (out) out[r] = i;
    }
    return first;
}
