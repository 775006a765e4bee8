"""Decoder layers swapped for one module each (``FusedLayer``), as ``norms`` swaps RMSNorms and ``kernels.pack``
linears: the modelling code untouched, the loaded model's layer modules replaced.

A stock Llama-shaped layer (Llama, Qwen2) makes ~13 module calls and ~40 small torch ops a call: q, k and v
called apart and split from their shared product, views and transposes, RoPE's rotate_half (slices, a negation,
a concatenation, four products and two sums), the attention interface, two residual sums, SiLU and its product.
On SmolLM2's one-row bf16 step that was ~6 ms of a ~14 ms forward outside our kernels (Zen 4). ``FusedLayer`` does
the same arithmetic in ~11 calls: the norm, one product for q, k and v, RoPE on both in place (``native.rope``),
the cache's update, the attention, the output product, its residual sum with the second norm
(``native.add_rms_norm``), one product for gate and up, SiLU x up, the down product and its residual sum.

Every operation is the stock one or rounds as it does (``csrc/rope.c``, ``csrc/rms_norm.c``), so a fused layer's
output equals the layer it replaces (on our kernels) bit for bit: ``fuse`` checks that on each layer at load, on
a random input of a few rows after a few cached ones, and keeps any layer that differs as it is.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from transformers import DynamicCache
from transformers.activations import SiLUActivation

from lookahead import native
from lookahead.norms import FusedRMSNorm

LAYERS = ("LlamaDecoderLayer", "Qwen2DecoderLayer")  # the classes whose forward ``FusedLayer`` does
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


class FusedLayer(nn.Module):
    """A Llama-shaped decoder layer's forward in few calls (see the module doc). Holds the original's norms, its
    attention module (its ``layer_idx``, ``scaling``, ``is_causal``: what the attention function reads) and MLP, so
    the model's modules are still its linears (what ``kernels.weights_of`` and the cost curve's key read), and calls
    the products those packed linears share."""

    def __init__(self, layer: nn.Module, attend: Callable) -> None:
        super().__init__()
        attention, mlp = layer.self_attn, layer.mlp
        self.input_layernorm, self.post_attention_layernorm = layer.input_layernorm, layer.post_attention_layernorm
        self.self_attn, self.mlp, self.attend = attention, mlp, attend
        self.qkv, self.o = _products(attention, ATTENTION[:3]), _products(attention, ATTENTION[3:])
        self.gate_up, self.down = _products(mlp, MLP[:2]), _products(mlp, MLP[2:])
        self.head_dim = attention.head_dim
        self.heads = [getattr(attention, name).out_features // self.head_dim for name in ATTENTION[:3]]  # query, key and value heads
        self.width = mlp.gate_proj.out_features

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, cache=None, use_cache: bool | None = False,
                position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None, **kwargs) -> torch.Tensor:  # (B, T, E)
        b, t, _ = hidden_states.shape
        attention, norm = self.self_attn, self.post_attention_layernorm
        qkv = _matmul(self.qkv, self.input_layernorm(hidden_states))  # (B, T, (H + 2 G) D)
        cos, sin = (c.expand(b, t, -1) for c in position_embeddings)  # (B, T, D): a prompt's are (1, T, D)
        native.rope(qkv, cos, sin, self.heads[0] + self.heads[1], self.head_dim)  # q and k, in place
        q, k, v = qkv.view(b, t, -1, self.head_dim).transpose(1, 2).split(self.heads, dim=1)  # (B, H or G, T, D) views
        if cache is not None:
            k, v = cache.update(k, v, attention.layer_idx, kwargs=kwargs)
        out, _ = self.attend(attention, q, k, v, attention_mask, dropout=0.0, scaling=attention.scaling,
                             sliding_window=getattr(attention, "sliding_window", None), **kwargs)  # (B, T, H, D)
        hidden_states, h = native.add_rms_norm(hidden_states, _matmul(self.o, out.reshape(b, t, -1)), norm.weight, norm.eps, norm.offset)
        gate, up = _matmul(self.gate_up, h).split(self.width, -1)
        return hidden_states + _matmul(self.down, nn.functional.silu(gate) * up)


def _matmul(products: list, x: torch.Tensor) -> torch.Tensor:
    """The linears' outputs side by side: one call where they share one product (a GGUF's siblings of two kinds
    have two)."""
    return products[0].matmul(x) if len(products) == 1 else torch.cat([product.matmul(x) for product in products], -1)


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
    """Swap ``model``'s Llama-shaped decoder layers (in place) for ``FusedLayer`` where it computes what they do, bit
    for bit; how many. ``attend``: the attention function the model runs (its ``_attn_implementation``'s)."""
    fused = 0
    for parent in list(model.modules()):
        for name, layer in list(parent.named_children()):
            if (swap := _fused(layer, attend, model)) is not None:
                setattr(parent, name, swap)
                fused += 1
    return fused


def _fused(layer: nn.Module, attend: Callable, model: nn.Module) -> FusedLayer | None:
    if type(layer).__name__ not in LAYERS or not _shaped(layer):
        return None
    swap = FusedLayer(layer, attend)
    return swap if _agrees(layer, swap, model) else None


def _shaped(layer: nn.Module) -> bool:
    """Whether ``layer`` is what ``FusedLayer`` reads: our norms, packed linears (``_products``), a SiLU, whole heads."""
    attention, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    norms = [getattr(layer, name, None) for name in ("input_layernorm", "post_attention_layernorm")]
    if not all(isinstance(norm, FusedRMSNorm) for norm in norms) or not native.has("rope") or attention is None or mlp is None:
        return False
    head_dim = getattr(attention, "head_dim", None)
    return (all(_products(parent, names) for parent, names in ((attention, ATTENTION[:3]), (attention, ATTENTION[3:]), (mlp, MLP[:2]),
                                                                 (mlp, MLP[2:])))
            and isinstance(getattr(mlp, "act_fn", None), SiLUActivation) and isinstance(head_dim, int)
            and all(getattr(attention, name).out_features % head_dim == 0 for name in ATTENTION[:3]))


def _agrees(layer: nn.Module, swap: FusedLayer, model: nn.Module) -> bool:
    """Whether ``swap`` gives ``layer``'s outputs bit for bit: 3 rows after 5 cached ones, each side with its own cache."""
    dtype, width = swap.input_layernorm.weight.dtype, swap.input_layernorm.weight.numel()
    rng = torch.Generator().manual_seed(0)
    x = torch.randn(1, 8, width, generator=rng).to(dtype)
    positions = torch.arange(8)[None]
    cos, sin = model.model.rotary_emb(x, positions) if hasattr(getattr(model, "model", None), "rotary_emb") else (None, None)
    if cos is None:
        return False
    outs = []
    with torch.inference_mode():
        for module in (layer, swap):
            cache = DynamicCache()
            module(x[:, :5], position_ids=positions[:, :5], cache=cache, use_cache=True, position_embeddings=(cos[:, :5], sin[:, :5]))
            outs.append(module(x[:, 5:], position_ids=positions[:, 5:], cache=cache, use_cache=True,
                               position_embeddings=(cos[:, 5:], sin[:, 5:])))
    return torch.equal(*outs)
