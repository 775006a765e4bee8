"""The CPU kernel layer: packed linears agree with stock ones, fall back cleanly, leave unpackable modules
alone, and a packed model's lookahead output equals the stock model's ``generate()``."""

from __future__ import annotations

import copy
import json
import re
import shutil
import weakref

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from torch import nn
from torch.nn import functional as F
from transformers import GPT2Config, GPT2LMHeadModel, Qwen2Config, Qwen2ForCausalLM

from conftest import assert_greedy_equal, hf_greedy, tiny_llama
from test_quants import random_blocks
from lookahead import LookaheadConfig, LookaheadGenerator, cpu, host_kernels, kernels, layer_kernels, linear_kernels, native, quants
from lookahead.cli import main
from lookahead.probing import curve_file

needs_onednn = pytest.mark.skipif(kernels.available(torch.float32) is not None, reason="no oneDNN packed linear here")
OWN = kernels.own_kernel(torch.bfloat16) is None  # this machine runs our own kernels (AVX-512 BF16, gcc): bf16 and fp32
OWN_FP32 = kernels.own_kernel(torch.float32) is None  # ... our fp32 ones (any tier: AVX2 and up)
needs_own = pytest.mark.skipif(not OWN, reason="our own kernels cannot run here")


@needs_onednn
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 64, 40), (5, 96, 17), (33, 576, 200), (16, 200, 1536)])
def test_packed_linear_agrees_with_stock_to_fp32_rounding(shape, bias):
    rows, k, n = shape
    torch.manual_seed(rows + k)
    linear = nn.Linear(k, n, bias=bias)
    packed = kernels.PackedLinear(copy.deepcopy(linear))
    x = torch.randn(2, rows, k)
    with torch.inference_mode():
        for inp in (x, x[0], x.transpose(0, 1).contiguous().transpose(0, 1)):  # 3-D, 2-D, non-contiguous
            assert torch.allclose(packed(inp), linear(inp), atol=1e-4, rtol=1e-5)


@needs_onednn
def test_pack_replaces_every_linear_and_keeps_tied_embeddings():
    model = tiny_llama()
    model.config.tie_word_embeddings = True
    model.lm_head.weight = model.model.embed_tokens.weight
    stock = copy.deepcopy(model)
    report = kernels.pack(model)
    linears = sum(isinstance(m, nn.Linear) for m in stock.modules())
    assert report.kernels == kernels.kernels_of(model) == ("packed-own" if OWN_FP32 else "packed")  # fp32: ours where it runs
    assert report.packed == linears and report.kept == 0
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert report.extra_bytes == model.model.embed_tokens.weight.numel() * 4  # the tied head's packed copy, nothing else
    assert kernels.kernels_of(stock) == "stock"
    ids = torch.tensor([[3, 9, 27, 81, 5]])
    with torch.inference_mode():
        assert torch.allclose(model(ids).logits, stock(ids).logits, atol=1e-4)


@needs_onednn
@pytest.mark.parametrize("build", ["llama", "qwen2-biased", "gpt2-conv1d"])
def test_packed_model_lookahead_equals_stock_generate(build):
    torch.manual_seed(0)
    common = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    if build == "llama":
        stock = tiny_llama(vocab=64)
    elif build == "qwen2-biased":  # q/k/v projections with biases
        stock = Qwen2ForCausalLM(Qwen2Config(**common)).eval()
    else:  # GPT-2's Conv1D projections are not nn.Linear: only its lm_head gets packed
        stock = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=128, n_embd=64, n_layer=2, n_head=4,
                                           eos_token_id=None, bos_token_id=None, pad_token_id=None)).eval()
    with torch.no_grad():
        stock.get_output_embeddings().weight.mul_(4.0)  # sharper: greedy paths repeat, drafts get accepted
    model = copy.deepcopy(stock)
    report = kernels.pack(model)
    assert report.packed >= 1
    for prompt in ([1, 2, 3, 1, 2, 3, 1], [7, 30, 7, 30, 11]):
        ref = hf_greedy(stock, prompt, 40)
        for config in (LookaheadConfig(auto=False), LookaheadConfig(auto=False, window=0, tree_budget=64)):
            out = LookaheadGenerator(model, config=config).generate(prompt, max_new_tokens=40)
            assert_greedy_equal(stock, prompt, out.tokens, ref)


def test_pack_lets_sdpa_share_grouped_kv_heads_and_a_masked_wide_step_agrees_with_stock_attention():
    stock = tiny_llama()  # 4 query heads over 2 K/V heads
    model = copy.deepcopy(stock)
    kernels.pack(model)
    assert model.config._attn_implementation == kernels.GROUPED_SDPA and stock.config._attn_implementation == "sdpa"
    q, k, v = torch.randn(2, 4, 5, 16), torch.randn(2, 2, 9, 16), torch.randn(2, 2, 9, 16)  # (B, heads, rows, head_dim)
    mask = torch.zeros(2, 1, 5, 9).masked_fill_(torch.rand(2, 1, 5, 9) < 0.3, torch.finfo(torch.float32).min)
    mask[..., 0] = 0  # every row sees a key
    attention = model.model.layers[0].self_attn
    grouped, _ = kernels.grouped_sdpa(attention, q, k, v, mask, scaling=0.25)
    with torch.no_grad():
        want, _ = kernels.sdpa_attention_forward(attention, q, k, v, mask, scaling=0.25)  # copies the K/V heads
    assert grouped.shape == want.shape == (2, 5, 4, 16) and torch.allclose(grouped, want, atol=1e-6)


class QuantizedLinear(nn.Linear):
    """Stands for a quantization library's linear: a subclass whose forward is not nn.Linear's."""


def test_unpackable_linears_and_stock_kernels_are_left_alone():
    model = tiny_llama()
    model.lm_head = QuantizedLinear(64, 128, bias=False)
    assert kernels.pack(model, "stock") == kernels.KernelReport("stock")
    report = kernels.pack(model)
    assert isinstance(model.lm_head, QuantizedLinear) and report.kept == 1
    out = LookaheadGenerator(model).generate([1, 2, 3], max_new_tokens=8)
    assert len(out.tokens) == 8
    with pytest.raises(ValueError, match="kernels must be one of"):
        kernels.pack(model, "fast")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_module_of_linears_only_packs_though_no_parameter_is_left(dtype):
    """Packing frees each original weight, so a module of nothing but linears has no parameter left after it (the
    norms' pass read its dtype from one and raised StopIteration)."""
    mlp = nn.Sequential(nn.Linear(64, 128, bias=False, dtype=dtype))
    x = torch.randn(1, 3, 64, dtype=dtype)
    with torch.inference_mode():
        want = mlp(x)
        report = kernels.pack(mlp)
        assert torch.allclose(mlp(x).float(), want.float(), rtol=1e-2, atol=1e-2)
    assert report.packed == 1 or report.notice


