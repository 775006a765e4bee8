"""CPU kernels: every linear projection, ``lm_head`` included, on weights packed once for small-M products.

Stock PyTorch sends a CPU ``nn.Linear`` to the BLAS, which repacks the whole weight matrix on every call
with more than one row (one row takes a GEMV path): a forward of T tokens then costs far more than one of
a single token for no reason of arithmetic, and the cost model keeps trees small. oneDNN's prepacked linear
(``torch.ops.mkldnn._reorder_linear_weight`` once, ``_linear_pointwise`` per call) streams the packed
weight for all T rows at once, so wide steps get cheap and the one-token step itself faster.

These ops are private to PyTorch: ``available`` checks them per dtype (the op exists, the CPU supports the
dtype, a packed product agrees with the stock one), and ``pack`` falls back to the stock kernels with a
one-line reason, never an error. The packed product equals the stock one up to fp32 rounding (summation
order), so fp32 output equals stock ``generate()`` up to numerical ties, as the tests check; whether row i
of a T-row product equals the one-row product bit for bit ("row-invariant") is measured by
``row_invariant`` and reported, not assumed.

On a CPU with AVX-512 BF16: our own kernels (``native``, built with gcc on first use) instead of oneDNN's
product for every bf16 or fp32 product whose shape they fit (``kernels_of`` says "packed-own"), instead of
SDPA for bf16 attention, and in one call for each RMSNorm module (``norms``). oneDNN's small-M product
streams a weight, then does the arithmetic; ours prefetches the next blocks while it computes (SmolLM2 bf16,
Zen 5: a forward of 1 / 16 rows 15.5 / 21.4 -> 12.9 / 18.3 ms, measured side by side), and it is row-invariant.

Sibling projections (``SIBLINGS``: q/k/v, gate/up) share one product of their stacked weights (``Product``):
a call costs ~14 us of oneDNN overhead, so three calls for three thin products were ~7% of SmolLM2's
forward (Zen 5, one token, bf16 17.4 -> 16.3 ms; 16 tokens 22.0 -> 20.5 ms; fp32 21.7 -> 20.5, 30.4 -> 28.5).

Attention: transformers' SDPA path copies every layer's grouped K/V heads once per query head whenever a 4D
mask is given, which is every step of the loop. ``pack`` also switches such a model to ``grouped_sdpa``,
registered through transformers' public ``AttentionInterface``: the same SDPA call, with SDPA sharing the
grouped heads (``enable_gqa``) instead of a copy, for steps of several rows (8 sequences x 4 rows over 435
keys, fp32: 141 -> 107 ms a step on a 2-core Zen 4; one sequence x 16 rows over 1024 keys, Zen 5: bf16 30.4 ->
29.3 ms, fp32 41.4 -> 40.2). A one-row step keeps the copy: there CPU SDPA's grouped path is the slower one
(Zen 5, bf16, one row over 1024 keys: 18 ms a forward with the copy, 28 without).

Quantized weights: ``pack(model, quantized={name: Quantized})`` (a GGUF's own blocks, or Q8_0 made at load:
``lookahead.quants``) runs those linears on our quantized kernel (``csrc/quant_linear.c``; bf16 on AMX tiles where
the process uses them), siblings of one kind sharing a product as dense ones do; transformers' ``GgufLinear``
modules are read the same way. ``weights_of`` says what a model's linears multiply.

Memory: each weight is packed, then its original freed, one module at a time, so the peak is the model plus
one layer. A weight shared with another module (tied input and output embeddings) stays for that module,
and the packed copy of it is the one extra (SmolLM2-135M fp32: 113 MB for its 49152 x 576 ``lm_head``).
"""

from __future__ import annotations

import itertools
import threading
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from lookahead import layer_kernels, layers, linear_kernels, native, norms, quants
from lookahead.quants import Quantized

