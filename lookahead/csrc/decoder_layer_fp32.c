/* The fp32 decoder layer in one call (decoder_layer.h's steps), on AVX2 + FMA (every tier builds it): the fp32
   products (linear.c's or linear_avx2.c's fp32_linear, quant_fp32_linear, the integer linear with fp32
   activations), tree_attention_avx2.c's attention, and SiLU and GELU-tanh as torch computes them. */

#include <immintrin.h>
#include <math.h>

#include "decoder_layer.h"

#define TARGET __attribute__((target("avx2,fma")))

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

/* Sleef's expf_u10 as torch's vectors call it (decoder_layer.c's sleef_expf, 8 lanes): Cody-Waite reduction by ln 2,
   the polynomial in FMAs, 2^q in two factors; 0 below -104, infinity above 100 */
TARGET static inline __m256 sleef_expf8(__m256 d) {
    const __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(d, _mm256_set1_ps(1.442695040888963407359924681001892137426645954152985934135449406931f)));
    const __m256 qf = _mm256_cvtepi32_ps(q);
    __m256 s = _mm256_fmadd_ps(qf, _mm256_set1_ps(-0.693145751953125f), d);
    s = _mm256_fmadd_ps(qf, _mm256_set1_ps(-1.428606765330187045e-06f), s);
    __m256 u = _mm256_set1_ps(0.000198527617612853646278381f);
    u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.00139304355252534151077271f));
    u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.00833336077630519866943359f));
    u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.0416664853692054748535156f));
    u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.166666671633720397949219f));
    u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.5f));
    u = _mm256_add_ps(_mm256_set1_ps(1.0f), _mm256_fmadd_ps(_mm256_mul_ps(s, s), u, s));
    const __m256i half = _mm256_srai_epi32(q, 1), rest = _mm256_sub_epi32(q, half); /* 2^q in two factors */
    u = _mm256_mul_ps(_mm256_mul_ps(u, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, _mm256_set1_epi32(0x7f)), 23))),
                      _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(rest, _mm256_set1_epi32(0x7f)), 23)));
    u = _mm256_andnot_ps(_mm256_cmp_ps(d, _mm256_set1_ps(-104.0f), _CMP_LT_OQ), u);
    return _mm256_blendv_ps(u, _mm256_set1_ps(__builtin_inff()), _mm256_cmp_ps(_mm256_set1_ps(100.0f), d, _CMP_LT_OQ));
}

/* A product gcc cannot fuse into the sum after it: the AVX-512 tiers are not built with -ffp-contract=off, and Sleef's
   double-float steps below round each product and sum apart (decoder_layer.c's `_round` forms, which AVX2 lacks) */
TARGET static inline __m256 MUL(__m256 a, __m256 b) {
    __m256 r = _mm256_mul_ps(a, b);
    __asm__("" : "+x"(r));
    return r;
}
#define ADD _mm256_add_ps
#define SUB _mm256_sub_ps
#define ONE _mm256_set1_ps(1.0f)
typedef struct { __m256 x, y; } f2; /* x + y, |y| below half x's last place */