def test_missing_onednn_falls_back_to_stock_kernels_with_a_notice(monkeypatch):
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    model = tiny_llama()
    report = kernels.pack(model)
    assert report.kernels == "stock" and report.packed == 0 and "no oneDNN" in report.notice
    assert kernels.kernels_of(model) == "stock"
    assert len(LookaheadGenerator(model).generate([4, 5, 6], max_new_tokens=6).tokens) == 6


def test_a_dtype_without_a_fast_kernel_is_named(monkeypatch):
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_fp16_supported", lambda: False, raising=False)
    assert "float16" in kernels.available(torch.float16)


@needs_onednn
def test_the_cost_curve_is_cached_per_kernel_set(tmp_path):
    stock = tiny_llama()
    packed = copy.deepcopy(stock)
    kernels.pack(packed)
    assert curve_file(stock, tmp_path) != curve_file(packed, tmp_path)
    assert "-packed-" in curve_file(packed, tmp_path).name


def test_cli_kernels_option_reaches_the_model(tmp_path):
    path = tmp_path / "tiny"
    tiny_llama().save_pretrained(path)
    seen = {}
    for choice in ("stock", "packed"):
        result = CliRunner().invoke(main, ["generate", "--model", str(path), "--ids", "5,6,7", "--max-new-tokens", "4", "--json",
                                           "--dtype", "float32", "--kernels", choice, "--cache-dir", str(tmp_path / "cache")])
        assert result.exit_code == 0, result.output
        seen[choice] = json.loads(result.stdout)
    assert seen["stock"]["kernels"] == "stock"
    assert seen["packed"]["kernels"] == ("stock" if kernels.available(torch.float32) else "packed-own" if OWN_FP32 else "packed")
    assert seen["stock"]["tokens"] == seen["packed"]["tokens"]
    assert seen["stock"]["isa"] is None and seen["packed"]["isa"] == native.isa()  # the ISA our kernels run on, said
    if OWN_FP32:
        assert native.isa() == native.tier() + ("+amx" if native.amx() else "")
    else:
        assert native.isa().startswith("none (")
    bad = CliRunner().invoke(main, ["generate", "--model", str(path), "--ids", "1", "--kernels", "fast"])
    assert bad.exit_code != 0 and "fast" in bad.output


def test_checking_and_packing_leave_the_global_rng_alone():
    """Unseeded sampling draws from torch's global RNG: loading a model must not reset it."""
    model = tiny_llama()
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    kernels.available(torch.float32)
    kernels.pack(model)
    assert torch.equal(torch.rand(3), expected)


@needs_onednn
def test_a_packed_linear_still_shows_its_weight():
    linear = nn.Linear(48, 24)
    assert torch.equal(kernels.PackedLinear(linear).weight, linear.weight)


@needs_onednn
def test_sibling_linears_share_one_product_exact_in_any_call_order():
    """q/k/v run as one packed product (gate/up likewise); a call order other than a decoder's computes afresh."""
    torch.manual_seed(0)
    block = nn.Module()
    block.q_proj, block.k_proj, block.v_proj, block.o_proj = nn.Linear(48, 48), nn.Linear(48, 16), nn.Linear(48, 16), nn.Linear(48, 48)
    stock = copy.deepcopy(block)
    report = kernels.pack(block)
    assert report.packed == 4 and report.shared == 1
    assert block.q_proj.product is block.k_proj.product is block.v_proj.product is not block.o_proj.product
    x, y = torch.randn(2, 3, 48), torch.randn(2, 3, 48)
    calls = [("q_proj", x), ("k_proj", x), ("v_proj", x),  # a decoder's order: one product
             ("k_proj", y), ("k_proj", y), ("q_proj", x), ("v_proj", y), ("q_proj", y), ("o_proj", y), ("v_proj", x)]
    with torch.inference_mode():
        for name, inp in calls:
            assert torch.allclose(getattr(block, name)(inp), getattr(stock, name)(inp), atol=1e-5), name
        z = torch.randn(1, 48)
        for name in ("q_proj", "k_proj", "v_proj"):
            getattr(block, name)(z)
    assert block.q_proj.product.held.input is None and block.q_proj.product.held.outputs == ()  # nothing held once all took theirs
    for name in ("q_proj", "k_proj", "v_proj"):
        assert torch.equal(getattr(block, name).weight, getattr(stock, name).weight)


@needs_onednn
def test_siblings_that_differ_are_packed_alone():
    block = nn.Module()
    block.gate_proj, block.up_proj = nn.Linear(32, 64, bias=False), nn.Linear(32, 64, bias=True)  # one biased, one not
    block.q_proj, block.k_proj = nn.Linear(32, 32), nn.Linear(32, 8)  # no v_proj
    report = kernels.pack(block)
    assert report.packed == 4 and report.shared == 0
    assert len({id(m.product) for m in block.children()}) == 4




@needs_own
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 64, 48), (5, 96, 32), (16, 576, 208), (33, 200, 160), (8, 1536, 576)])
def test_own_bf16_linear_agrees_with_an_fp32_product_to_bf16_rounding(shape, bias):
    """One row tile of 1-12 rows or several as even as can be (3-D input doubles the rows: 2-66), an odd number of
    16-column blocks, biases, 3-D/2-D/strided input."""
    rows, k, n = shape
    torch.manual_seed(rows + k)
    linear = nn.Linear(k, n, bias=bias).to(torch.bfloat16)
    packed = kernels.PackedLinear(copy.deepcopy(linear))
    assert packed.product.own and "packed=own" in repr(packed)
    x = torch.randn(2, rows, k).to(torch.bfloat16)
    with torch.inference_mode():
        for inp in (x, x[0], x.transpose(0, 1).contiguous().transpose(0, 1)):
            want = inp.float() @ linear.weight.float().T + (linear.bias.float() if bias else 0)
            got = packed(inp)
            assert got.dtype == torch.bfloat16 and got.shape == want.shape
            assert torch.allclose(got.float(), want, rtol=2 ** -8, atol=1e-3)  # one bf16 rounding of fp32 sums
    assert torch.equal(packed.weight, linear.weight)


