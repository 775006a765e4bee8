"""A lane: one sequence of a decode batch, with everything that is its own (prompt, options, drafting window,
the planner's ledger, output, statistics), and the drafting state its batch shares."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lookahead import kv
from lookahead.rules import Rules, TokenLogprob
from lookahead.drafting import DraftState
from lookahead.planner import Ledger
from lookahead.stats import Clock, GenerationStats
from lookahead.window import JacobiWindow
from ngram_pool import SuffixDrafter


@dataclass(eq=False)
class Lane:
    """One sequence of the batch: its prompt and options, its drafting, and what it has emitted so far."""

    prompt: list[int]
    rules: Rules
    state: DraftState  # shared by the lanes of a batch; ``suffix`` is this lane's own
    streamer: object | None = None
    lookahead: bool = True
    out: list[int] = field(default_factory=list)
    done: bool = False  # ended by EOS or a stop string
    cancelled: bool = False  # set from another thread (a client that went away): the lane leaves at the next step
    stats: GenerationStats = field(default_factory=GenerationStats)
    suffix: SuffixDrafter | None = None
    window: JacobiWindow | None = None
    ledger: Ledger | None = None  # the cost model's account of a drafting lane (``Planner``)
    clock: Clock = field(default_factory=Clock)
    prefix: kv.BatchCache | None = None  # the keys of the prompt's first tokens, computed before: its prefill goes on after them
    keeps_keys: bool = False  # whether the lane keeps its keys when it finishes (``keys``), for a prompt that begins with it
    keys: kv.HeldKeys | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one an emitted token, where ``rules.logprobs`` asks
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)  # one a prompt token (the first: None), where
                                                                              # ``rules.prompt_logprobs`` asks

    @property
    def position(self) -> int:
        """Of the current token, ``out[-1]``."""
        return len(self.prompt) + len(self.out) - 1

    @property
    def last_position(self) -> int:
        """The last position generate() feeds; no row goes beyond."""
        return len(self.prompt) + self.rules.max_new_tokens - 2

    @property
    def finished(self) -> bool:
        return self.done or self.cancelled or len(self.out) >= self.rules.max_new_tokens or self.rules.out_of_time()

    @property
    def finish_reason(self) -> str:
        return "stop" if self.done else "cancelled" if self.cancelled else "length"

    def emit(self, tokens: list[int]) -> None:
        if self.streamer is not None and tokens:
            self.streamer.put(torch.tensor(tokens))


def shared_state(lanes: list[Lane]) -> DraftState | None:
    """The one drafting state of the lanes that draft (None: none does); a ValueError if they have several (the
    shared sources learn from a whole step in one call)."""
    states = {id(lane.state): lane.state for lane in lanes if lane.lookahead}
    if len(states) > 1:
        raise ValueError("the drafting sequences of a batch share one drafting state (its sources learn from the whole step)")
    return next(iter(states.values()), None)
