/* A decoder layer in one call, bf16 (Llama's shape: no q/k head norms, norms not sandwiched), for
   lookahead/layers.py's FusedLayer:

       xn = norm1(x)                     rms_norm.c
       qkv = xn Wqkv^T                   the product's kernel (Product: which, and its layout)
       RoPE on q and k, in place         rope.c
       k, v -> the cache's columns held .. held + T - 1 of each sequence (its buffer, which the caller made room in)
       a = attention(q, keys, values)    tree_attention.c, over held + T keys, the step's mask or causal
       h = x + a Wo^T, y = norm2(h)      the product, then add_rms_norm (rms_norm.c)
       both = y Wgate_up^T               the product: gate and up side by side
       out = h + (silu(gate) up) Wdown^T where the activation is SiLU (else the caller does this line)

   The same kernels the module calls one by one from Python, in the same order on the same values, so the same
   bits; SiLU is torch's own arithmetic (below). What it saves is the ~15 trips from Python a layer between them (a
   few microseconds each, more in a step whose products stream every cache line out). */

#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* a bf16 product's kernel and its weights, as native.Linear sets it up */
typedef struct {
    int kind; /* PRODUCTS */
    const void *packed;
    const float *bias;
    int n, k, bits, group, offsets, supers, l2;
} Product;
enum { BF16, AMX_BF16, QUANT_BF16, AMX_QUANT, INTEGER }; /* native.PRODUCTS' order */

void bf16_linear(const void *x, const void *packed, const float *bias, uint16_t *y, int m, int n, int k, int threads, int l2);
void amx_bf16_linear(const uint16_t *x, const char *packed, const float *bias, uint16_t *y, int m, int n, int k, int threads, int l2);
int quant_bf16_linear(const uint16_t *x, const char *packed, const float *bias, uint16_t *y, int m, int n, int k, int bits, int group,
                      int offsets, int threads, int l2);
int amx_quant_linear(const uint16_t *x, const char *packed, const float *bias, uint16_t *y, int m, int n, int k, int bits, int group,
                     int offsets, int threads, int l2);
int int_linear(const void *x, const char *packed, const float *bias, void *y, int m, int n, int k, int bits, int group, int offsets,
               int supers, int threads, int l2, int bf16);
int tree_attention(const uint16_t *q, const long *qs, const uint16_t *k, const uint16_t *v, const long *kvs, const uint16_t *mask,
                   const long *ms, uint16_t *out, int B, int H, int G, int T, int S, int D, float scale, int threads);
void rms_norm(const void *x, const void *w, void *y, int bf16, int rows, int n, float eps, int offset, int threads);
void add_rms_norm(const void *x, const void *d, void *s, const void *w, void *y, int bf16, int rows, int n, float eps, int offset,
                  int threads);
void rope(void *x, const void *c, const void *s, int bf16, int rows, int width, int heads, int d);

/* y (m, p->n) = x (m, p->k) W^T (+ bias); 1 where the kernel could not allocate its buffers */
static int product(const Product *p, const uint16_t *x, uint16_t *y, int m, int threads) {
    switch (p->kind) {
    case BF16: bf16_linear(x, p->packed, p->bias, y, m, p->n, p->k, threads, p->l2); return 0;
    case AMX_BF16: amx_bf16_linear(x, p->packed, p->bias, y, m, p->n, p->k, threads, p->l2); return 0;
    case QUANT_BF16: return quant_bf16_linear(x, p->packed, p->bias, y, m, p->n, p->k, p->bits, p->group, p->offsets, threads, p->l2);
    case AMX_QUANT: return amx_quant_linear(x, p->packed, p->bias, y, m, p->n, p->k, p->bits, p->group, p->offsets, threads, p->l2);
    case INTEGER:
        return int_linear(x, p->packed, p->bias, y, m, p->n, p->k, p->bits, p->group, p->offsets, p->supers, threads, p->l2, 1);
    }
    return 1;
}

/* torch's SiLU of a bf16 x, times a bf16 u: silu = x / (1 + exp(-x)) in fp32, exp as torch's vectors compute it
   (Sleef's expf_u10, below), rounded to bf16 as torch rounds (to nearest even, in integers: denormals kept, where
   vcvtneps2bf16 flushes them); then the product, rounded alike. Equal to F.silu(x) * u for every bf16 x
   (tests/test_layers.py runs all 65536). */
static inline __m512 sleef_expf(__m512 d) {
    const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(d, _mm512_set1_ps(1.442695040888963407359924681001892137426645954152985934135449406931f)));
    const __m512 qf = _mm512_cvtepi32_ps(q);
    __m512 s = _mm512_fmadd_ps(qf, _mm512_set1_ps(-0.693145751953125f), d);
    s = _mm512_fmadd_ps(qf, _mm512_set1_ps(-1.428606765330187045e-06f), s);
    __m512 u = _mm512_set1_ps(0.000198527617612853646278381f);
    u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.00139304355252534151077271f));
    u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.00833336077630519866943359f));
    u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.0416664853692054748535156f));
    u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.166666671633720397949219f));
    u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.5f));
    u = _mm512_add_ps(_mm512_set1_ps(1.0f), _mm512_fmadd_ps(_mm512_mul_ps(s, s), u, s));
    const __m512i half = _mm512_srai_epi32(q, 1), rest = _mm512_sub_epi32(q, half); /* 2^q in two factors */
    u = _mm512_mul_ps(_mm512_mul_ps(u, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(half, _mm512_set1_epi32(0x7f)), 23))),
                      _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(rest, _mm512_set1_epi32(0x7f)), 23)));
    u = _mm512_maskz_mov_ps(~_mm512_cmp_ps_mask(d, _mm512_set1_ps(-104.0f), _CMP_LT_OQ), u);
    return _mm512_mask_mov_ps(u, _mm512_cmp_ps_mask(_mm512_set1_ps(100.0f), d, _CMP_LT_OQ), _mm512_set1_ps(__builtin_inff()));
}