@needs_own
@pytest.mark.parametrize("rows", [11, 16])
@pytest.mark.parametrize("k", [576, 1536])
def test_own_bf16_linear_is_row_invariant(k, rows):
    """Row i of a product of one row tile (11 rows) or two (16) equals the one-row product bit for bit (oneDNN's
    is not at K = 1536)."""
    linear = nn.Linear(k, 64, bias=True).to(torch.bfloat16)
    assert kernels.row_invariant(kernels.PackedLinear(linear), torch.bfloat16, rows)


BF16_PATHS = [False, pytest.param(True, marks=pytest.mark.skipif(not (OWN and native.amx()), reason="no AMX tiles here"))]


@needs_own
@pytest.mark.parametrize("tiles", BF16_PATHS, ids=["vector", "amx"])
@pytest.mark.parametrize("n, k", [(64, 576), (96, 1536), (48, 64), (1040, 576)])  # 1040: a last group of 1 block
def test_each_bf16_path_is_row_invariant_and_rounds_fp32_sums_once(tiles, n, k):
    """The bf16 linear on the vector units (``linear.c``) and on AMX tiles (``amx_linear.c``), chosen by argument:
    each gives row i of an M-row product (M across one tile and several, 16-row tiles padded past 16) bit for
    bit as the one-row product, within one bf16 rounding of fp32 sums, with and without a bias."""
    torch.manual_seed(n + k)
    weight, bias = torch.randn(n, k).to(torch.bfloat16), torch.randn(n)
    for b in (None, bias):
        product = linear_kernels.Linear(linear_kernels.pack(weight), b, tiles=tiles)
        x = torch.randn(40, k).to(torch.bfloat16)
        alone = torch.cat([product(x[i : i + 1]) for i in range(40)])
        want = x.float() @ weight.float().T + (0 if b is None else b)
        assert torch.allclose(alone.float(), want, rtol=2 ** -8, atol=1e-3)
        for rows in (1, 2, 9, 16, 17, 33, 40):
            assert torch.equal(product(x[:rows]), alone[:rows]), rows


