/* torch's activations on fp32 vectors of 8 lanes, bit for bit as its vectorised CPU kernels compute them (Sleef's
   expf_u10 and tanhf_u10, the functions torch's vectors call; SiLU; GELU with the tanh approximation): the fp32
   layer's (decoder_layer_fp32.c) and, a 16-lane vector as two halves, the bf16 layer's (decoder_layer.c). Per lane
   the same operations whatever the width, so the same bits as torch's AVX-512 or AVX2 vectors. */

#include <immintrin.h>
#include <math.h>

#define AVX2_FMA __attribute__((target("avx2,fma")))

/* Sleef's expf_u10: Cody-Waite reduction by ln 2, the polynomial in FMAs, 2^q in two factors; 0 below -104,
   infinity above 100 */
AVX2_FMA static inline __m256 sleef_expf8(__m256 d) {
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
   double-float steps below round each product and sum apart (AVX2 has no `_round` forms to say so) */
AVX2_FMA static inline __m256 MUL8(__m256 a, __m256 b) {
    __m256 r = _mm256_mul_ps(a, b);
    __asm__("" : "+x"(r));
    return r;
}
#define ADD8 _mm256_add_ps
#define SUB8 _mm256_sub_ps
#define ONE8 _mm256_set1_ps(1.0f)
typedef struct { __m256 x, y; } f2; /* x + y, |y| below half x's last place */

AVX2_FMA static inline f2 f2_of(__m256 x, __m256 y) { return (f2){x, y}; }
AVX2_FMA static inline f2 df_add2_f(f2 x, __m256 y) {
    const __m256 s = ADD8(x.x, y), v = SUB8(s, x.x);
    return f2_of(s, ADD8(ADD8(SUB8(x.x, SUB8(s, v)), SUB8(y, v)), x.y));
}
AVX2_FMA static inline f2 df_add2(f2 x, f2 y) {
    const __m256 s = ADD8(x.x, y.x), v = SUB8(s, x.x);
    return f2_of(s, ADD8(ADD8(SUB8(x.x, SUB8(s, v)), SUB8(y.x, v)), ADD8(x.y, y.y)));
}
AVX2_FMA static inline f2 df_add_f(__m256 x, f2 y) { /* |x| >= |y| */
    const __m256 s = ADD8(x, y.x);
    return f2_of(s, ADD8(ADD8(SUB8(x, s), y.x), y.y));
}
AVX2_FMA static inline f2 df_add(f2 x, f2 y) { /* |x| >= |y| */
    const __m256 s = ADD8(x.x, y.x);
    return f2_of(s, ADD8(ADD8(ADD8(SUB8(x.x, s), y.x), x.y), y.y));
}
AVX2_FMA static inline f2 df_mul_f(f2 x, __m256 y) {
    const __m256 s = MUL8(x.x, y);
    return f2_of(s, _mm256_fmadd_ps(x.y, y, _mm256_fmsub_ps(x.x, y, s)));
}
AVX2_FMA static inline f2 df_mul(f2 x, f2 y) {
    const __m256 s = MUL8(x.x, y.x);
    return f2_of(s, _mm256_fmadd_ps(x.x, y.y, _mm256_fmadd_ps(x.y, y.x, _mm256_fmsub_ps(x.x, y.x, s))));
}
AVX2_FMA static inline f2 df_squ(f2 x) {
    const __m256 s = MUL8(x.x, x.x);
    return f2_of(s, _mm256_fmadd_ps(ADD8(x.x, x.x), x.y, _mm256_fmsub_ps(x.x, x.x, s)));
}
AVX2_FMA static inline f2 df_rec(f2 d) {
    const __m256 s = _mm256_div_ps(ONE8, d.x);
    return f2_of(s, MUL8(s, _mm256_fnmadd_ps(d.y, s, _mm256_fnmadd_ps(d.x, s, ONE8))));
}
AVX2_FMA static inline f2 df_div(f2 n, f2 d) {
    const __m256 t = _mm256_div_ps(ONE8, d.x), s = MUL8(n.x, t), u = _mm256_fmsub_ps(t, n.x, s);
    const __m256 v = _mm256_fnmadd_ps(d.y, t, _mm256_fnmadd_ps(d.x, t, ONE8));
    return f2_of(s, _mm256_fmadd_ps(s, v, _mm256_fmadd_ps(n.y, t, u)));
}
AVX2_FMA static inline __m256 ldexp2(__m256 d, __m256i e) { /* d 2^e, 2^e in two factors */
    const __m256i half = _mm256_srai_epi32(e, 1), bias = _mm256_set1_epi32(0x7f);
    return MUL8(MUL8(d, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, bias), 23))),
               _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(e, half), bias), 23)));
}
AVX2_FMA static f2 expk2f(__m256 d) { /* exp(d) in double-float, d >= 0 */
    const __m256i q = _mm256_cvtps_epi32(MUL8(ADD8(d, _mm256_setzero_ps()), _mm256_set1_ps(1.442695040888963407359924681001892137426645954152985934135449406931f)));
    const __m256 qf = _mm256_cvtepi32_ps(q);
    f2 s = df_add2_f(f2_of(d, _mm256_setzero_ps()), MUL8(qf, _mm256_set1_ps(-0.693145751953125f)));
    s = df_add2_f(s, MUL8(qf, _mm256_set1_ps(-1.428606765330187045e-06f)));
    __m256 u = _mm256_set1_ps(+0.1980960224e-3f);
    u = _mm256_fmadd_ps(u, s.x, _mm256_set1_ps(+0.1394256484e-2f));
    u = _mm256_fmadd_ps(u, s.x, _mm256_set1_ps(+0.8333456703e-2f));
    u = _mm256_fmadd_ps(u, s.x, _mm256_set1_ps(+0.4166637361e-1f));
    f2 t = df_add2_f(df_mul_f(s, u), _mm256_set1_ps(+0.166666659414234244790680580464e+0f));
    t = df_add2_f(df_mul(s, t), _mm256_set1_ps(0.5f));
    t = df_add_f(ONE8, df_add2(s, df_mul(df_squ(s), t)));
    return f2_of(ldexp2(t.x, q), ldexp2(t.y, q));
}
/* Sleef's tanhf_u10: (e - 1/e) / (e + 1/e) in double-float, e = exp(|x|) */
AVX2_FMA static __m256 sleef_tanhf8(__m256 x) {
    const __m256 sign = _mm256_set1_ps(-0.0f), a = _mm256_andnot_ps(sign, x);
    const f2 d = expk2f(a), e = df_rec(d);
    const f2 r = df_div(df_add(d, f2_of(SUB8(_mm256_setzero_ps(), e.x), SUB8(_mm256_setzero_ps(), e.y))), df_add(d, e));
    __m256 y = ADD8(r.x, r.y);
    y = _mm256_blendv_ps(y, ONE8, _mm256_or_ps(_mm256_cmp_ps(a, _mm256_set1_ps(8.664339742f), _CMP_GT_OQ), _mm256_cmp_ps(y, y, _CMP_UNORD_Q)));
    y = _mm256_xor_ps(y, _mm256_and_ps(x, sign));
    return _mm256_blendv_ps(y, _mm256_castsi256_ps(_mm256_set1_epi32(-1)), _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}

/* torch's GELU with the tanh approximation on fp32 vectors (ATen/native/cpu/GeluKernel.cpp), its sum of x and the
   cube's product one FMA as torch's build has it (tested on fp32 gates of every exponent) */
AVX2_FMA static inline __m256 gelu_tanh8(__m256 x) {
    const __m256 cube = MUL8(MUL8(x, x), x);
    const __m256 inner = MUL8(_mm256_set1_ps((float)(M_SQRT2 * M_2_SQRTPI * 0.5)), _mm256_fmadd_ps(_mm256_set1_ps(0.044715f), cube, x));
    return MUL8(MUL8(_mm256_set1_ps(0.5f), x), ADD8(ONE8, sleef_tanhf8(inner)));
}

AVX2_FMA static inline __m256 silu8(__m256 g) { /* g / (1 + exp(-g)) */
    return _mm256_div_ps(g, ADD8(ONE8, sleef_expf8(_mm256_xor_ps(g, _mm256_set1_ps(-0.0f)))));
}