KERNELS = ("packed", "stock")
INTEGER_KERNELS = "packed-own-int8"  # ``kernels_of`` a model whose quantized linears run on the integer kernel
GROUPED_SDPA = "lookahead_grouped_sdpa"  # the attention implementation ``pack`` switches sdpa models to
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # linears of one module read on one input
ATOL = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 5e-3}  # the self-check's bound, per dtype


class Product:
    """One packed product for linears that a module reads on the same input (``SIBLINGS``: q/k/v, gate/up),
    their weights stacked: the first of them to be called computes every one's output in one call, the others
    take theirs while the input is the same tensor and each takes it once (any other call order computes
    afresh: exact whatever the module does, fast for what decoders do; only an input changed in place between
    the siblings' calls would go unseen, which no decoder does). One call for three is what pays:
    oneDNN's call overhead is ~14 us, a one-token product of a 576-wide q, k or v a few us (Zen 5, bf16:
    q, k, v 48 -> 24 us, gate and up 52 -> 41 us a layer, ~1 ms of SmolLM2's ~15 ms forward)."""

    def __init__(self, linears: list[nn.Module], quantized: list[Quantized | linear_kernels.QuantLayout] | None = None,
                 dtype: torch.dtype | None = None, integer: bool = False) -> None:
        """``quantized``: the linears' weights as ``Quantized`` or already laid out (one kind), run on our quantized
        kernel with ``dtype`` activations (rounded to 8 bits, on the integer kernel, where ``integer``; their own
        weights are then not read: a ``GgufLinear``'s are blocks, a GGUF model's loaded directly are on the meta
        device)."""
        if quantized and isinstance(quantized[0], linear_kernels.QuantLayout):
            self.own, self.packed = True, linear_kernels.cat_layouts(quantized, dtype, integer)
        elif quantized:
            q = Quantized.cat(quantized) if len(quantized) > 1 else quantized[0]
            self.own, self.packed = True, linear_kernels.lay_out(q, dtype, integer)
        else:
            weights = [linear.weight.detach() for linear in linears]
            weight = torch.cat(weights) if len(weights) > 1 else weights[0]
            self.own = own_kernel(weight.dtype) is None and linear_kernels.fits(*weight.shape, weight.dtype)  # ours, else oneDNN's
            self.packed = linear_kernels.pack(weight) if self.own else _pack(weight)  # native's layout, or opaque oneDNN
        bias = None if linears[0].bias is None else torch.cat([linear.bias.detach() for linear in linears])
        self.bias = bias.float() if self.own and bias is not None else bias  # ours adds it to the fp32 sums
        self.native = linear_kernels.Linear(self.packed, self.bias) if self.own else None
        self.splits = [linear.out_features for linear in linears]
        self.held = threading.local()  # per thread (two threads may run one model): input, outputs, taken

    @property
    def quantized(self) -> bool:
        return isinstance(self.packed, linear_kernels.QuantLayout)

    def __call__(self, x: torch.Tensor, part: int) -> torch.Tensor:  # (..., in) -> (..., splits[part])
        if len(self.splits) == 1:
            return self.matmul(x)
        held = self.held
        if getattr(held, "input", None) is not x or held.taken[part]:
            # the input is held (so no other tensor can be it) until every part took its output; a sibling
            # never called (a layer that reuses another's K/V) leaves it held until the next call
            held.input, held.outputs, held.taken = x, self.matmul(x).split(self.splits, -1), [False] * len(self.splits)
        held.taken[part] = True
        out = held.outputs[part]
        if all(held.taken):
            held.input, held.outputs = None, ()
        return out

    def matmul(self, x: torch.Tensor) -> torch.Tensor:  # (..., in) -> (..., sum(splits)): every sibling's output
        if self.own:
            return self.native(x)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")


