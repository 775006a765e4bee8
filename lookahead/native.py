"""Our own CPU kernels (``csrc/*.c``, AVX-512 CPUs, in ``TIERS``): the linear of a step's few rows (bf16 and fp32;
bf16 on AMX tiles where the CPU has them, ``csrc/amx_linear.c``) and its bf16 attention, built once per machine
with gcc into the cache and called through ctypes.

The linear (``csrc/linear.c``): a step's linears must stream every weight from memory, and at 16 rows
also do 16x the arithmetic. oneDNN's small-M product does one after the other (in the model its 16-row time is
its hot 16-row time plus its one-row streaming time); ours prefetches the next weight blocks while it computes.
SmolLM2-135M's products, Zen 5, 2 threads, weights cycled through 30 copies as a forward streams them, us: one
row 116 against 163 a layer and ``lm_head`` 0.68 against 0.86 ms; 16 rows 174 against 265 and 1.1 against 1.6
ms. Each row is summed in the same order whatever the number of rows (row-invariant), and the fp32 sums are
rounded to bf16 once, as oneDNN does.

The attention (``csrc/tree_attention.c``): a step's query rows of every head that shares a K/V head, under the
step's additive 4D mask, 2.2-4x as fast as CPU SDPA on SmolLM2's shapes (see the source), and a prompt's
prefill. The RMSNorm (``csrc/rms_norm.c``): one call for the ~8 torch ops of a norm module. And two pieces of a
step's host work: the recycled top-k over the vocabulary (``csrc/top_k.c``, in place of ``torch.topk``), and
the KV compaction's moves in one call (``csrc/move_columns.c``, in place of three torch ops a K/V tensor).

The quantized linear (``csrc/quant_linear.c``, bf16 on AMX in ``csrc/amx_linear.c``): a GGUF's integers and
scales (``lookahead.quants``) laid out once by ``pack_quantized`` in the same blocks of 16 columns, dequantized in
registers inside the product; ``Linear`` runs either layout. The integer linear (``csrc/int_linear.c``, AVX512-VNNI):
the same blocks times activations rounded to 8 bits, in integer dot products (``QuantLayout.integer``); on the
other tiers ``csrc/int_linear_avx2.c``, the same bits on fp32 activations, and ``csrc/tree_attention_avx2.c``, the
attention in fp32 (row-invariant as the bf16 one: what int8's lookahead needs there to equal its plain loop).

``library`` says why not where they cannot run: the packed kernels then use oneDNN's product and SDPA, as they do
for fp16."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from lookahead import cpu, quants
from lookahead.cpu import default_cache_dir

CSRC = Path(__file__).parent / "csrc"
BASE_FLAGS = ("-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-fopenmp", "-fPIC", "-shared")


@dataclass(frozen=True)
class Tier:
    """One build of the kernels: the CPU flags it needs, its sources and gcc's flags."""

    needs: tuple[str, ...]
    sources: tuple[str, ...]
    flags: tuple[str, ...]


# the best tier this CPU has serves the process; an AVX-512F CPU without BF16 (Skylake-X, Cascade Lake, Ice
# Lake) gets the fp32 linears (dense, quantized and integer), the fp32 attention, RMSNorm and RoPE, the fp32 layer in
# one call, the top-k and the KV moves (their bf16 code is not compiled); an AVX2 one (Haswell and later, Zen 1-3)
# the fp32 linears, attention, RMSNorm, RoPE and layer in one call (linear_avx2.c, quant_linear_avx2.c,
# int_linear_avx2.c, tree_attention_avx2.c, rms_norm_avx2.c, rope_avx2.c, decoder_layer_fp32.c: the same bits;
# -ffp-contract=off keeps each product and sum apart where the AVX-512 code rounds them apart), the top-k and
# argmax (top_k.c on 8 lanes) and the KV moves; an AVX-VNNI one (Alder Lake and later client chips) the same, its
# integer dot products on vpdpbusd
AVX2_SOURCES = ("linear_avx2.c", "quant_linear_avx2.c", "int_linear_avx2.c", "tree_attention_avx2.c", "rms_norm_avx2.c", "rope_avx2.c",
                "decoder_layer_fp32.c", "top_k.c", "move_columns.c")
AVX2_FLAGS = ("-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp", "-fPIC", "-shared")
TIERS = {
    "avx512-bf16": Tier(("avx512f", "avx512bw", "avx512vl", "avx512_bf16"),
                        ("linear.c", "amx_linear.c", "quant_linear.c", "int_linear.c", "tree_attention.c", "tree_attention_avx2.c",
                         "rms_norm.c", "top_k.c", "move_columns.c", "rope.c", "decoder_layer.c", "decoder_layer_fp32.c"),
                        BASE_FLAGS + ("-mavx512bf16", "-mamx-tile", "-mamx-bf16")),
    "avx512f": Tier(("avx512f", "avx512bw", "avx512vl", "f16c"),
                    ("linear.c", "quant_linear.c", "int_linear_avx2.c", "tree_attention_avx2.c", "rms_norm.c", "top_k.c", "move_columns.c",
                     "rope.c", "decoder_layer_fp32.c"), BASE_FLAGS),
    "avx-vnni": Tier(("avx2", "fma", "f16c", "avx_vnni"), AVX2_SOURCES, AVX2_FLAGS + ("-mavxvnni",)),
    "avx2": Tier(("avx2", "fma", "f16c"), AVX2_SOURCES, AVX2_FLAGS),
}
INTEGER = "int8"  # the --dtype whose quantized linears round their activations to 8 bits and multiply integers
BLOCK = 16  # output columns a packed block holds: N must be a multiple (and K even in bf16)
Longs = ctypes.c_long * 3
SCALINGS = ("groups", "supers", "halves")  # csrc/int_linear.c's: a layout's scales fp32 a group, the K types', fp16 a group
PRODUCTS = ("bf16_linear", "amx_bf16_linear", "quant_bf16_linear", "amx_quant_linear", "int_linear", "fp32_linear",
            "quant_fp32_linear")  # csrc/decoder_layer.h's kinds
ATTENTIONS = {torch.bfloat16: "tree_attention", torch.float32: "tree_attention_fp32"}  # csrc/tree_attention.c's, _avx2.c's
LAYERS = {torch.bfloat16: "decoder_layer", torch.float32: "decoder_layer_fp32"}  # csrc/decoder_layer.c's, _fp32.c's
ACTIVATIONS = (None, "silu", "gelu_tanh")  # csrc/decoder_layer.h's: what ``gated`` and ``decoder_layer`` compute as torch does
GATES = {torch.bfloat16: "gated", torch.float32: "gated_fp32"}  # csrc/decoder_layer.c's, _fp32.c's
NORMS = ("input", "residual", "attended", "mlp_out", "q_heads", "k_heads")  # a layer's norms, as ``decoder_layer`` takes them


