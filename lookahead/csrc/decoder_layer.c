/* The bf16 decoder layer in one call (decoder_layer.h's steps) on the bf16 kernels: bf16_linear, amx_linear.c's,
   quant_linear.c's, int_linear.c's; tree_attention.c; SiLU and GELU-tanh as torch computes them. */

#include <immintrin.h>
#include <math.h>

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

/* The activations of a bf16 x, times a bf16 u, as torch computes them: in fp32, with the Sleef functions torch's
   AVX-512 vectors call (expf_u10 for SiLU = x / (1 + exp(-x)), tanhf_u10 for GELU-tanh), rounded to bf16 as torch
   rounds (to nearest even, in integers: denormals kept, where vcvtneps2bf16 flushes them); then the product,
   rounded alike. Equal to F.silu(x) * u and F.gelu(x, approximate="tanh") * u for every bf16 x
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

/* Sleef's tanhf_u10 as torch's AVX-512 vectors call it (Sleef_tanhf16_u10, built with FMA and without contracting
   a product into a sum): a double-float exp of |x|, then (e - 1/e) / (e + 1/e) in double-float. Its products and
   sums are the _round forms, which gcc never fuses into an FMA (it may fuse _mm512_mul_ps into an add). */
#define RN (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define ADD(a, b) _mm512_add_round_ps(a, b, RN)
#define SUB(a, b) _mm512_sub_round_ps(a, b, RN)
#define MUL(a, b) _mm512_mul_round_ps(a, b, RN)
#define ONE _mm512_set1_ps(1.0f)
typedef struct { __m512 x, y; } f2; /* x + y, |y| below half x's last place */

