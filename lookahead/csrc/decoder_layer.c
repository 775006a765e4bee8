/* A decoder layer in one call, bf16 (Llama's shape and Gemma 3's), for lookahead/layers.py's FusedLayer:

       xn = norm_input(x)                rms_norm.c
       qkv = xn Wqkv^T                   the product's kernel (Product: which, and its layout)
       each q and k head normed          where the layer has head norms (Gemma 3, Qwen3)
       RoPE on q and k, in place         rope.c
       k, v -> the cache's columns held .. held + T - 1 of each sequence (its buffer, which the caller made room in)
       a = attention(q, keys, values)    tree_attention.c, over held + T keys, the step's mask or causal
       p = a Wo^T, normed                the product; the norm where the layer is sandwiched (Gemma 3)
       h = x + p, y = norm_residual(h)   add_rms_norm (rms_norm.c)
       both = y Wgate_up^T               the product: gate and up side by side
       m = (act(gate) up) Wdown^T        where act is SiLU or GELU-tanh (else the caller does this and the next line)
       out = h + m, m normed first where the layer is sandwiched

   The same kernels the module calls one by one from Python, in the same order on the same values, so the same
   bits; the activations are torch's own arithmetic (below). What it saves is the ~15-20 trips from Python a layer
   between them (a few microseconds each, more in a step whose products stream every cache line out). */

#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <math.h>
#include <string.h>

/* a bf16 product's kernel and its weights, as native.Linear sets it up */
typedef struct {
    int kind; /* PRODUCTS */
    const void *packed;
    const float *bias;
    int n, k, bits, group, offsets, scaling, l2;
} Product;
enum { BF16, AMX_BF16, QUANT_BF16, AMX_QUANT, INT }; /* native.PRODUCTS' order (their names less "_linear") */

void bf16_linear(const void *x, const void *packed, const float *bias, uint16_t *y, int m, int n, int k, int threads, int l2);
void amx_bf16_linear(const uint16_t *x, const char *packed, const float *bias, uint16_t *y, int m, int n, int k, int threads, int l2);
int quant_bf16_linear(const uint16_t *x, const char *packed, const float *bias, uint16_t *y, int m, int n, int k, int bits, int group,
                      int offsets, int threads, int l2);
int amx_quant_linear(const uint16_t *x, const char *packed, const float *bias, uint16_t *y, int m, int n, int k, int bits, int group,
                     int offsets, int threads, int l2);
int int_linear(const void *x, const char *packed, const float *bias, void *y, int m, int n, int k, int bits, int group, int offsets,
               int scaling, int threads, int l2, int bf16);
int tree_attention(const uint16_t *q, const long *qs, const uint16_t *k, const uint16_t *v, const long *kvs, const uint16_t *mask,
                   const long *ms, uint16_t *out, int B, int H, int G, int T, int S, int D, float scale, int threads);
void rms_norm(const void *x, const void *w, void *y, int bf16, int rows, int n, float eps, int offset, int threads);
void add_rms_norm(const void *x, const void *d, void *s, const void *w, void *y, int bf16, int rows, int n, float eps, int offset,
                  int threads);
void rope(void *x, const void *c, const void *s, int bf16, int rows, int width, int heads, int d);

/* y (m, p->n) = x (m, p->k) W^T (+ bias); 1 where the kernel could not allocate its buffers */
static int one_product(const Product *p, const uint16_t *x, uint16_t *y, int m, int threads) {
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

/* a layer's role (q/k/v, output, gate/up, down): one product, or a GGUF's siblings of other types as one product
   each (up to three: q, k and v), whose outputs sit side by side */
typedef struct {
    Product part[3];
    int parts, n; /* n: the parts' together */
} Role;

/* y (m, r->n) = x (m, k) times the role's weights; 1 where a kernel could not allocate its buffers */
static int product(const Role *r, const uint16_t *x, uint16_t *y, int m, int threads) {
    if (r->parts == 1) return one_product(&r->part[0], x, y, m, threads);
    uint16_t *apart = malloc(2 * (size_t)m * r->n);
    int failed = !apart;
    for (int i = 0, at = 0; i < r->parts && !failed; at += r->part[i++].n) {
        const size_t n = r->part[i].n;
        failed = one_product(&r->part[i], x, apart, m, threads);
        for (size_t row = 0; !failed && row < (size_t)m; row++) memcpy(y + row * r->n + at, apart + row * n, 2 * n);
    }
    free(apart);
    return failed;
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
enum { NONE, SILU, GELU_TANH }; /* native.ACTIVATIONS' order */
void gated(const uint16_t *both, uint16_t *out, int rows, int width, int act) {
    for (size_t r = 0; r < (size_t)rows; r++)
        for (int i = 0; i < width; i += 16) {
            const uint16_t *gate = both + 2 * r * width + i;
            const __m512 g = widen(gate);
            const __m512 a = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16_bits(act == SILU ? silu(g) : gelu_tanh(g))), 16));
            _mm256_storeu_si256((__m256i *)(out + r * width + i), bf16_bits(_mm512_mul_ps(a, widen(gate + width))));
        }
}