@pytest.mark.skipif(native.best_tier() is None or shutil.which("gcc") is None, reason="no AVX2 or no gcc here")
def test_every_tier_this_cpu_runs_builds_and_its_fp32_kernels_agree_bit_for_bit(tmp_path):
    """Each tier of the kernels this CPU can run (an AVX-512 BF16 host runs the AVX-512F and AVX2 ones too) is
    built and called by name: what two tiers both have (the fp32 linears, RMSNorm, top-k and argmax, the KV moves) gives
    the same bits in each (the AVX2 linear is other code with the same FMA chain per output), and only the
    AVX-512 BF16 tier has bf16 kernels."""
    import ctypes

    tiers = [t for t in native.TIERS if native.runs(t)]
    libs = {t: native.build(tmp_path, t) for t in tiers}
    assert all(not isinstance(lib, str) for lib in libs.values()), libs
    assert {t: hasattr(lib, "bf16_linear") for t, lib in libs.items()} == {t: t == "avx512-bf16" for t in tiers}
    torch.manual_seed(0)
    weight, bias, x = torch.randn(96, 576), torch.randn(96), torch.randn(13, 576)
    packed, scores, norm_weight, delta = linear_kernels.pack(weight), torch.randn(5, 1000), torch.randn(576), torch.randn(13, 576)
    tie = torch.zeros(1, 5000)
    tie[0, [4000, 7, 3000]] = 1.0  # in both threads' halves of the columns: the lower index first
    edges = torch.randn(6, 1004) * 4  # a tail past the last vector of either width
    edges[1, [3, 900]] = 100.0  # equal largest: the first
    edges[2] = float("-inf")  # nothing but -inf: the first
    edges[3, [20, 700]] = float("nan")  # a NaN is above all: the first one
    edges[4, 1003] = 100.0  # the largest in the tail
    edges[5] = -0.0
    edges[5, 9] = 0.0  # -0 and +0 are equal: the first
    angles = torch.randn(13, 32) * 30
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)  # (13, 64): each row's
    blocks = [quants.quantize_q8_0(weight),  # and a 4-bit kind, with offsets and a bias; and an odd count of blocks
              quants.Quantized(torch.randint(0, 16, (96, 576), dtype=torch.int8), torch.rand(96, 18), torch.randn(96, 18), 32, 4),
              quants.quantize_q8_0(weight[:80])]
    layouts = [linear_kernels.pack_quantized(q.q, q.scale, q.offset, q.group, q.bits, torch.float32) for q in blocks]
    keys = torch.randn(2, 3, 12, 32)  # (B, H, S, D): sequence b's columns 4 + index[b] move to 4, 5, 6
    index = np.array([[0, 2, 5], [1, 3, 4]], np.int64)
    gathered = torch.stack([keys[b, :, 4 + torch.from_numpy(index[b])] for b in range(2)])  # (B, H, C, D)
    outputs = {}
    for t, lib in libs.items():
        out = outputs[t] = {}
        for rows in (1, 5, 13):  # one tile, a full AVX2 tile, several
            y = torch.empty(rows, 96)
            lib.fp32_linear(x.data_ptr(), packed.data_ptr(), bias.data_ptr(), y.data_ptr(), rows, 96, 576, 2, 1)
            out[f"linear {rows}"] = y
        assert torch.allclose(out["linear 13"], x @ weight.T + bias, rtol=1e-4, atol=1e-4)
        assert torch.equal(out["linear 1"], out["linear 13"][:1]) and torch.equal(out["linear 5"], out["linear 13"][:5])
        for q, layout in zip(blocks, layouts):  # the quantized linear: the dense one's bits on the dequantized weight
            n = q.q.shape[0]
            for rows in (1, 2, 13):  # the AVX2 kernel's tiles of blocks two at a time (a lone one alone), and of 4 rows
                y = torch.empty(rows, n)
                lib.quant_fp32_linear(x.data_ptr(), layout.packed.data_ptr(), bias.data_ptr(), y.data_ptr(), rows, n, 576, q.bits,
                                      q.group, int(q.offset is not None), 2, 1)
                out[f"quant {q.kind} {n} {rows}"] = y
            dense, dequantized = torch.empty(13, n), linear_kernels.pack(q.dequantize())
            lib.fp32_linear(x.data_ptr(), dequantized.data_ptr(), bias.data_ptr(), dense.data_ptr(), 13, n, 576, 2, 1)
            assert all(torch.equal(out[f"quant {q.kind} {n} {rows}"], dense[:rows]) for rows in (1, 2, 13))
        if hasattr(lib, "rms_norm"):  # both weightings, and the residual sum before the norm
            for offset, name in ((0, "norm"), (1, "gemma norm")):
                out[name] = torch.empty_like(x)
                lib.rms_norm(x.data_ptr(), norm_weight.data_ptr(), out[name].data_ptr(), 0, 13, 576, 1e-5, offset, 2)
            out["sum"], out["summed norm"] = torch.empty_like(x), torch.empty_like(x)
            lib.add_rms_norm(x.data_ptr(), delta.data_ptr(), out["sum"].data_ptr(), norm_weight.data_ptr(), out["summed norm"].data_ptr(),
                             0, 13, 576, 1e-5, 0, 2)
            r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
            assert torch.allclose(out["norm"], norm_weight * (x * r), rtol=1e-5, atol=1e-6)
            assert torch.allclose(out["gemma norm"], x * r * (1 + norm_weight), rtol=1e-5, atol=1e-6)
            assert torch.equal(out["sum"], x + delta)
        if hasattr(lib, "rope"):  # heads 0-7 of 64 rotated in place as torch's ops round, the rest untouched
            out["rope"] = x.clone()
            lib.rope(out["rope"].data_ptr(), cos.data_ptr(), sin.data_ptr(), 0, 13, 576, 8, 64)
            heads = x[:, :512].view(13, 8, 64)
            want = heads * cos[:, None] + torch.cat([-heads[..., 32:], heads[..., :32]], -1) * sin[:, None]
            assert torch.equal(out["rope"][:, :512].view(13, 8, 64), want) and torch.equal(out["rope"][:, 512:], x[:, 512:])
        if hasattr(lib, "top_k"):  # fp32 and bf16 (as their fp32 values), a tail past the last vector, a tie across threads,
            # and argmax's edges: a row's first is its argmax (NaNs above all, the lower index first), as greedy verification reads it
            for name, x_, k in (("top", scores, 8), ("top tail", scores[:, :997].contiguous(), 8), ("top bf16", scores.bfloat16(), 8),
                                ("top tie", tie, 3), ("top edges", edges, 3), ("top edges bf16", edges.bfloat16(), 3)):
                top = np.empty((x_.shape[0], k), np.int64)
                assert lib.top_k(x_.data_ptr(), int(x_.dtype == torch.bfloat16), x_.shape[0], x_.shape[1], k, top.ctypes.data, 2) == 0
                out[name] = torch.from_numpy(top)
            assert torch.equal(out["top"], torch.topk(scores, 8).indices) and out["top tie"].tolist() == [[7, 3000, 4000]]
            assert torch.equal(out["top tail"], torch.topk(scores[:, :997], 8).indices)
            ranked = torch.sort(scores.bfloat16().float(), descending=True, stable=True).indices  # bf16 ties: the lower index first
            assert torch.equal(out["top bf16"], ranked[:, :8])
            for name, x_ in (("top edges", edges), ("top edges bf16", edges.bfloat16())):
                assert torch.equal(out[name], torch.sort(x_.float(), descending=True, stable=True).indices[:, :3])
                assert out[name][:, 0].tolist() == torch.argmax(x_, -1).tolist()
        if hasattr(lib, "argmax"):  # torch's: the first of equals, the first NaN above all; in fp32 and bf16
            for name, x_ in (("argmax", edges), ("argmax bf16", edges.bfloat16())):
                found = np.empty(len(x_), np.int64)
                lib.argmax(x_.data_ptr(), int(x_.dtype == torch.bfloat16), x_.shape[0], x_.shape[1], found.ctypes.data)
                out[name] = torch.from_numpy(found)
                assert out[name].tolist() == torch.argmax(x_, -1).tolist() == [int(torch.argmax(x_[0])), 3, 0, 20, 1003, 0]
        out["moved"] = keys.clone()
        lib.move_columns((ctypes.c_void_p * 1)(out["moved"].data_ptr()), (ctypes.c_long * 3)(*keys.stride()[:3]), 1, 4, 2, 3, 32, 4,
                         index.ctypes.data, 3)
        assert torch.equal(out["moved"][:, :, 4:7], gathered) and torch.equal(out["moved"][:, :, :4], keys[:, :, :4])
    for t, out in outputs.items():
        for other, theirs in outputs.items():
            assert all(torch.equal(out[name], theirs[name]) for name in out.keys() & theirs.keys()), (t, other)
    if "avx2" in outputs:  # the AVX2 tier: the fp32 linears, norms and RoPE, the top-k and argmax, and the KV moves
        assert set(outputs["avx2"]) == ({"linear 1", "linear 5", "linear 13", "moved", "norm", "gemma norm", "sum", "summed norm", "rope",
                                          "top", "top tail", "top bf16", "top tie", "top edges", "top edges bf16", "argmax", "argmax bf16"}
                                         | {f"quant {q.kind} {q.q.shape[0]} {r}" for q in blocks for r in (1, 2, 13)})


