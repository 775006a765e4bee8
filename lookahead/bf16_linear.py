"""Our own bf16 linear for a decoding step's few rows (``csrc/bf16_linear.c``, AVX-512 BF16), built once per
machine with gcc into the cache and called through ctypes.

Why not oneDNN's packed product here: a step's linears must stream every weight from memory, and at 16 rows
also do 16x the arithmetic; oneDNN's small-M product does one after the other (in the model its 16-row time is
its hot 16-row time plus its one-row streaming time), ours prefetches the next weight blocks while it computes.
SmolLM2-135M's products, Zen 5, 2 threads, weights cycled through 30 copies as a forward streams them, us:
one row 116 against 163 a layer and ``lm_head`` 0.68 against 0.86 ms; 16 rows 174 against 265 and 1.1 against
1.6 ms. Each row is summed in the same order whatever the number of rows (row-invariant), and the fp32 sums
are rounded to bf16 once, as oneDNN does.

``library`` says why not where it cannot run (no gcc, not x86-64, no AVX-512 BF16): the packed kernels then
use oneDNN's product, as on every other dtype."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
from pathlib import Path

import torch

SOURCE = Path(__file__).parent / "csrc" / "bf16_linear.c"
FLAGS = ("-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-fopenmp", "-fPIC", "-shared")
BLOCK = 16  # output columns a packed block holds: N must be a multiple, K even


def fits(n: int, k: int) -> bool:
    """Whether an (n, k) weight can be packed for this kernel."""
    return n % BLOCK == 0 and k % 2 == 0 and n > 0 and k > 0


@functools.cache
def library() -> ctypes.CDLL | str:
    """The kernel, built on first use (cached under ``~/.cache/lookahead/kernels``), or why it cannot run here.

    gcc's OpenMP runtime is torch's own (the same ``libgomp.so.1``, loaded with torch), so the kernel's
    threads are torch's."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"not an x86-64 CPU ({platform.machine()})"
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return "cannot read /proc/cpuinfo"
    if "avx512_bf16" not in flags:
        return "this CPU has no AVX-512 BF16"
    gcc = shutil.which("gcc")
    if gcc is None:
        return "no gcc to build it"
    from lookahead.models import default_cache_dir

    version = subprocess.run([gcc, "--version"], capture_output=True, text=True).stdout.partition("\n")[0]
    digest = hashlib.sha256(SOURCE.read_bytes() + repr((FLAGS, version)).encode()).hexdigest()[:16]
    target = default_cache_dir() / "kernels" / f"bf16_linear-{digest}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(f".{os.getpid()}.partial")  # renamed into place whole: a parallel build is harmless
        built = subprocess.run([gcc, *FLAGS, str(SOURCE), "-o", str(partial)], capture_output=True, text=True)
        if built.returncode:
            return f"gcc could not build it ({(built.stderr.strip().splitlines() or ['?'])[0][:120]})"
        os.replace(partial, target)
    lib = ctypes.CDLL(str(target))
    lib.bf16_linear.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 4
    lib.bf16_linear.restype = None
    return lib


def pack(weight: torch.Tensor) -> torch.Tensor:
    """(N, K) bf16 -> the kernel's layout (N/16, K/2, 16, 2): block, line (pair of k), column, k in the pair."""
    n, k = weight.shape
    return weight.view(n // BLOCK, BLOCK, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """``pack``'s inverse: the dense (N, K) weight."""
    blocks, lines, block, _ = packed.shape
    return packed.permute(0, 2, 1, 3).reshape(blocks * block, lines * 2)


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """(..., K) bf16 -> (..., N) bf16: x W^T (+ bias, fp32), W packed by ``pack``."""
    if x.dtype != torch.bfloat16:
        raise TypeError(f"the bf16 linear takes bf16 input, got {x.dtype}")
    blocks, lines, block, _ = packed.shape
    n, k = blocks * block, lines * 2
    if x.shape[-1] != k:  # the kernel reads K columns a row: never let it read past x
        raise ValueError(f"input has {x.shape[-1]} features, the weight {k}")
    x = x.contiguous()
    y = torch.empty(*x.shape[:-1], n, dtype=torch.bfloat16)
    if x.numel():
        library().bf16_linear(x.data_ptr(), packed.data_ptr(), 0 if bias is None else bias.data_ptr(), y.data_ptr(),
                              x.numel() // k, n, k, torch.get_num_threads())
    return y
