"""``LookaheadConfig``: every knob of the decoder in one frozen, validated dataclass."""

from __future__ import annotations

from dataclasses import dataclass

MAX_WINDOW = 128
MAX_NGRAM = 16
MAX_GUESS = 128


def _check_int(name: str, value: object, low: int, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be {bound}, got {value}")


@dataclass(frozen=True)
class LookaheadConfig:
    """Shape of one lookahead step (see ``layout.py``) and of the n-gram pool.

    window (W): Jacobi guesses advanced in parallel; ngram (N): n-gram length, so N-1 window levels
    and N-1 tokens per candidate; guess (G): most candidates verified per step (0 = lookahead only).
    """

    # small steps pay off on CPUs (see benchmarks/README.md); GPUs afford wider ones, e.g. W=15, N=5, G=15
    window: int = 3
    ngram: int = 3
    guess: int = 3
    pool_slots: int = 16  # continuations kept per key; least recently used evicted
    pool_sparse: bool | None = None  # allocate pool rows on demand; None: when the vocabulary exceeds 65536
    seed_pool_from_prompt: bool = True  # harvest the prompt's n-grams before decoding (input-grounded tasks)
    pool_from_output: bool = True  # harvest the accepted output's n-grams too
    seed: int = 0  # initial Jacobi window (drawn from the prompt) and sampling

    def __post_init__(self) -> None:
        _check_int("window (W)", self.window, 1, MAX_WINDOW)
        _check_int("ngram (N)", self.ngram, 2, MAX_NGRAM)
        _check_int("guess (G)", self.guess, 0, MAX_GUESS)
        _check_int("pool_slots", self.pool_slots, 1)
        _check_int("seed", self.seed, 0)
        for name in ("seed_pool_from_prompt", "pool_from_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.pool_sparse is not None and not isinstance(self.pool_sparse, bool):
            raise ValueError(f"pool_sparse must be True, False or None, got {self.pool_sparse!r}")
