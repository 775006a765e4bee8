"""A decoder layer's other kernels, and the whole layer in one call: the step's attention (``csrc/tree_attention.c``,
bf16; ``tree_attention_avx2.c``, fp32, row-invariant on every tier: what int8's lookahead needs to equal its plain
loop), RMSNorm (``csrc/rms_norm.c``: one call for the ~8 torch ops of a norm module), RoPE, the gated activation,
and ``decoder_layer`` (``csrc/decoder_layer.h``), which runs them and the layer's products in one call, in the
same order on the same values as the modules would, so the same bits.

The attention: every query head of a K/V group at once, under the step's additive 4D mask, 2.2-4x as fast as CPU
SDPA on SmolLM2's shapes (see its source), and a prompt's prefill."""

from __future__ import annotations

import ctypes

import torch

from lookahead.native import ACTIVATIONS, ATTENTIONS, EVERY_LAYER, GATES, LAYERS, NORMS, Layer, Longs, Norm, Product, Role, has, library

def role(linears: list) -> Role | None:
    """The role of ``linears`` (``Linear``s whose outputs sit side by side, in order, each with a ``product``), or None
    where ``decoder_layer`` cannot call them: more than three, or one not on a kernel it knows."""
    if not 0 < len(linears) <= 3 or any(getattr(linear, "product", None) is None for linear in linears):
        return None
    return Role((Product * 3)(*(linear.product for linear in linears)), len(linears), sum(linear.n for linear in linears))


def layer_norms(norms: dict) -> ctypes.Array:
    """``NORMS``' names -> (weight, eps, offset), as ``decoder_layer`` takes them: made once a layer (the weights are
    the caller's to hold)."""
    if set(norms) - set(NORMS):
        raise ValueError(f"a layer's norms are among {NORMS}, got {sorted(set(norms) - set(NORMS))}")
    return (Norm * len(NORMS))(*(Norm(norms[name][0].data_ptr(), *norms[name][1:]) if name in norms else Norm() for name in NORMS))


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


class EveryLayer:
    """A step's every decoder layer in one call (``csrc/decoder_layer.h``'s ``layers``), for layers of one dtype each
    with a down product: their ``layer_constants`` made into the kernel's array once, each layer's cache buffers
    written there again only where its buffer is new (a grown one)."""

    def __init__(self, dtype: torch.dtype, constants: list[tuple]) -> None:
        self.call = getattr(library(), EVERY_LAYER[dtype])
        self.layers = (Layer * len(constants))(*(Layer(*(ctypes.pointer(role) for role in head[:4]), ctypes.cast(head[4], ctypes.POINTER(Norm)),
                                                       head[5], *tail) for _, head, tail, _ in constants))
        self.strides: list[ctypes.Array | None] = [None] * len(constants)  # each layer's buffers' strides, as ``kv.reserve`` keeps them

    def __call__(self, x: torch.Tensor, step: tuple, rooms: list[tuple]) -> torch.Tensor:
        """x (B, T, E) through every layer: ``step``: ``step_constants``'; rooms: each layer's ``kv.reserve``, every
        one holding the same columns before the step."""
        for i, (keys, values, held, strides) in enumerate(rooms):
            if self.strides[i] is not strides:  # a new buffer (``reserve`` makes new strides for one)
                layer = self.layers[i]
                layer.keys, layer.values, layer.kvs = keys.data_ptr(), values.data_ptr(), strides
                self.strides[i] = strides
        rope, (mask, ms, b, t), threads = step
        out = torch.empty_like(x)
        if self.call(x.data_ptr(), out.data_ptr(), len(rooms), self.layers, *rope, mask, ms, b, t, rooms[0][2], threads):
            raise MemoryError(f"a decoder layer's kernels could not allocate their buffers for {b * t} rows")
        return out


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
    getattr(library(), GATES[both.dtype])(both.data_ptr(), out.data_ptr(), both.numel() // both.shape[-1], width, ACTIVATIONS.index(activation),
                                          torch.get_num_threads())
    return out
