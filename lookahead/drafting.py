"""Drafting: every free source proposes continuations of the current token; one tree is built from them.

Sources (all torch-free structures of ``ngram_pool``):
  pool     n-grams of the Jacobi trajectories, the prompt and earlier output (``NGramPool``), chains of N-1
  suffix   the longest matches of the sequence's last tokens earlier in it (``SuffixDrafter``), long chains
  recycle  token -> its k likeliest successors, rewritten from every forward's top-k (``RecycleTable``),
           expanded breadth-first along a template into a real tree

Each draft node is scored with the probability that it is accepted, measured online as the product of
conditional acceptance rates along its path: per source and depth for chains (tried = its parent was
accepted), per successor rank for the recycling table (how often the rank-r successor of an accepted token
was the next token), over the last ~``STATS_MEMORY`` steps; suffix drafts from matches of 3+ tokens have
statistics of their own, and so do the table's nodes that a chain proposes too (``AGREE``). ``DraftState``
owns the sources and the statistics; it lives across requests (pass
it to ``generate(state=...)``), and saves and loads as a directory of ``.npz`` files.

A new source of chains shared across requests is one class (``ChainSource``: ``start``, ``propose``, ``learn``,
and the names of its statistics rows), given to ``DraftState(extra=...)``; its chains are merged, scored and
counted as the pool's are.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple, Protocol

import numpy as np
from numba import njit

from lookahead.config import LookaheadConfig
from lookahead.tree import TokenTree, draft_rows
from ngram_pool import NGramPool, RecycleTable, Origin, SuffixDrafter, template
from ngram_pool.files import ArrayFile, written_whole
from ngram_pool.recycle import expand_template

SOURCES = ("trajectory", "prompt", "output", "other", "suffix", "recycle")  # bit i of a node's ``sources``
POOL_ROWS = np.full(256, SOURCES.index("other"), np.int64)  # pool origin code -> statistics row
POOL_ROWS[[int(s) for s in Origin]] = [SOURCES.index(s.name.lower()) for s in Origin]
TRAJECTORY, SUFFIX, RECYCLE = SOURCES.index("trajectory"), SOURCES.index("suffix"), SOURCES.index("recycle")
# an extra statistics row (and source bit) for suffix drafts from long matches, which are far likelier right
SUFFIX_LONG, LONG_MATCH = len(SOURCES), 3
# ... and one (no source bit) for the recycling table's nodes that a chain source proposed too (``merge_drafts``)
AGREE = len(SOURCES) + 1
STAT_ROWS = len(SOURCES) + 2
MAX_DEPTH = 32  # statistics buckets: depth for chains, rank for the recycling table
ASSUMED_WEIGHT = 4.0  # the assumed rates below are worth this many observations
STATS_MEMORY = 1000  # steps: every step's counts weigh 1 - 1/STATS_MEMORY less, so a state kept across requests
                     # follows what it drafts for now (code after chat) instead of averaging everything it has seen


def _assumed_rates() -> np.ndarray:
    """(sources, MAX_DEPTH) acceptance rates assumed before any are measured, as measured with SmolLM2-135M on
    the benchmark's four sets: a chain's first node is accepted about 1 time in 5 and a node whose parent was
    accepted about half the time, whatever the source; the recycling table's rank-r successor is the next
    token with probability about 0.4 / (r + 1)^2 (0.44, 0.09, 0.04, 0.02 measured)."""
    assumed = np.full((STAT_ROWS, MAX_DEPTH), 0.5)
    assumed[:, 0] = 0.2
    assumed[SUFFIX_LONG] = 0.7  # a copy of 3+ matched tokens goes on more often than not
    assumed[SUFFIX_LONG, 0] = 0.4
    assumed[RECYCLE] = 0.4 / (1.0 + np.arange(MAX_DEPTH)) ** 2
    return assumed  # AGREE: as a chain's until measured (0.2 at depth 1, one half deeper; measured 0.45-0.53)
ASSUMED_RATES = _assumed_rates()
NONE = np.empty(0, np.int64)
NO_TEMPLATE = (NONE, NONE, np.empty(0))  # parents, ranks, scores of no recycling expansion
_NO_DRAFTS = np.empty((0, 1), np.int32)
NO_SUFFIX = (_NO_DRAFTS[:, :-1], _NO_DRAFTS[:, -1])  # no suffix drafts, of the types ``SuffixDrafter.drafts`` gives
NO_RANKS = np.zeros((2, 0), np.int64)  # the recycling table's counts by rank (tried, hit) of no step
TEMPLATE_REFRESH = 16  # steps between re-derivations of the recycling template from the measured rank rates
STATE_FORMAT = 3  # 2: no AGREE row (loads, the row unmeasured)


@njit(cache=True)
def count_tried(parents: np.ndarray, sources: np.ndarray, depths: np.ndarray, path: np.ndarray, tried: np.ndarray,
                hits: np.ndarray, fade: float, ranks: np.ndarray) -> None:
    """A step's statistics into tried/hits (rows, MAX_DEPTH): first both times ``fade`` (older steps weigh less) and
    the recycling table's counts by rank (``ranks`` (2, k): tried, hit) into its row; then every node whose parent
    was accepted (the current token, parent -1, always is) was tried by each statistics row its source bits name
    (AGREE: a recycled node a chain proposed too), at its depth; the ``path``'s nodes were accepted. One kernel
    where a dozen numpy calls took ~0.035 ms a step, each cold after the forward."""
    if fade != 1.0:
        tried *= fade
        hits *= fade
    for r in range(ranks.shape[1]):
        tried[RECYCLE, r] += ranks[0, r]
        hits[RECYCLE, r] += ranks[1, r]
    k = parents.size
    accepted = np.zeros(k + 1, np.bool_)  # index k: the current token
    accepted[k] = True
    for node in path:
        accepted[node] = True
    for i in range(k):
        if not accepted[parents[i] if parents[i] >= 0 else k]:
            continue
        depth = min(depths[i], MAX_DEPTH) - 1
        for row in range(tried.shape[0]):
            if row == AGREE:
                on = (sources[i] >> RECYCLE) & 1 == 1 and sources[i] != 1 << RECYCLE
            else:
                on = row != RECYCLE and (sources[i] >> row) & 1 == 1
            if on:
                tried[row, depth] += 1
                hits[row, depth] += accepted[i]


@njit(cache=True)
def shrunk_rates(hits: np.ndarray, tried: np.ndarray, assumed: np.ndarray, weight: float) -> np.ndarray:
    """(rows, MAX_DEPTH) (hits + assumed weight) / (tried + weight), cell by cell: one kernel where numpy's four calls
    and their arrays took ~16 us of each proposal, cold after the forward."""
    out = np.empty_like(assumed)
    for i in range(out.shape[0]):
        for j in range(out.shape[1]):
            out[i, j] = (hits[i, j] + assumed[i, j] * weight) / (tried[i, j] + weight)
    return out


@njit(["(int32[:, :], int64[:], int32[:, :], int32[:])", "(int64[:, :], int64[:], int32[:, :], int32[:])"], cache=True)
def stacked_chains(chains: np.ndarray, rows: np.ndarray, drafts: np.ndarray, matched: np.ndarray
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The chain sources' ``chains`` (C, L) (their statistics ``rows`` (C,)), then the suffix ``drafts`` (S, L') (their
    ``matched`` lengths (S,)), as ``draft_rows`` takes them: (C + S, max(L, L')) token ids, -1 after a chain's end, each
    chain's statistics row and source bits (a suffix draft's: SUFFIX, or SUFFIX_LONG with both bits from a match of
    ``LONG_MATCH`` tokens or more). One kernel where numpy's dozen calls took ~0.03 ms of each proposal, cold. Its
    types are declared, of any layout: the sources' chains are views whose layout moves with their rows (C or not), and
    each layout met would have been a kernel of its own, compiled at its first call."""
    c, s = chains.shape[0], drafts.shape[0]
    out = np.full((c + s, max(chains.shape[1], drafts.shape[1])), -1, np.int64)
    out_rows, bits = np.empty(c + s, np.int64), np.empty(c + s, np.int64)
    for i in range(c):
        out[i, : chains.shape[1]] = chains[i]
        out_rows[i], bits[i] = rows[i], 1 << rows[i]
    for i in range(s):
        out[c + i, : drafts.shape[1]] = drafts[i]
        long = matched[i] >= LONG_MATCH
        out_rows[c + i] = SUFFIX_LONG if long else SUFFIX
        bits[c + i] = 1 << SUFFIX | (1 << SUFFIX_LONG if long else 0)
    return out, out_rows, bits


