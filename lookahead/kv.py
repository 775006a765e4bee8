"""KV-cache compaction through the transformers 5.x ``Cache`` API: the only module that knows cache internals."""

from __future__ import annotations

import torch
from transformers import Cache, DynamicCache, PreTrainedModel


def new_cache(model: PreTrainedModel) -> DynamicCache:
    """A dynamic cache whose sliding-window layers record their past, so a step can be rolled back past the window."""
    cache = DynamicCache(config=model.config)
    cache.activate_past_recording()
    return cache


def compact(cache: Cache, step_size: int, keep: torch.Tensor) -> None:
    """Of the ``step_size`` entries the last forward appended, keep only the rows ``keep`` (sorted, long).

    The kept rows move to the front of the step's block in every layer; ``crop`` then drops the rest
    (a negative count in transformers 5.x; sliding layers also shrink back to their window there).
    """
    kept = keep.numel()
    if not torch.equal(keep, torch.arange(kept)):  # rows 0..kept-1 are already in place
        for layer in cache.layers:
            for states in (layer.keys, layer.values):  # (batch, heads, seq, head_dim)
                start = states.shape[-2] - step_size
                states.narrow(-2, start, kept).copy_(states.narrow(-2, start, step_size).index_select(-2, keep))
    cache.crop(kept - step_size)