@pytest.mark.skipif(not native.runs("avx2") or shutil.which("gcc") is None, reason="no AVX2 or no gcc here")
def test_the_integer_linear_and_the_fp32_attention_give_the_same_bits_on_every_tier(tmp_path, monkeypatch):
    """int_linear_avx2.c (the AVX2, AVX-VNNI and AVX-512F tiers') gives int_linear.c's bits for every layout kind (int8
    quads, nibbles, 6-bit planes; fp32, fp16 and the K types' scales) at every M up to 40, and so does its vpdpbusd
    path, built here EVEX-encoded (AVX512-VNNI with VL: the instruction the AVX-VNNI tier runs, VEX-encoded, which
    gcc is shown to build); but for the K types' scales on the tiers without VNNI (``native.SUB_SCALES``), which put
    the sub-block scales on the integer sums: bits of their own, row-invariant, one set on every such tier, within
    fp32 rounding of the others'. tree_attention_avx2.c and decoder_layer_fp32.c's activations are one code on every
    tier, so one bits."""
    import ctypes
    import subprocess

    evex = native.Tier(("avx2", "fma", "f16c", "avx512_vnni", "avx512vl"), ("int_linear_avx2.c",),
                       native.AVX2_FLAGS + ("-mavx512vnni", "-mavx512vl"))
    monkeypatch.setitem(native.TIERS, "avx2 with avx512-vnni", evex)
    tiers = [t for t in native.TIERS if native.runs(t)]
    libs = {t: native.build(tmp_path, t) for t in tiers}
    assert all(not isinstance(lib, str) for lib in libs.values()), libs
    vnni = native.TIERS["avx-vnni"]
    built = subprocess.run(["gcc", *vnni.flags[:-1], "-c", str(native.CSRC / "int_linear_avx2.c"), "-o", str(tmp_path / "vnni.o")],
                           capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    layouts = []
    for kind in ("Q8_0", "Q4_1", "Q4_K", "Q6_K"):
        k = 576 if kind in ("Q8_0", "Q4_1") else 512
        q = quants.from_blocks(random_blocks(kind, 48, k, seed=k), kind, 48, k)
        layouts.append(linear_kernels.lay_out(q, torch.float32, integer=True))  # fp16 scales, the K types' own
    g = torch.Generator().manual_seed(5)  # fp32 scales a group, groups of 16 and 32
    for bits, group in ((8, 16), (4, 32)):
        values = torch.randint(0, 16, (48, 384), generator=g) if bits == 4 else torch.randint(-128, 128, (48, 384), generator=g)
        offset = torch.randn(48, 384 // group, generator=g) if bits == 4 else None
        layouts.append(linear_kernels.pack_quantized(values.to(torch.int8), torch.rand(48, 384 // group, generator=g), offset, group, bits, torch.float32,
                                             integer=True))
    assert {layout.scaling for layout in layouts} == {0, 1, 2} and {layout.bits for layout in layouts} == {4, 6, 8}
    bias = torch.randn(48, generator=g)
    outputs = {}
    for t, lib in libs.items():
        out = outputs[t] = {}
        for i, layout in enumerate(layouts):
            x = torch.randn(40, layout.k, generator=torch.Generator().manual_seed(i))
            for m in (1, 2, 3, 4, 5, 9, 16, 21, 40):
                y = torch.empty(m, 48)
                assert lib.int_linear(x.data_ptr(), layout.packed.data_ptr(), bias.data_ptr(), y.data_ptr(), m, 48, layout.k, layout.bits,
                                      layout.group, int(layout.offsets), layout.scaling, 2, 1, 0) == 0
                out[f"int {i} {m}"] = y
            assert all(torch.equal(out[f"int {i} {m}"], out[f"int {i} 40"][:m]) for m in (1, 2, 3, 4, 5, 9, 16, 21)), (t, i)
        if hasattr(lib, "tree_attention_fp32"):
            q, k, v, mask = attention_case(1, 9, 3, 5, 37, 64, seed=3, dtype=torch.float32)
            out["attention"] = torch.empty(1, 5, 9, 64)
            assert lib.tree_attention_fp32(q.data_ptr(), native.Longs(*q.stride()[:3]), k.data_ptr(), v.data_ptr(),
                                           native.Longs(*k.stride()[:3]), mask.data_ptr(), native.Longs(0, mask.stride(2), 0),
                                           out["attention"].data_ptr(), 1, 9, 3, 5, 37, 64, ctypes.c_float(0.125), 2) == 0
        if hasattr(lib, "gated_fp32"):  # built without -ffp-contract=off in the AVX-512 tiers: no product fused all the same
            both = torch.randn(80, 2 * 64, generator=torch.Generator().manual_seed(7)) * 8  # 80 rows: split over two threads
            for act in (1, 2):  # SiLU, GELU-tanh
                out[f"gated {act}"] = torch.empty(80, 64)
                lib.gated_fp32(both.data_ptr(), out[f"gated {act}"].data_ptr(), 80, 64, act, 2)
    assert {t for t in outputs if "attention" in outputs[t] and "gated 2" in outputs[t]} == set(tiers) - {"avx2 with avx512-vnni"}
    supers = {f"int {i} {m}" for i, layout in enumerate(layouts) if layout.supers for m in (1, 2, 3, 4, 5, 9, 16, 21, 40)}
    assert [layout.supers for layout in layouts] == [False, False, True, True, False, False]  # Q4_K's and Q6_K's
    first = outputs[tiers[0]]
    for sub_scales in (False, True):
        same = [t for t in tiers if (t in native.SUB_SCALES) == sub_scales]
        for t in same:
            assert all(torch.equal(outputs[t][name], (first if name not in supers else outputs[same[0]])[name]) for name in outputs[t]), t
    for t in set(tiers) & native.SUB_SCALES:
        for name in supers:
            want = first[name]
            assert (outputs[t][name] - want).abs().max() <= 1e-5 * want.abs().max(), (t, name)


def test_tiles_are_refused_where_amx_cannot_run(monkeypatch):
    monkeypatch.setattr(linear_kernels, "amx", lambda: False)  # the name Linear looks up (native.amx is True on an AMX CPU)
    with pytest.raises(ValueError, match="cannot use AMX tiles"):
        linear_kernels.Linear(linear_kernels.pack(torch.randn(16, 64).to(torch.bfloat16)), None, tiles=True)


@needs_own
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_where_the_weights_are_prefetched_changes_no_bit(dtype):
    """The linear prefetches the next weights non-temporally or into L2 by CPU (``native.prefetch_into_l2``); both
    give the same output, at one row tile and at two."""
    weight = torch.randn(96, 1536).to(dtype)
    products = [linear_kernels.Linear(linear_kernels.pack(weight), None) for _ in range(2)]
    products[0].l2, products[1].l2 = 0, 1
    for rows in (1, 16):
        x = torch.randn(rows, 1536).to(dtype)
        assert torch.equal(products[0](x), products[1](x))
    assert native.prefetch_into_l2() == int(cpu.cpu_generation() not in native.NON_TEMPORAL)


@needs_own
def test_own_kernel_packs_what_fits_and_onednn_the_rest():
    block = nn.Module()
    block.q_proj, block.k_proj, block.v_proj = nn.Linear(64, 64), nn.Linear(64, 32), nn.Linear(64, 32)  # one 128-wide product
    block.o_proj = nn.Linear(64, 24)  # 24 columns: not a multiple of 16
    block = block.to(torch.bfloat16)
    stock = copy.deepcopy(block)
    report = kernels.pack(block)
    assert report.kernels == kernels.kernels_of(block) == "packed-own" and report.notice is None
    assert block.q_proj.product.own and not block.o_proj.product.own
    x = torch.randn(3, 64).to(torch.bfloat16)
    with torch.inference_mode():
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            assert torch.allclose(getattr(block, name)(x).float(), getattr(stock, name)(x).float(), rtol=2 ** -7, atol=1e-2)
    with pytest.raises(ValueError, match="input has 32 features, the weight 64"):
        linear_kernels.linear(torch.randn(2, 32).to(torch.bfloat16), block.q_proj.product.packed, None)


@needs_own
def test_a_bf16_model_on_the_own_kernel_runs_lookahead_and_its_own_cost_curve(tmp_path, monkeypatch):
    model = tiny_llama().to(torch.bfloat16)
    kernels.pack(model)
    assert kernels.kernels_of(model) == "packed-own" and "-packed-own-" in curve_file(model, tmp_path).name
    today = curve_file(model, tmp_path)
    monkeypatch.setattr(native, "build_id", lambda tier: "a-changed-kernel")  # kernels built from other sources: probed anew
    assert curve_file(model, tmp_path) != today
    monkeypatch.undo()
    gen = LookaheadGenerator(model, config=LookaheadConfig(auto=False, tree_budget=8))
    plain = gen.generate([3, 1, 4, 1, 5], max_new_tokens=12, lookahead=False).tokens
    assert len(plain) == 12 and len(gen.generate([3, 1, 4, 1, 5], max_new_tokens=12).tokens) == 12


def test_without_gcc_a_bf16_model_packs_on_onednn_with_a_notice(monkeypatch):
    if kernels.available(torch.bfloat16) is not None:
        pytest.skip("no oneDNN bf16 product here")
    monkeypatch.setattr(native.shutil, "which", lambda name: None)
    native.library.cache_clear()
    try:
        model = tiny_llama().to(torch.bfloat16)
        report = kernels.pack(model)
        reason = kernels.own_kernel(torch.bfloat16)
        assert reason in report.notice and "run on oneDNN" in report.notice
        assert "no gcc" in reason or not OWN  # where it ran, gcc's absence is what stops it
        assert report.kernels == kernels.kernels_of(model) == "packed"
        assert report.norms == 0 and type(model.model.norm).__name__ == "LlamaRMSNorm"  # no kernel: stock norms
        assert len(LookaheadGenerator(model).generate([4, 5, 6], max_new_tokens=6).tokens) == 6
    finally:
        native.library.cache_clear()  # the next test builds (or finds) the real one again


def attention_case(b: int, h: int, g: int, t: int, s: int, d: int, seed: int, dtype: torch.dtype = torch.bfloat16):
    """query (B, H, T, D) as transformers makes it (a transposed view), key/value views into a roomier cache
    buffer, and a random additive mask that leaves every row its first key, all ``dtype``."""
    torch.manual_seed(seed)
    q = torch.randn(b, t, h, d).to(dtype).transpose(1, 2)
    kv = torch.randn(2, b, g, s + 5, d).to(dtype)[:, :, :, :s]
    allowed = torch.rand(b, 1, t, s) < 0.7
    allowed[..., 0] = True
    mask = torch.zeros(b, 1, t, s, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
    return q, kv[0], kv[1], mask


DTYPES = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])  # tree_attention.c, _avx2.c


@needs_own
@DTYPES
@pytest.mark.parametrize("shape", [(1, 9, 3, 1, 300, 64), (1, 9, 3, 16, 316, 64), (2, 9, 3, 5, 37, 64), (1, 14, 2, 7, 100, 64),
                                   (1, 8, 8, 3, 50, 128), (1, 4, 1, 16, 33, 256), (1, 9, 3, 20, 20, 64), (1, 6, 2, 5, 70, 96),
                                   (1, 9, 3, 179, 179, 64)])
def test_own_attention_agrees_with_fp32_sdpa_to_its_rounding(shape, dtype):
    """Grouped heads 3:1, 7:1, 1:1 and 4:1, head sizes 64-256 (96: a 32-wide tail of columns), one to 20 rows
    (49 of a K/V head in four tasks in bf16, seven in fp32), a batch of two, no mask (causal), a prompt's prefill
    (179 rows: tasks that straddle two heads)."""
    q, k, v, mask = attention_case(*shape, seed=sum(shape), dtype=dtype)
    t, s = q.shape[2], k.shape[2]
    causal = torch.ones(t, s, dtype=torch.bool).tril(s - t)  # row t sees keys up to s - t + t
    bound = (2 ** -7, 2e-3) if dtype == torch.bfloat16 else (1e-5, 1e-5)
    for given, reference in ((mask, mask.float()), (None, causal)):
        got = layer_kernels.attention(q, k, v, given, 0.125)
        want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=reference, scale=0.125, enable_gqa=True)
        assert got.dtype == dtype and torch.allclose(got.float(), want.transpose(1, 2), rtol=bound[0], atol=bound[1])


@needs_own
@DTYPES
def test_own_attention_row_depends_only_on_its_query_and_the_keys_it_sees(dtype):
    """Bit for bit: whatever other rows the call carries and wherever masked keys sit between the seen ones,
    which is what makes a lookahead step's rows the plain loop's."""
    q, k, v, _ = attention_case(1, 9, 3, 4, 40, 64, seed=1, dtype=dtype)
    keep = torch.tensor(sorted(torch.randperm(40)[:25].tolist()))
    mask = torch.full((1, 1, 4, 40), torch.finfo(dtype).min, dtype=dtype)
    mask[..., keep] = 0
    scattered = layer_kernels.attention(q, k, v, mask, 0.125)
    seen = k[:, :, keep].contiguous(), v[:, :, keep].contiguous()
    assert torch.equal(scattered, layer_kernels.attention(q, *seen, torch.zeros(1, 1, 4, 25, dtype=dtype), 0.125))
    assert torch.equal(scattered[:, 2:3], layer_kernels.attention(q[:, :, 2:3], *seen, None, 0.125))


@needs_own
@DTYPES
@pytest.mark.parametrize("h, g, d, t", [(9, 3, 64, 9), (12, 2, 128, 5), (4, 1, 256, 13), (9, 3, 96, 3)])
def test_own_attention_gives_a_row_the_same_bits_by_keys_as_by_rows(h, g, d, t, dtype):
    """A task of few rows runs its scores with the keys as lanes, a wider one with the rows as lanes: the same
    vdpbf16ps or FMAs on the same operands in the same order, so a row alone (by keys where it has few rows) is bit
    for bit that row in a call of t rows (whose tasks run by rows), masked or causal."""
    q, k, v, mask = attention_case(1, h, g, t, 300, d, seed=t + d, dtype=dtype)
    together, causal = layer_kernels.attention(q, k, v, mask, 0.125), layer_kernels.attention(q, k, v, None, 0.125)
    for row in range(t):
        alone = layer_kernels.attention(q[:, :, row:row + 1], k, v, mask[:, :, row:row + 1], 0.125)
        assert torch.equal(alone, together[:, row:row + 1])
        seen = 300 - t + row + 1  # the keys the causal row sees
        assert torch.equal(layer_kernels.attention(q[:, :, row:row + 1], k[:, :, :seen], v[:, :, :seen], None, 0.125), causal[:, row:row + 1])


@needs_own
@DTYPES
@pytest.mark.parametrize("t, s", [(179, 179), (40, 100), (1, 30)])
def test_own_causal_attention_is_the_causal_mask_bit_for_bit(t, s, dtype):
    """Without a mask a task skips the keys none of its rows sees (half a prefill's work): each would add an exact
    0 to the sums, so the output is the masked path's, which reads every key."""
    q, k, v, _ = attention_case(1, 9, 3, t, s, 64, seed=t + s, dtype=dtype)
    causal = torch.ones(t, s, dtype=torch.bool).tril(s - t)
    mask = torch.zeros(1, 1, t, s, dtype=dtype).masked_fill(~causal, torch.finfo(dtype).min)
    assert torch.equal(layer_kernels.attention(q, k, v, None, 0.125), layer_kernels.attention(q, k, v, mask, 0.125))


@needs_own
@DTYPES
def test_attention_that_could_not_allocate_runs_sdpa(monkeypatch, dtype):
    q, k, v, mask = attention_case(1, 9, 3, 4, 40, 64, seed=5, dtype=dtype)
    ours = kernels.grouped_sdpa(torch.nn.Module(), q, k, v, mask, scaling=0.125)[0]
    monkeypatch.setattr(layer_kernels, "attention", lambda *args: None)  # what it returns when its buffers fail
    stock = kernels.grouped_sdpa(torch.nn.Module(), q, k, v, mask, scaling=0.125)[0]
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.125, enable_gqa=True).transpose(1, 2)
    assert torch.equal(stock, want) and not torch.equal(ours, stock)


