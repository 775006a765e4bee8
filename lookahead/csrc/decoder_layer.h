/* A decoder layer in one call, for lookahead/layers.py's FusedLayer: what the bf16 layer (decoder_layer.c) and the
   fp32 one (decoder_layer_fp32.c) share. The steps, over either dtype's kernels (Dtype):

       xn = norm_input(x)                rms_norm.c
       qkv = xn Wqkv^T                   the product's kernel (Product: which, and its layout)
       each q and k head normed          where the layer has head norms (Gemma 3, Qwen3)
       RoPE on q and k, in place         rope.c
       k, v -> the cache's columns held .. held + T - 1 of each sequence (its buffer, which the caller made room in)
       a = attention(q, keys, values)    tree_attention.c (bf16) or tree_attention_avx2.c (fp32), over held + T
                                         keys, the step's mask or causal
       p = a Wo^T, normed                the product; the norm where the layer is sandwiched (Gemma 3)
       h = x + p, y = norm_residual(h)   add_rms_norm (rms_norm.c)
       both = y Wgate_up^T               the product: gate and up side by side
       m = (act(gate) up) Wdown^T        where act is one the dtype computes (else the caller does this and the next line)
       out = h + m, m normed first where the layer is sandwiched

   The same kernels the module calls one by one from Python, in the same order on the same values, so the same
   bits; the activations are torch's own arithmetic. What it saves is the ~15-20 trips from Python a layer between
   them (a few microseconds each, more in a step whose products stream every cache line out). */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* a product's kernel and its weights, as native.Linear sets it up */
typedef struct {
    int kind; /* PRODUCTS */
    const void *packed;
    const float *bias;
    int n, k, bits, group, offsets, scaling, l2;
} Product;
enum { BF16, AMX_BF16, QUANT_BF16, AMX_QUANT, INT, FP32, QUANT_FP32 }; /* native.PRODUCTS' order (their names less "_linear") */

/* a layer's role (q/k/v, output, gate/up, down): one product, or a GGUF's siblings of other types as one product
   each (up to three: q, k and v), whose outputs sit side by side */
typedef struct {
    Product part[3];
    int parts, n; /* n: the parts' together */
} Role;

/* a layer's norm: its weight (NULL: the layer has none there), eps and weighting (rms_norm.c) */
typedef struct {
    const void *w;
    float eps;
    int offset;
} Norm;
enum { INPUT, RESIDUAL, ATTENDED, MLP_OUT, Q_HEADS, K_HEADS }; /* norms[]: native.NORMS' order */
enum { NONE, SILU, GELU_TANH };                                 /* native.ACTIVATIONS' order */
#define GATED_ALONE 4096 /* gates a thread takes alone (~3.5 us): a parallel region costs ~1-2 us */

void rms_norm(const void *x, const void *w, void *y, int bf16, int rows, int n, float eps, int offset, int threads);
void add_rms_norm(const void *x, const void *d, void *s, const void *w, void *y, int bf16, int rows, int n, float eps, int offset,
                  int threads);
void rope(void *x, const void *c, const void *s, int bf16, int rows, int width, int heads, int d);
int int_linear(const void *x, const char *packed, const float *bias, void *y, int m, int n, int k, int bits, int group, int offsets,
               int scaling, int threads, int l2, int bf16);

/* a dtype's part of a layer: its element's bytes, and its kernels (each as its file says) */
typedef struct {
    int bf16;
    size_t size;
    int (*product)(const Product *p, const void *x, void *y, int m, int threads); /* 1: out of memory or no such kind */
    int (*attention)(const void *q, const long *qs, const void *k, const void *v, const long *kvs, const void *mask, const long *ms,
                     void *out, int B, int H, int G, int T, int S, int D, float scale, int threads);
    void (*gated)(const void *both, void *out, int rows, int width, int act, int threads); /* act(gate) up, as torch computes it */
    void (*add)(const void *a, const void *b, void *out, size_t n);           /* the residual sum, as torch rounds it */
} Dtype;

/* y (m, r->n) = x (m, k) times the role's weights; 1 where a kernel could not allocate its buffers */
static int product(const Dtype *t, const Role *r, const void *x, void *y, int m, int threads) {
    if (r->parts == 1) return t->product(&r->part[0], x, y, m, threads);
    char *apart = malloc(t->size * m * r->n), *out = y;
    int failed = !apart;
    for (int i = 0, at = 0; i < r->parts && !failed; at += r->part[i++].n) {
        const size_t n = r->part[i].n;
        failed = t->product(&r->part[i], x, apart, m, threads);
        for (size_t row = 0; !failed && row < (size_t)m; row++)
            memcpy(out + t->size * (row * r->n + at), apart + t->size * row * n, t->size * n);
    }
    free(apart);
    return failed;
}

static void norm(const Dtype *t, const Norm *n, void *x, size_t rows, size_t width, int threads) { /* in place, where the layer has it */
    if (n->w) rms_norm(x, n->w, x, t->bf16, (int)rows, (int)width, n->eps, n->offset, threads);
}

/* x (B, T, E) -> out (B, T, E), the layer's output, where `down` (act one the dtype computes); else out = h, the
   residual sum after attention, and both (B, T, gate_up->n) the gate/up product, for the caller to finish. q, k, v
   heads H, G, G of D in qkv's output, in that order; norms[6] as the enum above (RESIDUAL: the one after the
   residual sum; ATTENDED, MLP_OUT: Gemma 3's sandwich, on the attention's and the MLP's outputs; Q_HEADS, K_HEADS:
   each head's, before RoPE); cos, sin (B or 1, T, D) (cs: a sequence's stride, 0 where they are shared); keys,
   values (B, G, capacity, D) buffers of one layout (kvs: batch, head, key); mask additive (B or 1, 1, T, held + T)
   (ms: batch, row) or NULL (causal). 0, or 1 where a kernel could not allocate its buffers (the step's keys may then
   be written). */
