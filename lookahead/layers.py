"""Decoder layers swapped for one module each (``FusedLayer``), as ``norms`` swaps RMSNorms and ``kernels.pack``
linears: the modelling code untouched, the loaded model's layer modules replaced.

A stock decoder layer makes ~13 module calls and ~40 small torch ops: q, k and v called apart and split from
their shared product, views and transposes, RoPE's rotate_half (slices, a negation, a concatenation, four
products and two sums), the attention interface, the residual sums, the activation and its product. On
SmolLM2's one-row bf16 step that was ~6 ms of a ~14 ms forward outside our kernels (Zen 4). ``FusedLayer`` does
the same arithmetic in ~11 calls: the norm, one product for q, k and v, RoPE on both in place (``layer_kernels.rope``),
the cache's update, the attention, the output product, its residual sum with the next norm in one call
(``layer_kernels.add_rms_norm``), one product for gate and up, the activation times up, the down product and its
residual sum. Two shapes of layer (``LAYERS``): Llama's (Llama, Mistral, Qwen2, and Qwen3 with its q/k head
norms), and Gemma 3's, whose attention and MLP outputs are normed before their residual sums ("sandwich").

On our kernels a layer of either shape runs a step in one C call (``layer_kernels.decoder_layer``: the same kernels in the
same order, the head norms and the sandwich's where the layer has them, the step's keys and values written straight
into the engine's cache buffer), in bf16 (and int8 with bf16 between its products) and in fp32 (and int8 with fp32
between them, on the tiers without bf16 kernels); the activation too where the call computes it as torch does (SiLU
and GELU-tanh), else everything up to it, then the rest from Python. One call a layer took SmolLM2's
fp32 one-row forward from 9.4 to 7.5 ms on the AVX-512 BF16 tier, and on the AVX2 tier fp32 16.5 -> 12.4 and int8
10.7 -> 7.8 ms (Zen 4, ``benchmarks.profile_step``).

Every operation is the module's own or rounds as torch's does (``csrc/rope.c``, ``csrc/rms_norm.c``), so a fused
layer's output equals the layer it replaces (on our kernels) bit for bit: ``fuse`` checks that on each layer at
load, on a random input of a few rows after a few cached ones, and keeps any layer that differs as it is.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
from torch import nn
from torch.nn import functional as F
from transformers.activations import GELUTanh, SiLUActivation

from lookahead import kv, layer_kernels, native
from lookahead.norms import FusedRMSNorm, swap

LAYERS = {"LlamaDecoderLayer": False, "MistralDecoderLayer": False, "Qwen2DecoderLayer": False, "Qwen3DecoderLayer": False,
          "Gemma3DecoderLayer": True}  # the classes whose forward ``FusedLayer`` does: whether their norms are sandwiched
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
SANDWICH = ("pre_feedforward_layernorm", "post_feedforward_layernorm")  # Gemma 3's norms besides Llama's two
SILU = (nn.SiLU, SiLUActivation)  # activations that are ``F.silu`` itself: called as it, not as a module


class StepFits:
    """Whether a step's inputs shared by every layer (its mask, cos and sin) suit ``layer_kernels.decoder_layer``: checked at a
    model's first fused layer of each step, then known for the rest, which get the same tensors (held here, so
    identity cannot be a new tensor's at a reused address). Checked at every layer, the ~15 attribute reads took ~7
    us a layer cold, ~0.2 ms of SmolLM2's ~5.5 ms one-row forward (Zen 4). One per model, shared by its layers."""

    def __init__(self) -> None:
        self.inputs: tuple = ()  # (mask, cos, sin) last checked
        self.shape: tuple = ()  # (b, t, head size, dtype, causal) they were checked for
        self.fits = False
        self.constants: tuple | None = None  # ``layer_kernels.step_constants`` of the inputs, where they fit
        self.layers: list[FusedLayer] = []  # the model's decoder layers where every one is fused alike (``fuse``), in order
        self.every: layer_kernels.EveryLayer | None = None  # their kernels in one call
        self.passed: torch.Tensor | None = None  # the step's output of them all, where its first layer ran them

    @property
    def layers(self) -> list["FusedLayer"]:
        return self._layers

    @layers.setter
    def layers(self, layers: list["FusedLayer"]) -> None:
        """The layers, and what ``kv.rooms`` asks of them: their ``layer_idx``s and their keys' (heads, head size)."""
        self._layers = layers
        self.layer_ids = tuple(layer.layer_idx for layer in layers)
        self.kv_heads = tuple((layer.heads[1], layer.head_dim) for layer in layers)

    def __call__(self, mask: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, b: int, t: int, d: int, dtype: torch.dtype,
                 causal: bool) -> bool:
        last = self.inputs
        if not (last and last[0] is mask and last[1] is cos and last[2] is sin and self.shape == (b, t, d, dtype, causal)):
            self.inputs, self.shape = (mask, cos, sin), (b, t, d, dtype, causal)
            self.fits = (cos.dtype == dtype and cos.shape[1:] == (t, d) and cos.shape[0] in (1, b) and cos.is_contiguous()
                         and sin.shape == cos.shape and sin.stride() == cos.stride() and sin.dtype == dtype
                         and layer_kernels.mask_fits(mask, dtype, b, t, t if mask is None else mask.shape[-1], causal))
            self.constants = layer_kernels.step_constants(cos, sin, mask, b, t) if self.fits else None
        return self.fits


