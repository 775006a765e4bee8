"""``LookaheadConfig``: every knob of the decoder in one frozen, validated dataclass."""

from __future__ import annotations

from dataclasses import dataclass

MAX_WINDOW = 128
MAX_NGRAM = 16
MAX_GUESS = 128
MAX_TREE = 256
MAX_RECYCLE = 64
MAX_BODY_BYTES = 8 * 2**20  # the server's request body limit: far above a long context's text or token ids
PREFILL_CHUNK = 128  # the server's prompt tokens a step while others decode (SmolLM2, 2 cores: ~0.1 s, a few decode steps)
# the server's keys of finished requests kept for prompts that begin with them (a chat's next turn): the 1.5B's keys
# take ~57 KB a token in fp32, so ~9,000 tokens of conversations
HELD_KEYS_BYTES = 512 * 2**20


def _check_int(name: str, value: object, low: int, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be {bound}, got {value}")


@dataclass(frozen=True)
class LookaheadConfig:
    """Shape of one step (see ``layout.py``): the Jacobi window and the token tree, and its drafting sources.

    window (W): Jacobi guesses advanced in parallel (0 = no lookahead branch); ngram (N): n-gram length,
    so N-1 window levels and pool drafts of N-1 tokens; guess (G): pool n-grams offered to the tree;
    tree_budget: most tree nodes verified per step (0 = no verification); suffix_drafts/suffix_length:
    suffix-match drafts and their longest length (0 = off); recycle_k: successors kept per token by the
    recycling table (0 = off); recycle_prior: the lowest token ids (BPE vocabularies number the commonest
    first) whose successors the model predicts once, to seed a new drafting state's recycling table (0 = none;
    see ``prior.py``); recycle_prior_s: the seconds a first run may spend on it (later ones grow it by a tenth of that).
    auto: each step, the measured cost model (``probing.py``, ``planner.py``) picks how many of the tree's best
    nodes to verify and whether to run the Jacobi branch, within the shape above; False: always the full shape.
    live_cost: the loop corrects the cost curve from its own forwards' timings (``planner.LiveCurve``); False plans
    on the curve as given, so the plans do not depend on the machine's timings (reproducible runs: the tests'
    exactness checks).
    """

    # small steps pay off on CPUs (see benchmarks/README.md); GPUs afford wider ones
    window: int = 3
    ngram: int = 3
    guess: int = 3
    tree_budget: int = 16
    suffix_drafts: int = 4
    suffix_length: int = 8
    recycle_k: int = 8
    recycle_prior: int = 16384
    recycle_prior_s: float = 20.0
    auto: bool = True
    live_cost: bool = True
    pool_slots: int = 16  # continuations kept per key; least recently used evicted
    pool_sparse: bool | None = None  # allocate pool rows on demand; None: when the vocabulary exceeds 65536
    seed_pool_from_prompt: bool = True  # harvest the prompt's n-grams before decoding (input-grounded tasks)
    pool_from_output: bool = True  # harvest the accepted output's n-grams too
    seed: int = 0  # the initial Jacobi window's draw from the prompt (output-neutral); sampling takes generate(seed=)

    def __post_init__(self) -> None:
        _check_int("window (W)", self.window, 0, MAX_WINDOW)
        _check_int("ngram (N)", self.ngram, 2, MAX_NGRAM)
        _check_int("guess (G)", self.guess, 0, MAX_GUESS)
        _check_int("tree_budget", self.tree_budget, 0, MAX_TREE)
        _check_int("suffix_drafts", self.suffix_drafts, 0, MAX_GUESS)
        _check_int("suffix_length", self.suffix_length, 1, MAX_TREE)
        _check_int("recycle_k", self.recycle_k, 0, MAX_RECYCLE)
        _check_int("recycle_prior", self.recycle_prior, 0)
        if isinstance(self.recycle_prior_s, bool) or not isinstance(self.recycle_prior_s, (int, float)) or not self.recycle_prior_s > 0:
            raise ValueError(f"recycle_prior_s must be a number of seconds above 0 (inf: no limit), got {self.recycle_prior_s!r}")
        _check_int("pool_slots", self.pool_slots, 1)
        _check_int("seed", self.seed, 0)
        for name in ("auto", "live_cost", "seed_pool_from_prompt", "pool_from_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.pool_sparse is not None and not isinstance(self.pool_sparse, bool):
            raise ValueError(f"pool_sparse must be True, False or None, got {self.pool_sparse!r}")
