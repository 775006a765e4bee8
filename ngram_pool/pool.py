"""``NGramPool``: a thin owner of the kernel buffers (see ``kernels.py`` for their layout)."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ngram_pool import kernels
from ngram_pool.files import ArrayFile, written_whole

FORMAT_VERSION = 1
_INITIAL_SPARSE_ROWS = 256
_IDS = (np.dtype(np.int32), np.dtype(np.int64))  # the id arrays' types the kernels are compiled for


class Origin(enum.IntEnum):
    """Where a stored n-gram came from; kept per n-gram so an engine can report acceptance by origin."""

    TRAJECTORY = 0  # harvested from the Jacobi (lookahead) trajectories
    PROMPT = 1  # an n-gram of the prompt
    OUTPUT = 2  # an n-gram of text generated earlier


@dataclass(frozen=True)
class PoolStats:
    keys_used: int  # keys with at least one stored n-gram
    ngrams_stored: int
    hits: int  # lookups that returned at least one candidate
    misses: int  # lookups that returned none


def _as_ids(name: str, value: object, ndim: int) -> np.ndarray:
    """A C-contiguous, writable int32 or int64 array: one kernel specialization each, all compiled by the
    warm-ups (a read-only view, such as a one-row ``sliding_window_view``, would be another); range is checked
    in the kernels. Such an array comes back as it is, after the fewest checks (a decode step makes several calls)."""
    arr = np.asarray(value)
    flags = arr.flags
    if arr.dtype in _IDS and arr.ndim == ndim and flags.c_contiguous and flags.writeable:
        return arr
    if arr.dtype.kind not in "iu":
        if arr.size:
            raise ValueError(f"{name} must hold integer token ids, got dtype {arr.dtype}")
        arr = arr.astype(np.int64)
    if arr.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {arr.shape}")
    return np.require(arr if arr.dtype in _IDS else arr.astype(np.int64), requirements="CW")  # a copy only where needed


def _check_origin(origin: int) -> None:
    """An origin code is stored in a table column of its own: 0 .. 255."""
    if not 0 <= origin <= 255:
        raise ValueError(f"origin must be in [0, 255], got {origin}")


class NGramPool:
    """N-grams of length ``n`` keyed by their first token; up to ``slots_per_key`` continuations per key.

    Continuations of a key are kept most recently used first and deduplicated; a full key evicts its
    least recently used n-gram. Memory (dense): ``vocab_size * slots_per_key * n * 4`` bytes for the
    table plus ``vocab_size * 4`` for the counts, e.g. 128k vocab x 16 slots x n=5 -> 42 MB. With
    ``sparse=True`` a row is allocated only for keys that are actually inserted (the table grows by
    doubling), which costs ``vocab_size * 4`` bytes for the key index plus the rows in use.
    """

    _warm = False

    def __init__(self, vocab_size: int, n: int, slots_per_key: int = 16, *, sparse: bool = False) -> None:
        for name, value, low in (("vocab_size", vocab_size, 1), ("n", n, 2), ("slots_per_key", slots_per_key, 1)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        if vocab_size > np.iinfo(np.int32).max:
            raise ValueError(f"vocab_size must fit in int32, got {vocab_size}")
        self.vocab_size, self.n, self.slots_per_key = int(vocab_size), int(n), int(slots_per_key)
        self.sparse = bool(sparse)
        rows = min(_INITIAL_SPARSE_ROWS, self.vocab_size) if self.sparse else self.vocab_size
        self._table = np.zeros((rows, self.slots_per_key, self.n), dtype=np.int32)
        self._counts = np.zeros(rows, dtype=np.int32)
        self._row_of = np.full(self.vocab_size, -1, dtype=np.int32) if self.sparse else np.arange(rows, dtype=np.int32)
        self._rows_used = 0 if self.sparse else rows
        self.hits = self.misses = 0
        self._warm_up()

    @classmethod
    def _warm_up(cls) -> None:
        """Compile (or load from numba's on-disk cache) every kernel once per process, off the hot path."""
        if cls._warm:
            return
        table, counts, row_of = np.zeros((1, 1, 2), np.int32), np.zeros(1, np.int32), np.zeros(1, np.int32)
        for dtype in (np.int32, np.int64):
            grams = np.zeros((1, 2), dtype)
            kernels.missing_keys(row_of, grams[:, 0].copy())
            kernels.insert_ngrams(table, counts, row_of, grams, 0)
            kernels.insert_windows(table, counts, row_of, grams[0], np.ones(1, np.int64), 0)
            kernels.insert_then_lookup(table, counts, row_of, grams, 0, 0, 1)
        kernels.lookup_row(table, counts, row_of, 0, 1)
        cls._warm = True

    # -- inserting ------------------------------------------------------------------------------

    def insert_many(self, ngrams: np.ndarray, origin: int = Origin.TRAJECTORY) -> int:
        """Insert a (k, n) batch of n-grams in order (later rows end up more recent); returns how many were new."""
        grams = self._prepare(ngrams, origin)
        status = kernels.insert_ngrams(self._table, self._counts, self._row_of, grams, int(origin))
        return int(np.count_nonzero(status))

    def insert_and_lookup(
        self, ngrams: np.ndarray, key: int, max_candidates: int, origin: int = Origin.TRAJECTORY
    ) -> tuple[np.ndarray, np.ndarray]:
        """``insert_many`` then ``lookup_with_origins`` in one kernel call: a decode step's pool work."""
        grams = self._prepare(ngrams, origin)
        self._check_lookup(key, max_candidates)
        rows = kernels.insert_then_lookup(self._table, self._counts, self._row_of, grams, int(origin), key, max_candidates)
        return self._split(rows)

    def _prepare(self, ngrams: np.ndarray, origin: int) -> np.ndarray:
        grams = _as_ids("ngrams", ngrams, 2)
        if grams.shape[1] != self.n:
            raise ValueError(f"ngrams must have shape (k, {self.n}), got {grams.shape}")
        _check_origin(origin)
        if self.sparse:
            self._add_rows(kernels.missing_keys(self._row_of, grams[:, 0].copy()))
        return grams

    def insert_sequence(self, tokens: np.ndarray | list[int], origin: int = Origin.PROMPT) -> int:
        """Insert every n-gram of a token sequence (shorter than n: nothing); returns how many were new."""
        return self.insert_sequences([tokens], origin)

    def insert_sequences(self, sequences: list[np.ndarray | list[int]], origin: int = Origin.PROMPT) -> int:
        """Insert every n-gram of each sequence, in order, in one kernel call; returns how many were new."""
        _check_origin(origin)
        parts = [_as_ids("tokens", tokens, 1) for tokens in sequences]
        if not parts:
            return 0
        tokens = parts[0] if len(parts) == 1 else _as_ids("tokens", np.concatenate(parts), 1)
        ends = np.cumsum([part.size for part in parts], dtype=np.int64)
        if self.sparse:  # the keys: every token with n - 1 after it in its own sequence
            keys = np.concatenate([part[: max(part.size - self.n + 1, 0)] for part in parts])
            self._add_rows(kernels.missing_keys(self._row_of, keys))
        return kernels.insert_windows(self._table, self._counts, self._row_of, tokens, ends, int(origin))

    def _add_rows(self, keys: np.ndarray) -> None:
        """Give each key a row of its own, doubling the table when it is full (sparse pools only)."""
        if keys.size == 0:
            return
        need = self._rows_used + keys.size
        if need > self._table.shape[0]:
            rows = max(need, 2 * self._table.shape[0])
            self._table = np.concatenate([self._table, np.zeros((rows - self._table.shape[0],) + self._table.shape[1:], np.int32)])
            self._counts = np.concatenate([self._counts, np.zeros(rows - self._counts.size, np.int32)])
        self._row_of[keys] = np.arange(self._rows_used, need, dtype=np.int32)
        self._rows_used = need

    # -- looking up -----------------------------------------------------------------------------

    def lookup_with_origins(self, key: int, max_candidates: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Candidates for ``key`` most recent first: an (m, n-1) int32 array and their (m,) origins."""
        limit = self.slots_per_key if max_candidates is None else max_candidates
        self._check_lookup(key, limit)
        return self._split(kernels.lookup_row(self._table, self._counts, self._row_of, key, limit))

    @staticmethod
    def _check_lookup(key: int, max_candidates: int) -> None:
        # the kernel checks the key's range; here only what numba cannot take
        if type(key) is not int and not isinstance(key, np.integer):
            raise ValueError(f"key must be an integer token id, got {key!r}")
        if type(max_candidates) is not int and not isinstance(max_candidates, np.integer) or max_candidates < 0:
            raise ValueError(f"max_candidates must be an integer >= 0, got {max_candidates!r}")

    def _split(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Kernel rows (m, n) -> continuations (m, n-1) and origins (m,); counts the hit or miss."""
        if rows.shape[0]:
            self.hits += 1
        else:
            self.misses += 1
        return rows[:, :-1], rows[:, -1]

    def lookup(self, key: int, max_candidates: int | None = None) -> np.ndarray:
        """Candidates for ``key`` (the n-1 tokens after it), most recent first, as an (m, n-1) int32 array."""
        return self.lookup_with_origins(key, max_candidates)[0]

    @property
    def stats(self) -> PoolStats:
        counts = self._counts[: self._rows_used]
        return PoolStats(int(np.count_nonzero(counts)), int(counts.sum()), self.hits, self.misses)

    @property
    def nbytes(self) -> int:
        return self._table.nbytes + self._counts.nbytes + self._row_of.nbytes

    # -- persistence ----------------------------------------------------------------------------

    def save(self, path: str | Path) -> None:
        """Write a portable ``.npz`` (plain arrays, no pickle), whole or not at all; only the rows in use are stored."""
        used = self._rows_used
        with written_whole(path) as out:
            np.savez_compressed(
                out,
                format_version=np.int64(FORMAT_VERSION),
                shape=np.array([self.vocab_size, self.n, self.slots_per_key, int(self.sparse)], np.int64),
                hit_miss=np.array([self.hits, self.misses], np.int64),
                table=self._table[:used],
                counts=self._counts[:used],
                row_of=self._row_of,
            )

    @classmethod
    def load(cls, path: str | Path, vocab_size: int | None = None, n: int | None = None) -> "NGramPool":
        """Read a pool written by ``save``: every field is checked against the header (and ``vocab_size``, ``n`` when
        given) before the pool is allocated, so a truncated, corrupt, hostile or mismatched file is a ``ValueError``
        naming the field, never a failure later in a kernel."""
        with ArrayFile(path, "n-gram pool") as f:
            version = f.scalar("format_version")
            f.check("format_version", version == FORMAT_VERSION, f"unsupported version {version} (expected {FORMAT_VERSION})")
            file_vocab, file_n, slots, sparse = (int(v) for v in f.array("shape", np.int64, (4,)))
            f.check("shape", 1 <= file_vocab <= np.iinfo(np.int32).max and 2 <= file_n and 1 <= slots and sparse in (0, 1),
                    f"not a pool's (vocab_size, n, slots_per_key, sparse): {(file_vocab, file_n, slots, sparse)}")
            f.check("shape", vocab_size is None or vocab_size == file_vocab, f"built for vocab_size={file_vocab}, not {vocab_size}")
            f.check("shape", n is None or n == file_n, f"holds {file_n}-grams, not {n}-grams")
            hits_misses = f.array("hit_miss", np.int64, (2,))
            f.check("hit_miss", (hits_misses >= 0).all(), "negative counts")
            row_of = f.array("row_of", np.int32, (file_vocab,))
            counts = f.array("counts", np.int32, (None,) if sparse else (file_vocab,))
            used = counts.size
            table = f.array("table", np.int32, (used, slots, file_n))
            f.check("counts", used <= file_vocab and ((counts >= 0) & (counts <= slots)).all(), f"outside [0, {slots}]")
            f.check("table", ((table[..., :-1] >= 0) & (table[..., :-1] < file_vocab)).all(), f"a token id outside [0, {file_vocab})")
            f.check("table", ((table[..., -1] >= 0) & (table[..., -1] <= 255)).all(), "an origin code outside [0, 255]")
            if sparse:
                keyed = row_of[row_of >= 0]
                f.check("row_of", ((row_of >= -1) & (row_of < used)).all() and np.unique(keyed).size == keyed.size,
                        f"a key's row outside [-1, {used}) or shared by two keys")
            else:
                f.check("row_of", np.array_equal(row_of, np.arange(file_vocab)), "not a dense pool's key index")
        pool = cls(file_vocab, file_n, slots, sparse=bool(sparse))
        if sparse:
            pool._table, pool._counts, pool._rows_used = table.copy(), counts.copy(), used
        else:
            pool._table[:], pool._counts[:] = table, counts
        pool._row_of[:] = row_of
        pool.hits, pool.misses = (int(v) for v in hits_misses)
        return pool
