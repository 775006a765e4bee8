"""Lossless Lookahead (Jacobi) decoding for Hugging Face causal LMs: faster, no draft model, same output.

The names below are imported on first use: a process that needs one module (``lookahead.drafting`` in a state
file's check, ``lookahead.vllm`` in vLLM's engine) does not import torch and transformers for it (~6 s)."""

from __future__ import annotations

import importlib

_HOMES = {"CostCurve": "curve", "DraftState": "drafting", "GenerationResult": "generator", "GenerationStats": "stats",
          "LookaheadConfig": "config", "LookaheadGenerator": "generator", "custom_generate": "hf"}

__all__ = ["CostCurve", "DraftState", "GenerationResult", "GenerationStats", "LookaheadConfig", "LookaheadGenerator", "custom_generate"]


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'lookahead' has no attribute {name!r}")
    value = globals()[name] = getattr(importlib.import_module(f"lookahead.{_HOMES[name]}"), name)  # found once
    return value