class FusedLayer(nn.Module):
    """A decoder layer's forward in few calls (see the module doc). Holds the original's norms, its attention module
    (what the attention function reads: ``is_causal``, ``layer_idx``) and MLP, so the model's modules are still its
    linears (what ``kernels.weights_of`` and the cost curve's key read), and calls the products those packed linears
    share. What a forward reads is looked up once here, in plain attributes: a module's attribute lookup, a missing
    attribute's exception and a module call cost microseconds each, and in a step every cache line they touch is
    cold (the products stream the weights through it), so a layer's Python is a share of a small model's step."""

    def __init__(self, layer: nn.Module, attend: Callable, sandwich: bool, fits: StepFits) -> None:
        """fits: the model's ``StepFits``, shared by its fused layers."""
        super().__init__()
        self.fits = fits
        attention, mlp = layer.self_attn, layer.mlp
        self.input_layernorm, self.post_attention_layernorm = layer.input_layernorm, layer.post_attention_layernorm
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = (getattr(layer, name) if sandwich else None for name in SANDWICH)
        self.self_attn, self.mlp, self.attend = attention, mlp, attend
        self.norms = dict(zip(native.NORMS, (  # ``native.NORMS``' roles (None: the layer has none there)
            self.input_layernorm, self.pre_feedforward_layernorm if sandwich else self.post_attention_layernorm,
            self.post_attention_layernorm if sandwich else None, self.post_feedforward_layernorm,
            getattr(attention, "q_norm", None), getattr(attention, "k_norm", None))))
        products = _products(attention, ATTENTION[:3]), _products(attention, ATTENTION[3:]), _products(mlp, MLP[:2]), _products(mlp, MLP[2:])
        self.qkv, self.o, self.gate_up, self.down = (_joined(p) for p in products)
        self.activation = _activation(mlp.act_fn)
        self.act = F.silu if self.activation == "silu" else mlp.act_fn.__call__  # a bound method: not registered twice
        self.head_dim, self.layer_idx, self.scaling = attention.head_dim, attention.layer_idx, attention.scaling
        self.sliding_window = getattr(attention, "sliding_window", None)
        self.heads = [getattr(attention, name).out_features // self.head_dim for name in ATTENTION[:3]]  # query, key and value heads
        self.width = mlp.gate_proj.out_features
        self.causal = getattr(attention, "is_causal", True)
        self.dtype = dtype = self.input_layernorm.weight.dtype
        self.gated = layer_kernels.gates(dtype, self.activation, self.width)  # the activation in one call
        roles = [layer_kernels.role([product.native for product in p]) for p in products[:3 + self.gated]] + [None] * (not self.gated)
        norms = {name: norm for name, norm in self.norms.items() if norm is not None}
        self.whole = tuple(roles) if (  # a step's layer in one call (``layer_kernels.decoder_layer``) on our kernels of its dtype
            dtype in native.LAYERS and native.has(native.LAYERS[dtype]) and all(roles[:3 + self.gated])
            and layer_kernels.heads_fit(self.heads[0], self.heads[1], self.head_dim) and self.heads[1] == self.heads[2]
            and all(isinstance(norm, FusedRMSNorm) and norm.weight.dtype == dtype for norm in norms.values())
            and all(norms[name].weight.numel() == self.head_dim for name in native.NORMS[4:] if name in norms)) else None
        self.constants = layer_kernels.layer_constants(dtype, self.whole, layer_kernels.layer_norms({name: (norm.weight, norm.eps, norm.offset)
                                                                                     for name, norm in norms.items()}),
                                                self.activation if self.gated else None, (*self.heads[:2], self.head_dim),
                                                self.scaling) if self.whole else None  # ``layer_kernels.decoder_layer``'s, made once

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, cache=None, use_cache: bool | None = False,
                position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None, **kwargs) -> torch.Tensor:  # (B, T, E)
        b, t, _ = hidden_states.shape
        (h, g, _), d = self.heads, self.head_dim
        cos, sin = position_embeddings  # (B, T, D), a prompt's (1, T, D)
        if self.whole and cache is not None:
            if hidden_states is self.fits.passed:  # the step's first layer ran this one (``_every_layer``)
                return hidden_states
            done = self._in_one_call(hidden_states, attention_mask, cos, sin, cache)
            if done is not None:
                out, both = done
                return out if both is None else self._mlp(out, both)
        qkv = self.qkv(self.norms["input"].forward(hidden_states))  # (B, T, (H + 2 G) D)
        if cos.shape[0] != b:
            cos, sin = cos.expand(b, t, d), sin.expand(b, t, d)
        q, k, v = qkv.view(b, t, -1, d).split_with_sizes(self.heads, 2)  # (B, T, H or G, D) views
        if self.norms["q_heads"] is not None:  # Gemma 3, Qwen3: each head normed (contiguous), then rotated
            q, k = self.norms["q_heads"](q), self.norms["k_heads"](k)
            layer_kernels.rope(q.view(b, t, -1), cos, sin, h, d)
            layer_kernels.rope(k.view(b, t, -1), cos, sin, g, d)
        else:
            layer_kernels.rope(qkv, cos, sin, h + g, d)  # q and k, in place
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H or G, T, D)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx, kwargs=kwargs)
        out, _ = self.attend(self.self_attn, q, k, v, attention_mask, dropout=0.0, scaling=self.scaling,
                             sliding_window=self.sliding_window, **kwargs)  # (B, T, H, D)
        attended = self.o(out.reshape(b, t, -1))
        if self.norms["attended"] is not None:  # sandwich
            attended = self.norms["attended"].forward(attended)
        hidden_states, x = _add_norm(hidden_states, attended, self.norms["residual"])
        return self._mlp(hidden_states, self.gate_up(x))

    def _mlp(self, h: torch.Tensor, both: torch.Tensor) -> torch.Tensor:
        """h + the MLP's output, after its gate/up product ``both`` (..., 2 width): gate, up (normed first where the
        layer is sandwiched)."""
        width = self.width
        if self.gated:
            out = self.down(layer_kernels.gated(both, self.activation))
        else:
            out = self.down(self.act(both.narrow(-1, 0, width)) * both.narrow(-1, width, width))
        return h + (out if self.norms["mlp_out"] is None else self.norms["mlp_out"].forward(out))

    def _in_one_call(self, x: torch.Tensor, mask: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, cache) -> tuple | None:
        """``layer_kernels.decoder_layer``'s (the layer's output, None), or (x + attention, the gate/up product) where the
        activation is not one it computes, the step's keys and values written into ``cache``; None, with nothing done,
        where that call does not take this step."""
        b, t, _ = x.shape
        g, d = self.heads[1], self.head_dim
        if x.dtype != self.dtype or not x.is_contiguous() or not self.fits(mask, cos, sin, b, t, d, x.dtype, self.causal):
            return None
        if self.fits.layers and self.fits.layers[0] is self:
            self.fits.passed = self._every_layer(x, mask, cache)
            if self.fits.passed is not None:
                return self.fits.passed, None
        room = kv.reserve(cache, self.layer_idx, t, (b, g, d), x.dtype, None if mask is None else mask.shape[-1] - t)
        if room is None:
            return None
        keys, values, held, strides = room
        return layer_kernels.decoder_layer(x, self.constants, self.fits.constants, keys, values, strides, held)

    def _every_layer(self, x: torch.Tensor, mask: torch.Tensor | None, cache) -> torch.Tensor | None:
        """At the model's first layer, every layer of the step (``StepFits.layers``) in one call (``StepFits.every``): their
        output, or None with nothing done where a layer has hooks or its cache no room. Run layer by layer, each layer's
        Python (its checks, its cache's room, the call's arguments) runs cold after the kernels before it: ~50 us a
        layer, ~1 ms of SmolLM2's ~5.3 ms plain forward (Xeon m167); here it runs once."""
        b, t, _ = x.shape
        held = None if mask is None else mask.shape[-1] - t
        layers = self.fits.layers
        if any(layer._forward_hooks or layer._forward_pre_hooks for layer in layers):
            return None
        rooms = kv.rooms(cache, self.fits.layer_ids, self.fits.kv_heads, b, x.dtype, t, held)
        return None if rooms is None else self.fits.every(x, self.fits.constants, rooms)


