"""RMSNorm modules swapped for one call of our kernel (``layer_kernels.rms_norm``), as ``kernels.pack`` swaps linears.
transformers itself marks these modules as replaceable kernels (``@use_kernel_forward_from_hub("RMSNorm")``,
for its hub's kernels); here the replacement is a module swapped in on the loaded model, the modelling code
untouched.

transformers' RMSNorm modules run ~8 torch ops a call (~13 us for one SmolLM2 row on Zen 5; ours ~4 us), 61
calls a forward: ~0.5 ms of a ~10 ms bf16 step, for both loops, and a prompt's prefill. A module is swapped only
where our kernel gives its output on load: ``fuse`` runs each candidate (a leaf whose class name ends in
"RMSNorm", with a 1-D weight of the model's dtype and an ``eps`` or ``variance_epsilon``) and ``FusedRMSNorm``
in both weightings on one random input, and keeps the module as it is unless exactly one weighting agrees to
``TOLERANCE``. Only the order of the sum of squares differs from torch's: r may differ in its last bit, and so
an fp32 output; a bf16 output rarely, by one unit in its last place.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from lookahead import layer_kernels

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}  # relative, against the module's own output


class FusedRMSNorm(nn.Module):
    """An RMSNorm's forward in one kernel call; ``offset`` 0 weighs as Llama (w * dtype(x r)), 1 as Gemma 3
    (dtype(x r (1 + w))). Holds the original module's weight (no copy)."""

    def __init__(self, norm: nn.Module, eps: float, offset: int) -> None:
        super().__init__()
        self.weight, self.eps, self.offset = norm.weight, eps, offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., N) -> (..., N)
        return layer_kernels.rms_norm(x, self.weight, self.eps, self.offset)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}, weighting={'gemma' if self.offset else 'llama'}"


def fuse(model: nn.Module, dtype: torch.dtype) -> int:
    """Swap ``model``'s RMSNorm modules of ``dtype`` (in place) for ``FusedRMSNorm`` where it computes what they do;
    how many. (The dtype is given: once its linears are packed a model may have no parameter left to read it from.)"""
    return swap(model, lambda norm: _fused(norm, dtype))


def swap(model: nn.Module, replacement: Callable[[nn.Module], nn.Module | None]) -> int:
    """Replace each module of ``model`` (in place) that ``replacement`` gives a replacement for; how many."""
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if (new := replacement(child)) is not None:
                setattr(parent, name, new)
                swapped += 1
    return swapped


def _fused(norm: nn.Module, dtype: torch.dtype) -> FusedRMSNorm | None:
    if not type(norm).__name__.endswith("RMSNorm"):  # before reading any attribute: a packed linear's weight is made on reading
        return None
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    weight = getattr(norm, "weight", None)
    if (isinstance(norm, FusedRMSNorm) or next(norm.children(), None) is not None
            or not isinstance(eps, float) or not isinstance(weight, torch.Tensor) or weight.dim() != 1 or weight.dtype != dtype
            or weight.device.type != "cpu"):
        return None
    x = torch.randn(3, weight.numel(), generator=torch.Generator().manual_seed(0)).to(dtype)
    with torch.inference_mode():
        want = norm(x)
        agree = [FusedRMSNorm(norm, eps, offset) for offset in (0, 1)
                 if torch.allclose(layer_kernels.rms_norm(x, weight, eps, offset).float(), want.float(), rtol=TOLERANCE[dtype], atol=0)]
    return agree[0] if len(agree) == 1 and want.dtype == dtype else None
