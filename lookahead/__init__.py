"""Lossless Lookahead (Jacobi) decoding for Hugging Face causal LMs: faster, no draft model, same output."""

from lookahead.config import LookaheadConfig
from lookahead.drafting import DraftState
from lookahead.generator import GenerationResult, LookaheadGenerator
from lookahead.hf import custom_generate
from lookahead.stats import GenerationStats
from lookahead.curve import CostCurve

__all__ = ["CostCurve", "DraftState", "GenerationResult", "GenerationStats", "LookaheadConfig", "LookaheadGenerator", "custom_generate"]