def _activation(act: Callable) -> str | None:
    """Which of ``native.ACTIVATIONS`` the MLP's ``act`` is (torch's own function, so ``layer_kernels.gated`` computes it bit
    for bit), or None."""
    if type(act) in SILU:
        return "silu"
    inner = getattr(act, "act", None) if isinstance(act, GELUTanh) else None  # transformers' gelu_pytorch_tanh
    if (isinstance(act, nn.GELU) and act.approximate == "tanh"
            or isinstance(inner, functools.partial) and inner.func is F.gelu and not inner.args and inner.keywords == {"approximate": "tanh"}):
        return "gelu_tanh"
    return None


def _add_norm(x: torch.Tensor, delta: torch.Tensor, norm: FusedRMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, its norm), in one call."""
    return layer_kernels.add_rms_norm(x, delta, norm.weight, norm.eps, norm.offset)


def _joined(products: list) -> Callable[[torch.Tensor], torch.Tensor]:
    """The linears' outputs side by side in one call where they share one product (its kernel itself where it is
    ours); a GGUF's siblings of two kinds have two, concatenated."""
    if len(products) == 1:
        return products[0].native or products[0].matmul
    return lambda x: torch.cat([product.matmul(x) for product in products], -1)


def _products(parent: nn.Module, names: tuple[str, ...]) -> list | None:
    """The products of ``parent``'s packed linears ``names``, in order, each serving a run of them whole and in
    order (``kernels.Product``); None where they are not so."""
    products, at = [], 0
    while at < len(names):
        product = getattr(getattr(parent, names[at], None), "product", None)
        run = len(getattr(product, "splits", ()))
        if not run or at + run > len(names) or any(getattr(getattr(parent, name), "product", None) is not product
                                                    or getattr(parent, name).part != i for i, name in enumerate(names[at:at + run])):
            return None
        products.append(product)
        at += run
    return products