@needs_own
def test_own_attention_declines_what_it_does_not_do():
    q, k, v, mask = attention_case(1, 9, 3, 4, 40, 64, seed=2)
    assert layer_kernels.attention_fits(q, k, v, mask, causal=True) and layer_kernels.attention_fits(q, k, v, None, causal=True)
    assert layer_kernels.attention_fits(q.float(), k.float(), v.float(), mask.float(), causal=True)  # fp32: tree_attention_avx2.c
    assert not layer_kernels.attention_fits(q, k, v, None, causal=False)  # no mask and not causal: an encoder's
    assert not layer_kernels.attention_fits(q.half(), k.half(), v.half(), mask.half(), causal=True)  # fp16 stays SDPA's
    assert not layer_kernels.attention_fits(q.float(), k.float(), v.float(), mask, causal=True)  # a mask of another dtype
    assert not layer_kernels.attention_fits(q, k, v, mask.bool(), causal=True)
    assert not layer_kernels.attention_fits(q[..., :48], k[..., :48], v[..., :48], mask, causal=True)  # head size not a multiple of 32


@needs_own
def test_own_top_k_is_torch_topk_without_ties_and_takes_the_lower_index_on_one():
    torch.manual_seed(4)
    for rows, n, k in [(1, 49152, 8), (5, 49152, 8), (3, 100, 16), (2, 17, 17), (4, 1000, 64), (1, 15, 1)]:
        x = torch.randn(1, rows, n)
        assert np.array_equal(host_kernels.top_k(x, k), torch.topk(x, k).indices.numpy()), (rows, n, k)
    assert host_kernels.top_k(torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0]]), 2).tolist() == [[1, 2]]
    x = torch.randn(2, 100)
    assert np.array_equal(host_kernels.top_k(x, 65), torch.topk(x, 65).indices.numpy())  # past 64: torch's
    tie = torch.zeros(1, 49152)
    tie[0, [40000, 7, 30000]] = 1.0  # in both threads' halves of the columns: the lower index first
    assert host_kernels.top_k(tie, 3).tolist() == [[7, 30000, 40000]] and host_kernels.top_k(tie.to(torch.bfloat16), 2).tolist() == [[7, 30000]]


