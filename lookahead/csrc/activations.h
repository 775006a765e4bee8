/* torch's activations on fp32 vectors, bit for bit as its vectorised CPU kernels compute them (Sleef's expf_u10 and
   tanhf_u10, the functions torch's vectors call; SiLU; GELU with the tanh approximation), at 8 lanes (AVX2 + FMA:
   the fp32 layer's, decoder_layer_fp32.c, in every tier) and 16 (AVX-512: the bf16 layer's, decoder_layer.c).
   One code for both widths (activations_lanes.h, included once per width): per lane the same operations, so the
   same bits as torch's AVX-512 or AVX2 vectors. (The bf16 layer on two 8-lane halves took 34-41 us for SiLU of
   16 x 2048 gates where 16 lanes take ~28.) */

#include <immintrin.h>
#include <math.h>

#define AVX2_FMA __attribute__((target("avx2,fma")))

#define LANES 8
#include "activations_lanes.h"
#undef LANES
#ifdef __AVX512F__
#define LANES 16
#include "activations_lanes.h"
#undef LANES
#endif