static inline f2 f2_of(__m512 x, __m512 y) { return (f2){x, y}; }
static inline f2 df_add2_f(f2 x, __m512 y) {
    const __m512 s = ADD(x.x, y), v = SUB(s, x.x);
    return f2_of(s, ADD(ADD(SUB(x.x, SUB(s, v)), SUB(y, v)), x.y));
}
static inline f2 df_add2(f2 x, f2 y) {
    const __m512 s = ADD(x.x, y.x), v = SUB(s, x.x);
    return f2_of(s, ADD(ADD(SUB(x.x, SUB(s, v)), SUB(y.x, v)), ADD(x.y, y.y)));
}
static inline f2 df_add_f(__m512 x, f2 y) { /* |x| >= |y| */
    const __m512 s = ADD(x, y.x);
    return f2_of(s, ADD(ADD(SUB(x, s), y.x), y.y));
}
static inline f2 df_add(f2 x, f2 y) { /* |x| >= |y| */
    const __m512 s = ADD(x.x, y.x);
    return f2_of(s, ADD(ADD(ADD(SUB(x.x, s), y.x), x.y), y.y));
}
static inline f2 df_mul_f(f2 x, __m512 y) {
    const __m512 s = MUL(x.x, y);
    return f2_of(s, _mm512_fmadd_ps(x.y, y, _mm512_fmsub_ps(x.x, y, s)));
}
static inline f2 df_mul(f2 x, f2 y) {
    const __m512 s = MUL(x.x, y.x);
    return f2_of(s, _mm512_fmadd_ps(x.x, y.y, _mm512_fmadd_ps(x.y, y.x, _mm512_fmsub_ps(x.x, y.x, s))));
}
static inline f2 df_squ(f2 x) {
    const __m512 s = MUL(x.x, x.x);
    return f2_of(s, _mm512_fmadd_ps(ADD(x.x, x.x), x.y, _mm512_fmsub_ps(x.x, x.x, s)));
}
static inline f2 df_rec(f2 d) {
    const __m512 s = _mm512_div_ps(ONE, d.x);
    return f2_of(s, MUL(s, _mm512_fnmadd_ps(d.y, s, _mm512_fnmadd_ps(d.x, s, ONE))));
}
static inline f2 df_div(f2 n, f2 d) {
    const __m512 t = _mm512_div_ps(ONE, d.x), s = MUL(n.x, t), u = _mm512_fmsub_ps(t, n.x, s);
    const __m512 v = _mm512_fnmadd_ps(d.y, t, _mm512_fnmadd_ps(d.x, t, ONE));
    return f2_of(s, _mm512_fmadd_ps(s, v, _mm512_fmadd_ps(n.y, t, u)));
}
static inline __m512 ldexp2(__m512 d, __m512i e) { /* d 2^e, 2^e in two factors */
    const __m512i half = _mm512_srai_epi32(e, 1), bias = _mm512_set1_epi32(0x7f);
    return MUL(MUL(d, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(half, bias), 23))),
               _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_sub_epi32(e, half), bias), 23)));
}
static f2 expk2f(__m512 d) { /* exp(d) in double-float, d >= 0 */
    const __m512i q = _mm512_cvtps_epi32(MUL(ADD(d, _mm512_setzero_ps()), _mm512_set1_ps(1.442695040888963407359924681001892137426645954152985934135449406931f)));
    const __m512 qf = _mm512_cvtepi32_ps(q);
    f2 s = df_add2_f(f2_of(d, _mm512_setzero_ps()), MUL(qf, _mm512_set1_ps(-0.693145751953125f)));
    s = df_add2_f(s, MUL(qf, _mm512_set1_ps(-1.428606765330187045e-06f)));
    __m512 u = _mm512_set1_ps(+0.1980960224e-3f);
    u = _mm512_fmadd_ps(u, s.x, _mm512_set1_ps(+0.1394256484e-2f));
    u = _mm512_fmadd_ps(u, s.x, _mm512_set1_ps(+0.8333456703e-2f));
    u = _mm512_fmadd_ps(u, s.x, _mm512_set1_ps(+0.4166637361e-1f));
    f2 t = df_add2_f(df_mul_f(s, u), _mm512_set1_ps(+0.166666659414234244790680580464e+0f));
    t = df_add2_f(df_mul(s, t), _mm512_set1_ps(0.5f));
    t = df_add_f(ONE, df_add2(s, df_mul(df_squ(s), t)));
    return f2_of(ldexp2(t.x, q), ldexp2(t.y, q));
}
static __m512 sleef_tanhf(__m512 x) {
    const __m512i sign = _mm512_set1_epi32((int)0x80000000);
    const __m512 a = _mm512_castsi512_ps(_mm512_andnot_si512(sign, _mm512_castps_si512(x)));
    const f2 d = expk2f(a), e = df_rec(d);
    const f2 r = df_div(df_add(d, f2_of(SUB(_mm512_setzero_ps(), e.x), SUB(_mm512_setzero_ps(), e.y))), df_add(d, e));
    __m512 y = ADD(r.x, r.y);
    y = _mm512_mask_mov_ps(y, _mm512_cmp_ps_mask(a, _mm512_set1_ps(8.664339742f), _CMP_GT_OQ) | _mm512_cmp_ps_mask(y, y, _CMP_UNORD_Q), ONE);
    y = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(y), _mm512_and_si512(_mm512_castps_si512(x), sign)));
    return _mm512_mask_mov_ps(y, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_castsi512_ps(_mm512_set1_epi32(-1)));
}

/* torch's GELU with the tanh approximation on fp32 vectors (ATen/native/cpu/Gelu.h; whether its build fuses the
   cube's product into its sum changes no bf16 result: both forms were run on every bf16) */
static inline __m512 gelu_tanh(__m512 x) {
    const __m512 cube = MUL(MUL(x, x), x);
    const __m512 inner = MUL(_mm512_set1_ps((float)(M_SQRT2 * M_2_SQRTPI * 0.5)), _mm512_fmadd_ps(_mm512_set1_ps(0.044715f), cube, x));
    return MUL(MUL(_mm512_set1_ps(0.5f), x), ADD(ONE, sleef_tanhf(inner)));
}

static inline __m512 silu(__m512 g) {
    const __m512 minus = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(g), _mm512_set1_epi32((int)0x80000000)));
    return _mm512_div_ps(g, _mm512_add_ps(ONE, sleef_expf(minus)));
}

/* out (rows, width) = act(gate) up, for both (rows, 2 width): gate, up; width a multiple of 16; act SILU or GELU_TANH */
void gated(const void *gates, void *acted, int rows, int width, int act) {
    const uint16_t *both = gates;
    uint16_t *out = acted;
    for (size_t r = 0; r < (size_t)rows; r++)
        for (int i = 0; i < width; i += 16) {
            const uint16_t *gate = both + 2 * r * width + i;
            const __m512 g = widen(gate);
            const __m512 a = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16_bits(act == SILU ? silu(g) : gelu_tanh(g))), 16));
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