class PackedLinear(nn.Module):
    """``nn.Linear``'s forward on a weight packed once by oneDNN, alone or as part ``part`` of a ``Product``
    shared with its siblings (inference only: no autograd through it)."""

    def __init__(self, linear: nn.Linear, product: Product | None = None, part: int = 0) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.product, self.part = product or Product([linear]), part
        layout = self.product.packed
        self.register_buffer("packed_weight", layout.packed if self.product.quantized else layout, persistent=False)
        self.bias = linear.bias  # for code that reads it (the product holds its own copy, stacked with the siblings')

    @property
    def weight(self) -> torch.Tensor:
        """A dense copy of the weight, for code that reads it (writing to it changes nothing: use a stock model
        for a modelling code that rescales its weights in place)."""
        start = sum(self.product.splits[: self.part])
        if self.product.quantized:
            q, scale, offset = linear_kernels.unpack_quantized(self.product.packed)
            layout = self.product.packed
            dense = Quantized(q, scale, offset, layout.group, 4 if layout.bits == 4 else 8).dequantize().to(layout.dtype)  # 6-bit planes unpack to int8
        else:
            dense = linear_kernels.unpack(self.packed_weight) if self.product.own else self.packed_weight.to_dense()
        return dense[start : start + self.out_features]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., in) -> (..., out)
        return self.product(x, self.part)

    def extra_repr(self) -> str:
        shared = f", one product with {len(self.product.splits) - 1} sibling(s)" if len(self.product.splits) > 1 else ""
        packed = f"quantized {_kind(self)}" if self.product.quantized else "own" if self.product.own else "oneDNN"
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"packed={packed}{shared}")


def grouped_sdpa(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None,
                 dropout: float = 0.0, scaling: float | None = None, is_causal: bool | None = None, **kwargs):
    """transformers' SDPA attention, except: in bf16 where our own kernels run, our attention (``layer_kernels.attention``:
    a step's rows, a prompt's); else, for several rows under a 4D mask, SDPA sharing the grouped K/V heads (query
    (B, H, T, D), key and value (B, H / groups, S, D)) instead of copying them. Anything else is stock."""
    extras = dropout or any(kwargs.get(name) is not None for name in ("position_bias", "softcap", "s_aux", "sinks"))
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    if not extras and layer_kernels.attention_fits(query, key, value, attention_mask, causal):
        out = layer_kernels.attention(query, key, value, attention_mask, query.shape[-1] ** -0.5 if scaling is None else scaling)
        if out is not None:
            return out, None
    if extras or query.shape[1] == key.shape[1] or query.shape[2] == 1 or attention_mask is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None  # (B, T, H, D), as transformers' attention functions return


AttentionInterface.register(GROUPED_SDPA, grouped_sdpa)
AttentionMaskInterface.register(GROUPED_SDPA, sdpa_mask)  # its masks are SDPA's


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 16)  # 16: the batch size it is laid out for


def available(dtype: torch.dtype) -> str | None:
    """None when packed linears run here in ``dtype``; else why not, in a few words."""
    if not torch.backends.mkldnn.is_available():
        return "this PyTorch build has no oneDNN"
    try:
        torch.ops.mkldnn._reorder_linear_weight, torch.ops.mkldnn._linear_pointwise  # noqa: B018 (resolve the ops)
    except (AttributeError, RuntimeError):
        return f"torch {torch.__version__} has no oneDNN prepacked linear"
    supported = {torch.float32: lambda: True,
                 torch.bfloat16: torch.ops.mkldnn._is_mkldnn_bf16_supported,
                 torch.float16: torch.ops.mkldnn._is_mkldnn_fp16_supported}
    if dtype not in supported or not supported[dtype]():
        return f"oneDNN has no fast {str(dtype).split('.')[-1]} linear on this CPU"
    try:  # a product that disagrees with the stock one means a broken op: never use it
        rng = torch.Generator().manual_seed(0)  # private: the global RNG (unseeded sampling) is the user's
        linear = nn.utils.skip_init(nn.Linear, 96, 40, dtype=dtype)  # no init: it would draw from the global RNG
        with torch.no_grad():
            linear.weight.copy_(torch.randn(40, 96, generator=rng))
            linear.bias.copy_(torch.randn(40, generator=rng))
        x = torch.randn(3, 5, 96, generator=rng).to(dtype)
        with torch.inference_mode():
            got, want = PackedLinear(linear)(x), linear(x)
        if not torch.allclose(got.float(), want.float(), atol=ATOL[dtype], rtol=ATOL[dtype]):
            return "oneDNN's packed linear disagrees with the stock one here"
    except RuntimeError as e:
        return f"oneDNN's packed linear failed ({str(e).splitlines()[0] if str(e) else type(e).__name__})"
    return None