static inline __m256i bf16_bits(__m512 v) {
    const __m512i bits = _mm512_castps_si512(v), lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0xffff)));
}

static inline __m512 widen(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* out (rows, width) = silu(gate) up, for both (rows, 2 width): gate, up; width a multiple of 16 */
void silu_mul(const uint16_t *both, uint16_t *out, int rows, int width) {
    for (size_t r = 0; r < (size_t)rows; r++)
        for (int i = 0; i < width; i += 16) {
            const uint16_t *gate = both + 2 * r * width + i;
            const __m512 g = widen(gate), minus = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(g), _mm512_set1_epi32((int)0x80000000)));
            const __m256i act = bf16_bits(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), sleef_expf(minus))));
            const __m512 a = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(act), 16));
            _mm256_storeu_si256((__m256i *)(out + r * width + i), bf16_bits(_mm512_mul_ps(a, widen(gate + width))));
        }
}

/* x (B, T, E) -> out (B, T, E), the layer's output, where `down` (the activation is SiLU); else out = h, the residual
   sum after attention, and both (B, T, gate_up->n) the gate/up product, for the caller to finish. q, k, v heads H, G,
   G of D in qkv's output, in that order; cos, sin (B or 1, T, D) (cs: a sequence's stride, 0 where they are shared);
   keys, values (B, G, capacity, D) buffers of one layout (kvs: batch, head, key); mask additive (B or 1, 1, T, held
   + T) (ms: batch, row) or NULL (causal). 0, or 1 where a kernel could not allocate its buffers (the step's keys may
   then be written). */
int decoder_layer(const uint16_t *x, uint16_t *out, uint16_t *both, const Product *qkv, const Product *o, const Product *gate_up,
                  const Product *down, const uint16_t *norm1, float eps1, const uint16_t *norm2, float eps2, const uint16_t *cos,
                  const uint16_t *sin, long cs, uint16_t *keys, uint16_t *values, const long *kvs, int held, const uint16_t *mask,
                  const long *ms, int B, int T, int H, int G, int D, float scale, int threads) {
    const size_t rows = (size_t)B * T, E = qkv->k, width = qkv->n, mlp = gate_up->n; /* width = (H + 2 G) D, mlp = 2 intermediate */
    /* the norms' outputs, qkv, the attention's, o's, h and the MLP's (where this call finishes the layer) */
    uint16_t *xn = malloc(2 * rows * (3 * E + width + (size_t)H * D + (down ? E + mlp + mlp / 2 + E : 0)));
    if (!xn) return 1;
    uint16_t *q = xn + rows * E, *attended = q + rows * width, *projected = attended + rows * H * D, *y = projected + rows * E;
    uint16_t *h = down ? y + rows * E : out, *gated = down ? h + rows * E : both, *act = gated + rows * mlp, *downed = act + rows * mlp / 2;
    int failed = 0;
    rms_norm(x, norm1, xn, 1, (int)rows, (int)E, eps1, 0, threads);
    if ((failed = product(qkv, xn, q, (int)rows, threads))) goto done;
    for (int b = 0; b < B; b++) rope(q + (size_t)b * T * width, cos + b * cs, sin + b * cs, 1, T, (int)width, H + G, D);
    for (int b = 0; b < B; b++)
        for (int g = 0; g < G; g++)
            for (int t = 0; t < T; t++) {
                const uint16_t *row = q + ((size_t)b * T + t) * width;
                const size_t at = b * kvs[0] + g * kvs[1] + (held + t) * kvs[2];
                memcpy(keys + at, row + (size_t)(H + g) * D, 2 * D), memcpy(values + at, row + (size_t)(H + G + g) * D, 2 * D);
            }
    const long qs[3] = {(long)T * width, D, (long)width}; /* q (B, H, T, D) as a view of qkv */
    if ((failed = tree_attention(q, qs, keys, values, kvs, mask, ms, attended, B, H, G, T, held + T, D, scale, threads))) goto done;
    if ((failed = product(o, attended, projected, (int)rows, threads))) goto done;
    add_rms_norm(x, projected, h, norm2, y, 1, (int)rows, (int)E, eps2, 0, threads);
    if ((failed = product(gate_up, y, gated, (int)rows, threads)) || !down) goto done;
    silu_mul(gated, act, (int)rows, (int)mlp / 2);
    if ((failed = product(down, act, downed, (int)rows, threads))) goto done;
    for (size_t i = 0; i < rows * E; i += 16) /* the residual sum, rounded as torch's */
        _mm256_storeu_si256((__m256i *)(out + i), bf16_bits(_mm512_add_ps(widen(h + i), widen(downed + i))));
done:
    free(xn);
    return failed;
}
