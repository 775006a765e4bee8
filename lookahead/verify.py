"""Acceptance rules: which candidate tokens the target model agrees with, plus its own next token.

Both rules walk the candidates position by position. ``scores_at(g, k)`` gives the processed next-token
scores (V,) after candidate ``g``'s token ``k`` (k = -1: after the current token); candidates still
alive at a position share the accepted prefix, so any of them gives the same scores.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

ScoresAt = Callable[[int, int], torch.Tensor]


@dataclass(frozen=True)
class Verdict:
    tokens: list[int]  # accepted candidate tokens, then the model's own next token (the bonus)
    branch: int  # index of the accepted candidate, -1 when none matched


def greedy_accept(scores_at: ScoresAt, cands: np.ndarray) -> Verdict:
    """Longest candidate prefix equal to the model's argmax chain, plus the bonus token (also after a full match)."""
    alive, accepted, branch = list(range(cands.shape[0])), [], -1
    token = int(scores_at(0, -1).argmax())
    for k in range(cands.shape[1]):
        alive = [g for g in alive if cands[g, k] == token]
        if not alive:
            break
        accepted.append(token)
        branch = alive[0]
        token = int(scores_at(branch, k).argmax())
    return Verdict(accepted + [token], branch)


def sampling_accept(scores_at: ScoresAt, cands: np.ndarray, rng: torch.Generator) -> Verdict:
    """Lossless multi-candidate speculative sampling with deterministic (one-hot) drafts.

    At each position the distinct candidate tokens x are tried in order: x is accepted with probability
    p(x); on rejection p(x) is set to 0 and p renormalised (the residual of a one-hot draft). When all
    are rejected, or after the last position, the next token is sampled from what remains of p. The
    emitted tokens are then distributed exactly as with plain sampling from p.
    """
    alive, accepted, branch = list(range(cands.shape[0])), [], -1
    probs = torch.softmax(scores_at(0, -1), dim=-1)
    for k in range(cands.shape[1]):
        chosen = None
        for x in dict.fromkeys(int(cands[g, k]) for g in alive):  # distinct tokens, most recent first
            if torch.rand((), generator=rng) < probs[x]:
                chosen = x
                break
            probs[x] = 0.0
            probs /= probs.sum()
        if chosen is None:
            break
        accepted.append(chosen)
        alive = [g for g in alive if cands[g, k] == chosen]
        branch = alive[0]
        probs = torch.softmax(scores_at(branch, k), dim=-1)
    token = int(torch.multinomial(probs, 1, generator=rng))
    return Verdict(accepted + [token], branch)