@dataclass(frozen=True)
class KernelReport:
    """What ``pack`` did to a model: the kernel set its forward runs on, and the memory the packing added."""

    kernels: str  # "stock", "packed", "packed-own" or "packed-own-int8" (``kernels_of``)
    packed: int = 0  # linears replaced
    kept: int = 0  # linears left stock (not on CPU, a subclass such as a quantized linear, or no packed op)
    extra_bytes: int = 0  # packed copies of weights still held elsewhere (tied embeddings)
    shared: int = 0  # products that serve several sibling linears (``Product``)
    norms: int = 0  # RMSNorm modules swapped for our kernel's (``norms.fuse``)
    layers: int = 0  # decoder layers swapped for one module each (``layers.fuse``)
    notice: str | None = None  # why packing was skipped, or why a bf16 model's products are not on our kernel
    weights: str = "dense"  # what the linears' weights are (``weights_of``)


def own_kernel(dtype: torch.dtype) -> str | None:
    """None when our own kernels (``native``) run packed products in ``dtype`` here (and, in bf16, steps'
    attention); else why not."""
    if dtype not in (torch.bfloat16, torch.float32):
        return f"it is for bfloat16 and float32, not {str(dtype).split('.')[-1]}"
    reason = native.library()
    if isinstance(reason, str):
        return reason
    return "this CPU has no AVX-512 BF16" if dtype == torch.bfloat16 and not native.has("bf16_linear") else None


def kernels_of(model: nn.Module) -> str:
    """What ``model``'s linears run on (the cost curve's cache key says it): "stock", "packed" (oneDNN's packed
    products), "packed-own" (our kernel's, oneDNN's for any shape it does not fit) or "packed-own-int8" (its
    quantized weights on the integer kernel: ``--dtype int8``)."""
    products = [m.product for m in model.modules() if isinstance(m, PackedLinear)]
    if any(p.quantized and p.packed.integer for p in products):
        return INTEGER_KERNELS
    return "stock" if not products else "packed-own" if any(p.own for p in products) else "packed"


def dtype_of(model: nn.Module) -> str:
    """The --dtype ``model`` runs in: ``native.INTEGER`` where its quantized linears are integer, else its dtype."""
    return native.INTEGER if kernels_of(model) == INTEGER_KERNELS else str(model.dtype).split(".")[-1]


def _kind(module: nn.Module) -> str:
    """A linear's weight kind: ``quants.kind`` of a quantized product's, else "dense"."""
    if isinstance(module, PackedLinear) and module.product.quantized:
        return module.product.packed.kind
    return "dense"


def weights_of(model: nn.Module) -> str:
    """What ``model``'s linears multiply, for people: "dense", or each kind and how many linears have it
    ("q4/32+offsets x 210, q8/32 x 1")."""
    kinds = Counter(_kind(m) for m in model.modules() if isinstance(m, (nn.Linear, PackedLinear)))
    return "dense" if set(kinds) <= {"dense"} else ", ".join(f"{kind} x {n}" for kind, n in sorted(kinds.items()))


def weight_kinds(model: nn.Module) -> str:
    """The kinds alone ("q4/32+offsets, q8/32"): what the cost curve's cache key says (``quants.gguf_kinds`` tells
    it from a GGUF's header before loading)."""
    return ", ".join(sorted({_kind(m) for m in model.modules() if isinstance(m, (nn.Linear, PackedLinear))})) or "dense"


