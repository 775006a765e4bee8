/* The k largest of each row of scores (fp32 or bf16), largest first (a tie: the lower index first), for the
   step's recycled top-k over ~50k-token vocabularies: a running floor (the k-th largest so far) skips 16 scores
   a compare, and the few that pass are sorted in. torch.topk took ~30 us a row (Zen 5, 49152 scores, k = 8).

   The threads split the columns as linear.c splits a product's (32 columns at a time, as OpenMP's static
   schedule does), so each reads the part of the logits its own core wrote, and the threads' lists of each row
   are merged (a tie: the lower thread's, whose columns come first). Right after lm_head's product, which has
   streamed its weights through the caches, the logits are mostly out of them, so the scan prefetches 2 KB
   ahead: 12 rows of 49152 bf16 scores 104 -> 46 us (30 once in cache), one row 36 -> 30 us (8). */

#include <immintrin.h>
#include <omp.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

static inline float bf16_float(uint16_t h) {
    union { uint32_t u; float f; } v = {(uint32_t)h << 16};
    return v.f;
}

/* the top-k of columns [j0, j1) of one row into (val, at), largest first; returns how many (k, or fewer columns) */
#define SCAN(TYPE, IN, LOAD, SCALAR)                                                                            \
    static int scan_##TYPE(const IN *x, int j0, int j1, int k, float *val, int64_t *at) {                      \
        int have = 0;                                                                                            \
        __m512 floor = _mm512_set1_ps(-__builtin_inff());                                                       \
        for (int j = j0; j < j1; j += 16) {                                                                      \
            _mm_prefetch((const char *)(x + j) + 2048, _MM_HINT_T0);                                            \
            __mmask16 in = j + 16 <= j1 ? 0xFFFF : (__mmask16)((1u << (j1 - j)) - 1);                           \
            __mmask16 pass = have < k ? in : _mm512_mask_cmp_ps_mask(in, LOAD, floor, _CMP_GT_OQ);            \
            while (pass) {                                                                                       \
                int c = j + __builtin_ctz(pass);                                                                 \
                pass &= pass - 1;                                                                                \
                float v = SCALAR;                                                                                \
                if (have == k && !(v > val[k - 1])) continue; /* the floor rose within this 16 */               \
                int i = have < k ? have++ : k - 1;            /* the slot it takes: the end, or the last one's */ \
                while (i > 0 && v > val[i - 1]) { val[i] = val[i - 1]; at[i] = at[i - 1]; i--; }                \
                val[i] = v;                                                                                      \
                at[i] = c;                                                                                       \
                if (have == k) floor = _mm512_set1_ps(val[k - 1]);                                               \
            }                                                                                                    \
        }                                                                                                        \
        return have;                                                                                             \
    }
SCAN(fp32, float, _mm512_maskz_loadu_ps(in, x + j), x[c])
SCAN(bf16, uint16_t, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(in, x + j)), 16)),
     bf16_float(x[c]))

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
                    (best < 0 || val[list + next[t]] > val[((size_t)best * rows + r) * k + next[best]]))
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
#define ARGMAX(TYPE, IN, LOAD)                                                                                    \
    static int64_t argmax_##TYPE(const IN *x, int n) {                                                           \
        const __m512 none = _mm512_set1_ps(-__builtin_inff());                                                    \
        __m512 top = none;                                                                                        \
        __mmask16 nan = 0;                                                                                        \
        for (int j = 0; j < n; j += 16) {                                                                         \
            const __mmask16 in = j + 16 <= n ? 0xFFFF : (__mmask16)((1u << (n - j)) - 1);                       \
            const __m512 v = _mm512_mask_blend_ps(in, none, LOAD);                                               \
            nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);                                                        \
            top = _mm512_max_ps(top, v);                                                                          \
        }                                                                                                         \
        const float best = _mm512_reduce_max_ps(top);                                                             \
        for (int j = 0; j < n; j += 16) {                                                                         \
            const __mmask16 in = j + 16 <= n ? 0xFFFF : (__mmask16)((1u << (n - j)) - 1);                       \
            const __m512 v = LOAD;                                                                                \
            const __mmask16 hit = nan ? _mm512_mask_cmp_ps_mask(in, v, v, _CMP_UNORD_Q)                           \
                                      : _mm512_mask_cmp_ps_mask(in, v, _mm512_set1_ps(best), _CMP_EQ_OQ);         \
            if (hit) return j + __builtin_ctz(hit);                                                               \
        }                                                                                                         \
        return 0; /* n == 0, or -inf throughout: the first */                                                     \
    }
ARGMAX(fp32, float, _mm512_maskz_loadu_ps(in, x + j))
ARGMAX(bf16, uint16_t, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(in, x + j)), 16)))

void argmax(const void *x, int bf16, int rows, int n, int64_t *out) {
    for (int r = 0; r < rows; r++)
        out[r] = bf16 ? argmax_bf16((const uint16_t *)x + (size_t)r * n, n) : argmax_fp32((const float *)x + (size_t)r * n, n);
}