def test_top_k_ranks_ties_and_nans_as_argmax_does_in_ours_and_torchs():
    """A row's first of the top-k is its argmax (greedy verification reads it): the lower index of equals, a NaN above all,
    in our kernel (k <= 64) and in torch.topk's, whose rows where ties or NaNs reach the top k are ranked again."""
    torch.manual_seed(5)
    x = (torch.randn(6, 3000) * 2).round()  # many ties, at the top and at the k-th
    x[1, [2999, 40, 1500]] = float("nan")
    x[2] = float("-inf")
    x[3, :] = 1.0
    x[4, [100, 7]] = 50.0
    stable = torch.sort(x, descending=True, stable=True).indices
    for k in (1, 3, 8, 65, 200):  # ours, then torch's
        assert np.array_equal(host_kernels.top_k(x, k), stable[:, :k].numpy()), k
        assert host_kernels.top_k(x, k)[:, 0].tolist() == torch.argmax(x, -1).tolist() == host_kernels.argmax(x).tolist()
    plain = torch.randn(3, 500)  # no ties: torch's own order, untouched
    assert np.array_equal(host_kernels.top_k(plain, 100), torch.topk(plain, 100).indices.numpy())


@needs_own
def test_own_top_k_reads_bf16_as_their_fp32_values():
    torch.manual_seed(6)
    for rows, n, k in [(1, 49152, 8), (9, 49152, 8), (3, 1000, 16), (2, 40, 33)]:
        x = torch.randn(2, rows, n).to(torch.bfloat16)
        assert np.array_equal(host_kernels.top_k(x, k), host_kernels.top_k(x.float(), k)), (rows, n, k)



@needs_own
def test_a_kept_top_k_buffer_answers_each_call_as_a_new_one_would():
    """``TopK`` reuses its output buffer: growing, shrinking and changing k, each answer is ``top_k``'s."""
    torch.manual_seed(9)
    ranker = host_kernels.TopK()
    for rows, n, k in [(2, 1000, 8), (9, 49152, 8), (1, 500, 3), (4, 49152, 16), (9, 300, 64)]:
        x = torch.randn(1, rows, n)
        assert np.array_equal(ranker(x, k), torch.topk(x, k).indices.numpy()), (rows, n, k)

