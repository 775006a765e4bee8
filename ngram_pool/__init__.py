"""A standalone, Numba-accelerated n-gram pool on numpy arrays (numpy and numba only: no torch)."""

from ngram_pool.pool import FORMAT_VERSION, NGramPool, PoolStats, Source

__all__ = ["FORMAT_VERSION", "NGramPool", "PoolStats", "Source"]
