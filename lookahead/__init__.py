"""Lossless Lookahead (Jacobi) decoding for Hugging Face causal LMs: faster, no draft model, same output."""

from lookahead.config import LookaheadConfig
from lookahead.generator import GenerationResult, GenerationStats, LookaheadGenerator

__all__ = ["GenerationResult", "GenerationStats", "LookaheadConfig", "LookaheadGenerator"]
