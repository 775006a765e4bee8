"""Our own C (``csrc/*.c``): its ISA tiers (``TIERS``), built once per machine with gcc into the cache and loaded
through ctypes (``library``), and the ABI the other modules call it by (the C functions' signatures, the structs
``csrc/decoder_layer.h`` takes). ``library`` says why not where the kernels cannot run: the packed products then
use oneDNN's product and SDPA, as they do for fp16.

What calls into it, by idea: ``linear_kernels`` (the weights laid out for the products, and the products: bf16, fp32,
quantized, integer), ``layer_kernels`` (the attention, norms, RoPE, activations and a decoder layer in one call),
``host_kernels`` (a step's top-k, argmax and KV moves). Why each kernel beats what it replaces, with the
measurements, is in its source's header and in DESIGN.md."""

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

import torch

from lookahead import cpu
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
                "decoder_layer_fp32.c", "top_k.c", "move_columns.c", "gguf_rows.c")
AVX2_FLAGS = ("-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp", "-fPIC", "-shared")
TIERS = {
    "avx512-bf16": Tier(("avx512f", "avx512bw", "avx512vl", "avx512_bf16"),
                        ("linear.c", "amx_linear.c", "quant_linear.c", "int_linear.c", "tree_attention.c", "tree_attention_avx2.c",
                         "rms_norm.c", "top_k.c", "move_columns.c", "rope.c", "decoder_layer.c", "decoder_layer_fp32.c", "gguf_rows.c"),
                        BASE_FLAGS + ("-mavx512bf16", "-mamx-tile", "-mamx-bf16", "-mamx-int8")),
    "avx512f": Tier(("avx512f", "avx512bw", "avx512vl", "f16c"),
                    ("linear.c", "quant_linear.c", "int_linear_avx2.c", "tree_attention_avx2.c", "rms_norm.c", "top_k.c", "move_columns.c",
                     "rope.c", "decoder_layer_fp32.c", "gguf_rows.c"), BASE_FLAGS),
    "avx-vnni": Tier(("avx2", "fma", "f16c", "avx_vnni"), AVX2_SOURCES, AVX2_FLAGS + ("-mavxvnni",)),
    "avx2": Tier(("avx2", "fma", "f16c"), AVX2_SOURCES, AVX2_FLAGS),
}
SUB_SCALES = frozenset({"avx2", "avx512f"})  # tiers whose integer linear puts the K types' sub-block scales on the
# integer sums (vpmaddwd by sc, one fp32 step a super-block: int_linear_avx2.c without VNNI), so bits of their own for
# those blocks; every other tier scales each group in fp32, as int_linear.c does
INTEGER = "int8"  # the --dtype whose quantized linears round their activations to 8 bits and multiply integers
Longs = ctypes.c_long * 3
PRODUCTS = ("bf16_linear", "amx_bf16_linear", "quant_bf16_linear", "amx_quant_linear", "int_linear", "fp32_linear",
            "quant_fp32_linear")  # csrc/decoder_layer.h's kinds
ATTENTIONS = {torch.bfloat16: "tree_attention", torch.float32: "tree_attention_fp32"}  # csrc/tree_attention.c's, _avx2.c's
LAYERS = {torch.bfloat16: "decoder_layer", torch.float32: "decoder_layer_fp32"}  # csrc/decoder_layer.c's, _fp32.c's
EVERY_LAYER = {torch.bfloat16: "decoder_layers", torch.float32: "decoder_layers_fp32"}  # a step's every layer in one call
ACTIVATIONS = (None, "silu", "gelu_tanh")  # csrc/decoder_layer.h's: what ``gated`` and ``decoder_layer`` compute as torch does
GATES = {torch.bfloat16: "gated", torch.float32: "gated_fp32"}  # csrc/decoder_layer.c's, _fp32.c's
GGUF_ROWS = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")  # the types csrc/gguf_rows.c decodes, in its order
NORMS = ("input", "residual", "attended", "mlp_out", "q_heads", "k_heads")  # a layer's norms, as ``decoder_layer`` takes them


