"""The acceptance rule: which branch of the token tree the target model agrees with, plus its own next token.

The walk goes from the current token down. ``next_token(node)`` gives the model's token after tree node ``node``
(-1: after the current token), i.e. after the branch ending there; it is called exactly once per emitted token, in
order. The children of a node carry distinct tokens (the tree is a trie), so at most one child can match.

Greedy decoding walks the argmax of the model's processed scores (``host_kernels.argmax``, or a row's first of the
step's top-k, which ranks as argmax does). Sampling walks the argmax of the same
scores plus fresh Gumbel noise per position (``gumbel``): by the Gumbel-max trick that argmax is an exact
sample from softmax(scores), so the accepted tokens are distributed exactly as plain sampling, and as the
noise is drawn once per emitted position, in order, a seed gives the same sample whatever was drafted (with
lookahead on or off, cold or warm).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from lookahead.tree import TokenTree

NextToken = Callable[[int], int]


@dataclass(frozen=True)
class Verdict:
    tokens: list[int]  # the accepted branch's tokens, then the model's own next token (the bonus)
    path: list[int]  # the accepted tree nodes, top down


def accept(next_token: NextToken, tree: TokenTree) -> Verdict:
    """The deepest branch equal to the chain of ``next_token``, plus the bonus token (also after a leaf). The tree is read
    as Python lists: a step's few dozen nodes scan faster so than by a numpy call a level (~16 us each, cold after the
    forward)."""
    parents, tokens = tree.parents.tolist(), tree.tokens.tolist()
    node, path = -1, []
    token = next_token(node)
    while True:
        node = next((c for c, (p, t) in enumerate(zip(parents, tokens)) if p == node and t == token), -1)
        if node < 0:
            break
        path.append(node)
        token = next_token(node)
    return Verdict([tokens[n] for n in path] + [token], path)


def accepted_after(tree: TokenTree, tokens: list[int]) -> int | None:
    """How many of ``tree``'s nodes ``accept`` would have accepted, given the ``tokens`` that came after its current
    token without it (a tree the cost model declined); None while that is not known (the walk is still matching
    at the last token that came). Exact in greedy and sampling alike: a node is accepted iff its token is the
    one that came (the Gumbel noise is drawn per emitted position, whatever was drafted)."""
    parents, drafted = tree.parents.tolist(), tree.tokens.tolist()  # a walk over lists: numpy's ~16 us a level, cold
    node = -1
    for depth, token in enumerate(tokens):
        node = next((i for i, (parent, mine) in enumerate(zip(parents, drafted)) if parent == node and mine == token), None)
        if node is None:
            return depth
    return None if node in parents else len(tokens)


def gumbel(size: int, rng: torch.Generator | None) -> torch.Tensor:
    """(size,) independent standard Gumbel noise from ``rng`` (None: torch's global RNG)."""
    u = torch.rand(size, generator=rng, dtype=torch.float64).clamp_(min=1e-300)
    return -torch.log(-torch.log(u))
