"""Weight-only quantized linears from a library, measured before writing our own (issue: run the GGUF as it is):
time of one product at T = 1 and 16 rows and row invariance (row i of a 16-row product equal bit for bit to the
1-row product), on SmolLM2-135M's linear shapes, against PyTorch's stock bf16 linear and our packed one.

    pip install torchao==0.18.0      # not a dependency of the project: only this measurement uses it
    python -m benchmarks.quantized_linears

Libraries that fail to load or quantize are reported and skipped. Nothing else may run meanwhile (2 cores)."""

from __future__ import annotations

import argparse
import copy
import time
from pathlib import Path

import torch
import torch.nn as nn

from benchmarks.run import hardware
from lookahead import kernels

SHAPES = [(576, 576), (576, 1536), (1536, 576), (576, 49152)]  # (in, out): q/o, gate/up, down, lm_head


def microseconds(module: nn.Module, x: torch.Tensor, reps: int) -> float:
    for _ in range(10):
        module(x)
    start = time.perf_counter()
    for _ in range(reps):
        module(x)
    return (time.perf_counter() - start) / reps * 1e6


def variants(base: nn.Linear) -> dict[str, nn.Module]:
    """The linears to compare, each a copy of ``base``; a library that is missing or fails is named, not run."""
    out: dict[str, nn.Module] = {"bf16 stock": base}
    packed = nn.Sequential(copy.deepcopy(base))
    kernels.pack(packed)
    out["bf16 packed (ours)"] = packed[0]
    try:
        from torchao.quantization import Int8WeightOnlyConfig, quantize_
        quantized = nn.Sequential(copy.deepcopy(base))
        quantize_(quantized, Int8WeightOnlyConfig())
        out["int8 weight-only (torchao)"] = quantized[0]
    except Exception as e:  # not installed, or no CPU path: reported in the table
        print(f"torchao skipped: {type(e).__name__}: {str(e)[:160]}")
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/quantized-linears-latest"))
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    hw = hardware()
    lines = ["# Weight-only quantized linears against our packed bf16 linear, SmolLM2-135M's shapes", "",
             f"{hw['cpu']}, {hw['cores']} cores, torch {hw['torch']}, commit {hw['commit']}. Microseconds a product, "
             "bf16 activations; row-invariant: a 16-row product's rows equal the 1-row products bit for bit.", "",
             "| shape (in x out) | linear | T = 1 (us) | T = 16 (us) | row-invariant |", "|---|---|---|---|---|"]
    with torch.inference_mode():
        for k, n in SHAPES:
            for name, module in variants(nn.Linear(k, n, bias=False).to(torch.bfloat16).eval()).items():
                one = microseconds(module, torch.randn(1, k).to(torch.bfloat16), args.reps)
                sixteen = microseconds(module, torch.randn(16, k).to(torch.bfloat16), args.reps)
                lines.append(f"| {k} x {n} | {name} | {one:.1f} | {sixteen:.1f} | {kernels.row_invariant(module, torch.bfloat16)} |")
                print(lines[-1], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