class Product(ctypes.Structure):
    """A product's kernel (its index in ``PRODUCTS``) and weights, as ``csrc/decoder_layer.h`` calls it."""

    _fields_ = [("kind", ctypes.c_int), ("packed", ctypes.c_void_p), ("bias", ctypes.c_void_p)] + [
        (name, ctypes.c_int) for name in ("n", "k", "bits", "group", "offsets", "scaling", "l2")]


class Role(ctypes.Structure):
    """A layer's role (q/k/v, output, gate/up, down) as ``csrc/decoder_layer.h`` calls it: one product, or a GGUF's
    siblings of other types as one product each (up to three), whose outputs sit side by side."""

    _fields_ = [("part", Product * 3), ("parts", ctypes.c_int), ("n", ctypes.c_int)]


class Norm(ctypes.Structure):
    """A layer's RMSNorm as ``csrc/decoder_layer.h`` calls it: its weight (None: the layer has none there), eps
    and weighting (``rms_norm``'s offset)."""

    _fields_ = [("w", ctypes.c_void_p), ("eps", ctypes.c_float), ("offset", ctypes.c_int)]


class Layer(ctypes.Structure):
    """One layer of a step's every layer in one call (``csrc/decoder_layer.h``'s ``layers``): its constants as
    ``decoder_layer`` takes them, and its cache's buffers (B, G, capacity, D) and their strides."""

    _fields_ = [(name, ctypes.POINTER(Role)) for name in ("qkv", "o", "gate_up", "down")] + [("norms", ctypes.POINTER(Norm))] + [
        (name, ctypes.c_int) for name in ("act", "H", "G", "D")] + [("scale", ctypes.c_float), ("keys", ctypes.c_void_p),
                                                                  ("values", ctypes.c_void_p), ("kvs", Longs)]


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
        self.directory: Path | None = None  # where the loaded build lies (``benchmarks.kernel_ab`` builds another tier beside it)

    def __call__(self, cache_dir: Path | None = None, tier: str | None = None) -> ctypes.CDLL | str:
        """``tier``: a lower one than the CPU's best, held for the process (benchmarks: an AVX2 run on an
        AVX-512 machine); ValueError for one the CPU lacks, or once another is loaded."""
        if tier is not None and (tier not in TIERS or not runs(tier)):
            raise ValueError(f"this CPU cannot run the {tier!r} kernels (tiers: {', '.join(TIERS)})")
        if self.loaded is None:
            self.tier, self.directory = tier or best_tier(), (cache_dir or default_cache_dir()) / "kernels"
            self.loaded = build(self.directory, self.tier) if self.tier else self._why_none()
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
        self.loaded = self.tier = self.directory = None


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
        "amx_int_linear": (linear + [ctypes.c_int] * 5, ctypes.c_int),  # the same; 2: no AMX-INT8 tiles here
        "int_tile_rows": ([ctypes.c_int], ctypes.c_int),  # threads -> the rows from which int_linear takes tiles (INT_MAX: never)
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
        **{name: ([ctypes.c_void_p] * 2 + [ctypes.c_int] * 4, None) for name in GATES.values()},
        **{name: ([ctypes.c_void_p] * 2 + [ctypes.c_int, ctypes.POINTER(Layer)] + [ctypes.c_void_p] * 2 + [ctypes.c_long, ctypes.c_void_p, Longs]
                  + [ctypes.c_int] * 4, ctypes.c_int) for name in EVERY_LAYER.values()},  # 1: out of memory
        "gguf_rows": ([ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_void_p] + [ctypes.c_int] * 3 + [ctypes.c_void_p, ctypes.c_int],
                      ctypes.c_long),  # -1, or the first id out of range
    }
    for name, (arguments, result) in signatures.items():
        if hasattr(lib, name):
            getattr(lib, name).argtypes, getattr(lib, name).restype = arguments, result
    return lib


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