def pack(model: nn.Module, kernels: str = "packed", cache_dir: Path | None = None,
         quantized: dict[str, Quantized | linear_kernels.QuantLayout] | None = None, integer: bool = False) -> KernelReport:
    """Replace every plain CPU ``nn.Linear`` of ``model`` (in place) with a ``PackedLinear``, and every transformers
    ``GgufLinear`` (a GGUF's blocks, loaded with ``GgufConfig``) of a type ``quants`` reads with one on our quantized
    kernel; see the module doc.

    ``kernels="stock"`` leaves the model as it is. Off CPU, or where ``available`` says no, the model stays
    stock and the report's ``notice`` says why. Our kernels are built into ``cache_dir`` (``native.library``).
    ``quantized``: {module name: its weight quantized, or laid out already}, run on our quantized kernel
    (``csrc/quant_linear.c``: the same outputs as the dense weight's ``dequantize()``); where that kernel cannot run,
    the dense weights do and the notice says why; a weight given laid out already has none, and is a ValueError there
    (``quantized_unavailable`` says beforehand whether the kernel runs). ``integer``: those run on the integer kernel
    (``csrc/int_linear.c``: each activation row rounded to 8 bits, as llama.cpp does; ``quantized_unavailable`` says
    where it runs)."""
    if kernels not in KERNELS:
        raise ValueError(f"kernels must be one of {', '.join(KERNELS)}, got {kernels!r}")
    if kernels == "stock":
        return KernelReport("stock")
    real = [p for p in model.parameters() if not p.is_meta] or list(model.parameters())  # a direct GGUF load's linears: meta
    device, dtype = real[0].device, next(p.dtype for p in real if p.is_floating_point())
    if device.type != "cpu":
        return KernelReport("stock", notice=f"packed kernels are for CPU; the model is on {device.type}")
    native.library(cache_dir)  # built (or found) where the caller keeps its cache, before anything asks for it
    if reason := available(dtype):
        return KernelReport("stock", notice=f"packed kernels unavailable ({reason}); running stock kernels")
    given = quantized or {}
    quantized, why_dense = _runnable(given, dtype, integer)
    stranded = [name for name, q in given.items() if isinstance(q, linear_kernels.QuantLayout) and name not in quantized]
    if stranded:  # laid out already (a GGUF loaded straight from its blocks): no dense weights to fall back on
        why = quantized_unavailable(dtype, integer) or "a shape the kernel does not take"
        raise ValueError(f"{stranded[0]}'s laid-out blocks cannot run here ({why}), and it has no dense weights")
    tied = _shared_weights(model)
    packed = kept = extra = products = 0
    for prefix, parent in list(model.named_modules()):
        linears = {name: child for name, child in parent.named_children() if isinstance(child, nn.Linear) or quants.is_gguf_linear(child)}
        blocks = {name: q for name, child in linears.items() if quants.is_gguf_linear(child) and (q := quants.from_gguf_linear(child))}
        blocks = _runnable(blocks, dtype, integer)[0]  # a GgufLinear our kernel cannot run stays as it is
        mine = {name: quantized.get(f"{prefix}.{name}" if prefix else name) or blocks.get(name) for name in linears}
        packable = {name: child for name, child in linears.items()
                    if type(child) is nn.Linear and child.weight.device.type == "cpu" and child.weight.dtype == dtype or mine[name]}
        kept += len(linears) - len(packable)
        for names in _products(packable, tied, mine):
            quantized_parts = [mine[name] for name in names] if mine[names[0]] else None
            product = Product([packable[name] for name in names], quantized_parts, dtype, integer)
            for part, name in enumerate(names):
                if id(packable[name].weight) in tied:
                    weight = packable[name].weight
                    extra += mine[name].nbytes() if mine[name] else weight.numel() * weight.element_size()
                setattr(parent, name, PackedLinear(packable[name], product, part))  # the original weight is freed unless tied
            packed += len(names)
            products += len(names) > 1
    if packed and getattr(model, "config", None) is not None and model.config._attn_implementation == "sdpa":
        model.set_attn_implementation(GROUPED_SDPA)
    why_not_own = own_kernel(dtype) if packed and dtype == torch.bfloat16 else None  # fp32 on oneDNN is as before: no notice
    notice = f"own bf16 kernel unavailable ({why_not_own}); packed products run on oneDNN" if why_not_own else why_dense
    fused = norms.fuse(model, dtype) if packed and own_kernel(dtype) is None and native.has("rms_norm") else 0
    whole = layers.fuse(model, grouped_sdpa) if fused and model.config._attn_implementation == GROUPED_SDPA else 0
    return KernelReport(kernels_of(model), packed, kept, extra, products, fused, whole, notice, weights_of(model))