static int layer(const Dtype *t, const void *x, void *out, void *both, const Role *qkv, const Role *o, const Role *gate_up,
                 const Role *down, const Norm *norms, int act, const void *cos, const void *sin, long cs, void *keys, void *values,
                 const long *kvs, int held, const void *mask, const long *ms, int B, int T, int H, int G, int D, float scale,
                 int threads) {
    const size_t rows = (size_t)B * T, E = qkv->part[0].k, width = qkv->n, mlp = gate_up->n, z = t->size; /* width = (H + 2 G) D */
    /* the norms' outputs, qkv, the attention's, o's, h and the MLP's (where this call finishes the layer) */
    char *xn = malloc(z * rows * (3 * E + width + (size_t)H * D + (down ? E + mlp + mlp / 2 + E : 0)));
    if (!xn) return 1;
    char *q = xn + z * rows * E, *attended = q + z * rows * width, *projected = attended + z * rows * H * D, *y = projected + z * rows * E;
    char *h = down ? y + z * rows * E : out, *two = down ? h + z * rows * E : both, *acted = two + z * rows * mlp;
    char *downed = acted + z * rows * mlp / 2;
    const char *c = cos, *s = sin, *m = mask;
    char *k = keys, *v = values;
    int failed = 0;
    rms_norm(x, norms[INPUT].w, xn, t->bf16, (int)rows, (int)E, norms[INPUT].eps, norms[INPUT].offset, threads);
    if ((failed = product(t, qkv, xn, q, (int)rows, threads))) goto done;
    for (size_t r = 0; r < rows; r++) /* a token's q heads, then its k heads, each normed alone */
        norm(t, &norms[Q_HEADS], q + z * r * width, H, D, 1), norm(t, &norms[K_HEADS], q + z * (r * width + (size_t)H * D), G, D, 1);
    for (int b = 0; b < B; b++) rope(q + z * b * T * width, c + z * b * cs, s + z * b * cs, t->bf16, T, (int)width, H + G, D);
    for (int b = 0; b < B; b++)
        for (int g = 0; g < G; g++)
            for (int i = 0; i < T; i++) {
                const char *row = q + z * ((size_t)b * T + i) * width;
                const size_t at = z * (b * kvs[0] + g * kvs[1] + (held + i) * kvs[2]);
                memcpy(k + at, row + z * (H + g) * D, z * D), memcpy(v + at, row + z * (H + G + g) * D, z * D);
            }
    const long qs[3] = {(long)T * width, D, (long)width}; /* q (B, H, T, D) as a view of qkv */
    if ((failed = t->attention(q, qs, keys, values, kvs, m, ms, attended, B, H, G, T, held + T, D, scale, threads))) goto done;
    if ((failed = product(t, o, attended, projected, (int)rows, threads))) goto done;
    norm(t, &norms[ATTENDED], projected, rows, E, threads);
    add_rms_norm(x, projected, h, norms[RESIDUAL].w, y, t->bf16, (int)rows, (int)E, norms[RESIDUAL].eps, norms[RESIDUAL].offset, threads);
    if ((failed = product(t, gate_up, y, two, (int)rows, threads)) || !down) goto done;
    t->gated(two, acted, (int)rows, (int)mlp / 2, act, threads);
    if ((failed = product(t, down, acted, downed, (int)rows, threads))) goto done;
    norm(t, &norms[MLP_OUT], downed, rows, E, threads);
    t->add(h, downed, out, rows * E);
done:
    free(xn);
    return failed;
}

/* one layer of a step's every layer in one call (layers, below): its constants as decoder_layer takes them, and its
   cache's buffers (B, G, capacity, D) and their strides (batch, head, key) */
typedef struct {
    const Role *qkv, *o, *gate_up, *down;
    const Norm *norms;
    int act, H, G, D;
    float scale;
    void *keys, *values;
    long kvs[3];
} Layer;

/* x (B, T, E) through n layers in order, each as `layer` (the same bits), each one's output the next one's input,
   the last one's into out; every layer's cache holds `held` columns before the step. What a step's layers cost
   between their kernels when Python calls them one by one (each layer's checks, its cache's room, the call's
   arguments, cold after the kernels before it) is then paid once. 0, or 1 where a kernel could not allocate. */
static int layers(const Dtype *t, const void *x, void *out, int n, const Layer *ls, const void *cos, const void *sin, long cs,
                  const void *mask, const long *ms, int B, int T, int held, int threads) {
    char *other = n > 1 ? malloc(t->size * (size_t)B * T * ls[0].qkv->part[0].k) : NULL;
    if (n > 1 && !other) return 1;
    const void *in = x;
    int failed = 0;
    for (int i = 0; i < n && !failed; i++) {
        void *to = (n - 1 - i) % 2 ? other : out; /* the last layer's into out */
        const Layer *l = &ls[i];
        failed = layer(t, in, to, NULL, l->qkv, l->o, l->gate_up, l->down, l->norms, l->act, cos, sin, cs, l->keys, l->values, l->kvs,
                       held, mask, ms, B, T, l->H, l->G, l->D, l->scale, threads);
        in = to;
    }
    free(other);
    return failed;
}

