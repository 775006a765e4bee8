"""The layout of one step: which tokens go in, at which positions, who sees whom.

One forward pass carries the current token ``c``, the lookahead branch (the Jacobi window: ``levels``
rows of W guesses) and the verification branch (the token tree of ``tree.py``). Example for W=3, two
levels ``a`` ``b`` and the six-node tree drawn in ``tree.py`` (t0=7, t1=9 under t0, t2=4 and t3=5 under
t1, t4=2 under t0, t5=3); x: may attend; every row also sees the KV cache, i.e. the accepted prefix:

            c  a0 a1 a2 b0 b1 b2 t0 t1 t2 t3 t4 t5
        c   x
        a0  x  x
        a1  x  x  x
        a2  x  x  x  x
        b0  x  x        x
        b1  x  x  x        x
        b2  x  x  x  x        x
        t0  x                    x
        t1  x                    x  x
        t2  x                    x  x  x
        t3  x                    x  x     x
        t4  x                    x           x
        t5  x                                   x
       pos  0  1  2  3  2  3  4  1  2  3  3  2  1

Level j, column i sits at position c+1+i+j and sees c, level 0 up to column i, and the levels
1..j of its own column: a causal sequence c, a0..ai, bi, ... of consecutive positions. So the
output of the last level's column i extends the n-gram (a_i, b_i, ...) down the column. A tree node
at depth d sits at c+d and sees c and its ancestors: exactly the sequence it would follow if its
branch were accepted, so its output is the model's next token after that branch. Logits are
computed only for ``c``, the last level and the tree.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from lookahead.tree import TokenTree, ancestor_matrix


@dataclass(frozen=True, eq=False)
class StepLayout:
    """Positions and visibility of one step's rows: c, then ``levels`` x ``window`` guesses, then the tree."""

    window: int
    levels: int
    offsets: torch.Tensor  # (T,) long: position of each row minus the current token's position
    allowed: torch.Tensor  # (T, T) bool: row may attend to column
    logit_rows: torch.Tensor  # (1 + W + K,) or (1 + K,) long: rows whose logits the step uses

    @property
    def size(self) -> int:
        return self.offsets.numel()

    @property
    def first_tree_row(self) -> int:
        return 1 + self.levels * self.window

    def split_logits(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Logits of ``logit_rows`` -> current token (V,), last level (W or 0, V), tree nodes (K, V)."""
        last = self.window if self.levels else 0
        return logits[0], logits[1 : 1 + last], logits[1 + last :]


@functools.lru_cache(maxsize=256)
def window_block(window: int, levels: int) -> tuple[np.ndarray, np.ndarray]:
    """Offsets (1+L*W,) and visibility (1+L*W, 1+L*W) of c and the Jacobi levels: the upper-left of the drawing."""
    size = 1 + levels * window
    offsets = np.zeros(size, np.int64)
    allowed = np.eye(size, dtype=bool)
    allowed[:, 0] = True
    for j in range(levels):
        for i in range(window):
            row = 1 + j * window + i
            offsets[row] = 1 + i + j
            allowed[row, 1 : 1 + i + 1] = True  # level 0 up to column i
            allowed[row, [1 + k * window + i for k in range(1, j + 1)]] = True  # the column above
    offsets.flags.writeable = allowed.flags.writeable = False  # shared by every layout of this shape
    return offsets, allowed


def build_layout(window: int, levels: int, tree: TokenTree) -> StepLayout:
    """The layout drawn in the module docstring, for any W, number of levels and tree (built in numpy, a few us
    an op where torch's small ops cost ~3: ~0.07 -> 0.02 ms a step)."""
    if not levels and not len(tree):
        return plain_layout(window)
    head_offsets, head_allowed = window_block(window, levels)
    head, k = head_offsets.size, len(tree)
    allowed = np.zeros((head + k, head + k), bool)
    allowed[:head, :head] = head_allowed
    allowed[head:, 0] = True
    allowed[head:, head:] = ancestor_matrix(tree.parents)
    offsets = np.concatenate([head_offsets, tree.depths])
    last_level = np.arange(head - window, head) if levels else np.empty(0, np.int64)
    logit_rows = np.concatenate([[0], last_level, np.arange(head, head + k)])
    return StepLayout(window, levels, torch.from_numpy(offsets), torch.from_numpy(allowed), torch.from_numpy(logit_rows))


@functools.lru_cache(maxsize=16)
def plain_layout(window: int) -> StepLayout:
    """The current token alone (a plain step: most steps of a batch's lanes), built once."""
    return StepLayout(window, 0, torch.zeros(1, dtype=torch.long), torch.ones(1, 1, dtype=torch.bool), torch.zeros(1, dtype=torch.long))


@dataclass(frozen=True, eq=False)
class BatchLayout:
    """The step of a batch: each sequence's layout, padded to the longest; a padding row ``p`` sees only
    itself and sits at the current token's position (its output is never read, its key is cropped). For
    b=0 with c and a two-node chain t0 t1, and b=1 with c and one node u0:

        b=0     c  t0 t1          b=1     c  u0 p
        c       x                 c       x
        t0      x  x              u0      x  x
        t1      x  x  x           p             x
        pos     0  1  2           pos     0  1  0

    Logits are computed for the union of the rows any sequence reads (here all three)."""

    layouts: tuple[StepLayout, ...]
    offsets: torch.Tensor  # (B, T) long
    allowed: torch.Tensor  # (B, T, T) bool
    logit_rows: torch.Tensor  # (U,) long: every row some sequence reads, sorted

    @property
    def size(self) -> int:
        return self.offsets.shape[1]

    def logits_of(self, logits: torch.Tensor | np.ndarray, b: int) -> torch.Tensor | np.ndarray:
        """Sequence b's logits (its ``logit_rows``, V) out of the step's (B, U, V) (or anything else per logit row)."""
        rows = self.layouts[b].logit_rows
        if rows.numel() == self.logit_rows.numel():  # all of them (always so for one sequence): a view, no copy
            return logits[b]
        return logits[b, torch.searchsorted(self.logit_rows, rows).numpy()]


def stack(layouts: list[StepLayout]) -> BatchLayout:
    """The layouts of a batch's sequences as one (B, T) step, drawn in ``BatchLayout``."""
    if len(layouts) == 1:  # one sequence: its own layout as a batch of one, no copies
        layout = layouts[0]
        return BatchLayout((layout,), layout.offsets[None], layout.allowed[None], layout.logit_rows)
    size = max(layout.size for layout in layouts)
    if size == 1:  # every sequence plain: the current tokens alone
        return BatchLayout(tuple(layouts), torch.zeros(len(layouts), 1, dtype=torch.long), torch.ones(len(layouts), 1, 1, dtype=torch.bool), layouts[0].logit_rows)
    offsets = torch.zeros(len(layouts), size, dtype=torch.long)
    allowed = torch.eye(size, dtype=torch.bool).repeat(len(layouts), 1, 1)
    for b, layout in enumerate(layouts):
        offsets[b, : layout.size] = layout.offsets
        allowed[b, : layout.size, : layout.size] = layout.allowed
    rows = torch.unique(torch.cat([layout.logit_rows for layout in layouts])) if len(layouts) > 1 else layouts[0].logit_rows
    return BatchLayout(tuple(layouts), offsets, allowed, rows)