class Product(ctypes.Structure):
    """A product's kernel (its index in ``PRODUCTS``) and weights, as ``csrc/decoder_layer.h`` calls it."""

    _fields_ = [("kind", ctypes.c_int), ("packed", ctypes.c_void_p), ("bias", ctypes.c_void_p)] + [
        (name, ctypes.c_int) for name in ("n", "k", "bits", "group", "offsets", "scaling", "l2")]


class Role(ctypes.Structure):
    """A layer's role (q/k/v, output, gate/up, down) as ``csrc/decoder_layer.h`` calls it: one product, or a GGUF's
    siblings of other types as one product each (up to three), whose outputs sit side by side."""

    _fields_ = [("part", Product * 3), ("parts", ctypes.c_int), ("n", ctypes.c_int)]


def role(linears: list) -> Role | None:
    """The role of ``linears`` (``Linear``s whose outputs sit side by side, in order, each with a ``product``), or None
    where ``decoder_layer`` cannot call them: more than three, or one not on a kernel it knows."""
    if not 0 < len(linears) <= 3 or any(getattr(linear, "product", None) is None for linear in linears):
        return None
    return Role((Product * 3)(*(linear.product for linear in linears)), len(linears), sum(linear.n for linear in linears))


class Norm(ctypes.Structure):
    """A layer's RMSNorm as ``csrc/decoder_layer.h`` calls it: its weight (None: the layer has none there), eps
    and weighting (``rms_norm``'s offset)."""

    _fields_ = [("w", ctypes.c_void_p), ("eps", ctypes.c_float), ("offset", ctypes.c_int)]


def layer_norms(norms: dict) -> ctypes.Array:
    """``NORMS``' names -> (weight, eps, offset), as ``decoder_layer`` takes them: made once a layer (the weights are
    the caller's to hold)."""
    if set(norms) - set(NORMS):
        raise ValueError(f"a layer's norms are among {NORMS}, got {sorted(set(norms) - set(NORMS))}")
    return (Norm * len(NORMS))(*(Norm(norms[name][0].data_ptr(), *norms[name][1:]) if name in norms else Norm() for name in NORMS))


@functools.cache
def build_id(tier: str, csrc: Path = CSRC) -> str:
    """A hash of what a tier's build depends on (its sources in ``csrc``, flags and gcc): the library's file name,
    and part of a cost curve's cache key, so a changed kernel is probed again."""
    gcc = shutil.which("gcc") or "gcc"
    version = subprocess.run([gcc, "--version"], capture_output=True, text=True).stdout.partition("\n")[0]
    t = TIERS[tier]
    files = [csrc / s for s in t.sources] + sorted(csrc.glob("*.h"))  # the sources and the headers they may include
    return hashlib.sha256(b"".join(f.read_bytes() for f in files) + repr((t.flags, version)).encode()).hexdigest()[:16]


def runs(tier: str) -> bool:
    """Whether this CPU has every instruction set ``tier`` is built for."""
    return all(f in cpu.flags() for f in TIERS[tier].needs)


def best_tier() -> str | None:
    """The best tier this CPU runs (None: not even AVX2)."""
    return next((name for name in TIERS if runs(name)), None)


class _Library:
    """``library``: the kernels of the best tier this CPU has, built on first use into ``cache_dir/kernels``
    (default: the user's cache), or why they cannot run here (no gcc, not x86-64, no AVX-512, an unwritable
    cache). A process loads one build (a loaded shared library stays loaded): the first call's directory holds,
    later calls get that build. ``build`` makes any tier's, for the tests.

    gcc's OpenMP runtime is torch's own (the same ``libgomp.so.1``, loaded with torch), so the kernels' threads
    are torch's."""

    def __init__(self) -> None:
        self.loaded: ctypes.CDLL | str | None = None
        self.tier: str | None = None

    def __call__(self, cache_dir: Path | None = None, tier: str | None = None) -> ctypes.CDLL | str:
        """``tier``: a lower one than the CPU's best, held for the process (benchmarks: an AVX2 run on an
        AVX-512 machine); ValueError for one the CPU lacks, or once another is loaded."""
        if tier is not None and (tier not in TIERS or not runs(tier)):
            raise ValueError(f"this CPU cannot run the {tier!r} kernels (tiers: {', '.join(TIERS)})")
        if self.loaded is None:
            self.tier = tier or best_tier()
            self.loaded = build((cache_dir or default_cache_dir()) / "kernels", self.tier) if self.tier else self._why_none()
        elif tier is not None and tier != self.tier:
            raise ValueError(f"this process already runs the {self.tier} kernels")
        return self.loaded

    @staticmethod
    def _why_none() -> str:
        if platform.machine() not in ("x86_64", "AMD64"):
            return f"not an x86-64 CPU ({platform.machine()})"
        return "cannot read /proc/cpuinfo" if not cpu.flags() else "this CPU has no AVX-512"

    def cache_clear(self) -> None:
        """Forget the build (tests): the next call builds or finds one again."""
        self.loaded = self.tier = None


library = _Library()


def has(kernel: str) -> bool:
    """Whether the process's kernels include ``kernel`` (``bf16_linear``, ``tree_attention``, ``amx_init`` ...: an
    AVX-512F build has no bf16 ones)."""
    lib = library()
    return not isinstance(lib, str) and hasattr(lib, kernel)


def loaded() -> ctypes.CDLL | None:
    """The process's kernels if something has loaded them (``kernels.pack``, ``library``), never building them: the
    helpers that have torch's ops to fall back on (``top_k``, ``move_columns``) use ours only then, so a process
    whose models run stock (``--kernels stock``) runs no C of ours."""
    return library.loaded if isinstance(library.loaded, ctypes.CDLL) else None


def tier() -> str | None:
    """The tier of the process's kernels (None where they do not run)."""
    return None if isinstance(library(), str) else library.tier