def quantized_unavailable(dtype: torch.dtype, integer: bool = False) -> str | None:
    """None where our quantized kernel (the integer one where ``integer``) runs ``dtype`` activations here; else
    why not."""
    kernel = f"quant_{'bf16' if dtype == torch.bfloat16 else 'fp32'}_linear"
    if reason := own_kernel(dtype) or (None if native.has(kernel) else f"the {native.tier()} kernels have no quantized linear"):
        return reason
    return "this AVX-512 BF16 CPU has no AVX512-VNNI" if integer and not native.integer_runs() else None


def _runnable(quantized: dict[str, Quantized], dtype: torch.dtype, integer: bool) -> tuple[dict[str, Quantized], str | None]:
    """(the quantized weights our kernel runs here, in ``dtype`` (on the integer kernel where ``integer``); why any
    run dense instead, or None)."""
    if not quantized:
        return {}, None
    if reason := quantized_unavailable(dtype, integer):
        return {}, f"quantized kernels unavailable ({reason}); running the dequantized weights"
    runnable = {name: q for name, q in quantized.items() if linear_kernels.quant_fits(*q.shape, q.group, integer)}
    left = len(quantized) - len(runnable)
    return runnable, f"{left} quantized weight(s) of a shape the kernel does not take run dequantized" if left else None


def _products(linears: dict[str, nn.Linear], tied: set[int], quantized: dict[str, Quantized | None]) -> list[tuple[str, ...]]:
    """One module's packable linears, by name, grouped into products: each group of ``SIBLINGS`` that is all there,
    of one input width, all biased or none, and with no tied weight shares one, or, where it mixes kinds, one for each
    run of one kind (a GGUF's Q4_K q and k beside a Q6_K v: two products); every other linear has its own."""
    kind = lambda name: quantized[name].kind if quantized[name] else None  # noqa: E731 -- None: dense
    groups = [tuple(run) for names in SIBLINGS if all(name in linears for name in names)
              and len({(linears[name].in_features, linears[name].bias is None) for name in names}) == 1
              and not any(id(linears[name].weight) in tied for name in names)
              for _, run in itertools.groupby(names, kind)]
    grouped = {name for names in groups for name in names}
    return groups + [(name,) for name in linears if name not in grouped]


def _shared_weights(model: nn.Module) -> set[int]:
    """ids of parameters held by more than one module (tied embeddings)."""
    seen: dict[int, int] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            seen[id(p)] = seen.get(id(p), 0) + 1
    return {k for k, n in seen.items() if n > 1}


def row_invariant(linear: nn.Module, dtype: torch.dtype, rows: int = 16) -> bool:
    """Whether row i of a ``rows``-row product equals the one-row product of that row, bit for bit."""
    x = torch.randn(1, rows, linear.in_features, generator=torch.Generator().manual_seed(0)).to(dtype)
    with torch.inference_mode():
        wide = linear(x)
        return all(torch.equal(linear(x[:, i:i + 1])[0, 0], wide[0, i]) for i in range(rows))
