/* The bf16 decoder layer in one call (decoder_layer.h's steps) on the bf16 kernels: bf16_linear, amx_linear.c's,
   quant_linear.c's, int_linear.c's; tree_attention.c; SiLU and GELU-tanh as torch computes them. */

#include "activations.h"
#include "decoder_layer.h"

void bf16_linear(const void *x, const void *packed, const float *bias, uint16_t *y, int m, int n, int k, int threads, int l2);
void amx_bf16_linear(const uint16_t *x, const char *packed, const float *bias, uint16_t *y, int m, int n, int k, int threads, int l2);
int quant_bf16_linear(const uint16_t *x, const char *packed, const float *bias, uint16_t *y, int m, int n, int k, int bits, int group,
                      int offsets, int threads, int l2);
int amx_quant_linear(const uint16_t *x, const char *packed, const float *bias, uint16_t *y, int m, int n, int k, int bits, int group,
                     int offsets, int threads, int l2);
int tree_attention(const uint16_t *q, const long *qs, const uint16_t *k, const uint16_t *v, const long *kvs, const uint16_t *mask,
                   const long *ms, uint16_t *out, int B, int H, int G, int T, int S, int D, float scale, int threads);

/* y (m, p->n) = x (m, p->k) W^T (+ bias); 1 where the kernel could not allocate its buffers, or is no bf16 one */
static int bf16_product(const Product *p, const void *x, void *y, int m, int threads) {
    switch (p->kind) {
    case BF16: bf16_linear(x, p->packed, p->bias, y, m, p->n, p->k, threads, p->l2); return 0;
    case AMX_BF16: amx_bf16_linear(x, p->packed, p->bias, y, m, p->n, p->k, threads, p->l2); return 0;
    case QUANT_BF16: return quant_bf16_linear(x, p->packed, p->bias, y, m, p->n, p->k, p->bits, p->group, p->offsets, threads, p->l2);
    case AMX_QUANT: return amx_quant_linear(x, p->packed, p->bias, y, m, p->n, p->k, p->bits, p->group, p->offsets, threads, p->l2);
    case INT:
        return int_linear(x, p->packed, p->bias, y, m, p->n, p->k, p->bits, p->group, p->offsets, p->scaling, threads, p->l2, 1);
    }
    return 1;
}

static inline __m256i bf16_bits(__m512 v) {
    const __m512i bits = _mm512_castps_si512(v), lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0xffff)));
}

static inline __m512 widen(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* The activations of a bf16 x, times a bf16 u, as torch computes them: in fp32 (activations.h), rounded to bf16 as torch
   rounds (to nearest even, in integers: denormals kept, where vcvtneps2bf16 flushes them); then the product, rounded
   alike. Equal to F.silu(x) * u and F.gelu(x, approximate="tanh") * u for every bf16 x (tests/test_layers.py runs
   all 65536). out (rows, width) = act(gate) up, for both (rows, 2 width): gate, up; width a multiple of 16; act SILU or
   GELU_TANH; a step's rows split over the threads (each element alone: the same bits) */
void gated(const void *gates, void *acted, int rows, int width, int act, int threads) {
    const uint16_t *both = gates;
    uint16_t *out = acted;
    const long vectors = (long)rows * (width / 16);
    _Pragma("omp parallel for schedule(static) num_threads(threads) if (vectors >= GATED_ALONE / 16)")
    for (long n = 0; n < vectors; n++) {
        const long r = n / (width / 16), i = n % (width / 16) * 16;
        const uint16_t *gate = both + 2 * r * width + i;
        const __m512 g = widen(gate);
        const __m512 a = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16_bits(act == SILU ? silu_16(g) : gelu_tanh_16(g))), 16));
        _mm256_storeu_si256((__m256i *)(out + r * width + i), bf16_bits(_mm512_mul_ps(a, widen(gate + width))));
    }
}

/* the residual sum, rounded as torch's; n a multiple of 16 */
static void bf16_add(const void *a, const void *b, void *out, size_t n) {
    const uint16_t *x = a, *y = b;
    for (size_t i = 0; i < n; i += 16) _mm256_storeu_si256((__m256i *)((uint16_t *)out + i), bf16_bits(_mm512_add_ps(widen(x + i), widen(y + i))));
}

static int bf16_attention(const void *q, const long *qs, const void *k, const void *v, const long *kvs, const void *mask, const long *ms,
                          void *out, int B, int H, int G, int T, int S, int D, float scale, int threads) {
    return tree_attention(q, qs, k, v, kvs, mask, ms, out, B, H, G, T, S, D, scale, threads);
}

static const Dtype BF16_LAYER = {1, 2, bf16_product, bf16_attention, gated, bf16_add};

/* decoder_layer.h's layer, bf16 (act SILU or GELU_TANH where `down`) */
int decoder_layer(const uint16_t *x, uint16_t *out, uint16_t *both, const Role *qkv, const Role *o, const Role *gate_up,
                  const Role *down, const Norm *norms, int act, const uint16_t *cos, const uint16_t *sin, long cs, uint16_t *keys,
                  uint16_t *values, const long *kvs, int held, const uint16_t *mask, const long *ms, int B, int T, int H, int G, int D,
                  float scale, int threads) {
    return layer(&BF16_LAYER, x, out, both, qkv, o, gate_up, down, norms, act, cos, sin, cs, keys, values, kvs, held, mask, ms, B, T, H,
                 G, D, scale, threads);
}

/* decoder_layer.h's layers, bf16: a step's every layer (each with a down product) in one call */
int decoder_layers(const uint16_t *x, uint16_t *out, int n, const Layer *ls, const uint16_t *cos, const uint16_t *sin, long cs,
                   const uint16_t *mask, const long *ms, int B, int T, int held, int threads) {
    return layers(&BF16_LAYER, x, out, n, ls, cos, sin, cs, mask, ms, B, T, held, threads);
}