def build(directory: Path, tier: str, csrc: Path = CSRC) -> ctypes.CDLL | str:
    """The kernels of ``tier``, built from the sources in ``csrc`` (another revision's: ``benchmarks.kernel_ab``)
    into ``directory`` (kept: a later call finds them), or why they cannot be."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"not an x86-64 CPU ({platform.machine()})"
    if not runs(tier):
        return f"this CPU cannot run the {tier} kernels"
    gcc = shutil.which("gcc")
    if gcc is None:
        return "no gcc to build it"
    t = TIERS[tier]
    try:
        target = directory / f"lookahead-{tier}-{build_id(tier, csrc)}.so"
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            partial = target.with_suffix(f".{os.getpid()}.partial")  # renamed into place whole: a parallel build is harmless
            built = subprocess.run([gcc, *t.flags, *(str(csrc / s) for s in t.sources), "-o", str(partial)],
                                   capture_output=True, text=True)
            if built.returncode:
                return f"gcc could not build it ({(built.stderr.strip().splitlines() or ['?'])[0][:120]})"
            os.replace(partial, target)
        lib = ctypes.CDLL(str(target))
    except OSError as e:  # an unwritable cache, a missing source, a library that will not load
        return f"cannot build or load it ({e})"
    linear = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 5
    signatures = {  # name: (argument types, result type)
        "fp32_linear": (linear, None),
        "bf16_linear": (linear, None),
        "amx_bf16_linear": (linear, None),
        "amx_init": ([], ctypes.c_int),
        "quant_fp32_linear": (linear + [ctypes.c_int] * 3, None),  # ... k, bits, group, offsets, threads, l2
        "quant_bf16_linear": (linear + [ctypes.c_int] * 3, ctypes.c_int),  # 1: out of memory
        "amx_quant_linear": (linear + [ctypes.c_int] * 3, ctypes.c_int),  # 1: out of memory
        "int_linear": (linear + [ctypes.c_int] * 5, ctypes.c_int),  # ... offsets, scaling, threads, l2, bf16; 1: out of memory
        **{name: ([ctypes.c_void_p, Longs, ctypes.c_void_p, ctypes.c_void_p, Longs, ctypes.c_void_p, Longs, ctypes.c_void_p]
                  + [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_int], ctypes.c_int) for name in ATTENTIONS.values()},  # 1: out of memory
        "rms_norm": ([ctypes.c_void_p] * 3 + [ctypes.c_int] * 3 + [ctypes.c_float] + [ctypes.c_int] * 2, None),
        "add_rms_norm": ([ctypes.c_void_p] * 5 + [ctypes.c_int] * 3 + [ctypes.c_float] + [ctypes.c_int] * 2, None),
        "rope": ([ctypes.c_void_p] * 3 + [ctypes.c_int] * 5, None),
        "top_k": ([ctypes.c_void_p] + [ctypes.c_int] * 4 + [ctypes.c_void_p, ctypes.c_int], ctypes.c_int),  # 1: out of memory
        "argmax": ([ctypes.c_void_p] + [ctypes.c_int] * 3 + [ctypes.c_void_p], ctypes.c_int64),  # the first row's
        "move_columns": ([ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int] * 5 + [ctypes.c_long, ctypes.c_void_p, ctypes.c_int], None),
        **{name: ([ctypes.c_void_p] * 3 + [ctypes.POINTER(Role)] * 4 + [ctypes.POINTER(Norm), ctypes.c_int]
                  + [ctypes.c_void_p] * 2 + [ctypes.c_long] + [ctypes.c_void_p] * 2 + [Longs, ctypes.c_int, ctypes.c_void_p, Longs]
                  + [ctypes.c_int] * 5 + [ctypes.c_float, ctypes.c_int], ctypes.c_int) for name in LAYERS.values()},  # 1: out of memory
        **{name: ([ctypes.c_void_p] * 2 + [ctypes.c_int] * 3, None) for name in GATES.values()},
    }
    for name, (arguments, result) in signatures.items():
        if hasattr(lib, name):
            getattr(lib, name).argtypes, getattr(lib, name).restype = arguments, result
    return lib


def fits(n: int, k: int, dtype: torch.dtype) -> bool:
    """Whether an (n, k) weight of ``dtype`` can be packed for the linear (bf16 or fp32)."""
    return n % BLOCK == 0 and n > 0 and k > 0 and (dtype == torch.float32 or dtype == torch.bfloat16 and k % 2 == 0)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """(N, K) -> the linear's layout: bf16 (N/16, K/2, 16, 2) (block, line = pair of k, column, k in the pair);
    fp32 (N/16, K, 16) (block, line = k, column)."""
    n, k = weight.shape
    if weight.dtype == torch.bfloat16:
        return weight.view(n // BLOCK, BLOCK, k // 2, 2).permute(0, 2, 1, 3).contiguous()
    return weight.view(n // BLOCK, BLOCK, k).permute(0, 2, 1).contiguous()


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """``pack``'s inverse: the dense (N, K) weight."""
    if packed.dtype == torch.bfloat16:
        return packed.permute(0, 2, 1, 3).reshape(packed.shape[0] * BLOCK, packed.shape[1] * 2)
    return packed.permute(0, 2, 1).reshape(packed.shape[0] * BLOCK, packed.shape[1])


@dataclass(frozen=True)
class QuantLayout:
    """A quantized weight in ``csrc/quant_linear.c``'s blocks: the bytes and what the kernel must be told of them."""

    packed: torch.Tensor  # (N / 16, bytes a block) uint8
    n: int
    k: int
    bits: int  # 8: int8 q, 4: nibbles, 6: 6-bit planes (``pack_supers``' int8 K types)
    group: int  # k's a scale covers
    offsets: bool  # whether each group has an offset too
    dtype: torch.dtype  # the activations' (and outputs') dtype: which kernel runs it
    integer: bool = False  # activations rounded to 8 bits, integer products (csrc/int_linear.c), where ``integer_runs()``
    supers: bool = False  # the K types' scales per 256 k's (``pack_supers``: the integer kernel's alone)
    halves: bool = False  # each group's scales (and offsets) as fp16 (``pack_quantized``: the integer kernel's alone)

    @property
    def shape(self) -> tuple[int, int]:
        return self.n, self.k

    @property
    def kind(self) -> str:
        """What must agree for weights to share one product (``quants.kind``)."""
        return quants.kind(self.bits, self.group, self.offsets, self.supers, self.halves)

    @property
    def scaling(self) -> int:
        """How the blocks hold their scales, as the integer kernel is told (``SCALINGS``)."""
        return SCALINGS.index("supers" if self.supers else "halves" if self.halves else "groups")

    def nbytes(self) -> int:
        return self.packed.numel()


def quant_fits(n: int, k: int, group: int, integer: bool = False) -> bool:
    """Whether an (n, k) quantized weight with groups of ``group`` k's can be laid out for the kernel (for the
    integer one: 4 k's a lane, 32 an activation scale)."""
    fits = n % BLOCK == 0 and n > 0 and k > 0 and group % 2 == 0 and k % group == 0
    return fits and (not integer or group in (16, 32) and k % 32 == 0)


