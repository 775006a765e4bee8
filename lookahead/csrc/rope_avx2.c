/* rope.c's rotary embedding for AVX2 + FMA CPUs, fp32 (bf16 must be 0: the AVX2 tier has no bf16 kernels): each
   product and the sum rounded apart (this tier is built with -ffp-contract=off), as torch's ops and rope.c do, so
   the same bits; gcc vectorizes the loops.

       y_i = x_i c_i + (-x_{i + D/2}) s_i      i <  D/2
       y_i = x_i c_i + x_{i - D/2} s_i         i >= D/2 */

void rope(void *xv, const void *cv, const void *sv, int bf16, int rows, int width, int heads, int d) {
    if (bf16) __builtin_trap();
    float *x = xv;
    const float *c = cv, *s = sv;
    const int half = d / 2;
    for (int r = 0; r < rows; r++)
        for (int h = 0; h < heads; h++) {
            float *at = x + (long)r * width + (long)h * d;
            const float *cr = c + (long)r * d, *sr = s + (long)r * d;
            for (int i = 0; i < half; i++) {
                const float a = at[i], b = at[half + i];
                at[i] = a * cr[i] + -b * sr[i];
                at[half + i] = b * cr[half + i] + a * sr[half + i];
            }
        }
}
