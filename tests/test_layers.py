"""Decoder layers in few calls (``layers.FusedLayer``): swapped where the load check agrees, and then the stock layer's
outputs on our kernels bit for bit (prefill, a masked wide step, a batch), each row alone; RoPE and the residual
norm kernels are torch's arithmetic bit for bit."""

from __future__ import annotations

import weakref

import numpy as np
import pytest
import torch
from transformers import (Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM,
                          Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)
from transformers.models.llama import modeling_llama
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from lookahead import kernels, kv, layer_kernels, layers, native, quants
from lookahead.layout import build_layout, stack
from lookahead.planner import chain_tree

pytestmark = pytest.mark.skipif(kernels.own_kernel(torch.bfloat16) is not None, reason="our own kernels cannot run here")
COMMON = dict(vocab_size=96, hidden_size=128, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, eos_token_id=None, bos_token_id=None, pad_token_id=None)
BUILDS = {  # every shape ``FusedLayer`` does: Llama's (SiLU or GELU), Qwen2's biases, Qwen3's and Gemma 3's head norms,
            # Gemma 3's sandwiched norms and sliding layers
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**COMMON)),
    "llama-gelu": lambda: LlamaForCausalLM(LlamaConfig(**COMMON, hidden_act="gelu")),
    "mistral": lambda: MistralForCausalLM(MistralConfig(**COMMON)),
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**COMMON)),
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(**COMMON, head_dim=32)),
    "gemma3": lambda: Gemma3ForCausalLM(Gemma3TextConfig(**COMMON, head_dim=32, sliding_window=4,
                                                         layer_types=["sliding_attention", "full_attention"])),
}


def tiny(name: str, dtype: torch.dtype):
    torch.manual_seed(0)
    return BUILDS[name]().eval().to(dtype)


def packed(model, fused: bool, monkeypatch, quantized: dict | None = None) -> torch.nn.Module:
    with monkeypatch.context() as patch:
        if not fused:
            patch.setattr(layers, "fuse", lambda model, attend: 0)
        report = kernels.pack(model, quantized=quantized, integer=bool(quantized) and native.integer_runs())
    assert report.layers == (model.config.num_hidden_layers if fused else 0)
    return model


def windows(model) -> dict:
    """Each of the model's layer types' sliding window (None: full attention), as the engine's masks take them."""
    return {kind: getattr(model.config, "sliding_window", None) if kind == "sliding_attention" else None
            for kind in set(getattr(model.config, "layer_types", None) or ["full_attention"])}


def masks(cache: kv.BatchCache, model, allowed: torch.Tensor, query: torch.Tensor):
    """A step's 4D masks as the model takes them: one tensor, or a dict of them by layer type."""
    masks = cache.masks(allowed, query, windows(model), model.dtype, model.device)
    return masks if len(masks) > 1 else next(iter(masks.values()))


