"""Our drafting inside vLLM: a speculative proposer for its ``custom_class`` method.

    LLM(model, speculative_config={"method": "custom_class", "model": "lookahead.vllm.LookaheadProposer",
                                   "num_speculative_tokens": 8})

vLLM builds the class with its ``VllmConfig`` and, after every step, calls ``propose`` with the tokens each
running request just got and every request's whole token row; it wants one chain of draft tokens per request
back (possibly none), verifies the chains itself and keeps exactly the tokens its own decoding would have
chosen (greedy) or their distribution (rejection sampling). So the output is vLLM's whatever we propose; what
we choose is how many tokens a step verifies and which.

What travels from our engine: a request's own suffix matches (``SuffixDrafter``) and the n-gram pool shared by
every request the proposer has seen (their prompts and outputs), merged into one tree scored by the measured
acceptance rates per source and depth (``DraftState``); the chain proposed is the tree's best path. What does
not: the Jacobi window (it needs rows of the model's own forward) and the recycling table (it needs the top-k
of every row's logits; a proposer sees only the sampled tokens).

Requests have no ids here, and vLLM moves a request to another row when one before it finishes. A row's state
is its request's token sequence (the suffix source's): each step, a row whose tokens extend the state it had
keeps it, one whose tokens extend another row's earlier state takes that one (a moved request), and any other
row is a new request; states no row continues are dropped. Nothing of this can change vLLM's output, only how
good the drafts are.

How long the drafts are is measured, not guessed: the time between two calls is one engine step, and a line
``a + b x tokens`` fitted to those times prices a verified token. Each step keeps the draft tokens, best first
across all requests, that raise the expected tokens per second (the nodes' acceptance probabilities against
that price); with many requests running the step is dear already and drafts shrink or vanish.

Options are class attributes: subclass to change them, and name the subclass in ``speculative_config``::

    class Proposer(LookaheadProposer):
        state_dir = "/var/lib/lookahead/state"  # a DraftState directory: loaded at start, saved every minute
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from lookahead.config import LookaheadConfig
from lookahead.drafting import DraftState, Observed
from lookahead.tree import TokenTree
from ngram_pool import SuffixDrafter

ASSUMED_ROW_COST = 0.03  # b / a (an extra verified token against a one-token step) until measured: a 2-core CPU's
                         # r(16) of ~1.45; a GPU's is far lower, and measured within ~16 steps
FIT_STEPS = 16  # steady steps (no request joining) before the measured line replaces the assumed one
FIT_MEMORY = 200  # steps: older steps weigh 1 - 1/FIT_MEMORY less


class StepCost:
    """Seconds of one engine step as ``a + b x tokens``, a least-squares line over the steps seen (older ones
    fading), with ``b = ASSUMED_ROW_COST x a`` until the steps seen span enough token counts to fit it."""

    def __init__(self) -> None:
        self.sums = np.zeros(5)  # weights, tokens, tokens^2, seconds, tokens x seconds
        self.steps = 0

    def observe(self, tokens: int, seconds: float) -> None:
        if self.steps >= FIT_STEPS and seconds > 5 * self.seconds(tokens):
            return  # not a step: the engine waited (a pause between requests, a prefill it ran alone)
        sums = self.sums * (1 - 1 / FIT_MEMORY) + [1.0, tokens, tokens * tokens, seconds, tokens * seconds]
        if seconds >= 0 and np.isfinite(sums).all():  # else not a time: once in the sums, it would stay there for good
            self.sums = sums
            self.steps += 1

    def line(self) -> tuple[float, float]:
        """(a, b): seconds of a step, and of each token it verifies."""
        w, t, tt, s, ts = self.sums
        if w == 0:
            return 1.0, ASSUMED_ROW_COST
        spread = w * tt - t * t
        if self.steps >= FIT_STEPS and spread > 1e-9 * w * w:
            b = (w * ts - t * s) / spread
            a = (s - b * t) / w
            if b >= 0 and a > 0:
                return a, b
        a = s / (w + ASSUMED_ROW_COST * t)  # the mean step under the assumed ratio
        return a, ASSUMED_ROW_COST * a

    def seconds(self, tokens: int) -> float:
        a, b = self.line()
        return a + b * tokens


@dataclass
class _Request:
    """What the proposer keeps of one running request: its tokens (the suffix source's) and its last draft."""

    suffix: SuffixDrafter
    draft: TokenTree  # the chain proposed last step, as a tree (its nodes' sources and depths count its statistics)


def best_chain(tree: TokenTree, longest: int) -> TokenTree:
    """The tree's path of at most ``longest`` nodes with the most expected accepted tokens (the sum of its
    scores), as a chain tree."""
    if not len(tree) or longest <= 0:
        return TokenTree.empty()
    value = np.empty(len(tree))
    for i, p in enumerate(tree.parents):  # parents come before their children
        value[i] = tree.scores[i] + (value[p] if p >= 0 else 0.0)
    value[tree.depths > longest] = -1.0
    return _chain(tree, tree.path(int(np.argmax(value))))


def price_floor(scores: list[np.ndarray], a: float, b: float) -> float:
    """The lowest acceptance probability worth drafting this step (inf: none is): the draft tokens kept, best first
    across every request's chain, maximise the step's expected tokens per second, (requests + accepted) /
    (a + b x (requests + drafted)). Each chain's scores never rise along it, so what is kept is chain prefixes."""
    best = np.sort(np.concatenate(scores or [np.empty(0)]))[::-1]
    requests = len(scores)
    rate = (requests + np.concatenate([[0.0], np.cumsum(best)])) / (a + b * (requests + np.arange(best.size + 1)))
    keep = int(np.argmax(rate))
    return best[keep - 1] if keep else np.inf


class LookaheadProposer:
    """A vLLM ``custom_class`` proposer: one chain a running request, drafted from its own suffix matches and
    the n-gram pool every request shares, as long as the measured step cost says pays."""

    config = LookaheadConfig(window=0, ngram=4, guess=4, tree_budget=32, suffix_drafts=4, recycle_k=0, recycle_prior=0, auto=False)
    state_dir: str | None = None  # a ``DraftState`` directory: loaded when the proposer starts, saved as it runs
    save_interval: float = 60.0  # seconds between saves of ``state_dir``

    def __init__(self, vllm_config) -> None:
        spec, model = vllm_config.speculative_config, vllm_config.model_config
        self.longest = int(spec.num_speculative_tokens)
        self.max_len = int(model.max_model_len)
        self.vocab = model.get_vocab_size()
        self.cfg = replace(self.config, suffix_length=max(self.config.suffix_length, self.longest))
        if self.cfg.window or self.cfg.recycle_k:
            raise ValueError("LookaheadProposer drafts without the Jacobi window and the recycling table (they need the "
                             "model's logits): set window=0 and recycle_k=0 in its config")
        if self.state_dir and (Path(self.state_dir) / "pool.npz").exists():
            self.state = DraftState.load(self.state_dir, self.vocab)
            self.state.check_fits(self.vocab, self.cfg)
        else:
            self.state = DraftState.for_config(self.vocab, self.cfg)
        DraftState.warm_up()
        self.requests: list[_Request | None] = []  # by row, as of the last call
        self.cost = StepCost()
        self.last_call: float | None = None
        self.last_tokens = 0  # tokens the step after the last call verifies (0: unknown, a prefill's rows among them)
        self.saved = time.monotonic()

    def load_model(self, *args, **kwargs) -> None:
        """vLLM's drafter interface: there is no draft model."""

    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec: np.ndarray, token_ids_cpu: np.ndarray,
                slot_mappings=None) -> list[list[int]]:
        """One chain of draft tokens per row (empty: none), after the tokens each row just got."""
        now = time.perf_counter()
        # 1. whose row is whose: each row's tokens continue its own earlier state, a moved one's, or none (a new request)
        earlier, steady = self.requests, self.last_call is not None
        self.requests, steps = [], []
        for row, sampled in enumerate(sampled_token_ids):
            tokens = self._tokens(row, len(sampled), num_tokens_no_spec, token_ids_cpu)
            if tokens is None:  # a prompt still being prefilled, a row that takes no draft, or one it cannot read
                self.requests.append(None)
                steady = False
                continue
            request = _claim(earlier, row, tokens)
            if request is None:  # a new request: the pool learns its prompt; its suffix source starts with it
                request = _Request(self.state.start(tokens[: len(tokens) - len(sampled)].tolist(), self.cfg), TokenTree.empty())
                steady = False
            if len(tokens) > len(request.suffix):
                steps.append(self._observed(request, tokens, len(sampled)))
            self.requests.append(request)
        # 2. learn: acceptance statistics of last step's chains, the pool (output n-grams), the suffix sources
        self.state.learn(self.cfg, steps)
        if steady and self.last_tokens:
            self.cost.observe(self.last_tokens, now - self.last_call)
        # 3. propose: each row's best chain, then the draft tokens that pay across all rows
        live = [r for r in self.requests if r is not None]
        for request in live:
            room = min(self.longest, self.max_len - len(request.suffix) - 1)
            tree = self.state.propose(int(request.suffix.tokens[-1]), self.cfg, self.cfg.tree_budget, room, request.suffix)
            request.draft = best_chain(tree, room)
        floor = price_floor([r.draft.scores for r in live], *self.cost.line())
        for request in live:
            request.draft = _chain(request.draft, np.flatnonzero(request.draft.scores >= floor))  # a prefix: scores fall along it
        self.last_tokens = 0 if None in self.requests else sum(1 + len(r.draft) for r in live)  # 0: a prefill's unknown rows
        self.last_call = time.perf_counter()
        self._save_now_and_then()
        return [[] if r is None else r.draft.tokens.tolist() for r in self.requests]

    def _tokens(self, row: int, sampled: int, counts: np.ndarray, table: np.ndarray) -> np.ndarray | None:
        """The row's tokens; None where it sampled none, or where vLLM's arrays do not hold a row it can read (no
        such row, a count outside the table or below what it sampled, ids outside the vocabulary): drafting from it
        would raise, which takes vLLM's engine core down, or draft from garbage."""
        if not sampled or row >= min(len(counts), len(table)) or not sampled <= counts[row] <= table.shape[1]:
            return None
        tokens = table[row, : int(counts[row])]
        return tokens if 0 <= tokens.min() and tokens.max() < self.vocab else None

    def _observed(self, request: _Request, tokens: np.ndarray, sampled: int) -> Observed:
        """What the step showed a request: its new tokens and how many of its draft they accepted (none counted
        where more tokens came than the last step sampled: calls were missed, the draft is not what was verified)."""
        known = len(request.suffix)
        emitted = tokens[known:].tolist()
        verified = request.draft if len(emitted) == sampled else TokenTree.empty()
        accepted = 0
        while accepted < min(len(verified), len(emitted)) and verified.tokens[accepted] == emitted[accepted]:
            accepted += 1
        return Observed(tree=verified, path=list(range(accepted)), emitted=emitted,
                        trajectories=np.empty((0, self.cfg.ngram), np.int64), row_tokens=np.empty(0, np.int64),
                        row_topk=np.empty((0, 1), np.int64), history_tail=tokens[max(known - self.cfg.ngram + 1, 0) : known].tolist(),
                        suffix=request.suffix)

    def _save_now_and_then(self) -> None:
        if self.state_dir and time.monotonic() - self.saved > self.save_interval:
            self.state.save(self.state_dir)
            self.saved = time.monotonic()


def _claim(earlier: list[_Request | None], row: int, tokens: np.ndarray) -> _Request | None:
    """The earlier state this row's tokens continue (its own row's first: requests move only when one finishes),
    taken out of ``earlier`` so no two rows share one; None for a new request."""
    order = ([row] if row < len(earlier) else []) + [i for i in range(len(earlier)) if i != row]
    for i in order:
        request = earlier[i]
        if request is not None and len(request.suffix) <= len(tokens) and np.array_equal(request.suffix.tokens, tokens[: len(request.suffix)]):
            earlier[i] = None
            return request
    return None


def _chain(tree: TokenTree, nodes: list[int] | np.ndarray) -> TokenTree:
    """The chain of ``tree``'s ``nodes`` (a path, top down), as a tree of its own."""
    return TokenTree(tree.tokens[nodes], np.arange(len(nodes)) - 1, np.arange(1, len(nodes) + 1), tree.scores[nodes], tree.sources[nodes])
