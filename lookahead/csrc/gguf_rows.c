/* A GGUF table's rows, decoded and dequantized to fp32 as gguf-py does (quants.py's _legacy, then
   Quantized.dequantize): each value d q, rounded, then + m where the type has one, rounded again. For an embedding's
   few new rows a step: one call where numpy and torch took ~15 (~0.1 ms cold for SmolLM2's Q8_0 table). The legacy
   types of 32 values a block, an fp16 d (and m) first (GGUF_ROWS' order in native.py):

       Q8_0  d, 32 int8                          q
       Q4_0  d, 16 bytes: low nibbles, then high  q - 8
       Q4_1  d, m, 16 bytes                      q (+ m)
       Q5_0  d, a 32-bit word of fifth bits, 16 bytes    (q | bit j << 4) - 16
       Q5_1  d, m, the fifth bits, 16 bytes      q | bit j << 4 (+ m) */

#include <stdint.h>
#include <string.h>

enum { Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 };

static float half(uint16_t h) { /* fp16 -> fp32, exactly (numpy's astype) */
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = h >> 10 & 0x1F;
    uint32_t man = h & 0x3FF, bits;
    if (exponent == 0x1F) bits = sign | 0x7F800000 | man << 13; /* inf, NaN */
    else if (exponent) bits = sign | (exponent + 112) << 23 | man << 13;
    else if (!man) bits = sign;
    else { /* subnormal: normalised */
        uint32_t e = 113;
        while (!(man & 0x400)) man <<= 1, e--;
        bits = sign | e << 23 | (man & 0x3FF) << 13;
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static uint16_t u16(const uint8_t *p) { return (uint16_t)(p[0] | p[1] << 8); }

static uint16_t bf16(float f) { /* rounded to nearest even, as torch's .to(torch.bfloat16); a NaN its quiet NaN */
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7FFFFFFF) > 0x7F800000) return 0x7FC0;
    return (uint16_t)((bits + 0x7FFF + (bits >> 16 & 1)) >> 16);
}

/* out (n, k), fp32 or (bf16) rounded to bf16 = rows ids[0 .. n) of raw, V rows each `bytes` long, of type kind; k a
   multiple of 32. -1, or the first id outside [0, V) (then nothing is written) */
long gguf_rows(const uint8_t *raw, long bytes, long V, const int64_t *ids, int n, int k, int kind, void *out, int to_bf16) {
    static const int size[] = {34, 18, 20, 22, 24};
    for (int r = 0; r < n; r++)
        if (ids[r] < 0 || ids[r] >= V) return r;
    for (int r = 0; r < n; r++)
        for (int b = 0; b < k / 32; b++) {
            const uint8_t *block = raw + ids[r] * bytes + (long)b * size[kind];
            const int offset = kind == Q4_1 || kind == Q5_1;
            const float d = half(u16(block)), m = offset ? half(u16(block + 2)) : 0.0f;
            const uint8_t *qs = block + (kind == Q8_0 || kind == Q4_0 ? 2 : kind == Q4_1 ? 4 : kind == Q5_0 ? 6 : 8);
            const uint32_t high = kind == Q5_0 || kind == Q5_1 ? (uint32_t)u16(qs - 4) | (uint32_t)u16(qs - 2) << 16 : 0;
            const long at = (long)r * k + b * 32;
            for (int j = 0; j < 32; j++) {
                int q;
                if (kind == Q8_0) q = (int8_t)qs[j];
                else {
                    q = j < 16 ? qs[j] & 0x0F : qs[j - 16] >> 4;
                    if (kind == Q5_0 || kind == Q5_1) q |= (int)(high >> j & 1) << 4;
                    q -= kind == Q4_0 ? 8 : kind == Q5_0 ? 16 : 0;
                }
                float p = (float)q * d;
                __asm__("" : "+v"(p)); /* rounded before the sum, as numpy does: gcc would contract them into one FMA */
                p = offset ? p + m : p;
                if (to_bf16) ((uint16_t *)out)[at + j] = bf16(p);
                else ((float *)out)[at + j] = p;
            }
        }
    return -1;
}
