"""Standalone, Numba-accelerated drafting structures on numpy arrays (numpy and numba only: no torch):
an n-gram pool, a suffix matcher and a token-recycling table."""

from ngram_pool.pool import FORMAT_VERSION, NGramPool, PoolStats, Origin
from ngram_pool.recycle import RecycleTable, template
from ngram_pool.suffix import SuffixDrafter

__all__ = ["FORMAT_VERSION", "NGramPool", "PoolStats", "RecycleTable", "Origin", "SuffixDrafter", "template"]
