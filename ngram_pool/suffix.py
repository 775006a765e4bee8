"""Suffix drafting: continue the sequence the way it continued after earlier occurrences of its last tokens.

For every earlier position j whose token equals the last token, the match length is how many tokens
before it also agree with the tokens before the last one (up to ``max_match``). The longest matches win
(the most recent among equals) and each proposes what followed it, ``tokens_per_match`` tokens per matched
token up to ``max_len``: a long match (a copied paragraph, a repeated code block) earns a long draft, as
in SuffixDecoding and prompt lookup decoding. Drafts with the same continuation are proposed once.

    sequence   a b c d x a b c ?         last tokens "a b c" (match 3) ->  draft "d x a b ..."
               0 1 2 3 4 5 6 7           last token "c" only (match 1)  ->  the same, proposed once
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ngram_pool.pool import _as_ids
from ngram_pool.kernels import check_ids


@njit(cache=True)
def suffix_drafts(seq: np.ndarray, size: int, max_match: int, max_drafts: int, max_len: int, tokens_per_match: int) -> np.ndarray:
    """(D, max_len + 1) int32 drafts after ``seq[:size]``: columns 0..max_len-1 the draft (-1 padded), the
    last its match length; best match first, D <= max_drafts."""
    out = np.full((max_drafts, max_len + 1), -1, np.int32)
    if size < 2 or max_drafts == 0 or max_len == 0:
        return out[:0]
    last = size - 1
    # 1. every earlier occurrence of the last token, with its match length (most recent first)
    where = np.empty(last, np.int64)
    length = np.empty(last, np.int64)
    m = 0
    for j in range(last - 1, -1, -1):
        if seq[j] != seq[last]:
            continue
        k = 1
        while k < max_match and j - k >= 0 and seq[j - k] == seq[last - k]:
            k += 1
        where[m], length[m] = j, k
        m += 1
    # 2. longest first (stable: the most recent among equals), distinct continuations only
    order = np.argsort(-length[:m], kind="mergesort")
    d = 0
    for i in order:
        if d == max_drafts:
            break
        j, k = where[i], length[i]
        n = min(max_len, k * tokens_per_match, last - j)
        duplicate = False
        for e in range(d):
            same = True
            for t in range(n):
                if out[e, t] != seq[j + 1 + t]:
                    same = False
                    break
            if same:
                duplicate = True
                break
        if duplicate:
            continue
        for t in range(n):
            out[d, t] = seq[j + 1 + t]
        out[d, max_len] = k
        d += 1
    return out[:d]


class SuffixDrafter:
    """The token sequence of one request (prompt, then output) and suffix-match drafts from it."""

    _warm = False

    def __init__(self, vocab_size: int, max_match: int = 8) -> None:
        if isinstance(max_match, bool) or not isinstance(max_match, (int, np.integer)) or max_match < 1:
            raise ValueError(f"max_match must be an integer >= 1, got {max_match!r}")
        self.vocab_size, self.max_match = int(vocab_size), int(max_match)
        self._seq = np.zeros(256, np.int32)
        self._size = 0
        self._warm_up()

    @classmethod
    def _warm_up(cls) -> None:
        """Compile (or load from numba's on-disk cache) every kernel once per process, off the hot path."""
        if cls._warm:
            return
        for dtype in (np.int32, np.int64):
            check_ids(np.zeros(1, dtype), 1)  # ``extend`` checks ids before copying them in
        suffix_drafts(np.zeros(2, np.int32), 2, 1, 1, 1, 1)
        cls._warm = True

    def __len__(self) -> int:
        return self._size

    @property
    def tokens(self) -> np.ndarray:
        return self._seq[: self._size]

    def reset(self, tokens: np.ndarray | list[int] = ()) -> None:
        """Start a new sequence (a new request's prompt)."""
        self._size = 0
        self.extend(tokens)

    def extend(self, tokens: np.ndarray | list[int]) -> None:
        """Append tokens (ids checked against the vocabulary)."""
        ids = check_ids(_as_ids("tokens", tokens, 1), self.vocab_size)
        need = self._size + ids.size
        if need > self._seq.size:
            self._seq = np.concatenate([self._seq, np.zeros(max(need, 2 * self._seq.size) - self._seq.size, np.int32)])
        self._seq[self._size : need] = ids
        self._size = need

    def drafts(self, max_drafts: int, max_len: int, tokens_per_match: int = 4) -> tuple[np.ndarray, np.ndarray]:
        """Up to ``max_drafts`` continuations of the sequence: (D, max_len) int32, -1 padded, and (D,) match lengths."""
        for name, value in (("max_drafts", max_drafts), ("max_len", max_len), ("tokens_per_match", tokens_per_match)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        rows = suffix_drafts(self._seq, self._size, self.max_match, max_drafts, max_len, tokens_per_match)
        return rows[:, :-1], rows[:, -1]