@needs_own
def test_own_argmax_is_torchs_first_of_equals_and_first_nan_in_fp32_and_bf16():
    torch.manual_seed(8)
    rows = torch.randn(6, 49157) * 4  # a tail past the last 16
    rows[1, [3, 40000]] = 100.0  # equal largest: the first
    rows[2] = float("-inf")  # nothing but -inf: the first
    rows[3, [20, 30000]] = float("nan")  # a NaN is above all: the first one
    rows[4, 49156] = 100.0  # the largest in the tail
    rows[5, :] = -0.0
    rows[5, 9] = 0.0  # -0 and +0 are equal: the first
    for x in (rows, rows.to(torch.bfloat16)):
        assert host_kernels.argmax(x).tolist() == torch.argmax(x, -1).tolist() == [int(torch.argmax(x[0])), 3, 0, 20, 49156, 0]
        assert host_kernels.argmax(x[4]) == 49156 and isinstance(host_kernels.argmax(x[4]), int)
        assert host_kernels.argmax(x[:, :7]).tolist() == torch.argmax(x[:, :7], -1).tolist()  # shorter than a vector
    assert host_kernels.argmax(rows.double()).tolist() == torch.argmax(rows, -1).tolist()  # float64 (sampling's): numpy's


@needs_own
def test_own_move_columns_is_the_gather_it_replaces():
    """A batch of two whose second row keeps fewer columns (it repeats its last), K/V views into roomier buffers."""
    torch.manual_seed(7)
    tensors = [torch.randn(2, 3, 20, 16).to(torch.bfloat16)[:, :, :15] for _ in range(2)]  # fp32: the compaction tests
    index = np.array([[0, 2, 3, 6], [0, 4, 4, 4]])
    want = [t.clone() for t in tensors]
    for t in want:
        block = t.narrow(-2, 8, 7)
        block.narrow(-2, 0, 4).copy_(torch.stack([block[b, :, index[b]] for b in range(2)]))
    assert host_kernels.move_columns(tensors, 8, index)
    assert all(torch.equal(got, w) for got, w in zip(tensors, want))
    assert not host_kernels.move_columns([tensors[0].transpose(2, 3)], 8, index)  # head_dim not contiguous: torch's ops


@needs_own
def test_a_column_mover_follows_its_tensors_when_they_are_replaced():
    """``ColumnMover`` makes its pointers once for a cache's tensors: new tensors (a grown buffer) are moved as they
    are, not where the old ones were, and the old ones are not kept alive."""
    torch.manual_seed(10)
    mover, index = host_kernels.ColumnMover(), np.array([[0, 3], [2, 3]])  # sources past the targets: a move twice is one
    for _ in range(3):
        tensors = [torch.randn(2, 2, 12, 32) for _ in range(4)]
        want = [t.clone() for t in tensors]
        for t in want:
            t[:, :, 4:6] = torch.stack([t[b, :, 4 + index[b]] for b in range(2)])
        for _ in range(2):  # the second time on the pointers made the first
            assert mover(tensors, 4, index)
        assert all(torch.equal(got, w) for got, w in zip(tensors, want))
    gone = weakref.ref(tensors[0])
    del tensors, want, t
    assert gone() is None


@needs_own
def test_the_kernels_are_built_into_the_cache_dir_the_cli_names(monkeypatch, tmp_path):
    """``--cache-dir`` holds everything a run keeps, our kernels' build included: the user's cache stays untouched."""
    from pathlib import Path

    model_dir, mine, user = tmp_path / "model", tmp_path / "mine", tmp_path / "user"
    tiny_llama().save_pretrained(model_dir)
    built = Path(native.library()._name)
    (mine / "kernels").mkdir(parents=True)
    shutil.copy(built, mine / "kernels" / built.name)  # as gcc would leave it (a build takes a while on 2 cores)
    monkeypatch.setenv("XDG_CACHE_HOME", str(user))
    native.library.cache_clear()
    try:
        result = CliRunner().invoke(main, ["generate", "--model", str(model_dir), "--cache-dir", str(mine), "--ids", "1,2,3",
                                           "--max-new-tokens", "4", "--json"])
        assert result.exit_code == 0, result.output
        assert json.loads(result.stdout)["kernels"] == "packed-own"
        assert native.library()._name == str(mine / "kernels" / built.name) and not user.exists()
    finally:
        native.library.cache_clear()


def test_an_unwritable_cache_leaves_bf16_on_onednn_with_a_notice(monkeypatch, tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocked))  # its "lookahead/kernels" cannot be made under a file
    native.library.cache_clear()
    try:
        reason = kernels.own_kernel(torch.bfloat16)
        assert reason is not None and ("cannot build or load it" in reason or not OWN)
    finally:
        native.library.cache_clear()


@needs_own
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 64, 48), (5, 96, 32), (16, 576, 208), (33, 200, 160), (8, 1536, 576), (3, 7, 32)])
def test_own_fp32_linear_agrees_with_stock_to_fp32_rounding_and_is_row_invariant(shape, bias):
    rows, k, n = shape  # K = 7: odd is fine in fp32
    torch.manual_seed(rows + k)
    linear = nn.Linear(k, n, bias=bias)
    packed = kernels.PackedLinear(copy.deepcopy(linear))
    assert packed.product.own
    x = torch.randn(2, rows, k)
    with torch.inference_mode():
        for inp in (x, x[0], x.transpose(0, 1).contiguous().transpose(0, 1)):
            assert torch.allclose(packed(inp), linear(inp), atol=1e-4, rtol=1e-5)
    assert torch.equal(packed.weight, linear.weight) and kernels.row_invariant(packed, torch.float32)


def test_the_kernels_enums_are_in_the_order_python_passes_them():
    """native passes a product's kind, an activation, a layer's norms and a layout's scaling as indices into its
    tuples; the C reads them as enums: one order each (a product's enum name is its kernel's name less "_linear")."""
    source = "".join((native.CSRC / name).read_text() for name in ("decoder_layer.h", "int_linear.c"))
    enums = [re.findall(r"\w+", body) for body in re.findall(r"enum \{([^}]*)\}", source)]
    for names in (native.PRODUCTS, native.ACTIVATIONS, native.NORMS, linear_kernels.SCALINGS):
        assert [str(name).removesuffix("_linear").upper() for name in names] in enums, names
