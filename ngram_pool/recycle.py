"""Token recycling (Luo et al., 2025): every forward's top-k predictions, kept as token -> likeliest successors.

    table  (vocab, k)  int32   row t: the k tokens the model last ranked likeliest after t, best first
                               (-1: nothing seen yet); each occurrence of t overwrites its row

A draft tree is grown from the table along a fixed template: template node i is the ``ranks[i]``-th
successor of its parent's token (the root's parent: the current token). The template is chosen to
maximise the expected number of accepted nodes for measured per-rank acceptance rates (``template``).

    template (rates .6 .3, 5 nodes)      expansion from current token c
        c                                    c         table[c] = [7 3], table[7] = [9 2],
      0/  \\1                               / \\        table[9] = [4 ...]
      n0   n1     n0 = rank 0 of c          7   3
     0/ \\1                                / \\
     n2  n3                              9   2
    0/
    n4                                  4
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from numba import njit

from ngram_pool.files import ArrayFile, written_whole
from ngram_pool.kernels import check_ids
from ngram_pool.pool import _as_ids

FORMAT_VERSION = 1


@njit(cache=True)
def update_table(table: np.ndarray, tokens: np.ndarray, successors: np.ndarray) -> np.ndarray:
    """Row ``tokens[i]`` of ``table`` <- ``successors[i]`` (first k' columns), in order: later rows win.

    Returns ``tokens``; ids are checked first (``ValueError``, nothing written)."""
    vocab = table.shape[0]
    check_ids(tokens, vocab)
    check_ids(successors, vocab)
    width = min(successors.shape[1], table.shape[1])
    for i in range(tokens.size):
        for r in range(width):
            table[tokens[i], r] = successors[i, r]
    return tokens


@njit(cache=True)
def rank_then_update(table: np.ndarray, before: np.ndarray, after: np.ndarray, k: int, tokens: np.ndarray,
                     successors: np.ndarray) -> np.ndarray:
    """(2, k) counts by rank r < k, over the pairs (before[i], after[i]): [0] how many had an r-th successor in
    ``table``, [1] how many of those were ``after[i]``; then ``update_table`` with (``tokens``, ``successors``).
    Counted against the table as it was before the update. Ids are checked first."""
    check_ids(before, table.shape[0])
    counts = np.zeros((2, k), np.int64)
    for i in range(before.size):
        for r in range(min(k, table.shape[1])):
            s = table[before[i], r]
            if s >= 0:
                counts[0, r] += 1
                counts[1, r] += s == after[i]
    update_table(table, tokens, successors)
    return counts


@njit(cache=True)
def expand_template(table: np.ndarray, root: int, parents: np.ndarray, ranks: np.ndarray) -> np.ndarray:
    """Tokens (M,) of a template's nodes grown from ``root``: node i = table[its parent's token, ranks[i]]; -1
    where the table has no such successor (and below it)."""
    out = np.empty(parents.size, np.int64)
    for i in range(parents.size):
        parent = root if parents[i] < 0 else out[parents[i]]
        out[i] = -1 if parent < 0 else table[parent, ranks[i]]
    return out


@njit(cache=True)
def best_template(rank_rates: np.ndarray, size: int, max_depth: int) -> np.ndarray:
    """(K, 3) int64 rows (parent, rank, depth) of the ``size`` nodes with the highest expected acceptance,
    parents first, by depth: a node's expectation is the product of its path's rank rates."""
    k = rank_rates.size
    parent = np.empty(size, np.int64)
    rank = np.empty(size, np.int64)
    depth = np.empty(size, np.int64)
    score = np.empty(size, np.float64)
    # the frontier: children not taken yet, at most one per (taken node or root) and rank
    f_parent = np.empty(size * k + k, np.int64)
    f_rank = np.empty(size * k + k, np.int64)
    f_depth = np.empty(size * k + k, np.int64)
    f_score = np.empty(size * k + k, np.float64)
    nf = 0
    if max_depth >= 1:
        for r in range(k):
            f_parent[nf], f_rank[nf], f_depth[nf], f_score[nf] = -1, r, 1, rank_rates[r]
            nf += 1
    n = 0
    while n < size and nf > 0:
        best = 0
        for i in range(1, nf):
            if f_score[i] > f_score[best]:
                best = i
        parent[n], rank[n], depth[n], score[n] = f_parent[best], f_rank[best], f_depth[best], f_score[best]
        nf -= 1
        f_parent[best], f_rank[best], f_depth[best], f_score[best] = f_parent[nf], f_rank[nf], f_depth[nf], f_score[nf]
        if depth[n] < max_depth:
            for r in range(k):
                f_parent[nf], f_rank[nf], f_depth[nf], f_score[nf] = n, r, depth[n] + 1, score[n] * rank_rates[r]
                nf += 1
        n += 1
    # lay out by depth (a stable sort keeps the score order within a depth), parents re-indexed
    order = np.argsort(depth[:n], kind="mergesort")
    index = np.empty(n, np.int64)
    for i in range(n):
        index[order[i]] = i
    out = np.empty((n, 3), np.int64)
    for i in range(n):
        j = order[i]
        out[i, 0] = -1 if parent[j] < 0 else index[parent[j]]
        out[i, 1] = rank[j]
        out[i, 2] = depth[j]
    return out


def template(rank_rates: np.ndarray, size: int, max_depth: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The best template of ``size`` nodes for acceptance rates by rank (k,): parents, ranks, depths (K,)."""
    rates = np.ascontiguousarray(rank_rates, dtype=np.float64)
    if rates.ndim != 1 or not ((rates >= 0) & (rates <= 1)).all():
        raise ValueError(f"rank_rates must be a 1-D array of probabilities, got {rank_rates!r}")
    for name, value in (("size", size), ("max_depth", max_depth)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
            raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
    rows = best_template(rates, int(size), int(max_depth))
    return rows[:, 0].copy(), rows[:, 1].copy(), rows[:, 2].copy()


def _rows(tokens: np.ndarray, successors: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """An update's input tokens (R,) and their ranked next tokens (R, k'), checked as id arrays of one row a token."""
    tokens, successors = _as_ids("tokens", tokens, 1), _as_ids("successors", successors, 2)
    if successors.shape[0] != tokens.size:
        raise ValueError(f"successors must have one row per token, got {successors.shape} for {tokens.size} tokens")
    return tokens, successors


class RecycleTable:
    """Owner of the (vocab, k) successor table. Memory: ``vocab_size * k * 4`` bytes (128k x 8: 4 MB)."""

    _warm = False

    def __init__(self, vocab_size: int, k: int = 8) -> None:
        for name, value in (("vocab_size", vocab_size), ("k", k)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        self.vocab_size, self.k = int(vocab_size), int(k)
        self.table = np.full((self.vocab_size, self.k), -1, np.int32)
        self._warm_up()

    @classmethod
    def _warm_up(cls) -> None:
        """Compile (or load from numba's on-disk cache) every kernel once per process, off the hot path."""
        if cls._warm:
            return
        for dtype in (np.int32, np.int64):
            update_table(np.zeros((1, 1), np.int32), np.zeros(1, dtype), np.zeros((1, 1), dtype))
            rank_then_update(np.zeros((1, 1), np.int32), np.zeros(1, dtype), np.zeros(1, dtype), 1, np.zeros(1, dtype), np.zeros((1, 1), dtype))
        expand_template(np.zeros((1, 1), np.int32), 0, np.full(1, -1, np.int64), np.zeros(1, np.int64))
        best_template(np.ones(1), 1, 1)
        cls._warm = True

    def update(self, tokens: np.ndarray, successors: np.ndarray) -> None:
        """Rows (R,) of input tokens and (R, k') of their ranked next tokens; later rows overwrite earlier ones."""
        update_table(self.table, *_rows(tokens, successors))

    def rank_then_update(self, before: np.ndarray, after: np.ndarray, k: int, tokens: np.ndarray,
                         successors: np.ndarray) -> np.ndarray:
        """How the table ranked what came: (2, k) counts by rank r, over the pairs (``before[i]``, ``after[i]``) of a
        token and the one that followed it, [0] how many pairs had an r-th successor, [1] how many of those
        were ``after[i]``. Then ``update``. One kernel call (a decode step's)."""
        before, after = _as_ids("before", before, 1), _as_ids("after", after, 1)
        if before.size != after.size:
            raise ValueError(f"after must have one token per token before, got {after.size} for {before.size}")
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 0:
            raise ValueError(f"k must be an integer >= 0, got {k!r}")
        return rank_then_update(self.table, before, after, int(k), *_rows(tokens, successors))

    def expand(self, root: int, parents: np.ndarray, ranks: np.ndarray) -> np.ndarray:
        """Tokens (M,) of the template (``parents``, ``ranks``) grown from ``root``; -1 where the table is empty."""
        parents, ranks = _as_ids("parents", parents, 1).astype(np.int64), _as_ids("ranks", ranks, 1).astype(np.int64)
        if not 0 <= root < self.vocab_size:
            raise ValueError(f"root {root} is outside the vocabulary [0, {self.vocab_size})")
        if parents.size != ranks.size or (ranks < 0).any() or (ranks >= self.k).any() \
                or (parents >= np.arange(parents.size)).any() or (parents < -1).any():
            raise ValueError("a template needs parents before children and ranks below k")
        return expand_template(self.table, int(root), parents, ranks)

    def fill_empty(self, successors: np.ndarray) -> None:
        """Rows 0 .. R-1 that hold nothing yet take ``successors`` (R, k') (a prior: what is learned stays)."""
        successors = _as_ids("successors", successors, 2)
        if successors.shape[0] > self.vocab_size or (successors >= self.vocab_size).any() or (successors < -1).any():
            raise ValueError(f"successors must be at most {self.vocab_size} rows of ids in [-1, {self.vocab_size}), "
                             f"got shape {successors.shape}")
        rows, k = successors.shape[0], min(successors.shape[1], self.k)
        empty = self.table[:rows, 0] < 0
        self.table[:rows][empty, :k] = successors[empty, :k]

    def save(self, path: str | Path) -> None:
        """Write a portable ``.npz``, whole or not at all."""
        with written_whole(path) as out:
            np.savez_compressed(out, format_version=np.int64(FORMAT_VERSION), table=self.table)

    @classmethod
    def load(cls, path: str | Path, vocab_size: int | None = None) -> "RecycleTable":
        """Read a table written by ``save``, checked (and against ``vocab_size`` when given) before it is allocated:
        a corrupt, hostile or mismatched file raises ``ValueError`` naming the field."""
        with ArrayFile(path, "recycling table") as f:
            version = f.scalar("format_version")
            f.check("format_version", version == FORMAT_VERSION, f"unsupported version {version} (expected {FORMAT_VERSION})")
            table = f.array("table", np.int32, (vocab_size, None))
            f.check("table", table.shape[0] >= 1 and table.shape[1] >= 1, f"empty shape {table.shape}")
            f.check("table", ((table >= -1) & (table < table.shape[0])).all(), f"a token id outside [-1, {table.shape[0]})")
        out = cls(table.shape[0], table.shape[1])
        out.table[:] = table
        return out
