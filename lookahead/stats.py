"""What a generation measured: steps, compression, per-phase time, and drafted/accepted tokens by source."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

from lookahead.drafting import SOURCES
from lookahead.tree import TokenTree


class Clock:
    """Seconds since the last lap, for the per-phase timings of the stats."""

    def __init__(self) -> None:
        self.start = self.last = time.perf_counter()

    def lap(self) -> float:
        now = time.perf_counter()
        elapsed, self.last = now - self.last, now
        return elapsed

    def total(self) -> float:
        return time.perf_counter() - self.start


def _count_bits(counter: Counter, sources: list[int], names: tuple[str | None, ...]) -> None:
    """counter[name] += 1 for every set bit of every node's ``sources`` that ``names`` names (not None)."""
    for bits in sources:
        while bits:
            low = bits & -bits
            at = low.bit_length() - 1
            if at < len(names) and names[at] is not None:
                counter[names[at]] += 1
            bits ^= low


@dataclass
class GenerationStats:
    new_tokens: int = 0
    steps: int = 0  # decode forwards (the prefill not counted)
    prefill_s: float = 0.0
    decode_s: float = 0.0
    tree_nodes: int = 0  # tree nodes verified, all steps together
    window_steps: int = 0  # steps that ran the Jacobi branch
    plain_steps: int = 0  # steps that fed the current token alone (nothing drafted, or nothing worth its cost)
    accepted_hist: Counter = field(default_factory=Counter)  # tokens emitted in a step -> number of steps
    accepted_by_source: Counter = field(default_factory=Counter)  # emitted draft tokens, by each source that proposed them
    drafted_by_source: Counter = field(default_factory=Counter)  # tree nodes verified, by each source that proposed them
    phase_s: Counter = field(default_factory=Counter)  # decode time by phase: draft, forward, verify, learn
    rested_steps: int = 0  # steps the planner held the lane from drafting (dormant, or its drafting lost: ``planner.Pace``)
    drafted: Counter = field(default_factory=Counter)  # the drafting steps': tokens and seconds promised, and as they came
    reused_tokens: int = 0  # prompt tokens whose keys came from an earlier sequence (``Lane.prefix``), not prefilled

    def record(self, tree: TokenTree, levels: int, path: list[int], emitted: int,
               names: tuple[str | None, ...] = SOURCES, promise: tuple[float, float] | None = None, seconds: float = 0.0,
               rested: bool = False) -> None:
        """One step that fed ``levels`` window levels, verified ``tree``, accepted ``path`` and emitted ``emitted`` tokens
        (cut by stops or length) in ``seconds`` (the whole step); ``names``: of the node source bits
        (``DraftState.names``; None: not counted); ``promise``: the (tokens, seconds) the planner expected of a drafting
        step; ``rested``: the lane was held from drafting."""
        self.steps += 1
        self.rested_steps += rested
        if promise is not None:
            for key, value in zip(("steps", "promised_tokens", "promised_s", "tokens", "seconds"), (1, *promise, emitted, seconds)):
                self.drafted[key] += value
        self.tree_nodes += len(tree)
        self.window_steps += levels > 0
        self.plain_steps += levels == 0 and len(tree) == 0
        self.accepted_hist[emitted] += 1
        if not len(tree):
            return
        sources = tree.sources.tolist()  # a few nodes of a few bits: Python's ints, not numpy's (~14 -> ~4 us a step)
        _count_bits(self.drafted_by_source, sources, names)
        _count_bits(self.accepted_by_source, [sources[node] for node in path[:emitted]], names)

    @property
    def compression(self) -> float:
        """New tokens per forward pass, the prefill's first token included (plain greedy: 1.0)."""
        return self.new_tokens / max(self.steps + 1, 1)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / max(self.prefill_s + self.decode_s, 1e-9)

    def summary(self) -> str:
        """The line the CLI prints after an answer."""
        return (f"{self.new_tokens} tokens, {self.steps} steps, compression {self.compression:.2f}, "
                f"{self.tokens_per_s:.1f} tokens/s, time to first token {self.prefill_s * 1000:.0f} ms")

    def as_dict(self) -> dict:
        return {
            "new_tokens": self.new_tokens, "steps": self.steps, "compression": round(self.compression, 4),
            "tokens_per_s": round(self.tokens_per_s, 3), "prefill_s": round(self.prefill_s, 4),
            "decode_s": round(self.decode_s, 4), "time_to_first_token_s": round(self.prefill_s, 4),
            "mean_tree_nodes": round(self.tree_nodes / max(self.steps, 1), 3), "window_steps": self.window_steps,
            "plain_steps": self.plain_steps, "reused_prompt_tokens": self.reused_tokens,
            "accepted_hist": {str(k): v for k, v in sorted(self.accepted_hist.items())},
            "accepted_by_source": dict(self.accepted_by_source), "drafted_by_source": dict(self.drafted_by_source),
            "phase_s": {k: round(v, 4) for k, v in self.phase_s.items()}, "rested_steps": self.rested_steps,
            "drafting_step": self.drafting_step(),
        }

    def drafting_step(self) -> dict:
        """A drafting step on average, as the planner promised it and as it came: tokens and milliseconds (the whole
        step as measured against its forward as priced)."""
        n = max(self.drafted["steps"], 1)
        return {"steps": self.drafted["steps"], "promised_tokens": round(self.drafted["promised_tokens"] / n, 3),
                "tokens": round(self.drafted["tokens"] / n, 3), "promised_ms": round(self.drafted["promised_s"] / n * 1000, 3),
                "ms": round(self.drafted["seconds"] / n * 1000, 3)}
