/* activations.h's functions for one vector width, LANES (8: AVX2 + FMA; 16: AVX-512), included once per width: the
   same operations per lane at either width, so the same bits. Names end in the width (silu_8, silu_16, ...); V is
   the vector of floats, VI of int32; a comparison gives a vector on AVX2, a mask register on AVX-512 (WHERE takes
   either). */

#define LANED_(f, w) f##_##w
#define LANED(f, w) LANED_(f, w)
#define L(f) LANED(f, LANES)

#if LANES == 8
#define ATTR AVX2_FMA
typedef __m256 L(V);
typedef __m256i L(VI);
#define SET1 _mm256_set1_ps
#define SET1I _mm256_set1_epi32
#define ZERO _mm256_setzero_ps
#define ADD _mm256_add_ps
#define SUB _mm256_sub_ps
#define MUL_ _mm256_mul_ps
#define DIV _mm256_div_ps
#define FMADD _mm256_fmadd_ps
#define FMSUB _mm256_fmsub_ps
#define FNMADD _mm256_fnmadd_ps
#define TO_INT _mm256_cvtps_epi32
#define TO_FLOAT _mm256_cvtepi32_ps
#define SRAI _mm256_srai_epi32
#define SLLI _mm256_slli_epi32
#define ADDI _mm256_add_epi32
#define SUBI _mm256_sub_epi32
#define AS_FLOAT _mm256_castsi256_ps
#define XOR _mm256_xor_ps
#define AND _mm256_and_ps
#define ANDNOT _mm256_andnot_ps
#define LESS(a, b) _mm256_cmp_ps(a, b, _CMP_LT_OQ)
#define GREATER(a, b) _mm256_cmp_ps(a, b, _CMP_GT_OQ)
#define NAN_AT(a) _mm256_cmp_ps(a, a, _CMP_UNORD_Q)
#define EITHER _mm256_or_ps
#define WHERE(m, a, b) _mm256_blendv_ps(b, a, m) /* m ? a : b */
#else
#define ATTR
typedef __m512 L(V);
typedef __m512i L(VI);
#define SET1 _mm512_set1_ps
#define SET1I _mm512_set1_epi32
#define ZERO _mm512_setzero_ps
#define ADD _mm512_add_ps
#define SUB _mm512_sub_ps
#define MUL_ _mm512_mul_ps
#define DIV _mm512_div_ps
#define FMADD _mm512_fmadd_ps
#define FMSUB _mm512_fmsub_ps
#define FNMADD _mm512_fnmadd_ps
#define TO_INT _mm512_cvtps_epi32
#define TO_FLOAT _mm512_cvtepi32_ps
#define SRAI _mm512_srai_epi32
#define SLLI _mm512_slli_epi32
#define ADDI _mm512_add_epi32
#define SUBI _mm512_sub_epi32
#define AS_FLOAT _mm512_castsi512_ps
#define BITS_(op, a, b) _mm512_castsi512_ps(op(_mm512_castps_si512(a), _mm512_castps_si512(b))) /* AVX-512F has no float logic */
#define XOR(a, b) BITS_(_mm512_xor_si512, a, b)
#define AND(a, b) BITS_(_mm512_and_si512, a, b)
#define ANDNOT(a, b) BITS_(_mm512_andnot_si512, a, b)
#define LESS(a, b) _mm512_cmp_ps_mask(a, b, _CMP_LT_OQ)
#define GREATER(a, b) _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ)
#define NAN_AT(a) _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q)
#define EITHER(m, n) ((__mmask16)((m) | (n)))
#define WHERE(m, a, b) _mm512_mask_blend_ps(m, b, a) /* m ? a : b */
#endif
#define V L(V)
#define VI L(VI)
#define ONE SET1(1.0f)
#define F2 L(pair)

/* Sleef's expf_u10: Cody-Waite reduction by ln 2, the polynomial in FMAs, 2^q in two factors; 0 below -104,
   infinity above 100 */
