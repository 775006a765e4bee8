"""The floor that a CPU's 8-bit dot products put under a wide integer step, beside the step as measured.

    python -m benchmarks.arithmetic_floor [--model qwen2.5-coder-1.5b --weights gguf --sizes 2,4,8,16]

Measures (1) the peak of the CPU's 8-bit dot product here: a C loop of independent accumulators on every thread at
once, `vpdpbusd` where the CPU has VNNI (64 multiply-adds an instruction on zmm, AVX512-VNNI; 32 on ymm, AVX-VNNI),
else the pair every AVX2 integer product needs, `vpmaddubsw` (32 byte products summed in pairs into int16) and the
`vpaddw` that accumulates it (``int_linear_avx2.c``'s inner loop; its `vpmaddwd` widening once in 8 pairs is left
out, so the floor is low, never high); (2) the model's int8 forwards of T
rows over a 256-token cache (``profile_step``'s); and prints for each T the measured r(T) beside its floor:
T rows' multiply-adds of every linear (``lm_head`` included) at that peak, over the measured one-row forward.
Every product of the integer path is such dot products, so no kernel on this CPU goes below the floor: a
target under it needs another CPU (more or wider VNNI units, or AMX). The other work of a step (attention,
norms, quantizing the rows, the host) is left out, so the floor is low, never high.
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import tempfile
from pathlib import Path

import torch

from benchmarks.profile_step import linear_flops, profile_size
from benchmarks.run import hardware
from lookahead import cpu, models, native

LOOP = r"""
#include <omp.h>
/* multiply-adds a second of `threads` threads each running `iterations` x DOTS (12 dot products into registers of
   their own: independent, so one instruction's latency never waits on another's); registers 12 and 13 are the operands */
double peak(long iterations, int threads) {
    double start = omp_get_wtime();
    _Pragma("omp parallel num_threads(threads)")
    for (long n = 0; n < iterations; n++)
        __asm__ volatile(DOTS ::: "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11");
    return (double)iterations * 12 * MACS * threads / (omp_get_wtime() - start);
}
"""
VARIANTS = {  # CPU flag -> (what it is, the loop's 12 dot products, multiply-adds each), the first the CPU has
    "avx512_vnni": ("zmm vpdpbusd (AVX512-VNNI)", "".join(f"vpdpbusd %%zmm13, %%zmm12, %%zmm{i}\\n" for i in range(12)), 64),
    "avx_vnni": ("ymm vpdpbusd (AVX-VNNI)", "".join(f"{{vex}} vpdpbusd %%ymm13, %%ymm12, %%ymm{i}\\n" for i in range(12)), 32),
    "avx2": ("ymm vpmaddubsw + vpaddw (AVX2)",  # 6 accumulators, each fed by its own product register
             "".join(f"vpmaddubsw %%ymm13, %%ymm12, %%ymm{i}\\nvpaddw %%ymm{i}, %%ymm{i + 6}, %%ymm{i + 6}\\n" for i in range(6)) * 2, 32),
}


TIER_DOTS = {"avx-vnni": "avx_vnni", "avx512f": "avx2", "avx2": "avx2"}  # a tier held below the CPU's best -> its dot product


def dot_peak(threads: int, seconds: float = 0.5, tier: str | None = None) -> tuple[str, float]:
    """(the instruction, multiply-adds a second on ``threads`` threads at once: the fastest of 5 runs), the best the
    CPU has, or the one the kernels of ``tier`` multiply with."""
    flag = TIER_DOTS.get(tier) or next((f for f in VARIANTS if f in cpu.flags()), None)
    if flag is None:
        raise SystemExit("this CPU has no AVX2: the integer path does not run here")
    what, dots, macs = VARIANTS[flag]
    with tempfile.TemporaryDirectory() as tmp:
        source, library = Path(tmp) / "peak.c", Path(tmp) / "peak.so"
        source.write_text(LOOP)
        built = subprocess.run(["gcc", "-O2", "-fopenmp", "-fPIC", "-shared", f'-DDOTS="{dots}"', f"-DMACS={macs}", str(source), "-o", str(library)],
                               capture_output=True, text=True)
        if built.returncode:
            raise SystemExit(f"gcc could not build the peak loop: {(built.stderr.strip().splitlines() or ['?'])[-1]}")
        run = ctypes.CDLL(str(library)).peak
        run.argtypes, run.restype = [ctypes.c_long, ctypes.c_int], ctypes.c_double
        iterations = max(int(run(1_000_000, threads) * seconds / (12 * macs * threads)), 1)  # about ``seconds`` a run
        return what, max(run(iterations, threads) for _ in range(5))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--weights", choices=models.WEIGHTS, default="gguf")
    parser.add_argument("--sizes", default="2,4,8,16")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args(argv)
    threads, hw = torch.get_num_threads(), hardware()
    what, peak = dot_peak(threads)
    model = models.load(args.model, dtype=native.INTEGER, kernels="packed", weights=args.weights)[0]
    macs = linear_flops(model, 1) / 2  # a row's multiply-adds
    sizes = sorted({1} | {int(s) for s in args.sizes.split(",")})
    forward = {size: profile_size(model, size, args.context, args.reps)["wall_ms"] for size in sizes}
    print(f"# {args.model} int8 ({args.weights}): {macs / 1e9:.3f} G multiply-adds a row; {hw['cpu']}, {threads} threads, commit "
          f"{hw['commit']}; {what} peak {peak / 1e9:.0f} G multiply-adds a second on the {threads} threads\n")
    print("| T | forward (ms) | r(T) | its multiply-adds at the peak (ms) | r(T) floor |\n|---|---|---|---|---|")
    for size in sizes:
        at_peak = size * macs / peak * 1e3
        print(f"| {size} | {forward[size]:.1f} | {forward[size] / forward[1]:.2f} | {at_peak:.1f} | {max(at_peak / forward[1], 1.0):.2f} |")


if __name__ == "__main__":
    main()