def fuse(model: nn.Module, attend: Callable) -> int:
    """Swap ``model``'s decoder layers of ``LAYERS`` (in place) for ``FusedLayer`` where it computes what they do,
    bit for bit, and the list holding them for a ``LayerList``; how many. ``attend``: the attention function the model
    runs (its ``_attn_implementation``'s)."""
    fits = StepFits()
    fused = swap(model, lambda layer: _fused(layer, attend, fits))
    swap(model, lambda held: LayerList(held) if type(held) is nn.ModuleList and any(isinstance(m, FusedLayer) for m in held) else None)
    fits.layers = _alike(model)
    fits.every = layer_kernels.EveryLayer(fits.layers[0].dtype, [layer.constants for layer in fits.layers]) if fits.layers else None
    return fused


def _alike(model: nn.Module) -> list[FusedLayer]:
    """The model's decoder layers where its forward gives every one the same inputs and each is one call of its kernels
    (``_every_layer`` runs them at the first): one ``LayerList`` of fused layers of one dtype, head size, causality and
    sliding window, each with its activation in the call, as many as the config's layers (the forward loops over those),
    and one layer type in the config (Gemma 3's sliding and global layers get masks and rotations of their own); else
    none."""
    lists = [m for m in model.modules() if isinstance(m, LayerList)]
    layers = list(lists[0]) if len(lists) == 1 else []
    config = model.config.get_text_config(decoder=True)
    types = getattr(config, "layer_types", None) or ()
    fused = all(isinstance(layer, FusedLayer) and layer.whole and layer.gated for layer in layers)
    alike = (fused and len(layers) == getattr(config, "num_hidden_layers", None) and len(set(types)) <= 1
             and len({(layer.dtype, layer.head_dim, layer.causal, layer.sliding_window) for layer in layers}) == 1)
    return layers if layers and alike else []


