"""A pure-Python pool with the semantics of ``NGramPool``: the oracle for property tests and the
baseline of the pool microbenchmark (it is how the public reference implementation keeps its pool)."""

from __future__ import annotations


class PyNGramPool:
    """Dict of lists: key -> continuations (tuples), most recent first, at most ``slots_per_key``."""

    def __init__(self, n: int, slots_per_key: int) -> None:
        self.n, self.slots_per_key = n, slots_per_key
        self.rows: dict[int, list[tuple[int, ...]]] = {}
        self.origins: dict[tuple[int, ...], int] = {}

    def insert_many(self, ngrams, origin: int = 0) -> int:
        new = 0
        for gram in ngrams:
            key, cont = int(gram[0]), tuple(int(t) for t in gram[1:])
            row = self.rows.setdefault(key, [])
            if cont in row:
                row.remove(cont)
            else:
                new += 1
                if len(row) == self.slots_per_key:
                    row.pop()
            row.insert(0, cont)
            self.origins[(key,) + cont] = origin
        return new

    def lookup(self, key: int, max_candidates: int) -> list[tuple[int, ...]]:
        return self.rows.get(key, [])[:max_candidates]


def py_suffix_drafts(seq: list[int], max_match: int, max_drafts: int, max_len: int, tokens_per_match: int) -> list[tuple[list[int], int]]:
    """``suffix_drafts`` the slow way: (draft, match length) pairs, longest match first, then most recent."""
    last = len(seq) - 1
    matches = []
    for j in range(last - 1, -1, -1):
        k = 0
        while k < max_match and j - k >= 0 and seq[j - k] == seq[last - k]:
            k += 1
        if k:
            matches.append((-k, -j))
    out: list[tuple[list[int], int]] = []
    for neg_k, neg_j in sorted(matches):
        k, j = -neg_k, -neg_j
        draft = seq[j + 1 : j + 1 + min(max_len, k * tokens_per_match)]
        if len(out) < max_drafts and not any(d[: len(draft)] == draft for d, _ in out):
            out.append((draft, k))
    return out


class PyRecycleTable:
    """Dict of lists: token -> its successors as last written."""

    def __init__(self, k: int) -> None:
        self.k, self.rows = k, {}

    def update(self, tokens, successors) -> None:
        for t, s in zip(tokens, successors):
            row = self.rows.setdefault(int(t), [-1] * self.k)
            row[: len(s)] = [int(x) for x in s[: self.k]]

    def expand(self, root: int, parents, ranks) -> list[int]:
        out: list[int] = []
        for p, r in zip(parents, ranks):
            parent = root if p < 0 else out[p]
            out.append(-1 if parent < 0 else self.rows.get(parent, [-1] * self.k)[r])
        return out
