/* The fp32 decoder layer in one call (decoder_layer.h's steps), on AVX2 + FMA (every tier builds it): the fp32
   products (linear.c's or linear_avx2.c's fp32_linear, quant_fp32_linear, the integer linear with fp32
   activations), tree_attention_avx2.c's attention, and SiLU and GELU-tanh as torch computes them. */

#include "activations.h"
#include "decoder_layer.h"

void fp32_linear(const void *x, const void *packed, const float *bias, float *y, int m, int n, int k, int threads, int l2);
void quant_fp32_linear(const float *x, const char *packed, const float *bias, float *y, int m, int n, int k, int bits, int group,
                       int offsets, int threads, int l2);
int tree_attention_fp32(const float *q, const long *qs, const float *k, const float *v, const long *kvs, const float *mask,
                        const long *ms, float *out, int B, int H, int G, int T, int S, int D, float scale, int threads);

/* y (m, p->n) = x (m, p->k) W^T (+ bias); 1 where the kernel could not allocate its buffers, or is no fp32 one */
static int fp32_product(const Product *p, const void *x, void *y, int m, int threads) {
    switch (p->kind) {
    case FP32: fp32_linear(x, p->packed, p->bias, y, m, p->n, p->k, threads, p->l2); return 0;
    case QUANT_FP32: quant_fp32_linear(x, p->packed, p->bias, y, m, p->n, p->k, p->bits, p->group, p->offsets, threads, p->l2); return 0;
    case INT:
        return int_linear(x, p->packed, p->bias, y, m, p->n, p->k, p->bits, p->group, p->offsets, p->scaling, threads, p->l2, 0);
    }
    return 1;
}

/* out (rows, width) = act(gate) up as torch computes it in fp32 (F.silu, or F.gelu(approximate="tanh"), then the
   product), for both (rows, 2 width): gate, up; width a multiple of 8; act SILU or GELU_TANH; a step's rows split over
   the threads (each element alone: the same bits) */
AVX2_FMA void gated_fp32(const void *gates, void *acted, int rows, int width, int act, int threads) {
    const float *both = gates;
    float *out = acted;
    const long vectors = (long)rows * (width / 8);
    _Pragma("omp parallel for schedule(static) num_threads(threads) if (vectors >= GATED_ALONE / 8)")
    for (long n = 0; n < vectors; n++) {
        const long r = n / (width / 8), i = n % (width / 8) * 8;
        const float *gate = both + 2 * r * width + i;
        const __m256 g = _mm256_loadu_ps(gate), a = act == SILU ? silu_8(g) : gelu_tanh_8(g);
        _mm256_storeu_ps(out + r * width + i, mul_8(a, _mm256_loadu_ps(gate + width)));
    }
}

static void fp32_add(const void *a, const void *b, void *out, size_t n) { /* the residual sum */
    const float *x = a, *y = b;
    float *z = out;
    for (size_t i = 0; i < n; i++) z[i] = x[i] + y[i];
}

static int fp32_attention(const void *q, const long *qs, const void *k, const void *v, const long *kvs, const void *mask, const long *ms,
                          void *out, int B, int H, int G, int T, int S, int D, float scale, int threads) {
    return tree_attention_fp32(q, qs, k, v, kvs, mask, ms, out, B, H, G, T, S, D, scale, threads);
}

static const Dtype FP32_LAYER = {0, 4, fp32_product, fp32_attention, gated_fp32, fp32_add};

/* decoder_layer.h's layer, fp32 (act SILU where `down`) */
int decoder_layer_fp32(const float *x, float *out, float *both, const Role *qkv, const Role *o, const Role *gate_up, const Role *down,
                       const Norm *norms, int act, const float *cos, const float *sin, long cs, float *keys, float *values,
                       const long *kvs, int held, const float *mask, const long *ms, int B, int T, int H, int G, int D, float scale,
                       int threads) {
    return layer(&FP32_LAYER, x, out, both, qkv, o, gate_up, down, norms, act, cos, sin, cs, keys, values, kvs, held, mask, ms, B, T, H,
                 G, D, scale, threads);
}

/* decoder_layer.h's layers, fp32: a step's every layer (each with a down product) in one call */
int decoder_layers_fp32(const float *x, float *out, int n, const Layer *ls, const float *cos, const float *sin, long cs,
                        const float *mask, const long *ms, int B, int T, int held, int threads) {
    return layers(&FP32_LAYER, x, out, n, ls, cos, sin, cs, mask, ms, B, T, held, threads);
}
