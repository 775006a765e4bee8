/* A step's compaction in one call: in each of the cache's K and V tensors (B, H, S, D), sequence b's kept columns
   start + index[b][c] move to start + c. torch's ops for it (a narrow, an index_select and a copy per tensor, 60
   tensors for SmolLM2) took ~0.7 ms a step that moved columns, for a few KB of data.

   index[b] is sorted, so moving c in ascending order never overwrites a column still to be read: the column c
   writes is at most index[b][c], and later ones read from index[b][c'] >= index[b][c] (equal: the same column). */

#include <stdint.h>
#include <string.h>

/* tensors[i]: (B, H, S, D) with strides[3 i .. 3 i + 2] (elements) for b, h and the column, D contiguous; index
   (B, kept) */
void move_columns(char *const *tensors, const long *strides, int count, int elem, int B, int H, int D, long start,
                  const int64_t *index, int kept) {
    for (int i = 0; i < count; i++)
        for (int b = 0; b < B; b++)
            for (int h = 0; h < H; h++) {
                char *base = tensors[i] + (b * strides[3 * i] + h * strides[3 * i + 1] + start * strides[3 * i + 2]) * elem;
                for (int c = 0; c < kept; c++) {
                    long from = index[(long)b * kept + c];
                    if (from != c)
                        memcpy(base + c * strides[3 * i + 2] * elem, base + from * strides[3 * i + 2] * elem, (size_t)D * elem);
                }
            }
}
