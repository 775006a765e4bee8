"""Decoder layers in few calls (``layers.FusedLayer``): swapped where the load check agrees, and then the stock layer's
outputs on our kernels bit for bit (prefill, a masked wide step, a batch), each row alone; RoPE and the residual
norm kernels are torch's arithmetic bit for bit."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from lookahead import kernels, kv, layers, native
from lookahead.layout import build_layout, stack
from lookahead.planner import chain_tree

pytestmark = pytest.mark.skipif(kernels.own_kernel(torch.bfloat16) is not None, reason="our own kernels cannot run here")
COMMON = dict(vocab_size=96, hidden_size=128, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, eos_token_id=None, bos_token_id=None, pad_token_id=None)


def tiny(cls, config, dtype: torch.dtype, **extra):
    torch.manual_seed(0)
    return cls(config(**COMMON, **extra)).eval().to(dtype)


def packed(model, fused: bool, monkeypatch) -> torch.nn.Module:
    with monkeypatch.context() as patch:
        if not fused:
            patch.setattr(layers, "fuse", lambda model, attend: 0)
        report = kernels.pack(model)
    assert report.layers == (model.config.num_hidden_layers if fused else 0)
    return model


def logits(model, prompt: list[int], step: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompt's logits, then a 4-row chain step's under its 4D mask, two sequences at once."""
    cache = kv.BatchCache()
    with torch.inference_mode():
        first = model(input_ids=torch.tensor([prompt, prompt[::-1]]), **kv.cache_kwarg(model, cache.cache)).logits
        cache.append(torch.arange(len(prompt)).repeat(2, 1))
        layout = stack([build_layout(0, 0, chain_tree(0.5, len(step) - 1))] * 2)
        query = torch.full((2, 1), len(prompt)) + layout.offsets  # (2, T)
        masks = cache.masks(layout.allowed, query, {"full_attention": None}, model.dtype, model.device)
        second = model(input_ids=torch.tensor([step, step[::-1]]), position_ids=query, attention_mask=masks["full_attention"],
                       **kv.cache_kwarg(model, cache.cache)).logits
    return first, second


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cls, config", [(LlamaForCausalLM, LlamaConfig), (Qwen2ForCausalLM, Qwen2Config)])
def test_fused_layers_give_the_stock_layers_logits_bit_for_bit(cls, config, dtype, monkeypatch):
    """Qwen2's q/k/v biases included; a prefill of two sequences, then a masked 4-row step of each."""
    fused, stock = packed(tiny(cls, config, dtype), True, monkeypatch), packed(tiny(cls, config, dtype), False, monkeypatch)
    assert all(isinstance(layer, layers.FusedLayer) for layer in fused.model.layers)
    prompt, step = [5, 17, 3, 88, 41, 9, 60, 2, 33], [7, 19, 23, 71]
    for got, want in zip(logits(fused, prompt, step), logits(stock, prompt, step)):
        assert torch.equal(got, want) and got.abs().sum() > 0


def test_a_layer_the_fused_one_does_not_compute_stays_stock(monkeypatch):
    """A GELU MLP is not what ``FusedLayer`` does: those layers keep their own forward."""
    model = packed(tiny(LlamaForCausalLM, LlamaConfig, torch.float32, hidden_act="gelu"), False, monkeypatch)
    assert layers.fuse(model, kernels.grouped_sdpa) == 0 and not any(isinstance(m, layers.FusedLayer) for m in model.modules())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_is_apply_rotary_pos_emb_bit_for_bit_each_row_alone(dtype):
    rng = torch.Generator().manual_seed(0)
    b, t, heads, kv_heads, d = 2, 7, 6, 2, 64
    qkv = (torch.randn(b, t, (heads + 2 * kv_heads) * d, generator=rng) * 3).to(dtype)
    angles = torch.randn(b, t, d // 2, generator=rng) * 40
    cos, sin = torch.cat([angles.cos()] * 2, -1).to(dtype), torch.cat([angles.sin()] * 2, -1).to(dtype)
    q, k, _ = qkv.view(b, t, -1, d).transpose(1, 2).split([heads, kv_heads, kv_heads], dim=1)
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
    got = qkv.clone()
    native.rope(got, cos, sin, heads + kv_heads, d)
    got_q, got_k, got_v = got.view(b, t, -1, d).transpose(1, 2).split([heads, kv_heads, kv_heads], dim=1)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k) and torch.equal(got_v, _)
    row = qkv[1:, 3:4].clone()
    native.rope(row, cos[1:, 3:4], sin[1:, 3:4], heads + kv_heads, d)
    assert torch.equal(row, got[1:, 3:4])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_is_the_sum_then_the_norm(dtype):
    rng = torch.Generator().manual_seed(1)
    x, delta = (torch.randn(3, 5, 200, generator=rng).to(dtype) for _ in range(2))
    weight = torch.randn(200, generator=rng).to(dtype)
    s, y = native.add_rms_norm(x, delta, weight, 1e-6, 0)
    assert torch.equal(s, x + delta) and torch.equal(y, native.rms_norm(x + delta, weight, 1e-6, 0))
    with pytest.raises(ValueError, match="one shape and dtype"):
        native.add_rms_norm(x, delta[:, :2], weight, 1e-6, 0)


@pytest.mark.slow
def test_the_default_models_layers_are_fused(smollm2_packed):
    """SmolLM2 on the default kernels: every decoder layer fused, which the real-model tests then hold to stock
    ``generate()`` (Qwen2's biases: the tiny models above)."""
    assert all(isinstance(layer, layers.FusedLayer) for layer in smollm2_packed[0].model.layers)
