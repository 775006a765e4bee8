"""The test oracle of exactness: where greedy decoding may part from stock ``generate()`` without a bug (the
benchmarks check their runs with it too)."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from lookahead import kv

TIE = 1e-4  # fp32: top-2 logits closer than this are a tie


def is_tie(model, prompt: list[int], generated: list[int]) -> bool:
    """Whether the reference's top-2 next-token logits after ``prompt + generated`` are a numerical tie.

    fp32: their margin is below 1e-4. bf16/fp16: their margin is within the rounding noise of that very step,
    measured as the largest logit difference between two computation orders of it: one forward over the
    whole sequence, and generate()'s order (the prompt, then one generated token at a time against the cache).
    """
    with torch.inference_mode():
        whole = model(input_ids=torch.tensor([prompt + generated], device=model.device), logits_to_keep=1).logits[0, -1].float()
        top = whole.topk(2).values
        if model.dtype == torch.float32:
            return float(top[0] - top[1]) < TIE
        cache = DynamicCache(config=model.config)
        stepwise = model(input_ids=torch.tensor([prompt], device=model.device), **kv.cache_kwarg(model, cache), logits_to_keep=1).logits[0, -1]
        for token in generated:
            stepwise = model(input_ids=torch.tensor([[token]], device=model.device), **kv.cache_kwarg(model, cache)).logits[0, -1]
    return float(top[0] - top[1]) <= float((whole - stepwise.float()).abs().max())