ATTR static inline V L(sleef_expf)(V d) {
    const VI q = TO_INT(MUL_(d, SET1(1.442695040888963407359924681001892137426645954152985934135449406931f)));
    const V qf = TO_FLOAT(q);
    V s = FMADD(qf, SET1(-0.693145751953125f), d);
    s = FMADD(qf, SET1(-1.428606765330187045e-06f), s);
    V u = SET1(0.000198527617612853646278381f);
    u = FMADD(u, s, SET1(0.00139304355252534151077271f));
    u = FMADD(u, s, SET1(0.00833336077630519866943359f));
    u = FMADD(u, s, SET1(0.0416664853692054748535156f));
    u = FMADD(u, s, SET1(0.166666671633720397949219f));
    u = FMADD(u, s, SET1(0.5f));
    u = ADD(ONE, FMADD(MUL_(s, s), u, s));
    const VI half = SRAI(q, 1), rest = SUBI(q, half); /* 2^q in two factors */
    u = MUL_(MUL_(u, AS_FLOAT(SLLI(ADDI(half, SET1I(0x7f)), 23))), AS_FLOAT(SLLI(ADDI(rest, SET1I(0x7f)), 23)));
    u = WHERE(LESS(d, SET1(-104.0f)), ZERO(), u);
    return WHERE(LESS(SET1(100.0f), d), SET1(__builtin_inff()), u);
}

/* A product gcc cannot fuse into the sum after it: the AVX-512 tiers are not built with -ffp-contract=off, and Sleef's
   double-float steps below round each product and sum apart (AVX2 has no `_round` forms to say so) */
ATTR static inline V L(mul)(V a, V b) {
    V r = MUL_(a, b);
    __asm__("" : "+v"(r));
    return r;
}
#define MUL L(mul)
typedef struct { V x, y; } F2; /* x + y, |y| below half x's last place */

