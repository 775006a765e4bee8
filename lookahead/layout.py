"""The layout of one lookahead step: which tokens go in, at which positions, who sees whom.

One forward pass carries the current token ``c``, the lookahead branch (the Jacobi window: ``levels``
rows of W guesses) and the verification branch (``n_cands`` candidate n-grams of N-1 tokens each).
Example for W=3, N=3, two levels ``a`` ``b`` and two candidates ``v`` ``w`` (x: may attend; every row
also sees the whole KV cache, i.e. the accepted prefix):

            c  a0 a1 a2 b0 b1 b2 v0 v1 w0 w1
        c   x
        a0  x  x
        a1  x  x  x
        a2  x  x  x  x
        b0  x  x        x
        b1  x  x  x        x
        b2  x  x  x  x        x
        v0  x                    x
        v1  x                    x  x
        w0  x                          x
        w1  x                          x  x
       pos  0  1  2  3  2  3  4  1  2  1  2

Level j, column i sits at position c+1+i+j and sees c, level 0 up to column i, and the levels
1..j of its own column: a causal sequence c, a0..ai, bi, ... of consecutive positions. So the
output of the last level's column i extends the n-gram (a_i, b_i, ...) down the column. Candidate
token k sits at c+1+k and sees c and the candidate's tokens before it, so its output checks the
candidate's next token. Logits are computed only for ``c``, the last level and the candidates.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass(frozen=True, eq=False)
class StepLayout:
    """Everything about a step that depends only on (W, N, levels, n_cands): built once, reused."""

    window: int
    ngram: int
    levels: int
    n_cands: int
    offsets: torch.Tensor  # (T,) long: position of each row minus the current token's position
    allowed: torch.Tensor  # (T, T) bool: row may attend to column
    logit_rows: torch.Tensor  # (1 + W + n_cands*(N-1),) long: rows whose logits the step uses

    @property
    def size(self) -> int:
        return self.offsets.numel()

    @property
    def first_candidate_row(self) -> int:
        return 1 + self.levels * self.window

    def split_logits(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Logits of ``logit_rows`` -> current token (V,), last level (W or 0, V), candidates (n_cands, N-1, V)."""
        last = self.window if self.levels else 0
        return logits[0], logits[1 : 1 + last], logits[1 + last :].view(self.n_cands, self.ngram - 1, logits.shape[-1])

    def input_ids(self, current: int, levels: torch.Tensor, cands: torch.Tensor) -> torch.Tensor:
        """(1, T) ids: the current token, the window levels (levels, W), the candidates (n_cands, N-1)."""
        return torch.cat([torch.tensor([current]), levels.reshape(-1), cands.reshape(-1)]).unsqueeze(0)

    def additive_mask(
        self, kv_length: int, kv_offset: int, position: int, sliding_window: int | None, dtype: torch.dtype
    ) -> torch.Tensor:
        """(1, 1, T, kv_length) mask: 0 where attended, dtype-min elsewhere.

        The first ``kv_length - T`` keys are the cache, holding positions ``kv_offset`` on; a sliding
        layer hides those at ``sliding_window`` or more positions behind the query.
        """
        past = kv_length - self.size
        visible_past = torch.ones(self.size, past, dtype=torch.bool)
        if sliding_window is not None:
            query_pos = position + self.offsets
            key_pos = kv_offset + torch.arange(past)
            visible_past = (query_pos[:, None] - key_pos[None, :]) < sliding_window
        visible = torch.cat([visible_past, self.allowed], dim=1)
        mask = torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, torch.finfo(dtype).min)
        return mask[None, None]


@functools.lru_cache(maxsize=256)
def build_layout(window: int, ngram: int, levels: int, n_cands: int) -> StepLayout:
    """The step layout drawn in the module docstring, for any W, N, number of levels and candidates."""
    span = ngram - 1
    size = 1 + levels * window + n_cands * span
    offsets = torch.zeros(size, dtype=torch.long)
    allowed = torch.eye(size, dtype=torch.bool)
    allowed[:, 0] = True

    def level_row(j: int, i: int) -> int:
        return 1 + j * window + i

    for j in range(levels):
        for i in range(window):
            row = level_row(j, i)
            offsets[row] = 1 + i + j
            allowed[row, level_row(0, 0) : level_row(0, i) + 1] = True  # level 0 up to column i
            for k in range(1, j + 1):
                allowed[row, level_row(k, i)] = True  # the column above
    first = 1 + levels * window
    for g in range(n_cands):
        start = first + g * span
        for k in range(span):
            offsets[start + k] = 1 + k
            allowed[start + k, start : start + k + 1] = True
    last_level = torch.arange(level_row(levels - 1, 0), level_row(levels - 1, 0) + window) if levels else torch.arange(0)
    logit_rows = torch.cat([torch.tensor([0]), last_level, torch.arange(first, size)])
    return StepLayout(window, ngram, levels, n_cands, offsets, allowed, logit_rows)
