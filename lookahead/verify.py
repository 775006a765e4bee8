"""Acceptance rules: which branch of the token tree the target model agrees with, plus its own next token.

Both rules walk the tree from the current token down. ``scores_at(node)`` gives the processed next-token
scores (V,) after tree node ``node`` (-1: after the current token), i.e. after the branch ending there.
The children of a node carry distinct tokens (the tree is a trie), so at most one child can match.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from lookahead.tree import TokenTree

ScoresAt = Callable[[int], torch.Tensor]


@dataclass(frozen=True)
class Verdict:
    tokens: list[int]  # the accepted branch's tokens, then the model's own next token (the bonus)
    path: list[int]  # the accepted tree nodes, top down


def greedy_accept(scores_at: ScoresAt, tree: TokenTree) -> Verdict:
    """The deepest branch equal to the model's argmax chain, plus the bonus token (also after a leaf)."""
    node, path = -1, []
    token = int(scores_at(node).argmax())
    while True:
        match = next((c for c in tree.children(node) if tree.tokens[c] == token), None)
        if match is None:
            break
        node = int(match)
        path.append(node)
        token = int(scores_at(node).argmax())
    return Verdict([int(tree.tokens[n]) for n in path] + [token], path)


def sampling_accept(scores_at: ScoresAt, tree: TokenTree, rng: torch.Generator | None) -> Verdict:
    """Lossless multi-candidate speculative sampling over a tree of deterministic (one-hot) drafts.

    At each node its children x are tried in order: x is accepted with probability p(x); on rejection
    p(x) is set to 0 and p renormalised (the residual of a one-hot draft). When all are rejected, or at
    a leaf, the next token is sampled from what remains of p. The emitted tokens are then distributed
    exactly as with plain sampling from p.
    """
    node, path = -1, []
    probs = torch.softmax(scores_at(node), dim=-1)
    while True:
        chosen = None
        for child in tree.children(node):
            x = int(tree.tokens[child])
            if torch.rand((), generator=rng) < probs[x]:
                chosen = int(child)
                break
            probs[x] = 0.0
            probs /= probs.sum()
        if chosen is None:
            break
        node = chosen
        path.append(node)
        probs = torch.softmax(scores_at(node), dim=-1)
    token = int(torch.multinomial(probs, 1, generator=rng))
    return Verdict([int(tree.tokens[n]) for n in path] + [token], path)