ATTR static inline F2 L(f2_of)(V x, V y) { return (F2){x, y}; }
#define F2_OF L(f2_of)
ATTR static inline F2 L(df_add2_f)(F2 x, V y) {
    const V s = ADD(x.x, y), v = SUB(s, x.x);
    return F2_OF(s, ADD(ADD(SUB(x.x, SUB(s, v)), SUB(y, v)), x.y));
}
ATTR static inline F2 L(df_add2)(F2 x, F2 y) {
    const V s = ADD(x.x, y.x), v = SUB(s, x.x);
    return F2_OF(s, ADD(ADD(SUB(x.x, SUB(s, v)), SUB(y.x, v)), ADD(x.y, y.y)));
}
ATTR static inline F2 L(df_add_f)(V x, F2 y) { /* |x| >= |y| */
    const V s = ADD(x, y.x);
    return F2_OF(s, ADD(ADD(SUB(x, s), y.x), y.y));
}
ATTR static inline F2 L(df_add)(F2 x, F2 y) { /* |x| >= |y| */
    const V s = ADD(x.x, y.x);
    return F2_OF(s, ADD(ADD(ADD(SUB(x.x, s), y.x), x.y), y.y));
}
ATTR static inline F2 L(df_mul_f)(F2 x, V y) {
    const V s = MUL(x.x, y);
    return F2_OF(s, FMADD(x.y, y, FMSUB(x.x, y, s)));
}
ATTR static inline F2 L(df_mul)(F2 x, F2 y) {
    const V s = MUL(x.x, y.x);
    return F2_OF(s, FMADD(x.x, y.y, FMADD(x.y, y.x, FMSUB(x.x, y.x, s))));
}
ATTR static inline F2 L(df_squ)(F2 x) {
    const V s = MUL(x.x, x.x);
    return F2_OF(s, FMADD(ADD(x.x, x.x), x.y, FMSUB(x.x, x.x, s)));
}
ATTR static inline F2 L(df_rec)(F2 d) {
    const V s = DIV(ONE, d.x);
    return F2_OF(s, MUL(s, FNMADD(d.y, s, FNMADD(d.x, s, ONE))));
}
ATTR static inline F2 L(df_div)(F2 n, F2 d) {
    const V t = DIV(ONE, d.x), s = MUL(n.x, t), u = FMSUB(t, n.x, s);
    const V v = FNMADD(d.y, t, FNMADD(d.x, t, ONE));
    return F2_OF(s, FMADD(s, v, FMADD(n.y, t, u)));
}
ATTR static inline V L(ldexp2)(V d, VI e) { /* d 2^e, 2^e in two factors */
    const VI half = SRAI(e, 1), bias = SET1I(0x7f);
    return MUL(MUL(d, AS_FLOAT(SLLI(ADDI(half, bias), 23))), AS_FLOAT(SLLI(ADDI(SUBI(e, half), bias), 23)));
}
ATTR static F2 L(expk2f)(V d) { /* exp(d) in double-float, d >= 0 */
    const VI q = TO_INT(MUL(ADD(d, ZERO()), SET1(1.442695040888963407359924681001892137426645954152985934135449406931f)));
    const V qf = TO_FLOAT(q);
    F2 s = L(df_add2_f)(F2_OF(d, ZERO()), MUL(qf, SET1(-0.693145751953125f)));
    s = L(df_add2_f)(s, MUL(qf, SET1(-1.428606765330187045e-06f)));
    V u = SET1(+0.1980960224e-3f);
    u = FMADD(u, s.x, SET1(+0.1394256484e-2f));
    u = FMADD(u, s.x, SET1(+0.8333456703e-2f));
    u = FMADD(u, s.x, SET1(+0.4166637361e-1f));
    F2 t = L(df_add2_f)(L(df_mul_f)(s, u), SET1(+0.166666659414234244790680580464e+0f));
    t = L(df_add2_f)(L(df_mul)(s, t), SET1(0.5f));
    t = L(df_add_f)(ONE, L(df_add2)(s, L(df_mul)(L(df_squ)(s), t)));
    return F2_OF(L(ldexp2)(t.x, q), L(ldexp2)(t.y, q));
}
/* Sleef's tanhf_u10: (e - 1/e) / (e + 1/e) in double-float, e = exp(|x|) */
ATTR static V L(sleef_tanhf)(V x) {
    const V sign = SET1(-0.0f), a = ANDNOT(sign, x);
    const F2 d = L(expk2f)(a), e = L(df_rec)(d);
    const F2 r = L(df_div)(L(df_add)(d, F2_OF(SUB(ZERO(), e.x), SUB(ZERO(), e.y))), L(df_add)(d, e));
    V y = ADD(r.x, r.y);
    y = WHERE(EITHER(GREATER(a, SET1(8.664339742f)), NAN_AT(y)), ONE, y);
    y = XOR(y, AND(x, sign));
    return WHERE(NAN_AT(x), AS_FLOAT(SET1I(-1)), y);
}

/* torch's GELU with the tanh approximation on fp32 vectors (ATen/native/cpu/GeluKernel.cpp), its sum of x and the
   cube's product one FMA as torch's build has it (tested on fp32 gates of every exponent) */
ATTR static inline V L(gelu_tanh)(V x) {
    const V cube = MUL(MUL(x, x), x);
    const V inner = MUL(SET1((float)(M_SQRT2 * M_2_SQRTPI * 0.5)), FMADD(SET1(0.044715f), cube, x));
    return MUL(MUL(SET1(0.5f), x), ADD(ONE, L(sleef_tanhf)(inner)));
}

ATTR static inline V L(silu)(V g) { /* g / (1 + exp(-g)) */
    return DIV(g, ADD(ONE, L(sleef_expf)(XOR(g, SET1(-0.0f)))));
}

#undef ATTR
#undef SET1
#undef SET1I
#undef ZERO
#undef ADD
#undef SUB
#undef MUL_
#undef DIV
#undef FMADD
#undef FMSUB
#undef FNMADD
#undef TO_INT
#undef TO_FLOAT
#undef SRAI
#undef SLLI
#undef ADDI
#undef SUBI
#undef AS_FLOAT
#undef BITS_
#undef XOR
#undef AND
#undef ANDNOT
#undef LESS
#undef GREATER
#undef NAN_AT
#undef EITHER
#undef WHERE
#undef V
#undef VI
#undef ONE
#undef F2
#undef MUL
#undef F2_OF
#undef L