/* a layer's norm: its weight (NULL: the layer has none there), eps and weighting (rms_norm.c) */
typedef struct {
    const uint16_t *w;
    float eps;
    int offset;
} Norm;
enum { INPUT, RESIDUAL, ATTENDED, MLP_OUT, Q_HEADS, K_HEADS }; /* norms[]: native.decoder_layer's order */

static void norm(const Norm *n, uint16_t *x, size_t rows, size_t width, int threads) { /* in place, where the layer has it */
    if (n->w) rms_norm(x, n->w, x, 1, (int)rows, (int)width, n->eps, n->offset, threads);
}

/* x (B, T, E) -> out (B, T, E), the layer's output, where `down` (act SILU or GELU_TANH); else out = h, the residual
   sum after attention, and both (B, T, gate_up->n) the gate/up product, for the caller to finish. q, k, v heads H, G,
   G of D in qkv's output, in that order; norms[6] as the enum above (RESIDUAL: the one after the residual sum;
   ATTENDED, MLP_OUT: Gemma 3's sandwich, on the attention's and the MLP's outputs; Q_HEADS, K_HEADS: each head's,
   before RoPE); cos, sin (B or 1, T, D) (cs: a sequence's stride, 0 where they are shared); keys, values (B, G,
   capacity, D) buffers of one layout (kvs: batch, head, key); mask additive (B or 1, 1, T, held + T) (ms: batch,
   row) or NULL (causal). 0, or 1 where a kernel could not allocate its buffers (the step's keys may then be
   written). */
int decoder_layer(const uint16_t *x, uint16_t *out, uint16_t *both, const Role *qkv, const Role *o, const Role *gate_up,
                  const Role *down, const Norm *norms, int act, const uint16_t *cos, const uint16_t *sin, long cs, uint16_t *keys,
                  uint16_t *values, const long *kvs, int held, const uint16_t *mask, const long *ms, int B, int T, int H, int G, int D,
                  float scale, int threads) {
    const size_t rows = (size_t)B * T, E = qkv->part[0].k, width = qkv->n, mlp = gate_up->n; /* width = (H + 2 G) D, mlp = 2 intermediate */
    /* the norms' outputs, qkv, the attention's, o's, h and the MLP's (where this call finishes the layer) */
    uint16_t *xn = malloc(2 * rows * (3 * E + width + (size_t)H * D + (down ? E + mlp + mlp / 2 + E : 0)));
    if (!xn) return 1;
    uint16_t *q = xn + rows * E, *attended = q + rows * width, *projected = attended + rows * H * D, *y = projected + rows * E;
    uint16_t *h = down ? y + rows * E : out, *two = down ? h + rows * E : both, *acted = two + rows * mlp, *downed = acted + rows * mlp / 2;
    int failed = 0;
    rms_norm(x, norms[INPUT].w, xn, 1, (int)rows, (int)E, norms[INPUT].eps, norms[INPUT].offset, threads);
    if ((failed = product(qkv, xn, q, (int)rows, threads))) goto done;
    for (size_t r = 0; r < rows; r++) /* a token's q heads, then its k heads, each normed alone */
        norm(&norms[Q_HEADS], q + r * width, H, D, 1), norm(&norms[K_HEADS], q + r * width + (size_t)H * D, G, D, 1);
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
    norm(&norms[ATTENDED], projected, rows, E, threads);
    add_rms_norm(x, projected, h, norms[RESIDUAL].w, y, 1, (int)rows, (int)E, norms[RESIDUAL].eps, norms[RESIDUAL].offset, threads);
    if ((failed = product(gate_up, y, two, (int)rows, threads)) || !down) goto done;
    gated(two, acted, (int)rows, (int)mlp / 2, act);
    if ((failed = product(down, acted, downed, (int)rows, threads))) goto done;
    norm(&norms[MLP_OUT], downed, rows, E, threads);
    for (size_t i = 0; i < rows * E; i += 16) /* the residual sum, rounded as torch's */
        _mm256_storeu_si256((__m256i *)(out + i), bf16_bits(_mm512_add_ps(widen(h + i), widen(downed + i))));
done:
    free(xn);
    return failed;
}
