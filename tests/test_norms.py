"""RMSNorm modules on our kernel: the module's own output up to the last bit of r (bf16 mostly bit for bit), each
row alone, swapped only where the check on load agrees, and a swapped model's logits the stock norms'."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

from conftest import tiny_gemma3, tiny_llama
from lookahead import kernels, layer_kernels, layers, norms

pytestmark = pytest.mark.skipif(kernels.own_kernel(torch.bfloat16) is not None, reason="our own kernels cannot run here")
CLASSES = [(LlamaRMSNorm, 0), (Qwen2RMSNorm, 0), (Gemma3RMSNorm, 1)]


def random_norm(cls, n: int, dtype: torch.dtype, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    norm = cls(n, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(n) * 0.5 + 0.2)
    return norm


@pytest.mark.parametrize("cls, offset", CLASSES)
@pytest.mark.parametrize("shape", [(1, 1, 576), (1, 9, 576), (2, 5, 3, 256), (1, 179, 896), (3, 17)])
def test_fused_norm_is_the_modules_output(cls, offset, shape):
    """The sum of squares' order may move r by its last bit: fp32 outputs to that bit, bf16 ones equal or one unit
    in their last place apart, and equal on at least 99% of them."""
    for dtype in (torch.bfloat16, torch.float32):
        norm = random_norm(cls, shape[-1], dtype, seed=sum(shape))
        x = (torch.randn(shape) * 3).to(dtype)
        with torch.inference_mode():
            got, want = norms.FusedRMSNorm(norm, 1e-6, offset)(x), norm(x)
        assert got.dtype == want.dtype == dtype and got.shape == want.shape
        if dtype == torch.bfloat16:
            ulp = 2.0 ** (torch.frexp(want.float()).exponent - 8).float()  # one unit in a bf16's last place
            assert ((got.float() - want.float()).abs() <= ulp).all() and (got == want).float().mean() >= 0.99
        else:
            assert torch.allclose(got, want, rtol=4e-7, atol=0)


def test_a_rows_output_does_not_depend_on_the_other_rows():
    norm = random_norm(LlamaRMSNorm, 576, torch.bfloat16, seed=1)
    x = torch.randn(1, 100, 576).to(torch.bfloat16)  # 100 rows: the kernel's threads split them
    with torch.inference_mode():
        wide = layer_kernels.rms_norm(x, norm.weight, 1e-6, 0)
        assert all(torch.equal(layer_kernels.rms_norm(x[:, i:i + 1], norm.weight, 1e-6, 0)[0, 0], wide[0, i]) for i in range(100))


class OddRMSNorm(nn.Module):
    """Named like an RMSNorm, computes something else (mean of |x|): the check on load must keep it."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(n)), 1e-6

    def forward(self, x):
        return self.weight * x / (x.abs().mean(-1, keepdim=True) + self.eps)


def test_fuse_swaps_only_what_it_computes():
    model = nn.Sequential(LlamaRMSNorm(32), OddRMSNorm(32), nn.LayerNorm(32), Gemma3RMSNorm(32))
    with torch.no_grad():
        model[3].weight.normal_()  # Gemma's weight starts at 0 (its scale is 1 + w)
    stock = copy.deepcopy(model)
    assert norms.fuse(model, torch.float32) == 2
    assert [type(m).__name__ for m in model] == ["FusedRMSNorm", "OddRMSNorm", "LayerNorm", "FusedRMSNorm"]
    assert [m.offset for m in (model[0], model[3])] == [0, 1]
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():  # fp32 rounding at the outputs' scale (~1): rtol alone failed 3 in 200 inputs at an output near 0
        assert torch.allclose(model(x), stock(x), rtol=1e-5, atol=1e-6)


def test_a_norm_whose_weight_is_of_another_dtype_stays():
    model = nn.Sequential(nn.Linear(16, 16).to(torch.bfloat16), LlamaRMSNorm(16))  # the norm's weight left fp32
    assert norms.fuse(model, torch.bfloat16) == 0 and type(model[1]) is LlamaRMSNorm


@pytest.mark.parametrize("build", [tiny_llama, tiny_gemma3])
def test_packed_models_norms_are_fused_and_bf16_logits_are_the_stock_norms(build, monkeypatch):
    """A packed model's norms are fused (Gemma 3's q/k head norms too), and its logits are the ones it gives with the
    stock norms, to bf16 rounding (in stock layers: a ``FusedLayer`` calls our norm kernel itself)."""
    model = build().to(torch.bfloat16)
    count = sum(type(m).__name__.endswith("RMSNorm") for m in model.modules())
    unfused = copy.deepcopy(model)
    report = kernels.pack(model)
    assert report.norms == count == sum(isinstance(m, norms.FusedRMSNorm) for m in model.modules()) > 0
    monkeypatch.setattr(layers, "fuse", lambda model, attend: 0)
    kernels.pack(unfused)
    for parent in list(unfused.modules()):  # the same packed model with its norms put back
        for name, child in list(parent.named_children()):
            if isinstance(child, norms.FusedRMSNorm):
                stock = (Gemma3RMSNorm if child.offset else LlamaRMSNorm)(child.weight.numel(), eps=child.eps)
                stock.weight = child.weight
                setattr(parent, name, stock)
    ids = torch.tensor([[3, 9, 27, 81, 5, 7, 11, 13, 17, 19]])
    with torch.inference_mode():
        got, want = model(ids).logits.float(), unfused(ids).logits.float()
    assert torch.allclose(got, want, rtol=2 ** -6, atol=2 ** -6) and not torch.equal(got, torch.zeros_like(got))
