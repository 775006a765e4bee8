/* The front of a decoder layer in one call, bf16 (Llama's shape: no q/k head norms, norms not sandwiched), for
   lookahead/layers.py's FusedLayer: everything up to the activation,

       xn = norm1(x)                     rms_norm.c
       qkv = xn Wqkv^T                   the product's kernel (Product: which, and its layout)
       RoPE on q and k, in place         rope.c
       k, v -> the cache's columns held .. held + T - 1 of each sequence (its buffer, which the caller made room in)
       a = attention(q, keys, values)    tree_attention.c, over held + T keys, the step's mask or causal
       h = x + a Wo^T, y = norm2(h)      the product, then add_rms_norm (rms_norm.c)
       both = y Wgate_up^T               the product: gate and up side by side

   The same kernels the module calls one by one from Python, in the same order on the same values, so the same
   bits; what it saves is the ~10 trips from Python a layer between them (a few microseconds each, more in a step
   whose products stream every cache line out: on SmolLM2's one-row step ~100 us a layer in all). */

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

/* x (B, T, E) -> h (B, T, E), both (B, T, gate_up->n); q, k, v heads H, G, G of D in qkv's output, in that order;
   cos, sin (B or 1, T, D) (cs: a sequence's stride, 0 where they are shared); keys, values (B, G, capacity, D)
   buffers of one layout (kvs: batch, head, key); mask additive (B or 1, 1, T, held + T) (ms: batch, row) or NULL
   (causal). 0, or 1 where a kernel could not allocate its buffers (the step's keys may then be written). */
int layer_front(const uint16_t *x, uint16_t *h, uint16_t *both, const Product *qkv, const Product *o, const Product *gate_up,
                const uint16_t *norm1, float eps1, const uint16_t *norm2, float eps2, const uint16_t *cos, const uint16_t *sin, long cs,
                uint16_t *keys, uint16_t *values, const long *kvs, int held, const uint16_t *mask, const long *ms, int B, int T, int H,
                int G, int D, float scale, int threads) {
    const size_t rows = (size_t)B * T, E = qkv->k, width = qkv->n; /* width = (H + 2 G) D */
    uint16_t *xn = malloc(2 * rows * (3 * E + width + (size_t)H * D)); /* the norms' outputs, qkv, the attention's, o's */
    if (!xn) return 1;
    uint16_t *q = xn + rows * E, *attended = q + rows * width, *projected = attended + rows * H * D, *y = projected + rows * E;
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
    failed = product(gate_up, y, both, (int)rows, threads);
done:
    free(xn);
    return failed;
}