TARGET static inline f2 f2_of(__m256 x, __m256 y) { return (f2){x, y}; }
TARGET static inline f2 df_add2_f(f2 x, __m256 y) {
    const __m256 s = ADD(x.x, y), v = SUB(s, x.x);
    return f2_of(s, ADD(ADD(SUB(x.x, SUB(s, v)), SUB(y, v)), x.y));
}
TARGET static inline f2 df_add2(f2 x, f2 y) {
    const __m256 s = ADD(x.x, y.x), v = SUB(s, x.x);
    return f2_of(s, ADD(ADD(SUB(x.x, SUB(s, v)), SUB(y.x, v)), ADD(x.y, y.y)));
}
TARGET static inline f2 df_add_f(__m256 x, f2 y) { /* |x| >= |y| */
    const __m256 s = ADD(x, y.x);
    return f2_of(s, ADD(ADD(SUB(x, s), y.x), y.y));
}
TARGET static inline f2 df_add(f2 x, f2 y) { /* |x| >= |y| */
    const __m256 s = ADD(x.x, y.x);
    return f2_of(s, ADD(ADD(ADD(SUB(x.x, s), y.x), x.y), y.y));
}
TARGET static inline f2 df_mul_f(f2 x, __m256 y) {
    const __m256 s = MUL(x.x, y);
    return f2_of(s, _mm256_fmadd_ps(x.y, y, _mm256_fmsub_ps(x.x, y, s)));
}
TARGET static inline f2 df_mul(f2 x, f2 y) {
    const __m256 s = MUL(x.x, y.x);
    return f2_of(s, _mm256_fmadd_ps(x.x, y.y, _mm256_fmadd_ps(x.y, y.x, _mm256_fmsub_ps(x.x, y.x, s))));
}
TARGET static inline f2 df_squ(f2 x) {
    const __m256 s = MUL(x.x, x.x);
    return f2_of(s, _mm256_fmadd_ps(ADD(x.x, x.x), x.y, _mm256_fmsub_ps(x.x, x.x, s)));
}
TARGET static inline f2 df_rec(f2 d) {
    const __m256 s = _mm256_div_ps(ONE, d.x);
    return f2_of(s, MUL(s, _mm256_fnmadd_ps(d.y, s, _mm256_fnmadd_ps(d.x, s, ONE))));
}
TARGET static inline f2 df_div(f2 n, f2 d) {
    const __m256 t = _mm256_div_ps(ONE, d.x), s = MUL(n.x, t), u = _mm256_fmsub_ps(t, n.x, s);
    const __m256 v = _mm256_fnmadd_ps(d.y, t, _mm256_fnmadd_ps(d.x, t, ONE));
    return f2_of(s, _mm256_fmadd_ps(s, v, _mm256_fmadd_ps(n.y, t, u)));
}
TARGET static inline __m256 ldexp2(__m256 d, __m256i e) { /* d 2^e, 2^e in two factors */
    const __m256i half = _mm256_srai_epi32(e, 1), bias = _mm256_set1_epi32(0x7f);
    return MUL(MUL(d, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, bias), 23))),
               _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(e, half), bias), 23)));
}
TARGET static f2 expk2f(__m256 d) { /* exp(d) in double-float, d >= 0 */
    const __m256i q = _mm256_cvtps_epi32(MUL(ADD(d, _mm256_setzero_ps()), _mm256_set1_ps(1.442695040888963407359924681001892137426645954152985934135449406931f)));
    const __m256 qf = _mm256_cvtepi32_ps(q);
    f2 s = df_add2_f(f2_of(d, _mm256_setzero_ps()), MUL(qf, _mm256_set1_ps(-0.693145751953125f)));
    s = df_add2_f(s, MUL(qf, _mm256_set1_ps(-1.428606765330187045e-06f)));
    __m256 u = _mm256_set1_ps(+0.1980960224e-3f);
    u = _mm256_fmadd_ps(u, s.x, _mm256_set1_ps(+0.1394256484e-2f));
    u = _mm256_fmadd_ps(u, s.x, _mm256_set1_ps(+0.8333456703e-2f));
    u = _mm256_fmadd_ps(u, s.x, _mm256_set1_ps(+0.4166637361e-1f));
    f2 t = df_add2_f(df_mul_f(s, u), _mm256_set1_ps(+0.166666659414234244790680580464e+0f));
    t = df_add2_f(df_mul(s, t), _mm256_set1_ps(0.5f));
    t = df_add_f(ONE, df_add2(s, df_mul(df_squ(s), t)));
    return f2_of(ldexp2(t.x, q), ldexp2(t.y, q));
}
/* Sleef's tanhf_u10 (decoder_layer.c's sleef_tanhf, 8 lanes): (e - 1/e) / (e + 1/e) in double-float, e = exp(|x|) */
TARGET static __m256 sleef_tanhf8(__m256 x) {
    const __m256 sign = _mm256_set1_ps(-0.0f), a = _mm256_andnot_ps(sign, x);
    const f2 d = expk2f(a), e = df_rec(d);
    const f2 r = df_div(df_add(d, f2_of(SUB(_mm256_setzero_ps(), e.x), SUB(_mm256_setzero_ps(), e.y))), df_add(d, e));
    __m256 y = ADD(r.x, r.y);
    y = _mm256_blendv_ps(y, ONE, _mm256_or_ps(_mm256_cmp_ps(a, _mm256_set1_ps(8.664339742f), _CMP_GT_OQ), _mm256_cmp_ps(y, y, _CMP_UNORD_Q)));
    y = _mm256_xor_ps(y, _mm256_and_ps(x, sign));
    return _mm256_blendv_ps(y, _mm256_castsi256_ps(_mm256_set1_epi32(-1)), _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}

/* torch's GELU with the tanh approximation on fp32 vectors (ATen/native/cpu/GeluKernel.cpp), its sum of x and the
   cube's product one FMA as torch's build has it (tested on fp32 gates of every exponent) */
TARGET static inline __m256 gelu_tanh8(__m256 x) {
    const __m256 cube = MUL(MUL(x, x), x);
    const __m256 inner = MUL(_mm256_set1_ps((float)(M_SQRT2 * M_2_SQRTPI * 0.5)), _mm256_fmadd_ps(_mm256_set1_ps(0.044715f), cube, x));
    return MUL(MUL(_mm256_set1_ps(0.5f), x), ADD(ONE, sleef_tanhf8(inner)));
}

TARGET static inline __m256 silu8(__m256 g) { /* g / (1 + exp(-g)) */
    return _mm256_div_ps(g, ADD(ONE, sleef_expf8(_mm256_xor_ps(g, _mm256_set1_ps(-0.0f)))));
}

/* out (rows, width) = act(gate) up as torch computes it in fp32 (F.silu, or F.gelu(approximate="tanh"), then the
   product), for both (rows, 2 width): gate, up; width a multiple of 8; act SILU or GELU_TANH */
TARGET void gated_fp32(const void *gates, void *acted, int rows, int width, int act) {
    const float *both = gates;
    float *out = acted;
    for (size_t r = 0; r < (size_t)rows; r++)
        for (int i = 0; i < width; i += 8) {
            const float *gate = both + 2 * r * width + i;
            const __m256 g = _mm256_loadu_ps(gate), a = act == SILU ? silu8(g) : gelu_tanh8(g);
            _mm256_storeu_ps(out + r * width + i, MUL(a, _mm256_loadu_ps(gate + width)));
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
