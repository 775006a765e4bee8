/* A GGUF table's rows, decoded and dequantized to fp32 as gguf-py does (quants.py's _legacy, then
   Quantized.dequantize): each value d q, rounded, then + m where the type has one, rounded again. For an embedding's
   few new rows a step: one call where numpy and torch took ~15 (~0.1 ms cold for SmolLM2's Q8_0 table). The legacy
   types of 32 values a block, an fp16 d (and m) first (GGUF_ROWS' order in native.py):

       Q8_0  d, 32 int8                          q
       Q4_0  d, 16 bytes: low nibbles, then high  q - 8
       Q4_1  d, m, 16 bytes                      q (+ m)
       Q5_0  d, a 32-bit word of fifth bits, 16 bytes    (q | bit j << 4) - 16
       Q5_1  d, m, the fifth bits, 16 bytes      q | bit j << 4 (+ m) */

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define F16C __attribute__((target("f16c"))) /* every tier's CPU has it (native.TIERS); the AVX2 flags do not say so */

enum { Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 };

static uint16_t u16(const uint8_t *p) { return (uint16_t)(p[0] | p[1] << 8); }

static uint16_t bf16(float f) { /* rounded to nearest even, as torch's .to(torch.bfloat16); a NaN its quiet NaN */
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7FFFFFFF) > 0x7F800000) return 0x7FC0;
    return (uint16_t)((bits + 0x7FFF + (bits >> 16 & 1)) >> 16);
}

/* out (n, k), fp32 or (bf16) rounded to bf16 = rows ids[0 .. n) of raw, V rows each `bytes` long, of type kind; k a
   multiple of 32. -1, or the first id outside [0, V) (then nothing is written) */
F16C long gguf_rows(const uint8_t *raw, long bytes, long V, const int64_t *ids, int n, int k, int kind, void *out, int to_bf16) {
    static const int size[] = {34, 18, 20, 22, 24}, quants[] = {2, 2, 4, 6, 8}, bias[] = {0, 8, 0, 16, 0};
    const int offset = kind == Q4_1 || kind == Q5_1, fifth = kind == Q5_0 || kind == Q5_1;
    for (int r = 0; r < n; r++)
        if (ids[r] < 0 || ids[r] >= V) return r;
    for (int r = 0; r < n; r++)
        for (int b = 0; b < k / 32; b++) {
            const uint8_t *block = raw + ids[r] * bytes + (long)b * size[kind], *qs = block + quants[kind];
            const float d = _cvtsh_ss(u16(block)), m = offset ? _cvtsh_ss(u16(block + 2)) : 0.0f; /* fp16 -> fp32: exact */
            const uint32_t high = fifth ? (uint32_t)u16(qs - 4) | (uint32_t)u16(qs - 2) << 16 : 0;
            const long at = (long)r * k + b * 32;
            for (int j = 0; j < 32; j++) {
                const int q = kind == Q8_0 ? (int8_t)qs[j] : ((j < 16 ? qs[j] & 0x0F : qs[j - 16] >> 4) | (int)(high >> j & 1) << 4) - bias[kind];
                float p = (float)q * d;
                __asm__("" : "+v"(p)); /* rounded before the sum, as numpy does: gcc would contract them into one FMA */
                p = offset ? p + m : p;
                if (to_bf16) ((uint16_t *)out)[at + j] = bf16(p);
                else ((float *)out)[at + j] = p;
            }
        }
    return -1;
}
