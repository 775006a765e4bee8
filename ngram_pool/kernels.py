"""Numba kernels of the n-gram pool.

Every kernel is a module-level ``@njit`` function over numpy arrays and ints and always returns an
array (possibly empty), never ``None``. The buffers they work on are owned by ``NGramPool``:

    table   (rows, slots, n)  int32  per key row: its stored n-grams, most recently used first;
                                     columns 0..n-2 are the continuation (the n-gram minus its key),
                                     column n-1 is the origin code of the last insertion
    counts  (rows,)           int32  how many slots of each row are filled
    row_of  (vocab,)          int32  key token -> row of ``table`` (-1: no row yet, sparse pools only)

A row is a move-to-front list: inserting an n-gram puts it in slot 0, shifting the newer ones down;
when the row is full the last slot (the least recently used n-gram) falls off. Reinserting a stored
n-gram moves it back to the front, so a row never holds duplicates.
"""

from __future__ import annotations

import numpy as np
from numba import njit

NEW = 1  # status of an n-gram that was not in the pool
REFRESHED = 0  # status of an n-gram that was already stored and moved to the front


@njit(cache=True)
def check_ids(ids: np.ndarray, vocab_size: int) -> np.ndarray:
    """Raise ``ValueError`` naming the first id outside [0, vocab_size); returns ``ids`` unchanged."""
    flat = ids.ravel()
    for i in range(flat.size):
        if flat[i] < 0 or flat[i] >= vocab_size:
            raise ValueError("token id " + str(flat[i]) + " is outside the vocabulary [0, " + str(vocab_size) + ")")
    return ids


@njit(cache=True)
def missing_keys(row_of: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """The distinct keys that have no row yet, in order of first appearance."""
    check_ids(keys, row_of.size)
    out = np.empty(keys.size, dtype=np.int32)
    m = 0
    for i in range(keys.size):
        k = keys[i]
        if row_of[k] >= 0:
            continue
        seen = False
        for j in range(m):
            if out[j] == k:
                seen = True
                break
        if not seen:
            out[m] = k
            m += 1
    return out[:m]


@njit(cache=True)
def _insert(table: np.ndarray, counts: np.ndarray, row_of: np.ndarray, gram: np.ndarray, origin: int) -> int:
    """Insert one n-gram ``gram`` (n,) (its key has a row); returns NEW or REFRESHED."""
    n, slots = gram.size, table.shape[1]
    row = row_of[gram[0]]
    filled = counts[row]
    # 1. find the n-gram among the stored ones (hit) or pick the slot that falls off (miss)
    at = -1
    for s in range(filled):
        same = True
        for t in range(n - 1):
            if table[row, s, t] != gram[t + 1]:
                same = False
                break
        if same:
            at = s
            break
    status = REFRESHED
    if at < 0:
        status = NEW
        at = filled if filled < slots else slots - 1
        if filled < slots:
            counts[row] = filled + 1
    # 2. move slots 0..at-1 one down and write the n-gram into slot 0
    for s in range(at, 0, -1):
        for t in range(n):
            table[row, s, t] = table[row, s - 1, t]
    for t in range(n - 1):
        table[row, 0, t] = gram[t + 1]
    table[row, 0, n - 1] = origin
    return status


@njit(cache=True)
def insert_ngrams(
    table: np.ndarray, counts: np.ndarray, row_of: np.ndarray, ngrams: np.ndarray, origin: int
) -> np.ndarray:
    """Insert a (k, n) batch in order; returns a (k,) int8 status array (NEW or REFRESHED).

    Ids are checked first (``ValueError``, nothing inserted); every key must already have a row.
    """
    check_ids(ngrams, row_of.size)
    status = np.empty(ngrams.shape[0], dtype=np.int8)
    for i in range(ngrams.shape[0]):
        status[i] = _insert(table, counts, row_of, ngrams[i], origin)
    return status


@njit(cache=True)
def insert_windows(
    table: np.ndarray, counts: np.ndarray, row_of: np.ndarray, tokens: np.ndarray, ends: np.ndarray, origin: int
) -> int:
    """Insert every n-gram (window of n = ``table.shape[2]`` tokens) of each sequence in order: sequence i is
    ``tokens[ends[i - 1]:ends[i]]`` (``ends`` cumulative). Returns how many were new (a count, not ``insert_ngrams``'
    statuses: a decode step's caller wants no array back); one call where the windows built in numpy took several
    a step. Ids are checked first; every key has a row."""
    check_ids(tokens, row_of.size)
    n = table.shape[2]
    new, start = 0, 0
    for end in ends:
        for first in range(start, end - n + 1):
            new += _insert(table, counts, row_of, tokens[first : first + n], origin) == NEW
        start = end
    return new


@njit(cache=True)
def lookup_row(table: np.ndarray, counts: np.ndarray, row_of: np.ndarray, key: int, max_candidates: int) -> np.ndarray:
    """The stored n-grams of ``key``, most recent first: an (m, n) array of continuation + origin column."""
    if key < 0 or key >= row_of.size:
        raise ValueError("key " + str(key) + " is outside the vocabulary [0, " + str(row_of.size) + ")")
    row = row_of[key]
    if row < 0:
        return np.empty((0, table.shape[2]), dtype=np.int32)
    m = min(counts[row], max_candidates)
    return table[row, :m].copy()


@njit(cache=True)
def insert_then_lookup(
    table: np.ndarray, counts: np.ndarray, row_of: np.ndarray, ngrams: np.ndarray, origin: int, key: int, max_candidates: int
) -> np.ndarray:
    """One decode step's pool work in one call: insert a batch, then look up the next key."""
    insert_ngrams(table, counts, row_of, ngrams, origin)
    return lookup_row(table, counts, row_of, key, max_candidates)
