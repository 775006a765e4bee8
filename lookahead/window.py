"""The Jacobi window: N-1 levels of W guesses; each step appends the model's outputs as a new level."""

from __future__ import annotations

import numpy as np


class JacobiWindow:
    """Levels of guesses, oldest first. Starts with one level drawn from the prompt (seeded) and grows a
    level per step until it holds N-1; from then on each step yields W trajectories as n-grams."""

    def __init__(self, window: int, ngram: int, prompt: np.ndarray, seed: int) -> None:
        self.levels = np.empty((ngram - 1, window), dtype=np.int64)
        self.levels[0] = np.random.default_rng(seed).choice(prompt, size=window)
        self.filled = 1

    @property
    def active(self) -> np.ndarray:
        """(filled, W) the levels fed to the next step."""
        return self.levels[: self.filled]

    def advance(self, outputs: np.ndarray) -> np.ndarray:
        """Take the last level's outputs (W,); return the finished columns as (W, N) n-grams, (0, N) while warming up."""
        full = self.filled == self.levels.shape[0]
        ngrams = np.concatenate([self.levels.T, outputs[:, None]], axis=1) if full else np.empty((0, self.levels.shape[0] + 1), np.int64)
        if full:
            self.levels[:-1] = self.levels[1:]
            self.levels[-1] = outputs
        else:
            self.levels[self.filled] = outputs
            self.filled += 1
        return ngrams

    def levels_within(self, room: int) -> int:
        """How many levels the next step feeds: all filled ones, or none if its deepest row would sit more than
        ``room`` positions past the current token (near the end of the request)."""
        return self.filled if self.levels.shape[1] + self.filled - 1 <= room else 0