def logits(model, prompt: list[int], step: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompt's logits, then a chain step's under its 4D masks (a sliding layer's too), two sequences at once."""
    cache = kv.BatchCache()
    with torch.inference_mode():
        first = model(input_ids=torch.tensor([prompt, prompt[::-1]]), **kv.cache_kwarg(model, cache.cache)).logits
        cache.append(torch.arange(len(prompt)).repeat(2, 1))
        layout = stack([build_layout(0, 0, chain_tree(0.5, len(step) - 1))] * 2)
        query = torch.full((2, 1), len(prompt)) + layout.offsets  # (2, T)
        second = model(input_ids=torch.tensor([step, step[::-1]]), position_ids=query, attention_mask=masks(cache, model, layout.allowed, query),
                       **kv.cache_kwarg(model, cache.cache)).logits
    return first, second


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(BUILDS))
def test_fused_layers_give_the_stock_layers_logits_bit_for_bit(name, dtype, monkeypatch):
    """A prefill of two sequences, then a masked 4-row step of each."""
    fused, stock = packed(tiny(name, dtype), True, monkeypatch), packed(tiny(name, dtype), False, monkeypatch)
    assert all(isinstance(layer, layers.FusedLayer) for layer in fused.model.layers)
    held = fused.model.layers  # a LayerList: its slice (the forward's loop) a list of the same layers, the weights' names kept
    assert type(held) is layers.LayerList and held[:2] == [held[0], held[1]] and held[-1] is held[len(held) - 1]
    assert dict(fused.named_modules())["model.layers.1"] is held[1]
    prompt, step = [5, 17, 3, 88, 41, 9, 60, 2, 33], [7, 19, 23, 71]
    for got, want in zip(logits(fused, prompt, step), logits(stock, prompt, step)):
        assert torch.equal(got, want) and got.abs().sum() > 0


def steps(model, prompt: list[int], rows: list[list[int]]) -> tuple[list[torch.Tensor], kv.BatchCache]:
    """The prompt's logits, then each step's (a chain under its 4D masks, two sequences at once), the last two
    columns of each step cropped after it as a rejected draft's are; and the cache."""
    cache = kv.BatchCache()
    with torch.inference_mode():
        out = [model(input_ids=torch.tensor([prompt, prompt[::-1]]), **kv.cache_kwarg(model, cache.cache)).logits]
        cache.append(torch.arange(len(prompt)).repeat(2, 1))
        for step in rows:
            layout = stack([build_layout(0, 0, chain_tree(0.5, len(step) - 1))] * 2)
            query = int(cache.positions.max()) + 1 + layout.offsets  # (2, T)
            out.append(model(input_ids=torch.tensor([step, step[::-1]]), position_ids=query, attention_mask=masks(cache, model, layout.allowed, query),
                             **kv.cache_kwarg(model, cache.cache)).logits)
            kept = max(len(step) - 2, 1)
            cache.compact(len(step), [np.arange(kept)] * 2, [row[:kept] for row in query.numpy()])
    return out, cache


def mixed(model) -> dict:
    """The model's linears quantized as a GGUF mixes them: Q8_0, with each v in 4 bits (q and k one product, v one)."""
    quantized = quants.q8_linears(model)
    for i, layer in enumerate(model.model.layers):
        n, k = layer.self_attn.v_proj.weight.shape
        rng = torch.Generator().manual_seed(i)
        quantized[f"model.layers.{i}.self_attn.v_proj"] = quants.Quantized(
            torch.randint(0, 16, (n, k), generator=rng, dtype=torch.int8), torch.rand(n, k // 32, generator=rng) / 64,
            -torch.rand(n, k // 32, generator=rng) / 8, 32, 4)
    return quantized


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", ["llama", "llama-gelu", "qwen2", "qwen3", "gemma3", "llama-mixed-blocks"])
def test_a_step_in_one_call_is_the_module_by_module_path(name, dtype, monkeypatch):
    """bf16 and fp32 layers run a step in one call (``layer_kernels.decoder_layer``; with an activation it does not compute,
    erf's GELU, up to it), Qwen3's and Gemma 3's head norms, Gemma 3's sandwiched norms, GELU-tanh
    and sliding layers included, and quantized siblings of two kinds (two products, on the integer kernel where it
    runs), writing the step's keys and values into the cache there; and where every layer is alike, all of them in
    one call at the first (``EveryLayer``): every step's logits and the cache are the module-by-module path's, bit for
    bit (a prefill, then steps of 4, 1 and 3 rows, each cropped after as a rejected draft's rows are)."""
    if dtype == torch.bfloat16 and not native.has("decoder_layer"):
        pytest.skip("the bf16 layer needs the AVX-512 BF16 kernels")
    model = tiny(name.removesuffix("-mixed-blocks"), dtype)
    model = packed(model, True, monkeypatch, mixed(model) if name.endswith("-mixed-blocks") else None)
    wholes = [layer.whole for layer in model.model.layers]
    assert all(wholes) and all((whole[3] is None) == (name == "llama-gelu") for whole in wholes)
    assert all(whole[0].parts == (2 if name.endswith("-mixed-blocks") else 1) for whole in wholes)
    calls, whole, every = [], layer_kernels.decoder_layer, layer_kernels.EveryLayer.__call__
    monkeypatch.setattr(layer_kernels, "decoder_layer", lambda *args: calls.append(args[0].shape) or whole(*args))
    monkeypatch.setattr(layer_kernels.EveryLayer, "__call__", lambda self, x, *args: calls.append(("every", x.shape)) or every(self, x, *args))
    fits = model.model.layers[0].fits
    alike = list(fits.layers)  # Gemma 3's sliding layers, and an activation the call does not compute: layer by layer
    assert bool(alike) == (name in ("llama", "qwen2", "qwen3", "llama-mixed-blocks")) and alike in ([], list(model.model.layers))
    runs = []
    for way in ("every layer at once", "each layer in one call", "module by module"):
        for layer, linears in zip(model.model.layers, wholes):
            layer.whole = None if way == "module by module" else linears
        fits.layers = alike if way == "every layer at once" else []
        calls.clear()
        runs.append(steps(model, [5, 17, 3, 88, 41, 9, 60, 2, 33], [[7, 19, 23, 71], [4], [8, 50, 6]]))
        at_once = way == "every layer at once" and alike
        assert calls == ([] if way == "module by module" else [("every", (2, t, 128)) for t in (4, 1, 3)] if at_once else
                         [(2, t, 128) for t in (4, 1, 3) for _ in wholes]), way
    *got, (want, want_cache) = runs
    for logits, cache in got:
        assert all(torch.equal(a, b) and a.abs().sum() > 0 for a, b in zip(logits, want))
        for a, b in zip(cache.cache.layers, want_cache.cache.layers):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_a_hooked_layer_has_the_step_run_layer_by_layer(monkeypatch):
    """Where every layer runs at the first, the later ones' forwards pass its output on: a hook on one (a user's probe)
    has the step run layer by layer instead, so it sees that layer's own output, and the logits stay the same."""
    model = packed(tiny("llama", torch.float32), True, monkeypatch)
    fits, alike = model.model.layers[0].fits, list(model.model.layers[0].fits.layers)
    assert alike
    seen = {True: [], False: []}
    for every in (True, False):
        fits.layers = alike if every else []
        handle = model.model.layers[1].register_forward_hook(lambda module, args, out, every=every: seen[every].append(out.clone()))
        got = steps(model, [5, 17, 3, 88, 41], [[7, 19, 23], [4]])[0]
        handle.remove()
        want = steps(model, [5, 17, 3, 88, 41], [[7, 19, 23], [4]])[0]  # unhooked
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert len(seen[True]) == 3 and all(torch.equal(a, b) for a, b in zip(seen[True], seen[False]))


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_gated_is_torchs_activation_times_up_for_every_bf16(activation):
    """All 65536 bf16 gates (NaNs as NaNs), each times a random up: torch's vectorised SiLU and GELU-tanh (Sleef's
    expf and tanhf) and torch's rounding to bf16, denormals kept."""
    act = {"silu": torch.nn.functional.silu, "gelu_tanh": lambda x: torch.nn.functional.gelu(x, approximate="tanh")}[activation]
    gate = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    up = (torch.randn(65536, generator=torch.Generator().manual_seed(0)) * 4).to(torch.bfloat16)
    for ups in (up, torch.ones_like(up)):
        want, got = act(gate) * ups, layer_kernels.gated(torch.cat([gate, ups])[None], activation)[0]
        numbers = ~torch.isnan(want)
        assert torch.equal(torch.isnan(got), ~numbers) and torch.equal(got[numbers].view(torch.int16), want[numbers].view(torch.int16))
    with pytest.raises(ValueError, match="2 width"):
        layer_kernels.gated(torch.cat([gate[:32], up[:1]])[None], activation)  # an odd last dimension is no gate and up
    with pytest.raises(ValueError, match="gelu_tanh"):
        layer_kernels.gated(torch.cat([gate[:32], up[:32]])[None], "gelu")


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_gated_is_torchs_activation_times_up_for_fp32(activation):
    """fp32 gates of every exponent (random bit patterns, NaNs as NaNs), normal ones and the edges of exp's and tanh's
    ranges, each times a random up and times one: torch's vectorised SiLU and GELU-tanh (Sleef's expf and tanhf) bit
    for bit."""
    act = {"silu": torch.nn.functional.silu, "gelu_tanh": lambda x: torch.nn.functional.gelu(x, approximate="tanh")}[activation]
    rng = torch.Generator().manual_seed(0)
    edges = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 88.7, -88.7, 100.0, -100.0, 104.0, -104.0, 1e-40,
                          -1e-40, 3.0, -3.0, 1.0, 8.664339742, -8.664339742, 10.0, -10.0, 1e-4, -1e-4])
    gate = torch.cat([edges, torch.randint(-2**31, 2**31 - 1, (1 << 20,), generator=rng, dtype=torch.int64).to(torch.int32).view(torch.float32),
                      torch.randn(1 << 18, generator=rng) * 30, torch.randn(1 << 18, generator=rng)])[: (1 << 20) + (1 << 19)]  # 16 | width
    for ups in (torch.randn(gate.numel(), generator=rng) * 4, torch.ones_like(gate)):
        want, got = act(gate) * ups, layer_kernels.gated(torch.cat([gate, ups])[None], activation)[0]
        numbers = ~torch.isnan(want)
        assert torch.equal(torch.isnan(got), ~numbers) and torch.equal(got[numbers].view(torch.int32), want[numbers].view(torch.int32))


def test_a_layer_the_fused_one_does_not_compute_stays_stock(monkeypatch):
    """A layer whose forward is not the stock one (here: remote code's of the same class name, doubling its output)
    fails the check on load and keeps its own forward; the others are fused."""

    class LlamaDecoderLayer(modeling_llama.LlamaDecoderLayer):
        def forward(self, *args, **kwargs):
            return 2 * super().forward(*args, **kwargs)

    model = tiny("llama", torch.float32)
    model.model.layers[0].__class__ = LlamaDecoderLayer
    assert kernels.pack(model).layers == 1
    assert type(model.model.layers[0]) is LlamaDecoderLayer and isinstance(model.model.layers[1], layers.FusedLayer)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_is_apply_rotary_pos_emb_bit_for_bit_each_row_alone(dtype):
    rng = torch.Generator().manual_seed(0)
    b, t, heads, kv_heads, d = 2, 7, 6, 2, 64
    qkv = (torch.randn(b, t, (heads + 2 * kv_heads) * d, generator=rng) * 3).to(dtype)
    angles = torch.randn(b, t, d // 2, generator=rng) * 40
    cos, sin = torch.cat([angles.cos()] * 2, -1).to(dtype), torch.cat([angles.sin()] * 2, -1).to(dtype)
    q, k, v = qkv.view(b, t, -1, d).transpose(1, 2).split([heads, kv_heads, kv_heads], dim=1)
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
    got = qkv.clone()
    layer_kernels.rope(got, cos, sin, heads + kv_heads, d)
    got_q, got_k, got_v = got.view(b, t, -1, d).transpose(1, 2).split([heads, kv_heads, kv_heads], dim=1)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k) and torch.equal(got_v, v)  # v untouched
    row = qkv[1:, 3:4].clone()
    layer_kernels.rope(row, cos[1:, 3:4], sin[1:, 3:4], heads + kv_heads, d)
    assert torch.equal(row, got[1:, 3:4])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_is_the_sum_then_the_norm(dtype):
    rng = torch.Generator().manual_seed(1)
    x, delta = (torch.randn(3, 5, 200, generator=rng).to(dtype) for _ in range(2))
    weight = torch.randn(200, generator=rng).to(dtype)
    s, y = layer_kernels.add_rms_norm(x, delta, weight, 1e-6, 0)
    assert torch.equal(s, x + delta) and torch.equal(y, layer_kernels.rms_norm(x + delta, weight, 1e-6, 0))
    with pytest.raises(ValueError, match="one shape and dtype"):
        layer_kernels.add_rms_norm(x, delta[:, :2], weight, 1e-6, 0)


@pytest.mark.slow
def test_the_default_models_layers_are_fused(smollm2_packed):
    """SmolLM2 on the default kernels: every decoder layer fused, which the real-model tests then hold to stock
    ``generate()`` (Qwen2's biases: the tiny models above)."""
    assert all(isinstance(layer, layers.FusedLayer) for layer in smollm2_packed[0].model.layers)


def test_a_steps_shared_inputs_are_checked_again_only_when_they_change():
    """``StepFits``: what every layer of a step gets (mask, cos, sin) is checked at the first and known at the rest."""
    fits = layers.StepFits()
    cos, sin, mask = torch.zeros(1, 3, 64), torch.zeros(1, 3, 64), torch.zeros(1, 1, 3, 8)
    assert fits(mask, cos, sin, 1, 3, 64, torch.float32, True) and fits(mask, cos, sin, 1, 3, 64, torch.float32, True)
    assert not fits(mask, cos, sin, 1, 3, 32, torch.float32, True)  # another head size
    assert not fits(mask.bfloat16(), cos, sin, 1, 3, 64, torch.float32, True)  # another mask: not the step's dtype
    assert not fits(mask, cos, sin.bfloat16(), 1, 3, 64, torch.float32, True)
    assert fits(None, cos, sin, 1, 3, 64, torch.float32, True) and not fits(None, cos, sin, 1, 3, 64, torch.float32, False)


def test_rooms_for_every_layer_check_each_buffer_once_and_refuse_what_does_not_fit(monkeypatch):
    """``kv.rooms`` (a step's every layer at once): where each layer still holds the buffer it found last, the room is
    made without each layer's ``reservable`` (its Python was ~2% of SmolLM2's plain step), at the columns that path
    gives; a layer whose keys were replaced (as a join replaces them) sends it back to the checks, and a ``held`` the
    layers do not hold, or layers holding different columns, are refused with nothing reserved."""
    cache = kv.GrowingCache()
    for i in range(3):
        cache.update(torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8), i)
    layers, heads = (0, 1, 2), ((2, 8),) * 3
    checked = []
    reservable = kv.reservable
    monkeypatch.setattr(kv, "reservable", lambda *args: checked.append(args[1]) or reservable(*args))
    first = kv.rooms(cache, layers, heads, 2, torch.float32, 3, 5)
    assert [room[2] for room in first] == [5, 5, 5] and checked == [0, 1, 2]
    second = kv.rooms(cache, layers, heads, 2, torch.float32, 1, 8)  # the 3 rows kept: no checks
    assert [room[2] for room in second] == [8, 8, 8] and checked == [0, 1, 2]
    assert all(room[0] is layer._keys and room[3] is before[3] for room, before, layer in zip(second, first, cache.layers))
    assert kv.rooms(cache, layers, heads, 2, torch.float32, 1, 4) is None  # they hold 9, not 4
    assert [layer.get_seq_length() for layer in cache.layers] == [9, 9, 9] and checked[3:] == [0, 1, 2]  # nothing reserved
    keys = cache.layers[1].keys.clone()
    cache.layers[1].keys = keys  # replaced: checked again, and moved into a buffer of its own
    third = kv.rooms(cache, layers, heads, 2, torch.float32, 1, 9)
    assert [room[2] for room in third] == [9, 9, 9] and checked[6:] == [0, 1, 2]
    assert third[1][0] is not keys and torch.equal(third[1][0][:, :, :9], keys)
    assert kv.rooms(cache, layers, heads, 2, torch.float32, 1, 10) is not None and len(checked) == 9  # that buffer found
    cache.layers[1].crop(-1)
    assert kv.rooms(cache, layers, heads, 2, torch.float32, 1, None) is None  # 11, 10 and 11: not as many as each other
    assert [layer.get_seq_length() for layer in cache.layers] == [11, 10, 11]
    cache = kv.GrowingCache()  # a growth past the buffers found: each old buffer freed as it grows, as layer by layer
    for i in range(3):
        cache.update(torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8), i)
    assert [room[2] for room in kv.rooms(cache, layers, heads, 2, torch.float32, 1, 5)] == [5, 5, 5]
    old = {id(layer): weakref.ref(layer._keys) for layer in cache.layers}
    freed, room = [], kv.room

    def room_then_freed(layer, rows):
        made = room(layer, rows)
        freed.append(old[id(layer)]() is None)
        return made

    monkeypatch.setattr(kv, "room", room_then_freed)
    grown = kv.rooms(cache, layers, heads, 2, torch.float32, 100, 6)  # past the buffers' 71 columns
    assert [room[2] for room in grown] == [6, 6, 6] and all(room[0].shape[-2] >= 106 for room in grown)
    assert freed == [True, True, True]  # each at its own growth, not after every layer's