class Observed(NamedTuple):
    """What one sequence's step showed its sources (``DraftState.learn``)."""

    tree: TokenTree  # the tree verified
    path: list[int]  # its accepted nodes, top down
    emitted: list[int]  # the tokens emitted: the path's, then the model's own
    trajectories: np.ndarray  # (W, N) finished Jacobi columns (W = 0: the window did not run)
    row_tokens: np.ndarray  # (R,) input token of every row whose logits were computed, accepted rows last
    row_topk: np.ndarray  # (R, k) their top-k next tokens
    history_tail: list[int]  # the N-1 tokens before ``emitted``
    suffix: SuffixDrafter  # the sequence's own suffix source


class ChainSource(Protocol):
    """A drafting source shared by every request of a state that proposes chains after the current token (the
    n-gram pool is one; ``DraftState(extra=...)`` takes more). ``rows`` names its statistics rows: each chain it
    proposes names one (an index into ``rows``), whose measured acceptance rates score the chain's nodes and
    whose source bit they carry (``DraftState.names``)."""

    rows: tuple[str, ...]

    def start(self, prompt: np.ndarray, cfg: LookaheadConfig) -> None:
        """A request begins with ``prompt``."""

    def propose(self, current: int, cfg: LookaheadConfig) -> tuple[np.ndarray, np.ndarray]:
        """Chains (C, L) of token ids after ``current`` (-1 pads a short one) and each one's row (C,)."""

    def learn(self, cfg: LookaheadConfig, steps: list[Observed]) -> None:
        """What a step of one or more sequences showed (``DraftState.learn``)."""


