"""Acceptance rules: which candidate tokens the target model agrees with, plus its own next token."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Verdict:
    tokens: list[int]  # accepted candidate tokens, then the model's own next token (the bonus)
    branch: int  # index of the accepted candidate, -1 when none matched


def greedy_accept(first_logits: torch.Tensor, cand_logits: torch.Tensor, cands: torch.Tensor) -> Verdict:
    """Longest candidate prefix equal to the model's argmax chain, plus the bonus token (also after a full match).

    first_logits (V,) at the current token; cand_logits (C, N-1, V) at each candidate token; cands (C, N-1).
    """
    first = int(first_logits.argmax())
    if cands.shape[0] == 0:
        return Verdict([first], -1)
    preds = torch.cat([torch.full((cands.shape[0], 1), first), cand_logits.argmax(-1)], dim=1)  # (C, N)
    matched = (cands == preds[:, :-1]).long().cumprod(dim=1).sum(dim=1)  # (C,)
    branch = int(matched.argmax())  # ties: the most recent candidate
    length = int(matched[branch])
    if length == 0:
        return Verdict([first], -1)
    return Verdict(preds[branch, : length + 1].tolist(), branch)
