"""The acceptance rule: which branch of the token tree the target model agrees with, plus its own next token.

The walk goes from the current token down. ``scores_at(node)`` gives the next-token scores (V,) after tree
node ``node`` (-1: after the current token), i.e. after the branch ending there; it is called exactly once
per emitted token, in order. The children of a node carry distinct tokens (the tree is a trie), so at most
one child can match.

Greedy decoding walks the argmax of the model's processed scores (``host_kernels.argmax``). Sampling walks the argmax of the same
scores plus fresh Gumbel noise per position (``gumbel``): by the Gumbel-max trick that argmax is an exact
sample from softmax(scores), so the accepted tokens are distributed exactly as plain sampling, and as the
noise is drawn once per emitted position, in order, a seed gives the same sample whatever was drafted (with
lookahead on or off, cold or warm).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from lookahead.host_kernels import argmax
from lookahead.tree import TokenTree

ScoresAt = Callable[[int], torch.Tensor]


@dataclass(frozen=True)
class Verdict:
    tokens: list[int]  # the accepted branch's tokens, then the model's own next token (the bonus)
    path: list[int]  # the accepted tree nodes, top down


def accept(scores_at: ScoresAt, tree: TokenTree) -> Verdict:
    """The deepest branch equal to the argmax chain of ``scores_at``, plus the bonus token (also after a leaf)."""
    node, path = -1, []
    token = argmax(scores_at(node))
    while len(tree):  # a plain step's tree is empty: its one token
        match = next((c for c in tree.children(node) if tree.tokens[c] == token), None)
        if match is None:
            break
        node = int(match)
        path.append(node)
        token = argmax(scores_at(node))
    return Verdict([int(tree.tokens[n]) for n in path] + [token], path)


def accepted_after(tree: TokenTree, tokens: list[int]) -> int | None:
    """How many of ``tree``'s nodes ``accept`` would have accepted, given the ``tokens`` that came after its current
    token without it (a tree the cost model declined); None while that is not known (the walk is still matching
    at the last token that came). Exact in greedy and sampling alike: a node is accepted iff its token is the
    one that came (the Gumbel noise is drawn per emitted position, whatever was drafted)."""
    node = -1
    for depth, token in enumerate(tokens):
        children = tree.children(node)
        match = children[tree.tokens[children] == token]
        if not match.size:
            return depth
        node = int(match[0])
    return len(tokens) if not tree.children(node).size else None


def gumbel(size: int, rng: torch.Generator | None) -> torch.Tensor:
    """(size,) independent standard Gumbel noise from ``rng`` (None: torch's global RNG)."""
    u = torch.rand(size, generator=rng, dtype=torch.float64).clamp_(min=1e-300)
    return -torch.log(-torch.log(u))