def checked_chains(source: ChainSource, chains: np.ndarray, rows: np.ndarray, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """An extra source's proposal (``ChainSource.propose``) as int64 arrays, or a ValueError naming the source: its rows
    index the statistics and its tokens go into the model (a row of -9 hung the loop, a token past the vocabulary
    failed deep in the embedding)."""
    name, chains, rows = type(source).__name__, np.asarray(chains), np.asarray(rows)
    if chains.ndim != 2 or chains.size and chains.dtype.kind not in "iu":
        raise ValueError(f"{name}.propose must give its chains as a 2-D integer array, got {chains.dtype} of shape {chains.shape}")
    if rows.shape != chains.shape[:1] or rows.size and rows.dtype.kind not in "iu":
        raise ValueError(f"{name}.propose must give one integer row a chain, got {rows.dtype} of shape {rows.shape} for {chains.shape[0]} chains")
    if ((rows < 0) | (rows >= len(source.rows))).any():
        raise ValueError(f"{name}.propose named a statistics row outside [0, {len(source.rows)}) (its rows: {source.rows})")
    if ((chains < -1) | (chains >= vocab_size)).any():
        raise ValueError(f"{name}.propose drafted a token outside [0, {vocab_size}) (-1 ends a chain)")
    return chains.astype(np.int64, copy=False), rows.astype(np.int64, copy=False)


class PoolSource:
    """The n-gram pool as a chain source: a request's prompt n-grams when it starts, the Jacobi trajectories and
    the output's n-grams as they come; its rows are where an n-gram came from."""

    rows = SOURCES[: SUFFIX]  # trajectory, prompt, output, other: POOL_ROWS maps the pool's origin codes onto them

    def __init__(self, pool: NGramPool) -> None:
        self.pool = pool

    def start(self, prompt: np.ndarray, cfg: LookaheadConfig) -> None:
        if cfg.seed_pool_from_prompt:
            self.pool.insert_sequence(prompt, Origin.PROMPT)

    def propose(self, current: int, cfg: LookaheadConfig) -> tuple[np.ndarray, np.ndarray]:
        grams, codes = self.pool.lookup_with_origins(current, cfg.guess)  # guess 0: none, of the same types as ever
        return grams, POOL_ROWS[codes]

    def learn(self, cfg: LookaheadConfig, steps: list[Observed]) -> None:
        grams = [s.trajectories for s in steps if s.trajectories.size]
        if grams:
            self.pool.insert_many(np.concatenate(grams), Origin.TRAJECTORY)
        if cfg.pool_from_output:
            self.pool.insert_sequences([s.history_tail + s.emitted for s in steps], Origin.OUTPUT)


class DraftState:
    """The drafting sources and their acceptance statistics for one vocabulary and n-gram length.

    The drafting knobs (how many drafts of each source, the budget) come from the ``LookaheadConfig``
    passed to each call, so one state serves generators that differ only in those.
    """

    def __init__(self, vocab_size: int, ngram: int, pool_slots: int = 16, recycle_k: int = 8, sparse: bool = False,
                 extra: tuple[ChainSource, ...] = ()) -> None:
        """extra: chain sources beside the pool, each with statistics rows of its own after the built-in ones
        (only the built-in sources are saved: ``save``)."""
        self.vocab_size = vocab_size
        self.recycle = RecycleTable(vocab_size, max(recycle_k, 1))
        pool = PoolSource(NGramPool(vocab_size, ngram, pool_slots, sparse=sparse))
        self.chains: list[tuple[ChainSource, int]] = [(pool, 0)]  # each with its first statistics row
        for source in extra:
            rows = getattr(source, "rows", None)
            if not all(callable(getattr(source, name, None)) for name in ("start", "propose", "learn")) \
                    or not isinstance(rows, tuple) or not rows or not all(isinstance(row, str) for row in rows):
                raise ValueError(f"an extra source is a ChainSource (start, propose, learn, and its statistics rows: a tuple "
                                 f"of names), got {type(source).__name__}")
            self.chains.append((source, STAT_ROWS + sum(len(s.rows) for s, _ in self.chains[1:])))
        # bit i of a node's ``sources`` and statistics row i: its name (None: a row with no source of its own)
        self.names = SOURCES + (None, None) + tuple(row for source in extra for row in source.rows)
        if len(self.names) > 63:
            raise ValueError(f"{len(self.names)} statistics rows: a node's sources are bits of an int64 (63 at most)")
        self.assumed = np.vstack([ASSUMED_RATES, np.repeat(ASSUMED_RATES[TRAJECTORY:TRAJECTORY + 1], len(self.names) - STAT_ROWS, 0)])  # a chain's
        self.tried = np.zeros_like(self.assumed)  # nodes offered whose parent was accepted
        self.hits = np.zeros_like(self.assumed)  # ... and accepted
        self._template, self._template_age = None, TEMPLATE_REFRESH

    @property
    def pool(self) -> NGramPool:
        """The n-gram pool: the first chain source's."""
        return self.chains[0][0].pool

    @staticmethod
    def warm_up() -> None:
        """Compile (or load from numba's on-disk cache) every drafting kernel, for every argument type the decode
        loop passes, once per process: a fresh install's first request would otherwise spend seconds compiling."""
        for source in (NGramPool, RecycleTable, SuffixDrafter):
            source._warm_up()
        draft_rows(np.zeros((1, 1), np.int64), np.zeros(1, np.int64), np.ones(1, np.int64), np.ones((STAT_ROWS, MAX_DEPTH)),
                   NONE, NONE, np.empty(0), 1, np.ones(MAX_DEPTH), 1, 1)
        count_tried(np.full(1, -1, np.int64), np.ones(1, np.int64), np.ones(1, np.int64), NONE, np.zeros((STAT_ROWS, MAX_DEPTH)),
                    np.zeros((STAT_ROWS, MAX_DEPTH)), 1.0, NO_RANKS)
        shrunk_rates(np.zeros((STAT_ROWS, MAX_DEPTH)), np.zeros((STAT_ROWS, MAX_DEPTH)), ASSUMED_RATES, ASSUMED_WEIGHT)

    # -- per request ----------------------------------------------------------------------------

    @classmethod
    def for_config(cls, vocab_size: int, config: LookaheadConfig, sparse: bool = False,
                   extra: tuple[ChainSource, ...] = ()) -> "DraftState":
        return cls(vocab_size, config.ngram, config.pool_slots, config.recycle_k, sparse, extra)

    def check_fits(self, vocab_size: int, config: LookaheadConfig) -> None:
        """ValueError unless this state can draft for a generator of this vocabulary and config."""
        if self.vocab_size != vocab_size or self.pool.n != config.ngram or self.recycle.k < config.recycle_k:
            raise ValueError(f"drafting state is for {self.pool.n}-grams over {self.vocab_size} ids with {self.recycle.k} "
                             f"successors per token; this generator needs {config.ngram}-grams over {vocab_size} ids "
                             f"and {config.recycle_k} successors")

    def start(self, prompt: list[int], config: LookaheadConfig) -> SuffixDrafter:
        """A new request: the chain sources see its prompt (the pool learns its n-grams); returns the request's own
        suffix source (pass it to ``propose`` and ``learn``), so requests decoded together share everything else."""
        for source, _ in self.chains:
            source.start(np.asarray(prompt), config)
        suffix = SuffixDrafter(self.vocab_size)
        suffix.reset(np.asarray(prompt))
        return suffix

    def rates(self) -> np.ndarray:
        """(rows, MAX_DEPTH) estimated conditional acceptance rates, shrunk towards the assumed ones."""
        return shrunk_rates(self.hits, self.tried, self.assumed, ASSUMED_WEIGHT)

    def propose(self, current: int, cfg: LookaheadConfig, budget: int, max_depth: int, suffix: SuffixDrafter) -> TokenTree:
        """The best tree of at most ``budget`` nodes, none deeper than ``max_depth``, after ``current`` (the last
        token of ``suffix``'s sequence)."""
        if budget <= 0 or max_depth <= 0:
            return TokenTree.empty()
        if not 0 <= current < self.vocab_size:
            raise ValueError(f"current token {current} is outside the vocabulary [0, {self.vocab_size})")
        rates = self.rates()
        chains, rows = self._chains(current, cfg)
        drafts, matched = suffix.drafts(cfg.suffix_drafts, cfg.suffix_length) if cfg.suffix_drafts else NO_SUFFIX
        chains, rows, bits = stacked_chains(chains, rows, drafts, matched)
        parents, ranks, scores = self._recycle_template(rates[RECYCLE, : cfg.recycle_k], budget, max_depth) if cfg.recycle_k else NO_TEMPLATE
        expanded = expand_template(self.recycle.table, current, parents, ranks)  # the template is ours: only ``current`` is checked
        return TokenTree(*draft_rows(chains, rows, bits, rates, expanded, parents, scores, 1 << RECYCLE, rates[AGREE], budget, max_depth))

    def _chains(self, current: int, cfg: LookaheadConfig) -> tuple[np.ndarray, np.ndarray]:
        """The chain sources' chains after ``current`` (C, L), -1 after a chain's end, and their statistics rows (C,): the
        pool's as it gives them (the state's one source but where ``extra`` adds more)."""
        found = []
        for source, first in self.chains:
            chains, own = source.propose(current, cfg)
            if first:  # an extra source's rows follow the built-in ones; its proposal is checked (the pool's is ours)
                chains, own = checked_chains(source, chains, own, self.vocab_size)
                own = first + own
            found.append((chains, own))
        if len(found) == 1:
            return found[0]
        stacked = np.full((sum(c.shape[0] for c, _ in found), max(c.shape[1] for c, _ in found)), -1, np.int64)
        start = 0
        for c, _ in found:
            stacked[start : start + c.shape[0], : c.shape[1]] = c
            start += c.shape[0]
        return stacked, np.concatenate([rows for _, rows in found])

    def _recycle_template(self, rank_rates: np.ndarray, budget: int, max_depth: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The recycling expansion's template for the measured rank rates (re-derived every few steps)."""
        key = (budget, min(max_depth, MAX_DEPTH), rank_rates.size)
        self._template_age += 1
        if self._template is None or self._template[0] != key or self._template_age >= TEMPLATE_REFRESH:
            parents, ranks, _ = template(rank_rates, budget, key[1])
            scores = np.empty(parents.size)
            for i, (p, r) in enumerate(zip(parents, ranks)):
                scores[i] = rank_rates[r] * (scores[p] if p >= 0 else 1.0)
            self._template, self._template_age = (key, parents, ranks, scores), 0
        return self._template[1:]

    def learn(self, cfg: LookaheadConfig, steps: list[Observed]) -> None:
        """After a step of one or more sequences (a batch's, in order): acceptance statistics, then every source
        learns what the step showed. The shared sources take the whole batch in one call each (per-sequence
        calls were most of a batch's host work: ~0.45 ms a step at 8 sequences), so in a batch each sequence's
        recycling ranks are counted against the table as it was before the step (not after its batch mates'
        rows), and the pool takes every trajectory, then every output n-gram: statistics and recency only."""
        # 1. recycling ranks (before the table takes this step): where did each emitted token stand among its
        #    predecessor's successors? Then the table takes every row's top-k
        ranks = NO_RANKS
        if cfg.recycle_k and steps:
            before = np.array([t for s in steps for t in s.history_tail[-1:] + s.emitted[:-1]], np.int64)
            emitted = np.array([t for s in steps for t in s.emitted], np.int64)
            rows, topk = ((steps[0].row_tokens, steps[0].row_topk) if len(steps) == 1 else
                          (np.concatenate([s.row_tokens for s in steps]), np.concatenate([s.row_topk for s in steps])))
            ranks = self.recycle.rank_then_update(before, emitted, cfg.recycle_k, rows, topk)
        # 2. statistics, older steps fading (``STATS_MEMORY``): the ranks, then the chains' nodes (every node whose
        #    parent was accepted was tried; the path's were accepted), in one kernel call a sequence
        fade = 1 - 1 / STATS_MEMORY
        for step in steps:
            count_tried(step.tree.parents, step.tree.sources, step.tree.depths, np.asarray(step.path, np.int64), self.tried,
                        self.hits, fade, ranks)
            fade, ranks = 1.0, NO_RANKS
        if not steps:
            self.tried *= fade
            self.hits *= fade
        # 3. the chain sources (the pool: finished Jacobi columns and the n-grams ending in a new token); the
        #    suffix sources: the tokens
        for source, _ in self.chains:
            source.learn(cfg, steps)
        for step in steps:
            step.suffix.extend(np.asarray(step.emitted))

    # -- persistence ----------------------------------------------------------------------------

    def save(self, directory: str | Path) -> None:
        """Write ``pool.npz``, ``recycle.npz`` and ``acceptance.npz`` (the built-in sources' rows) into ``directory``
        (created if missing), each whole or not at all (``written_whole``): a save killed midway leaves each file
        the old one or the new one (old and new files of one generator's state load together)."""
        directory = Path(directory)
        if directory.exists() and not directory.is_dir():
            raise ValueError(f"{directory}: exists and is not a directory; the drafting state is saved as a directory")
        directory.mkdir(parents=True, exist_ok=True)
        self.pool.save(directory / "pool.npz")
        self.recycle.save(directory / "recycle.npz")
        with written_whole(directory / "acceptance.npz") as out:
            np.savez(out, format_version=np.int64(STATE_FORMAT), tried=self.tried[:STAT_ROWS], hits=self.hits[:STAT_ROWS])

    @classmethod
    def load(cls, directory: str | Path, vocab_size: int | None = None) -> "DraftState":
        """Read a state written by ``save``, every field checked (against ``vocab_size`` too, when given) before
        anything is allocated: a missing, corrupt, hostile or mismatched file raises ``ValueError``."""
        directory = Path(directory)
        if not directory.is_dir():
            raise ValueError(f"{directory}: no drafting state directory")
        pool = NGramPool.load(directory / "pool.npz", vocab_size)
        recycle = RecycleTable.load(directory / "recycle.npz", vocab_size=pool.vocab_size)
        with ArrayFile(directory / "acceptance.npz", "acceptance statistics") as f:
            version = f.scalar("format_version")
            f.check("format_version", version in (2, STATE_FORMAT), f"unsupported version {version} (expected {STATE_FORMAT})")
            rows = AGREE if version == 2 else STAT_ROWS  # version 2: from before the AGREE row, which starts unmeasured
            tried, hits = (np.vstack([f.array(name, np.float64, (rows, MAX_DEPTH)), np.zeros((STAT_ROWS - rows, MAX_DEPTH))])
                           for name in ("tried", "hits"))
            f.check("tried", np.isfinite(tried).all() and (tried >= 0).all(), "a count that is negative or not finite")
            f.check("hits", np.isfinite(hits).all() and (hits >= 0).all() and (hits <= tried).all(),
                    "a count that is negative, not finite or above its tried count")
        state = cls(pool.vocab_size, pool.n, pool.slots_per_key, recycle.k)
        state.chains[0], state.recycle, state.tried, state.hits = (PoolSource(pool), 0), recycle, tried, hits
        return state