def pack_quantized(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None, group: int, bits: int,
                   dtype: torch.dtype, integer: bool = False, halves: bool = False) -> QuantLayout:
    """q (N, K) int8 (0 .. 15 where ``bits`` is 4), scale and offset (N, K / group) fp32 -> the kernel's blocks, for
    ``dtype`` activations (rounded to 8 bits where ``integer``): per block of 16 rows and group, the 16 scales, the 16 offsets, then steps of 32 values
    (k's 16 columns, then k + 1's; nibbles: value i in byte i % 16, the high nibble from i = 16; for the integer
    kernel, the values in its lanes' order: ``_lanes``). ``halves``: the
    scales and offsets as fp16, for the integer kernel (a ValueError where one is not exact in fp16)."""
    n, k = q.shape
    groups = k // group
    if halves and not (integer and halves_exact(scale, offset)):
        raise ValueError("fp16 scales are for the integer kernel, and for scales and offsets exact in fp16")
    heads = [_columns(t.half() if halves else t.float(), groups) for t in (scale, offset) if t is not None]  # (NB, G, 64 or 32) each
    values = _lanes(q, group, bits) if integer else _steps(q, group, bits)
    packed = torch.cat([*heads, values], dim=-1).reshape(n // BLOCK, -1).contiguous()
    return QuantLayout(packed, n, k, bits, group, offset is not None, dtype, integer, halves=halves)


def halves_exact(scale: torch.Tensor, offset: torch.Tensor | None) -> bool:
    """Whether the scales (and offsets) are exact in fp16: a GGUF's d, m and dmin are fp16 in its file."""
    return all(torch.equal(t.half().float(), t.float()) for t in (scale, offset) if t is not None)


def supers_fit(q: quants.Quantized) -> bool:
    """Whether ``q`` can be laid out by ``pack_supers``: a K type's (``q.supers``, d and dmin exact in fp16), K a
    multiple of 256."""
    return (q.supers is not None and q.shape[1] % 256 == 0 and quant_fits(*q.shape, q.group, integer=True)
            and halves_exact(q.supers.d, q.supers.dmin))


def lay_out(q: quants.Quantized, dtype: torch.dtype, integer: bool = False) -> QuantLayout:
    """``q`` for the quantized kernel with ``dtype`` activations, or for the integer one where ``integer``: in the
    K types' own scales where they fit (``pack_supers``), else ``pack_quantized``'s (with fp16 scales where they are
    exact in fp16)."""
    if integer and supers_fit(q):
        return pack_supers(q, dtype)
    return pack_quantized(q.q, q.scale, q.offset, q.group, q.bits, dtype, integer, halves=integer and halves_exact(q.scale, q.offset))


def pack_supers(q: quants.Quantized, dtype: torch.dtype) -> QuantLayout:
    """A K type's weight (``q.supers`` set; K a multiple of 256) -> the integer kernel's blocks: per block of 16
    rows and 256 k's, the 16 d (and dmin) as fp16 (the file's), then each group's 16 int8 sc (and then each group's m), then the
    values: nibbles in the integer kernel's order (``_octets``); the int8 ones (Q6_K, Q5_K, Q3_K: -32 .. 31)
    as 6 bits (``_planes``). Q4_K: 2368 bytes for 4096 weights (4.625 bits each; the file's 4.5) where
    ``pack_quantized`` takes 3072; Q6_K 3360 (6.5625 bits, as in the file) where it takes 5120. A ValueError where
    d or dmin is not exact in fp16."""
    n, k = q.shape
    supers, groups = q.supers, k // q.group
    per = 256 // q.group  # groups a super-block
    if not halves_exact(supers.d, supers.dmin):
        raise ValueError("a K type's d and dmin are fp16 in its file: these are not exact in fp16")
    wide = [_columns(t.half(), k // 256) for t in (supers.d, supers.dmin) if t is not None]  # (NB, S, 32) each
    small = [_columns(t, groups).reshape(n // BLOCK, k // 256, per * BLOCK) for t in (supers.sc, supers.m) if t is not None]
    values = _planes(q.q) if q.bits == 8 else _octets(q.q, q.group)
    packed = torch.cat([*wide, *small, values.reshape(n // BLOCK, k // 256, -1)], dim=-1).reshape(n // BLOCK, -1).contiguous()
    return QuantLayout(packed, n, k, 6 if q.bits == 8 else q.bits, q.group, supers.dmin is not None, dtype, integer=True, supers=True)


def _planes(q: torch.Tensor) -> torch.Tensor:
    """q (N, K) int8 in -32 .. 31 -> (N / 16, K / 16, 192): per 16 k's, u = q + 32 (6 bits) in the integer kernel's
    own order, four quads of 64 bytes (byte 4c + j: k + 4t + j of column c, quad t): 64 bytes of quads 0 and 1's
    low nibbles (0's low), 64 of quads 2 and 3's, then 64 of the four quads' high two bits (quad t's at bit 2t)."""
    n, k = q.shape
    if q.numel() and (int(q.min()) < -32 or int(q.max()) > 31):
        raise ValueError("6-bit planes hold values in -32 .. 31")
    u = (q + 32).to(torch.uint8).view(n // BLOCK, BLOCK, k // 16, 4, 4).permute(0, 2, 3, 1, 4).reshape(n // BLOCK, k // 16, 4, 64)
    low, high = u & 15, u >> 4
    return torch.cat([low[:, :, 0] | (low[:, :, 1] << 4), low[:, :, 2] | (low[:, :, 3] << 4),
                      high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)], dim=-1)


def _unplanes(planes: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """``_planes``' inverse: (N / 16, K / 16, 192) -> q (N, K) int8."""
    a, b, h = planes[..., :64], planes[..., 64:128], planes[..., 128:]
    low = torch.stack([a & 15, a >> 4, b & 15, b >> 4], dim=2)  # (NB, K / 16, 4, 64)
    high = torch.stack([(h >> (2 * t)) & 3 for t in range(4)], dim=2)
    u = (low | (high << 4)).view(n // BLOCK, k // 16, 4, BLOCK, 4).permute(0, 3, 1, 2, 4).reshape(n, k)
    return u.to(torch.int8) - 32


def _lanes(q: torch.Tensor, group: int, bits: int) -> torch.Tensor:
    """q (N, K) -> (N / 16, K / group, bytes): a group's values in the integer kernel's lanes, 16 columns of 4 k's
    (vpdpbusd's), so a quad is a load (int8: ``_quads``) or a mask and a shift (nibbles: ``_octets``)."""
    return _octets(q, group) if bits == 4 else _quads(q, group)


def _unlanes(values: torch.Tensor, n: int, k: int, bits: int) -> torch.Tensor:
    """``_lanes``' inverse: (N / 16, K / group, bytes) -> q (N, K) int8."""
    return _unoctets(values, n, k) if bits == 4 else _unquads(values, n, k)


def _quads(q: torch.Tensor, group: int) -> torch.Tensor:
    """q (N, K) int8 -> (N / 16, K / group, group * 16): per 4 k's, 64 bytes, byte 4c + j holding column c's k + j
    plus 128 (vpdpbusd multiplies unsigned weights; the kernel takes 128 sum_k qx[k] off, exactly)."""
    n, k = q.shape
    lanes = q.view(n // BLOCK, BLOCK, k // 4, 4).permute(0, 2, 1, 3).reshape(n // BLOCK, k // group, group * BLOCK)
    return (lanes.to(torch.int16) + 128).to(torch.uint8)


def _unquads(quads: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """``_quads``' inverse: (N / 16, K / group, bytes) -> q (N, K) int8."""
    lanes = (quads.reshape(n // BLOCK, k // 4, BLOCK, 4).to(torch.int16) - 128).to(torch.int8)
    return lanes.permute(0, 2, 1, 3).reshape(n, k)


def _octets(q: torch.Tensor, group: int) -> torch.Tensor:
    """q (N, K) in 0 .. 15 -> (N / 16, K / group, group * 8): per 8 k's, 64 bytes in the integer kernel's lanes,
    byte 4c + j holding column c's k + j (low nibble) and k + 4 + j (high), so a mask and a shift make the two
    quads vpdpbusd multiplies: no byte permutes."""
    n, k = q.shape
    lanes = q.to(torch.uint8).view(n // BLOCK, BLOCK, k // 8, 2, 4).permute(0, 2, 3, 1, 4).reshape(n // BLOCK, k // 8, 2, 64)
    return (lanes[:, :, 0] | (lanes[:, :, 1] << 4)).reshape(n // BLOCK, k // group, -1)


def _unoctets(octets: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """``_octets``' inverse: (N / 16, K / group (or K / 256), bytes) -> q (N, K) int8."""
    octets = octets.reshape(n // BLOCK, k // 8, 1, 64)
    lanes = torch.cat([octets & 15, octets >> 4], dim=2).view(n // BLOCK, k // 8, 2, BLOCK, 4)
    return lanes.permute(0, 3, 1, 2, 4).reshape(n, k).to(torch.int8)


def _columns(t: torch.Tensor, groups: int) -> torch.Tensor:
    """(N, groups) values -> (N / 16, groups, 16 values' bytes): each group's values for a block's 16 columns."""
    return t.view(t.shape[0] // BLOCK, BLOCK, groups).transpose(1, 2).contiguous().view(torch.uint8)


def _steps(q: torch.Tensor, group: int, bits: int) -> torch.Tensor:
    """q (N, K) -> (N / 16, K / group, bytes): each group's steps of 32 values (k's 16 columns, then k + 1's),
    nibbles two a byte (value i in byte i % 16, the high nibble from i = 16) where ``bits`` is 4."""
    n, k = q.shape
    steps = q.view(n // BLOCK, BLOCK, k // group, group // 2, 2).permute(0, 2, 3, 4, 1).reshape(n // BLOCK, k // group, group // 2, 32)
    steps = steps.contiguous().view(torch.uint8)
    if bits == 4:
        steps = steps[..., :16] | (steps[..., 16:] << 4)
    return steps.reshape(n // BLOCK, k // group, -1)


def cat_layouts(parts: list[QuantLayout], dtype: torch.dtype, integer: bool = False) -> QuantLayout:
    """Laid-out weights of one kind and width stacked by rows, for ``dtype`` activations (rounded to 8 bits where
    ``integer``): a view where each part's
    bytes follow the last's in one storage (``gguf_model`` lays siblings out so), else a copy."""
    if integer:  # the integer kernel reads values in its lanes' order: the fp32 kernel's laid out again (a copy)
        parts = [p if p.integer else _relaid(p) for p in parts]
    first = parts[0]
    if any((p.k, p.kind) != (first.k, first.kind) for p in parts):
        raise ValueError("laid-out weights of different kinds or widths cannot be stacked")
    n = sum(p.n for p in parts)
    storage = first.packed.untyped_storage()
    adjacent = all(p.packed.is_contiguous() and p.packed.untyped_storage().data_ptr() == storage.data_ptr() for p in parts) and all(
        a.packed.data_ptr() + a.packed.numel() == b.packed.data_ptr() for a, b in zip(parts, parts[1:]))
    if adjacent:
        packed = torch.empty(0, dtype=torch.uint8).set_(storage, first.packed.storage_offset(), (n // BLOCK, first.packed.shape[1]))
    else:
        packed = torch.cat([p.packed for p in parts])
    return QuantLayout(packed, n, first.k, first.bits, first.group, first.offsets, dtype, integer or first.integer, first.supers,
                       first.halves)


def _relaid(layout: QuantLayout) -> QuantLayout:
    """A layout of the fp32 kernel's, laid out for the integer one (``_lanes``)."""
    q, scale, offset = unpack_quantized(layout)
    return pack_quantized(q, scale, offset, layout.group, layout.bits, layout.dtype, integer=True)


def unpack_quantized(layout: QuantLayout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``pack_quantized``'s (and ``pack_supers``') inverse: (q, scale, offset)."""
    if layout.supers:
        return _unpack_supers(layout)
    n, k, group, heads = layout.n, layout.k, layout.group, 2 if layout.offsets else 1
    blocks, size, of = layout.packed.view(n // BLOCK, k // group, -1), 32 if layout.halves else 64, torch.float16 if layout.halves else torch.float32
    floats = [blocks[..., size * i:size * (i + 1)].contiguous().view(of).float().transpose(1, 2).reshape(n, -1) for i in range(heads)]
    values = blocks[..., size * heads:]
    q = _unlanes(values, n, k, layout.bits) if layout.integer else _unsteps(values, n, k, group, layout.bits)
    return q, floats[0], floats[1] if layout.offsets else None


def _unpack_supers(layout: QuantLayout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``pack_supers``' inverse: the scales ``d sc`` and offsets ``-(dmin m)`` as the decoders compute them."""
    n, k, group, heads, per = layout.n, layout.k, layout.group, 2 if layout.offsets else 1, 256 // layout.group
    blocks = layout.packed.view(n // BLOCK, k // 256, -1)
    at = [32 * i for i in range(heads)] + [32 * heads + 16 * per * i for i in range(heads + 1)]  # d, dmin, sc, m, values
    wide = [blocks[..., at[i]:at[i] + 32].contiguous().view(torch.float16).float().transpose(1, 2).reshape(n, -1, 1) for i in range(heads)]
    small = [blocks[..., at[heads + i]:at[heads + i + 1]].contiguous().view(torch.int8).view(n // BLOCK, k // 256, per, BLOCK)
             .permute(0, 3, 1, 2).reshape(n, -1, per).float() for i in range(heads)]
    values = blocks[..., at[-1]:]
    q = _unplanes(values.reshape(n // BLOCK, k // 16, 192), n, k) if layout.bits == 6 else _unoctets(values, n, k)
    return q, (wide[0] * small[0]).reshape(n, -1), -(wide[1] * small[1]).reshape(n, -1) if layout.offsets else None


def _unsteps(steps: torch.Tensor, n: int, k: int, group: int, bits: int) -> torch.Tensor:
    """``_steps``' inverse: (N / 16, K / group, bytes) -> q (N, K) int8."""
    steps = steps.reshape(n // BLOCK, k // group, group // 2, -1)
    if bits == 4:
        steps = torch.cat([steps & 15, steps >> 4], dim=-1)
    steps = steps.contiguous().view(torch.int8).view(n // BLOCK, k // group, group // 2, 2, BLOCK)
    return steps.permute(0, 4, 1, 2, 3).reshape(n, k)


NON_TEMPORAL = ("Zen 5",)  # the CPUs whose loop ran fastest with the weights prefetched non-temporally (linear.c)


@functools.cache
def prefetch_into_l2() -> int:
    """1 where the linears prefetch the weights into L2, 0 where non-temporally (``linear.c`` says what each CPU
    measured: into L2 won on a Zen 4 and by 1.9x on a Xeon; non-temporal beat into L1 on a Zen 5)."""
    return int(cpu.cpu_generation() not in NON_TEMPORAL)


@functools.cache
def amx() -> bool:
    """Whether bf16 products run on AMX tiles (``csrc/amx_linear.c``): the CPU has them and Linux lets this process
    use them. One answer a process, so every product of a shape takes one path whatever its rows."""
    return "amx_bf16" in cpu.flags() and has("amx_init") and bool(library().amx_init())


@functools.cache
def integer_runs() -> bool:
    """Whether the integer linear runs here: built, and on the AVX-512 BF16 tier (``csrc/int_linear.c``) the CPU has
    AVX512-VNNI (the other tiers' ``csrc/int_linear_avx2.c`` needs no more than the tier does)."""
    return has("int_linear") and (tier() != "avx512-bf16" or "avx512_vnni" in cpu.flags())


def isa() -> str:
    """What our kernels run on in this process, for ``--json`` and ``lookahead tune``: "avx512-bf16+amx",
    "avx512-bf16", "avx512f", "avx-vnni", "avx2", or "none (why)"."""
    lib = library()
    return f"none ({lib})" if isinstance(lib, str) else f"{tier()}+amx" if amx() else str(tier())


class Linear:
    """(..., K) -> (..., N) in the weight's dtype (bf16 or fp32): x W^T (+ bias, fp32), W packed by ``pack`` (or by
    ``pack_quantized``: a ``QuantLayout``); the sizes, pointers and kernel looked up once (a forward makes 121 calls:
    ~1 us each less than doing it per call). Holds ``packed`` and ``bias``, so the pointers stay valid."""

    def __init__(self, packed: torch.Tensor | QuantLayout, bias: torch.Tensor | None, tiles: bool | None = None) -> None:
        """``tiles``: bf16 on AMX tiles (None: where ``amx()``; True where they are not is a ValueError)."""
        self.packed, self.bias = packed, bias
        if tiles and not amx():
            raise ValueError("this CPU or process cannot use AMX tiles")
        quantized = isinstance(packed, QuantLayout)
        integer = quantized and packed.integer  # the integer kernel: bf16 or fp32 activations, said in its last argument
        if integer and not integer_runs():
            raise ValueError("no integer linear runs here (no kernels, or an AVX-512 BF16 CPU without AVX512-VNNI)")
        if integer and packed.dtype == torch.bfloat16 and not has("bf16_linear"):
            raise ValueError(f"the {tier()} integer linear takes fp32 activations, not bf16")
        if quantized:
            self.dtype, self.n, self.k = packed.dtype, packed.n, packed.k
            self.format = (packed.bits, packed.group, int(packed.offsets)) + ((packed.scaling,) if integer else ())  # the kernels' extra arguments
            weights = packed.packed
        else:
            self.dtype = packed.dtype
            self.n, self.k = packed.shape[0] * BLOCK, packed.shape[1] * (2 if packed.dtype == torch.bfloat16 else 1)
            self.format, weights = (), packed
        bf16 = self.dtype == torch.bfloat16
        on_tiles = bf16 and self.k % 32 == 0 and not integer and (amx() if tiles is None else tiles)
        name = f"amx_{'quant' if quantized else 'bf16'}_linear" if on_tiles else f"{'quant_' if quantized else ''}{'bf16' if bf16 else 'fp32'}_linear"
        self.run = getattr(library(), "int_linear" if integer else name)
        self.tail = (int(bf16),) if integer else ()
        self.pointers = weights.data_ptr(), None if bias is None else bias.data_ptr()
        self.l2 = prefetch_into_l2()
        kernel = "int_linear" if integer else name
        self.product = Product(PRODUCTS.index(kernel), *self.pointers, self.n, self.k, *(self.format + (0,) * 4)[:4], self.l2) \
            if kernel in PRODUCTS else None  # what ``decoder_layer`` calls

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.dtype:
            raise TypeError(f"the {self.dtype} linear takes {self.dtype} input, got {x.dtype}")
        if x.shape[-1] != self.k:  # the kernel reads K columns a row: never let it read past x
            raise ValueError(f"input has {x.shape[-1]} features, the weight {self.k}")
        x = x.contiguous()
        y = torch.empty(*x.shape[:-1], self.n, dtype=self.dtype)
        if self.into(x, y):
            raise MemoryError(f"the quantized linear could not allocate {x.numel() // self.k} x {self.k} floats")
        return y

    def into(self, x: torch.Tensor, y: torch.Tensor, run=None) -> int:
        """The kernel on ``x`` (contiguous, checked) into ``y``: its status (1: out of memory). ``run``: the same
        kernel of another build (``benchmarks.kernel_ab``)."""
        rows = x.numel() // self.k
        return rows and (run or self.run)(x.data_ptr(), *self.pointers, y.data_ptr(), rows, self.n, self.k, *self.format,
                                          torch.get_num_threads(), self.l2, *self.tail)


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``Linear(packed, bias)(x)``, for one call."""
    return Linear(packed, bias)(x)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: int) -> torch.Tensor:
    """(..., N) -> (..., N), bf16 or fp32 as ``x`` and ``weight`` (N,): transformers' RMSNorm, the weight applied as
    Llama's (``offset`` 0: w * dtype(x r)) or Gemma 3's (1: dtype(x r (1 + w))); see ``csrc/rms_norm.c``."""
    x, weight = _normed(x, weight)
    y = torch.empty_like(x)
    if x.numel():
        library().rms_norm(x.data_ptr(), weight.data_ptr(), y.data_ptr(), x.dtype == torch.bfloat16, x.numel() // x.shape[-1],
                           x.shape[-1], eps, offset, torch.get_num_threads())
    return y


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, ``rms_norm(s, ...)``) for s = x + delta (..., N), rounded as torch's sum, in one call."""
    if delta.shape != x.shape or delta.dtype != x.dtype:
        raise ValueError(f"add_rms_norm adds tensors of one shape and dtype, got {x.dtype} {tuple(x.shape)} and {delta.dtype} {tuple(delta.shape)}")
    x, weight = _normed(x, weight)
    delta = delta.contiguous()
    s, y = torch.empty_like(x), torch.empty_like(x)
    if x.numel():
        library().add_rms_norm(x.data_ptr(), delta.data_ptr(), s.data_ptr(), weight.data_ptr(), y.data_ptr(), x.dtype == torch.bfloat16,
                               x.numel() // x.shape[-1], x.shape[-1], eps, offset, torch.get_num_threads())
    return s, y


def _normed(x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` and ``weight`` contiguous, once checked for the norm kernels."""
    if x.dtype != weight.dtype or x.dtype not in (torch.bfloat16, torch.float32) or x.shape[-1] != weight.numel():
        raise ValueError(f"rms_norm takes bf16 or fp32 input and weight of one dtype and width, got {x.dtype} {tuple(x.shape)} "
                         f"and {weight.dtype} {tuple(weight.shape)}")
    if x.dtype == torch.bfloat16 and not has("bf16_linear"):
        raise ValueError("the bf16 RMSNorm needs the AVX-512 BF16 kernels")
    return x.contiguous(), weight.contiguous()


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, head_dim: int) -> None:
    """Rotary embedding, as transformers' ``apply_rotary_pos_emb`` (rotate_half), on the first ``heads`` heads of
    ``head_dim`` of each row of ``x`` (..., width) in place (a step's q/k/v product: q's heads, then k's), with that
    row's ``cos`` and ``sin`` (..., head_dim), all bf16 or all fp32; see ``csrc/rope.c``."""
    rows = x.numel() // x.shape[-1]
    if (x.dtype not in (torch.bfloat16, torch.float32) or cos.dtype != x.dtype or sin.dtype != x.dtype or not x.is_contiguous()
            or head_dim % 2 or heads * head_dim > x.shape[-1] or cos.shape != (*x.shape[:-1], head_dim) or sin.shape != cos.shape):
        raise ValueError(f"rope takes a contiguous bf16 or fp32 x and a cos and sin of one row a row, got {x.dtype} {tuple(x.shape)}, "
                         f"{cos.dtype} {tuple(cos.shape)} for {heads} heads of {head_dim}")
    if x.dtype == torch.bfloat16 and not has("bf16_linear"):
        raise ValueError("the bf16 rope needs the AVX-512 BF16 kernels")
    cos, sin = cos.contiguous(), sin.contiguous()
    if rows:
        library().rope(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), x.dtype == torch.bfloat16, rows, x.shape[-1], heads, head_dim)


def attention_fits(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, causal: bool) -> bool:
    """Whether ``attention`` runs this call: bf16 or fp32 on CPU where the kernels run (a step's rows or a prompt's:
    bf16 3-5x CPU SDPA's speed at 16-1024 causal rows), an additive mask of the same dtype (B or 1, 1, T, S) or
    none (then only causal), head size a multiple of 32 up to 256, whole groups of query heads."""
    if query.dtype not in ATTENTIONS or query.device.type != "cpu" or not has(ATTENTIONS[query.dtype]):
        return False
    (b, h, t, d), (kb, g, s, kd) = query.shape, key.shape
    return (mask_fits(mask, query.dtype, b, t, s, causal) and key.dtype == value.dtype == query.dtype and value.shape == key.shape
            and key.stride() == value.stride() and kb == b and kd == d and heads_fit(h, g, d) and 0 < t <= s
            and query.stride(-1) == key.stride(-1) == 1)


def mask_fits(mask: torch.Tensor | None, dtype: torch.dtype, b: int, t: int, s: int, causal: bool) -> bool:
    """Whether the attention kernel takes ``mask`` for ``b`` sequences' ``t`` rows over ``s`` keys: additive in
    ``dtype`` (B or 1, 1, T, S), or none where the attention is causal."""
    return causal if mask is None else (mask.dtype == dtype and mask.dim() == 4 and mask.shape[0] in (1, b)
                                        and tuple(mask.shape[1:]) == (1, t, s) and mask.stride(-1) == 1)


def heads_fit(h: int, g: int, d: int) -> bool:
    """Whether the attention kernel takes ``h`` query heads on ``g`` K/V heads of ``d``."""
    return d % 32 == 0 and d <= 256 and h % g == 0


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor | None:
    """softmax(scale q k^T + mask) v for query (B, H, T, D), key and value (B, G, S, D) of G grouped heads, mask
    (B or 1, 1, T, S) additive, or None for causal (row t sees keys up to S - T + t), all bf16 or all fp32
    (``attention_fits``) -> (B, T, H, D) of that dtype, as transformers' attention functions return; None where
    the kernel could not allocate its buffers (the caller runs SDPA)."""
    b, h, t, d = query.shape
    g, s = key.shape[1], key.shape[2]
    out = torch.empty(b, t, h, d, dtype=query.dtype)
    failed = getattr(library(), ATTENTIONS[query.dtype])(query.data_ptr(), Longs(*query.stride()[:3]), key.data_ptr(), value.data_ptr(),
                                      Longs(*key.stride()[:3]), _pointer(mask), _mask_strides(mask), out.data_ptr(),
                                      b, h, g, t, s, d, scale, torch.get_num_threads())
    return None if failed else out


def _pointer(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _mask_strides(mask: torch.Tensor | None) -> Longs:
    """An additive mask's strides as the attention kernel reads them: a sequence's (0: shared), a row's."""
    return Longs(0 if mask is None or mask.shape[0] == 1 else mask.stride(0), 0 if mask is None else mask.stride(2), 0)


def layer_constants(dtype: torch.dtype, roles: tuple, norms: ctypes.Array, activation: str | None, heads: tuple[int, int, int],
                    scale: float) -> tuple:
    """What ``decoder_layer`` passes for one layer at every step, made once a layer: its kernel (``LAYERS``), the q/k/v,
    output, gate/up and down (or None) ``Role``s on the dtype's kernels, ``layer_norms``' norms, the activation
    (one ``gates`` says, where there is a down product), and heads (H, G, D) and the attention's scale."""
    return getattr(library(), LAYERS[dtype]), (*roles, norms, ACTIVATIONS.index(activation)), (*heads, scale), roles[2].n


def step_constants(cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None, b: int, t: int) -> tuple:
    """What ``decoder_layer`` passes for every layer of one step, made once a step: cos, sin (B or 1, T, D) contiguous,
    the ``mask`` as ``mask_fits``, the step's b sequences of t rows, and the threads (each argument converted again
    for each layer's call was ~4 us a layer, a step's layers' Python ~25 us each)."""
    return ((cos.data_ptr(), sin.data_ptr(), 0 if cos.shape[0] == 1 else cos.stride(0)),
            (_pointer(mask), _mask_strides(mask), b, t), torch.get_num_threads())


def decoder_layer(x: torch.Tensor, layer: tuple, step: tuple, keys: torch.Tensor, values: torch.Tensor, strides: ctypes.Array,
                  held: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A decoder layer in one call (``csrc/decoder_layer.h``), bf16 or fp32 (``LAYERS``), x (B, T, E): (its output,
    None) where the layer has a down product, else (h, both) for the caller to finish: h the residual sum after
    attention (B, T, E), both the gate/up product (B, T, 2 width). ``layer``: ``layer_constants``' (of x's dtype);
    ``step``: ``step_constants``'; keys, values: the cache's buffers (B, G, capacity, D), room made for T columns after
    ``held``, ``strides`` their first three (``kv.reserve``'s)."""
    call, head, tail, width = layer
    rope, masking, threads = step
    out, both = torch.empty_like(x), None if head[3] is not None else torch.empty(*x.shape[:2], width, dtype=x.dtype)
    if call(x.data_ptr(), out.data_ptr(), _pointer(both), *head, *rope, keys.data_ptr(), values.data_ptr(), strides, held, *masking,
            *tail, threads):
        raise MemoryError(f"a decoder layer's kernels could not allocate their buffers for {x.shape[0] * x.shape[1]} rows")
    return out, both


def gates(dtype: torch.dtype, activation: str | None, width: int) -> bool:
    """Whether ``gated`` (and so ``decoder_layer``) computes ``activation`` (one of ``ACTIVATIONS``) of ``width`` gates in
    ``dtype`` here: bf16 or fp32 (``GATES``), width a multiple of 16."""
    return activation in ACTIVATIONS[1:] and width % 16 == 0 and dtype in GATES and has(GATES[dtype])


def gated(both: torch.Tensor, activation: str) -> torch.Tensor:
    """(..., 2 width) gate, up -> (..., width): ``act(gate) * up`` bit for bit as torch computes it (``F.silu``, or
    ``F.gelu(approximate="tanh")``; ``csrc/decoder_layer.c``, ``_fp32.c``), in one call; width a multiple of 16."""
    both = both.contiguous()
    width = both.shape[-1] // 2
    if both.shape[-1] != 2 * width or not gates(both.dtype, activation, width):
        raise ValueError(f"gated takes bf16 or fp32 (..., 2 width) where the kernels run, width a multiple of 16, and one of "
                         f"{ACTIVATIONS[1:]}, got {both.dtype} {tuple(both.shape)}, {activation!r}")
    out = torch.empty(*both.shape[:-1], width, dtype=both.dtype)
    getattr(library(), GATES[both.dtype])(both.data_ptr(), out.data_ptr(), both.numel() // both.shape[-1], width, ACTIVATIONS.index(activation))
    return out


def top_k(scores: torch.Tensor, k: int) -> np.ndarray:
    """Indices (..., k) of the ``k`` largest of each row of host fp32 or bf16 ``scores`` (..., V), largest first (a
    tie: the lower index first); ``torch.topk``'s where the kernels are not loaded, or for k over 64."""
    lib = loaded()
    ours = hasattr(lib, "top_k") and 0 < k <= min(64, scores.shape[-1]) and scores.dtype in (torch.float32, torch.bfloat16) \
        and scores.is_cpu
    if ours:
        x = scores.contiguous()
        out = np.empty((*x.shape[:-1], k), np.int64)
        if not lib.top_k(x.data_ptr(), x.dtype == torch.bfloat16, x.numel() // x.shape[-1], x.shape[-1], k, out.ctypes.data,
                         torch.get_num_threads()):
            return out
    return torch.topk(scores, k).indices.numpy()  # where ours does not run, or could not allocate its buffers


def argmax(scores: torch.Tensor) -> int | np.ndarray:
    """The index of the largest of each row of host ``scores`` (..., V): the first of equal ones, the first NaN above
    all (torch's rule). fp32 and bf16 are read as they are by ours (``csrc/top_k.c``; a bf16 row needs no fp32 copy)
    where the kernels are loaded, else by numpy (~14x faster than torch's argmax on a row of 49152, Zen 5)."""
    lib = loaded()
    if hasattr(lib, "argmax") and scores.dtype in (torch.float32, torch.bfloat16) and scores.is_cpu and scores.shape[-1]:
        x = scores.contiguous()
        if x.dim() == 1:  # a greedy step's row: returned, no output array (each call runs cold after a forward)
            return lib.argmax(x.data_ptr(), x.dtype == torch.bfloat16, 1, x.shape[-1], None)
        index = np.empty(x.shape[:-1], np.int64)
        lib.argmax(x.data_ptr(), x.dtype == torch.bfloat16, x.numel() // x.shape[-1], x.shape[-1], index.ctypes.data)
    else:
        index = (scores if scores.dtype in (torch.float32, torch.float64) else scores.float()).numpy().argmax(-1)
    return int(index) if index.ndim == 0 else index


def move_columns(tensors: list[torch.Tensor], start: int, index: np.ndarray) -> bool:
    """In each host tensor (B, H, S, D) of ``tensors`` (a cache's keys and values), sequence b's columns ``start +
    index[b]`` (``index`` (B, C) int64, each row sorted) move to ``start + 0 .. C - 1``, in place, in one call;
    False (nothing moved) where the kernels are not loaded or a tensor is not of that shape with D contiguous."""
    lib = loaded()
    if lib is None or not tensors or any(not t.is_cpu or t.dim() != 4 or t.stride(3) != 1
                                                  or t.shape != tensors[0].shape or t.dtype != tensors[0].dtype for t in tensors):
        return False
    b, h, _, d = tensors[0].shape
    pointers = (ctypes.c_void_p * len(tensors))(*(t.data_ptr() for t in tensors))
    strides = (ctypes.c_long * (3 * len(tensors)))(*(s for t in tensors for s in t.stride()[:3]))
    index = np.ascontiguousarray(index, np.int64)
    lib.move_columns(pointers, strides, len(tensors), tensors[0].element_size(), b, h, d, start, index.ctypes.data, index.shape[1])
    return True
