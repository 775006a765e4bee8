"""A pure-Python pool with the semantics of ``NGramPool``: the oracle for property tests and the
baseline of the pool microbenchmark (it is how the public reference implementation keeps its pool)."""

from __future__ import annotations


class PyNGramPool:
    """Dict of lists: key -> continuations (tuples), most recent first, at most ``slots_per_key``."""

    def __init__(self, n: int, slots_per_key: int) -> None:
        self.n, self.slots_per_key = n, slots_per_key
        self.rows: dict[int, list[tuple[int, ...]]] = {}
        self.sources: dict[tuple[int, ...], int] = {}

    def insert_many(self, ngrams, source: int = 0) -> int:
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
            self.sources[(key,) + cont] = source
        return new

    def lookup(self, key: int, max_candidates: int) -> list[tuple[int, ...]]:
        return self.rows.get(key, [])[:max_candidates]
