"""Each step, what to run: the tree size and the Jacobi branch that maximise expected tokens per unit of cost,
on the measured curve (``probing``) as the loop's own timings correct it, with gains the loop has checked.

For one sequence, ``choose`` takes the drafted tree and the estimated value of the Jacobi branch and picks
the tree size k and whether to feed the window:

    value(k, window) = (1 + S(k) + window x J) / r(1 + k + window x W(N-1))

where S(k) is the sum of the k best node scores (each the estimated probability that the node is
accepted, so the sum is the expected number of accepted draft tokens) and J the Jacobi branch's measured
worth (draft tokens accepted per step that only its trajectories proposed). Plain decoding is value 1: when
nothing beats it, the step is plain (T = 1), and the tree keeps being drafted (every step, then, once no draft
has been accepted for a while and where proposing is a noticeable share of a step, every ``DORMANT_STRIDE``-th
step, rarer the longer it lasts: ``LiveCurve.dormant``),
so an input-grounded stretch (a long suffix match) turns drafting back on by itself. ``plan`` is the same rule
for a batch. Each drafting width is priced with the host work a drafting step adds (its sources' proposals and
learning: measured, ~0.2-0.4 ms of a 7 ms SmolLM2 int8 step on a Zen 3). What the rule promises is then held
against what came: a lane whose drafting steps, whole, give fewer tokens a second than a plain step would rests
(``Pace``).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import numpy as np
import torch
from numba import njit

from lookahead.curve import CostCurve
from lookahead.drafting import TRAJECTORY
from lookahead.layout import StepLayout
from lookahead.tree import TokenTree
from lookahead.verify import Verdict, accepted_after

JACOBI_ASSUMED = 0.05  # draft tokens per step credited to the Jacobi branch before any is measured (SmolLM2: ~0)
JACOBI_DECAY = 0.05  # weight of each step in its running estimate
RETRY = 64  # steps after which what the planner left off (drafting, the Jacobi branch) runs once more, to re-measure it
DORMANT = 8  # forwards in a row without an accepted draft after which the loop proposes only every DORMANT_STRIDE-th step
DORMANT_STRIDE = 4  # ... doubled after every RETRY such forwards more, up to DORMANT_STRIDE << DORMANT_DEEPEST
DORMANT_DEEPEST = 2
DORMANT_HOST = 0.08  # ... and only where a drafting step's host work is this share of a plain forward or more
LIVE_WEIGHT = 0.1  # weight of each of the loop's own forward timings in the curve's online correction
LIVE_CLIP = 0.5  # most one timing moves a correction, in log units (a one-off stall must not price a width out)
CALIBRATION_DECAY = 0.95  # a sequence's calibration remembers its last ~20 drafting steps
CALIBRATION_ASSUMED = 1.0  # ... and starts as if one promised draft token had come (factor 1)
PACE_DECAY = 0.9  # a lane's pace remembers its last ~10 drafting steps
PACE_SAMPLES = 8  # drafting steps a lane takes before its pace is judged
PACE_MARGIN = 0.25  # ... and the share by which they must have lost: a clear loss only (``Pace`` says why)
PACE_RETRY = 32  # a lane whose drafting loses drafts once in this many steps, to measure it again
HOST_DECAY = 0.9  # weight of the past in the host work of a step (that drafted, or not)
NO_CELLS, NO_SCALES = np.zeros(0, np.int64), np.zeros(0)  # ``corrected_ratios``' arguments where no cell is observed


class LiveCurve:
    """The probed curve, corrected online by the loop's own forward timings, per batch size.

    A probe can disagree with the loop (seen: a bf16 probe's c(1) 40% above what the loop measured), and a
    wrong c(1) skews every ratio. Each timed forward of T rows over B sequences updates a running
    log-correction of c in its cell (B, the probed size nearest T); a step whose cell was never observed
    borrows the nearest observed cell's (in log B and log T), so the curve keeps its probed shape where the
    loop has not been, on both axes (the probe also timed 8 sequences x 1, 2, 4 rows: ``CostCurve.ratio``).
    Batch sizes are kept apart because B sequences of T/B rows cost more than one of T (each reads its own
    cache; measured, SmolLM2 fp32 over ~400 keys: 8 x 1 rows 50 ms, 1 x 8 rows 37 ms). A new cell starts from the correction it borrowed, and its first samples weigh
    more (1/2, 1/3, ... down to ``LIVE_WEIGHT``): a batch size that comes and goes in a server must learn its
    cost in a few steps (started from the probe instead, 8 sequences x 4 rows were still priced 7% low after
    13 samples).

    A width priced out is never run, so its cell is never corrected: measured, a 5-second stall of the machine
    (~90 ms forwards where 25 were usual) while a generator drafted left every drafting width priced ~3x
    high, and it decoded plain for the rest of the run (0.75x our plain loop, which pays no drafting host
    work). So one timing moves a cell by at most ``LIVE_CLIP``, a cell unobserved for ``RETRY`` forwards
    learns again as a new one (its next samples weigh 1/2, 1/3, ...), and after ``RETRY`` plain forwards in a
    row (``stale``, across requests) the loop drafts once whatever the prices say (``plan(explore=True)``).
    """

    def __init__(self, curve: CostCurve, corrects: bool = True) -> None:
        """corrects: False keeps the probed curve as it is (``LookaheadConfig.live_cost``); the counts of forwards
        (``stale``, ``dormant``) go on either way."""
        self.curve, self.corrects = curve, corrects
        self.log_scale: dict[tuple[int, int], float] = {}  # (batch, probed size index) -> log(measured / probed c)
        self.samples: dict[tuple[int, int], int] = {}
        self.seen: dict[tuple[int, int], int] = {}  # the cell's last observation, counted in ``observed`` forwards
        self.observed = 0
        self.plain_run = 0  # forwards in a row of one row per sequence
        self.idle_run = 0  # forwards in a row that accepted no draft token
        self.host = {False: None, True: None}  # seconds of host work of a step that drafted nothing, of one that drafted
        # per batch size: the probed r and the nearest probed size's index at 1, 2, ... rows (``_table``); the
        # observed cells as arrays (``_near``). Per-step numpy over the curve ran right after each forward, with
        # cold caches: ~0.25 ms a step (SmolLM2, Zen 5), ~1.5% of a bf16 step
        self._tables: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._cells: tuple[np.ndarray, np.ndarray] = (np.empty(0), np.empty(0))  # each observed cell's rows and batch size
        self._nearest: dict[int, np.ndarray] = {}  # per batch size: the observed cell nearest 1, 2, ... rows (its index)
        self._scales: np.ndarray | None = None  # ``log_scale``'s values, in its order

    @property
    def stale(self) -> bool:
        """No drafting width has been timed for ``RETRY`` forwards: the next step should draft, to re-measure."""
        return self.plain_run >= RETRY

    @property
    def dormant(self) -> bool:
        """No draft has been accepted for ``DORMANT`` forwards in a row: this step neither proposes nor teaches
        the shared sources (``loop``: host time, ~0.4 ms a step on SmolLM2, ~5% of its step, spent on drafts
        that gain nothing: chat text on a small model, or a batch whose rows are dear). Every
        ``DORMANT_STRIDE``-th step still drafts, every 8th after ``RETRY`` forwards more, every 16th after twice
        that, so a draft worth its rows (a long suffix match) waits at most that many steps. Counted on accepted
        drafts, not on plain forwards: drafting steps that came to nothing kept a chat answer proposing on most
        of its steps (SmolLM2 fp32, AVX2 held, MT-Bench: one step in six drafted, for 0.2 tokens each). Never
        where a drafting step's host work (what a dormant step saves, at most) is under ``DORMANT_HOST`` of a plain
        forward: there a dormant step saves little and forgoes its drafts and what its rows teach the sources
        (measured on a Xeon, int8: the 1.5B, host work ~1% of a step, dormant 1.22x the plain loop where fixed trees of
        4 nodes ran 1.39x, never dormant 1.37x; the 0.5B, ~4%, 1.46x against 1.64x, never dormant 1.66x; SmolLM2,
        ~12%, about even either way)."""
        if self.idle_run < DORMANT or not self.host_dear:
            return False
        return self.idle_run % (DORMANT_STRIDE << min((self.idle_run - DORMANT) // RETRY, DORMANT_DEEPEST)) != 0

    @property
    def host_dear(self) -> bool:
        """Whether a drafting step's host work is ``DORMANT_HOST`` of a plain forward or more (not measured yet: yes)."""
        drafting = self.host[True]
        return drafting is None or drafting >= DORMANT_HOST * self.seconds(1)

    def observe(self, tokens: int, seconds: float, batch: int = 1, accepted: int = 0, host: float | None = None,
                drafted: bool = False) -> None:
        """One forward of ``tokens`` rows over ``batch`` sequences took ``seconds`` and accepted ``accepted`` draft
        tokens; its step's host work took ``host`` seconds more, in a step that ``drafted`` or one that drafted nothing."""
        if isinstance(tokens, bool) or not isinstance(tokens, (int, np.integer)) or tokens < 1:
            raise ValueError(f"a forward has a whole number of rows >= 1, got {tokens!r}")
        if host is not None:
            was = self.host[drafted]
            self.host[drafted] = host if was is None else HOST_DECAY * was + (1 - HOST_DECAY) * host
        self.observed += 1
        self.plain_run = self.plain_run + 1 if tokens <= batch else 0
        self.idle_run = 0 if accepted else self.idle_run + 1
        if not self.corrects:
            return
        ratios, nearest = self._table(batch, tokens)
        cell = (batch, int(nearest[tokens - 1]))
        probed = self.curve.ms_at_1 * float(ratios[tokens - 1]) / 1000
        error = math.log(max(seconds, 1e-9) / probed)
        stale = self.observed - self.seen.get(cell, self.observed) > RETRY
        self.seen[cell] = self.observed
        n = self.samples[cell] = 1 if stale else self.samples.get(cell, 0) + 1
        old = self.log_scale[cell] if cell in self.log_scale else float(self._near(batch, tokens))  # starts from what it borrowed
        if cell not in self.log_scale:
            self._nearest.clear()  # a new cell: nearer than the old ones to some sizes
        self.log_scale[cell] = old + max(LIVE_WEIGHT, 1 / (n + 1)) * min(max(error - old, -LIVE_CLIP), LIVE_CLIP)
        self._scales = None

    def seconds(self, tokens: int, batch: int = 1) -> float:
        """What a forward of ``tokens`` rows over ``batch`` sequences costs, as corrected."""
        return self.curve.ms_at_1 / 1000 * math.exp(self._near(1, 1)) * float(self.ratio(tokens, batch))

    def drafting_host(self) -> float:
        """The host work a step that drafts adds to one that does not, in plain steps (0 until both are measured,
        or where the curve does not correct)."""
        plain, drafting = self.host[False], self.host[True]
        if not self.corrects or plain is None or drafting is None:
            return 0.0
        return max(drafting - plain, 0.0) / self.seconds(1)

    def ratio(self, tokens: int | np.ndarray, batch: int = 1) -> float | np.ndarray:
        """c(T rows over ``batch`` sequences) / c(1 row, one sequence), both corrected, never below 1."""
        if type(tokens) is int and tokens >= 1:  # one width, what the loop asks most (numpy on a scalar: ~20 us a call)
            return max(1.0, float(self._table(batch, tokens)[0][tokens - 1]) * math.exp(self._near(batch, tokens) - self._near(1, 1)))
        t = np.asarray(tokens)
        if t.dtype.kind in "iu" and t.size and t.min() >= 1:  # what the loop asks: the tables have it
            r = corrected_ratios(*self._corrections(batch, int(t.max())), t.astype(np.int64).ravel()).reshape(t.shape)
        else:
            r = np.maximum(1.0, self.curve.ratio(tokens, batch) * np.exp(self._near(batch, t) - self._near(1, 1)))
        return r if np.ndim(r) else float(r)

    def widths(self, widest: int, batch: int = 1) -> np.ndarray:
        """(widest,) ``ratio`` at B x T rows for T = 1 .. widest, B = ``batch``: what ``plan`` prices a step's widths by."""
        return corrected_ratios(*self._corrections(batch, batch * widest), np.arange(batch, batch * widest + 1, batch))

    def _corrections(self, batch: int, rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
        """``corrected_ratios``' tables for up to ``rows`` rows over ``batch`` sequences: the probed r, the nearest observed
        cells, their corrections and the one-row step's (one kernel over a step's widths: numpy there was ~30 us of a
        SmolLM2 plan, cold after the forward)."""
        probed = self._table(batch, rows)[0]
        if not self.log_scale:
            return probed, NO_CELLS, NO_SCALES, 0.0
        base = self._near(1, 1)  # (and ``_scales``, made where they were not)
        return probed, self._nearest_table(batch, rows), self._scales, base

    def _table(self, batch: int, rows: int) -> tuple[np.ndarray, np.ndarray]:
        """For ``batch`` sequences and 1, 2, ... (at least ``rows``) rows: the probed r, and the index of the
        probed size nearest each (its cell), computed once and grown by doubling."""
        table = self._tables.get(batch)
        if table is None or table[0].size < rows:
            t = np.arange(1, max(rows, 64, 2 * (table[0].size if table else 0)) + 1)
            nearest = np.abs(np.asarray(self.curve.sizes)[None, :] - t[:, None]).argmin(1)
            table = self._tables[batch] = (np.asarray(self.curve.ratio(t, batch)), nearest)
        return table

    def _near(self, batch: int, tokens: int | np.ndarray) -> float | np.ndarray:
        """The correction of the observed cell nearest (``batch``, ``tokens``) (0: none observed). Which cell is
        nearest to 1, 2, ... rows changes only when a cell is added: kept per batch size until then (the numpy
        over every cell at every call was ~0.04 ms a step)."""
        if not self.log_scale:
            return 0.0
        if self._scales is None:
            self._scales = np.fromiter(self.log_scale.values(), float, len(self.log_scale))
        if type(tokens) is int and tokens >= 1:  # one width: a Python float, without numpy's work on scalars
            return float(self._scales[self._nearest_table(batch, tokens)[tokens - 1]])
        return self._scales[self._nearest_cells(batch, np.asarray(tokens))]  # not what the loop asks: computed afresh

    def _nearest_table(self, batch: int, rows: int) -> np.ndarray:
        """The observed cell nearest 1, 2, ... (at least ``rows``) rows over ``batch`` sequences (its index), kept until
        a cell is added."""
        nearest = self._nearest.get(batch)
        if nearest is None or nearest.size < rows:
            nearest = self._nearest[batch] = self._nearest_cells(batch, np.arange(1, max(rows, 64) + 1))
        return nearest

    def _nearest_cells(self, batch: int, tokens: np.ndarray) -> np.ndarray:
        """The index (in ``log_scale``'s order) of the observed cell nearest each of ``tokens`` rows over ``batch``
        sequences, in log rows plus log batch size."""
        if self._cells[0].size != len(self.log_scale):  # cells are only ever added: keys and values keep one order
            self._cells = (np.asarray(self.curve.sizes, float)[[index for _, index in self.log_scale]],
                           np.array([float(b) for b, _ in self.log_scale]))
        rows, batches = self._cells
        distance = np.abs(np.log(rows / np.asarray(tokens, float)[..., None])) + np.abs(np.log(batches / batch))
        return distance.argmin(-1)


@dataclass(frozen=True)
class Choice:
    nodes: int  # tree nodes verified (the best ``nodes`` by score)
    window: bool  # whether the Jacobi branch runs
    value: float  # expected tokens per unit of plain-step cost (plain decoding: 1.0)
    tokens: float = 1.0  # tokens the step is expected to emit for the sequence
    ratio: float = 1.0  # the step's cost in plain steps (r(B x T))


PLAIN = Choice(0, False, 1.0)  # a step of the current token alone


def choose(curve: CostCurve | LiveCurve, tree: TokenTree, window_rows: int, window_value: float) -> Choice:
    """The step that maximises expected emitted tokens per cost for one sequence (see the module docstring)."""
    return plan(curve, [tree], [window_rows], [window_value])[0]


def plan(curve: CostCurve | LiveCurve, trees: list[TokenTree], window_rows: list[int], window_values: list[float],
         factors: list[float] | None = None, explore: bool = False, host: float = 0.0) -> list[Choice]:
    """The step of a batch: one width T for every sequence (the step is padded to its widest), each filling
    it with its best nodes (and its Jacobi branch where that gains more), maximising

        value(T) = sum over sequences of (1 + gain_b(T)) / r(B x T)

    so drafting shrinks as the batch grows, and stops where the batch alone fills the machine. B = 1 is the
    single-sequence rule of the module docstring; of equal values (within 1e-9), the narrowest width.
    ``factors``: each sequence's ``Calibration.factor`` (its node scores times it, at most 1 a node).
    ``explore``: the best step that drafts, even where plain is expected to be better (to re-measure a width
    the live curve has kept off; plain when nothing is drafted). ``host``: what a step that drafts costs beyond
    its forward, in plain steps (added to every width beyond one). Every width at once, in one kernel
    (``best_widths``; the widths' prices in another, ``widths``): numpy over the widths was ~0.13 ms of a SmolLM2
    step's host work, right after a forward that left every cache line it touches cold, and the numpy left around
    the kernel ~0.08 ms a call."""
    b = len(trees)
    sizes = [len(tree) for tree in trees]
    widest = max(size + 1 + rows for size, rows in zip(sizes, window_rows))
    scores = trees[0].scores if b == 1 else np.concatenate([tree.scores for tree in trees])
    nodes, window, gains, value, ratio = best_widths(
        np.asarray(scores, np.float64), np.array([0, *itertools.accumulate(sizes)], np.int64), np.array(factors or [1.0] * b, np.float64),
        np.array(window_rows, np.int64), np.array(window_values, np.float64), curve.widths(widest, b), host, explore)
    return [Choice(n, w, value, 1 + g, ratio) for n, w, g in zip(nodes.tolist(), window.tolist(), gains.tolist())]


@njit(cache=True)
def best_widths(scores: np.ndarray, bounds: np.ndarray, factors: np.ndarray, rows: np.ndarray, worths: np.ndarray,
                ratios: np.ndarray, host: float, explore: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray, float, float]:
    """``plan``'s rule: sequence b's node scores are ``scores[bounds[b]:bounds[b + 1]]``, its Jacobi branch ``rows[b]``
    rows worth ``worths[b]`` tokens; ``ratios`` (widest,) r(B x T) for T = 1 .. widest, ``host`` added beyond T = 1.
    Returns each sequence's nodes, whether its branch runs and the tokens they gain, at the best width; that width's
    value (tokens a sequence per cost) and its cost."""
    b_count, widest = bounds.size - 1, ratios.size
    gains = np.zeros(scores.size + b_count)  # S_b(k) for k = 0 .. n_b, sequence b's from bounds[b] + b
    for b in range(b_count):
        ranked = np.sort(scores[bounds[b]:bounds[b + 1]])[::-1]
        at = bounds[b] + b
        for i in range(ranked.size):
            gains[at + i + 1] = gains[at + i] + min(ranked[i] * factors[b], 1.0)
    costs = ratios.copy()
    costs[1:] += host
    values = np.zeros(widest)
    for b in range(b_count):
        for extra in range(widest):  # rows beyond the current token
            values[extra] += 1.0 + _fill(gains, bounds, rows, worths, b, extra)[2]
    values /= costs
    if explore and widest > 1:
        values[0] = -np.inf  # exploring: plain (width 1) is not a candidate
    best, top = 0, values.max()
    while values[best] < top - 1e-9:  # the narrowest of equal values
        best += 1
    nodes, window, gained = np.zeros(b_count, np.int64), np.zeros(b_count, np.bool_), np.zeros(b_count)
    for b in range(b_count):
        nodes[b], window[b], gained[b] = _fill(gains, bounds, rows, worths, b, best)
    return nodes, window, gained, values[best] / b_count, costs[best]


@njit(cache=True)
def corrected_ratios(probed: np.ndarray, nearest: np.ndarray, scales: np.ndarray, base: float, rows: np.ndarray) -> np.ndarray:
    """``LiveCurve.ratio`` at each of ``rows`` (whole numbers >= 1): the probed r (``probed[rows - 1]``) times exp(its
    nearest observed cell's correction (``scales[nearest[rows - 1]]``) - ``base``), at least 1; ``scales`` empty: none
    observed, the probe's r."""
    out = np.empty(rows.size)
    for i in range(rows.size):
        t = rows[i] - 1
        out[i] = max(1.0, probed[t] * math.exp(scales[nearest[t]] - base) if scales.size else probed[t])
    return out


def warm_up() -> None:
    """Compile (or load from numba's on-disk cache) ``best_widths`` once per process, at load time, as the drafting
    kernels are (``DraftState.warm_up``): a fresh install's first drafting step would otherwise compile it."""
    best_widths(np.ones(1), np.array([0, 1]), np.ones(1), np.ones(1, np.int64), np.ones(1), np.ones(2), 0.0, False)
    corrected_ratios(np.ones(2), np.zeros(2, np.int64), np.zeros(1), 0.0, np.ones(2, np.int64))


@njit(cache=True)
def _fill(gains: np.ndarray, bounds: np.ndarray, rows: np.ndarray, worths: np.ndarray, b: int, extra: int) -> tuple[int, bool, float]:
    """Sequence b's best use of ``extra`` rows: (its nodes, whether its Jacobi branch runs, the tokens they gain):
    the branch where it fits and gains more than the nodes its rows would hold."""
    at, size = bounds[b] + b, bounds[b + 1] - bounds[b]
    nodes = min(extra, size)
    gain = gains[at + nodes]
    if rows[b] and extra >= rows[b]:
        beside = min(extra - rows[b], size)
        if gains[at + beside] + worths[b] > gain + 1e-12:
            return beside, True, gains[at + beside] + worths[b]
    return nodes, False, gain


class Calibration:
    """Draft tokens a sequence got accepted per token its trees' scores promised, over its recent proposals (a
    proposal the cost model declined counts once the tokens after it have come: ``Ledger.hindsight``).

    The scores come from acceptance statistics shared by every sequence of a batch (and across requests), per
    source and depth: a sequence whose drafts fare worse than the mix (a chat answer beside a summary) would be
    planned with the mix's hopes. Measured, 8 sequences x 256 tokens: the scores promised 1.94 accepted tokens
    per drafting step and 1.41 came (one sequence alone: 0.99 promised, 1.19 came). A new sequence starts
    from ``factor`` (what every sequence so far got: ``Planner.calibration``), not from trusting the mix."""

    def __init__(self, factor: float = 1.0) -> None:
        self.promised, self.got = CALIBRATION_ASSUMED, CALIBRATION_ASSUMED * factor

    @property
    def factor(self) -> float:
        return self.got / self.promised

    def update(self, promised: float, got: int) -> None:
        """One step verified a tree whose scores summed to ``promised``; ``got`` of its nodes were accepted."""
        self.promised = CALIBRATION_DECAY * self.promised + promised
        self.got = CALIBRATION_DECAY * self.got + got


class JacobiWorth:
    """Running estimate of what one run of the Jacobi branch yields: the draft tokens accepted that only its
    trajectories proposed, from that run until the next (its n-grams stay in the pool and are drafted later:
    counted only in the steps that ran the branch, a branch run once in ``RETRY`` steps was credited
    with a step's share of them, and so never ran). A branch left off is retried now and then."""

    def __init__(self) -> None:
        self.value, self.idle, self.since_run = JACOBI_ASSUMED, 0, 0

    def runs(self, chosen: bool) -> bool:
        """Whether the branch runs this step: when chosen, or after ``RETRY`` steps without."""
        self.idle = 0 if chosen or self.idle >= RETRY else self.idle + 1
        return self.idle == 0

    def update(self, tokens: int, ran: bool) -> None:
        """Every step: ``tokens`` accepted draft tokens only the trajectories proposed; ``ran``: the branch ran
        in it (closing the previous run's account: the tokens so far came from the n-grams of earlier runs)."""
        self.since_run += tokens
        if ran:
            self.value += JACOBI_DECAY * (self.since_run - self.value)
            self.since_run = 0


class Pace:
    """Tokens a second a lane's drafting steps gave, measured whole (its sources' work, the forward, the
    verification, the learning), held against a plain step (its forward as the live curve has it, plus the host
    work of a step that drafts nothing). The planner prices a step by its forward's probed cost and its drafts by
    their scores; where either is wrong, drafting loses: measured on the 1.5B, int8, Zen 4, one prompt's drafting
    steps took ~59 ms for ~1.2 tokens against ~30 ms plain, 0.72x its plain loop. A lane whose drafting steps come
    out slower by ``PACE_MARGIN`` rests (no proposals: plain steps), drafting once in ``PACE_RETRY`` steps to measure
    again. Only a clear loss: a resting lane teaches the shared sources nothing, so a lane judged on its first, cold
    drafts (a code prompt after chat) stayed poor; judged at 5%, the planner ran 3-9% below fixed trees of 4 nodes
    (int8, Xeon m167: SmolLM2, the 0.5B, the 1.5B), at 25% within 1% of them on the Qwens (SmolLM2: 1.27x its plain
    loop against 1.34x)."""

    def __init__(self) -> None:
        self.tokens = self.seconds = 0.0  # decayed sums over the drafting steps
        self.samples = 0
        self.rested = 0  # steps rested in a row

    def update(self, tokens: int, seconds: float) -> None:
        """A drafting step emitted ``tokens`` in ``seconds``."""
        self.tokens = PACE_DECAY * self.tokens + tokens
        self.seconds = PACE_DECAY * self.seconds + seconds
        self.samples += 1

    def loses(self, plain_seconds: float) -> bool:
        """Whether the lane's drafting steps have given fewer tokens a second than plain steps of ``plain_seconds``."""
        return self.samples >= PACE_SAMPLES and self.tokens * plain_seconds < (1 - PACE_MARGIN) * self.seconds

    def rests(self, plain_seconds: float) -> bool:
        """Whether the lane rests this step: while its drafting loses, all but every ``PACE_RETRY``-th step."""
        self.rested = self.rested + 1 if self.loses(plain_seconds) else 0
        return self.rested % PACE_RETRY != 0


@dataclass(eq=False)
class Ledger:
    """What the planner keeps of one drafting lane: its calibration, its Jacobi branch's worth, its pace, and the
    proposals it declined, each with where in the lane's output the tokens after it start, until they judge it."""

    calibration: Calibration
    worth: JacobiWorth = field(default_factory=JacobiWorth)
    pace: Pace = field(default_factory=Pace)
    declined: list[tuple[TokenTree, int]] = field(default_factory=list)

    def hindsight(self, out: list[int]) -> list[tuple[float, int]]:
        """(promised, accepted) of each declined proposal that the tokens since have decided (it leaves
        ``declined``): what verifying it would have given, so a calibration learns on plain steps too. Without
        it a calibration that fell low (a few failed drafts of chat text) kept every later step plain, and,
        pooled, every later request: measured (SmolLM2 bf16, Zen 4, the benchmark), the first three prompts
        ran all plain."""
        judged, waiting = [], []
        for tree, start in self.declined:
            got = accepted_after(tree, out[start:])
            if got is None:
                waiting.append((tree, start))
            else:
                judged.append((float(tree.scores.sum()), got))
        self.declined = waiting
        return judged


@dataclass(eq=False)
class Move:
    """One lane's part of a step, filled in phase by phase: what its sources proposed and the room it has
    (draft), what the planner kept of it (``tree``, ``levels``), its rows (layout), the model's verdict and the
    tokens it emits (verify)."""

    proposed: TokenTree
    levels: int  # Jacobi levels fed (0: none)
    space: int  # rows the step may add for the lane
    ledger: Ledger | None  # None: a lane the cost model does not plan (plain decoding, or no cost model)
    rests: bool = False  # a drafting lane the planner holds dormant this step: it neither proposes nor teaches
    tree: TokenTree | None = None  # the nodes verified (``proposed`` until the planner cuts it)
    promise: tuple[float, float] | None = None  # (tokens, seconds) the planner expected of the step, where it drafts
    layout: StepLayout | None = None
    logits: torch.Tensor | None = None  # (its logit rows, V)
    ranked: np.ndarray | None = None  # (its logit rows, k) their likeliest tokens, where the step ranked them (``Batch._ranked``)
    verdict: Verdict | None = None
    new: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.tree = self.proposed

    @property
    def best(self) -> np.ndarray | None:
        """(its logit rows,) each row's argmax where the step ranked them (a row's first of ``ranked``); else None."""
        return self.ranked[:, 0] if self.ranked is not None and self.ranked.shape[-1] else None


class Planner:
    """The cost model of a batch: the live curve (None: the fixed shape, which runs whatever is proposed) and
    the calibration every lane so far pooled; each drafting lane's own part is its ``Ledger``. ``choose``
    before the forward, ``learn`` after it."""

    def __init__(self, curve: LiveCurve | None, calibration: Calibration | None = None) -> None:
        self.curve, self.calibration = curve, calibration or Calibration()

    def ledger(self) -> Ledger | None:
        """A new drafting lane's ledger (None without a cost model): its calibration starts from the pooled one."""
        return None if self.curve is None else Ledger(Calibration(self.calibration.factor))

    def proposes(self, ledger: Ledger | None, steps: int, batch: int = 1) -> bool:
        """Whether a lane ``steps`` into its decode, in a batch of ``batch``, drafts this step: not while the loop is
        dormant (``LiveCurve.dormant``; a new lane drafts its first steps), nor while its drafting loses (``Pace``)."""
        if self.curve is None:
            return True
        if self.curve.dormant and steps >= DORMANT:
            return False
        return ledger is None or not ledger.pace.rests(self.curve.seconds(batch, batch) + (self.curve.host[False] or 0.0))

    def choose(self, moves: list[Move], window: int) -> None:
        """Each move's tree and Jacobi levels: the step expected to pay most per cost (``plan``), possibly plain."""
        if self.curve is None:
            return
        choices = [PLAIN] * len(moves)  # nothing drafted (dormant steps): plain, without pricing it
        if any(len(m.proposed) or m.levels for m in moves):
            choices = plan(self.curve, [m.proposed for m in moves], [m.levels * window for m in moves],
                           [m.ledger.worth.value if m.ledger else 0.0 for m in moves],
                           [m.ledger.calibration.factor if m.ledger else 1.0 for m in moves], explore=self.curve.stale,
                           host=self.curve.drafting_host())
        plain = self.curve.seconds(1) + (self.curve.host[False] or 0.0)  # a plain step, whole
        for m, choice in zip(moves, choices):
            m.tree = m.proposed.best(choice.nodes)
            m.levels = m.levels if m.ledger is not None and m.ledger.worth.runs(choice.window) else 0
            m.promise = (choice.tokens, choice.ratio * plain) if len(m.tree) or m.levels else None

    def learn(self, moves: list[Move], outs: list[list[int]], rows: int, seconds: float, whole: float | None = None) -> None:
        """The step (``rows`` a lane) took ``seconds`` of forward, ``whole`` in all (default: ``seconds``); each
        lane's output ``outs`` now ends with its ``new`` tokens: the Jacobi branch's worth, each drafting lane's pace,
        and calibrations from what was verified and what declined proposals would have got."""
        if self.curve is None:
            return
        drafted, resting = any(m.promise is not None for m in moves), all(m.rests or m.ledger is None for m in moves)
        host = max(whole - seconds, 0.0) if whole is not None and (drafted or resting) else None  # a step of either kind
        self.curve.observe(len(moves) * rows, seconds, len(moves), sum(len(m.verdict.path) for m in moves), host, drafted)
        whole = seconds if whole is None else whole
        for m, out in zip(moves, outs):
            if m.ledger is None:
                continue
            if m.promise is not None:  # it drafted
                m.ledger.pace.update(len(m.new), whole)
            path = m.verdict.path
            m.ledger.worth.update(int((m.tree.sources[path] == 1 << TRAJECTORY).sum()) if path else 0, m.levels > 0)
            if not len(m.tree) and len(m.proposed):  # judged once its tokens have come
                m.ledger.declined.append((m.proposed, len(out) - len(m.new)))
            verified = [(float(m.tree.scores.sum()), len(m.verdict.path))] if len(m.tree) else []
            for promised, got in verified + m.ledger.hindsight(out):
                for calibration in (m.ledger.calibration, self.calibration):
                    calibration.update(promised, got)


def chain_tree(p: float, length: int) -> TokenTree:
    """A chain of ``length`` drafts, each accepted with probability ``p`` given its parent (what ``tune`` prints for)."""
    scores = p ** np.arange(1, length + 1)
    return TokenTree.merge(np.zeros(length, np.int64), np.arange(length) - 1, scores, np.ones(length, np.int64), length)