class LayerList(nn.ModuleList):
    """A model's decoder layers as its forward loops over them (``self.layers[: self.config.num_hidden_layers]``, in
    every transformers model): a slice is a list of the layers, not a new ``ModuleList`` (whose ``add_module`` a layer
    took ~0.09 ms of SmolLM2's ~8 ms step, cold after the layers' kernels). The layers are held as before."""

    def __getitem__(self, index: int | slice) -> nn.Module | list[nn.Module]:
        return list(self._modules.values())[index] if isinstance(index, slice) else super().__getitem__(index)


def _fused(layer: nn.Module, attend: Callable, fits: StepFits) -> FusedLayer | None:
    sandwich = LAYERS.get(type(layer).__name__)
    if sandwich is None or not _shaped(layer, sandwich):
        return None
    swap = FusedLayer(layer, attend, sandwich, fits)
    return swap if _agrees(layer, swap) else None


def _shaped(layer: nn.Module, sandwich: bool) -> bool:
    """Whether ``layer`` is what ``FusedLayer`` reads: our norms, packed linears (``_products``), whole heads."""
    attention, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    names = ("input_layernorm", "post_attention_layernorm") + (SANDWICH if sandwich else ())
    if not all(isinstance(getattr(layer, name, None), FusedRMSNorm) for name in names) or not native.has("rope") or attention is None:
        return False
    head_dim = getattr(attention, "head_dim", None)
    return (all(_products(parent, names) for parent, names in ((attention, ATTENTION[:3]), (attention, ATTENTION[3:]), (mlp, MLP[:2]),
                                                                 (mlp, MLP[2:])))
            and callable(getattr(mlp, "act_fn", None)) and isinstance(head_dim, int)
            and all(getattr(attention, name).out_features % head_dim == 0 for name in ATTENTION[:3]))


def _agrees(layer: nn.Module, swap: FusedLayer) -> bool:
    """Whether ``swap`` gives ``layer``'s outputs bit for bit: 3 rows after 5 cached ones, each side with its own
    cache, at random positions' cos and sin."""
    dtype, width = swap.input_layernorm.weight.dtype, swap.input_layernorm.weight.numel()
    rng = torch.Generator().manual_seed(0)
    x = torch.randn(1, 8, width, generator=rng).to(dtype)
    angles = torch.randn(1, 8, swap.head_dim // 2, generator=rng) * 30
    cos, sin = (torch.cat([f(angles)] * 2, -1).to(dtype) for f in (torch.cos, torch.sin))
    positions = torch.arange(8)[None]
    outs = []
    with torch.inference_mode():
        for module in (layer, swap):
            cache = kv.GrowingCache()  # the engine's: a step after the first runs in one call where it can
            for rows in (slice(0, 5), slice(5, 8)):
                out = module(x[:, rows], position_ids=positions[:, rows], cache=cache, use_cache=True,
                             position_embeddings=(cos[:, rows], sin[:, rows]))
            outs.append(out[0] if isinstance(out, tuple) else out)
    return torch.equal(*outs)
