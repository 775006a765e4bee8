"""The decode loop over a batch of sequences ("lanes"): one forward per step carries all of them.

A lane joins with its own prefill (which gives its first token) and leaves the moment it finishes; a batch
of one is the single-sequence engine. Each step:

    1. draft:    every lane's sources propose a token tree; the cost model sizes the whole step
    2. forward:  one call over every lane's current token, Jacobi levels and tree, padded to the widest
    3. verify:   per lane, the deepest branch the model agrees with (greedy or sampling), plus its own token
    4. compact:  per lane, keep the KV of the current token and the accepted branch only
    5. learn:    per lane, the window advances; the sources take the trajectories, new tokens and top-k
    6. emit:     stream what was accepted; a finished lane leaves the batch
"""

from __future__ import annotations

import numpy as np
import torch
from transformers import PreTrainedModel

from lookahead import host_kernels, kv
from lookahead.config import LookaheadConfig
from lookahead.rules import Rules, token_logprobs
from lookahead.drafting import Observed
from lookahead.lane import Lane, shared_state
from lookahead.layout import BatchLayout, StepLayout, build_layout, stack
from lookahead.model_forward import forward, placement, prefill
from lookahead.planner import Move, Planner
from lookahead.stats import Clock
from lookahead.capability import Reach
from lookahead.tree import TokenTree
from lookahead.window import JacobiWindow

PROMPT_ROWS = 256  # a scored prompt's rows a prefill call (``Batch._prefill``): their logits, (256, V), are held at once


def until_stop(rules: Rules, history: list[int], new: list[int]) -> tuple[list[int], bool]:
    """``new`` up to and including the first token that ends generation, and whether one did."""
    for i in range(len(new)):
        if rules.stops(history + new[: i + 1]):
            return new[: i + 1], True
    return new, False


class Batch:
    """The running batch: its lanes and their shared KV cache; ``step`` runs the numbered loop once."""

    def __init__(self, model: PreTrainedModel, config: LookaheadConfig, windows: dict[str, int | None], reach: Reach,
                 planner: Planner, prefill_chunk: int | None = None) -> None:
        """windows: layer type -> sliding window (``capability.mask_windows``); reach: the model's context and rotary
        switches; planner: the cost model (``Planner(None)``: the fixed shape); prefill_chunk: prompt tokens
        prefilled between two steps while other lanes decode (None: a joining prompt is prefilled whole at once;
        see ``join``)."""
        if prefill_chunk is not None and (isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int) or prefill_chunk < 1):
            raise ValueError(f"prefill_chunk must be None or an integer >= 1, got {prefill_chunk!r}")
        self.model, self.config, self.windows, self.reach, self.planner = model, config, windows, reach, planner
        self.where = placement(model)  # (device, dtype), read once
        self.prefill_chunk = prefill_chunk
        self.lanes: list[Lane] = []
        self.joining: list[tuple[Lane, kv.BatchCache]] = []  # lanes whose prompts are going in by chunks, oldest first
        self.cache = kv.BatchCache()
        self.top_k = host_kernels.TopK()  # the step's top-k (``_ranked``), in a buffer kept from step to step

    def __len__(self) -> int:
        return len(self.lanes) + len(self.joining)

    def __contains__(self, lane: Lane) -> bool:
        return lane in self.lanes or lane in [joining for joining, _ in self.joining]

    def join(self, lane: Lane) -> None:
        """The lane's prompt goes into a cache of its own, then the lane joins the batch with its first token
        (unless that token already finished it). With ``prefill_chunk`` and other lanes in the batch, the
        prompt goes in by chunks between steps (``step``), so a long prompt does not stall the others for
        its whole prefill (SmolLM2, 2 cores, bf16: ~3.5 s for 2048 tokens); else at once, here."""
        shared_state(self.lanes + [joining for joining, _ in self.joining] + [lane])
        lane.clock = Clock()
        if lane.streamer is not None:
            lane.streamer.put(torch.tensor(lane.prompt))
        lane.stats.reused_tokens = lane.prefix.length if lane.prefix is not None else 0
        if self.prefill_chunk is not None and len(self):
            self.joining.append((lane, lane.prefix if lane.prefix is not None else kv.BatchCache()))
        else:
            self._admit(lane, *self._prefill(lane, len(lane.prompt), lane.prefix))

    def _admit(self, lane: Lane, cache: kv.BatchCache, logits: torch.Tensor) -> bool:
        """The lane's first token from its prompt's ``logits`` (V,); it joins the batch (its ``cache``) unless
        that finished it; returns whether it did."""
        cfg = self.config
        first = lane.rules.verify(lane.prompt, logits, None, TokenTree.empty()).tokens
        lane.out, lane.done = until_stop(lane.rules, lane.prompt, first)
        lane.logprobs += lane.rules.logprobs_of(logits[None], lane.out)
        lane.suffix = lane.state.start(lane.prompt + lane.out, cfg)
        if lane.lookahead and cfg.window:
            lane.window = JacobiWindow(cfg.window, cfg.ngram, np.asarray(lane.prompt), cfg.seed)
        if lane.lookahead:
            lane.ledger = self.planner.ledger()
        lane.stats.prefill_s = lane.clock.lap()
        lane.emit(lane.out)
        finished = lane.finished  # read once: another thread may cancel it, a deadline may pass meanwhile
        if finished:
            lane.keys = kv.HeldKeys(lane.prompt, cache) if lane.keeps_keys else None
            self._finish(lane)
        else:
            self.cache.join(cache)
            self.lanes.append(lane)
        return finished

    def _prefill_some(self) -> list[Lane]:
        """Up to ``prefill_chunk`` prompt tokens of the joining lanes, oldest first (all of them while no lane
        decodes); a lane whose prompt is in joins. Returns the joining lanes that finished (cancelled, out of
        time, or at their first token)."""
        done = [lane.finished for lane, _ in self.joining]  # once, as in ``_retire``
        finished = [lane for (lane, _), d in zip(self.joining, done) if d]
        self.joining = [joining for joining, d in zip(self.joining, done) if not d]
        for lane in finished:
            self._finish(lane)
        budget = self.prefill_chunk if self.lanes else float("inf")
        while self.joining and budget > 0:
            lane, cache = self.joining[0]
            end = int(min(len(lane.prompt), cache.length + budget))
            budget -= end - cache.length
            _, logits = self._prefill(lane, end, cache)
            if end == len(lane.prompt):
                self.joining.pop(0)
                if self._admit(lane, cache, logits):
                    finished.append(lane)
        return finished

    def _prefill(self, lane: Lane, end: int, cache: kv.BatchCache | None) -> tuple[kv.BatchCache, torch.Tensor]:
        """``prefill``'s of the lane's prompt up to ``end``, after ``cache``. Where the lane scores its prompt
        (``rules.prompt_logprobs``), by calls of up to ``PROMPT_ROWS`` rows that keep every row's logits: each prompt
        token's log-probability after the tokens before it goes into ``lane.prompt_logprobs`` (the first token's: None)."""
        k = lane.rules.prompt_logprobs
        if k is None:
            return prefill(self.model, lane.prompt[:end], cache, self.windows)
        cache = cache if cache is not None else kv.BatchCache()
        if not cache.length:
            lane.prompt_logprobs = [None]
        while True:
            start, stop = cache.length, min(end, cache.length + PROMPT_ROWS)
            cache, logits = prefill(self.model, lane.prompt[:stop], cache, self.windows, every_row=True)  # (stop - start, V)
            lane.prompt_logprobs += token_logprobs(logits, lane.prompt[start + 1 : stop + 1], k)
            if stop == end:
                return cache, logits[-1]

    def step(self) -> list[Lane]:
        """One forward for every lane (after a chunk of the joining lanes' prompts); returns the lanes that
        finished (they have left the batch)."""
        finished = self._retire() + self._prefill_some()  # out of time or cancelled since the last step; joined at their first token
        if not self.lanes:
            return finished
        lanes, clock = self.lanes, Clock()
        self._squeeze_if_costly()
        # 1. draft: every lane's sources propose a tree; the planner keeps what is expected to pay (maybe nothing)
        moves = [self._propose(lane) for lane in lanes]
        self.planner.choose(moves, self.config.window)
        for move in moves:
            move.tree = move.tree.best(move.space - move.levels * self.config.window)
        draft_s = clock.lap()
        # 2. layout and one forward: logits only for each lane's current token, last window level and tree
        step, ids = self._layout(lanes, moves)
        positions = torch.from_numpy(np.array([lane.position for lane in lanes], np.int64))
        logits = forward(self.model, self.windows, step, self.cache, torch.from_numpy(ids), positions, self.where)
        forward_s = clock.lap()
        # 3. verify: per lane, the deepest branch the model agrees with, plus its own next token
        ranked = self._ranked(lanes, moves, logits)  # (B, U, k) every row's likeliest tokens, where sources learn them
        for b, (lane, move) in enumerate(zip(lanes, moves)):
            move.logits = step.logits_of(logits, b)
            move.ranked = step.logits_of(ranked, b) if ranked is not None else None
            self._verify(lane, move)
        verify_s = clock.lap()
        # 4. keep the KV of each lane's current token and accepted branch only
        keep = [np.array([0] + [move.layout.first_tree_row + n for n in move.verdict.path]) for move in moves]
        self.cache.compact(step.size, keep, [lane.position + move.layout.offsets.numpy()[k] for lane, move, k in zip(lanes, moves, keep)])
        # 5. learn: the drafting sources (not in plain decoding), then the lanes' outputs and the planner
        self._teach(lanes, moves, ids)
        step_s = clock.total()  # what each lane's new tokens cost
        for lane, move in zip(lanes, moves):
            lane.out += move.new
            lane.stats.record(move.tree, move.levels, move.verdict.path, len(move.new), lane.state.names, move.promise, step_s, move.rests)
        self.planner.learn(moves, [lane.out for lane in lanes], step.size, forward_s, step_s)
        learn_s = clock.lap()
        # 6. stream what was accepted; finished lanes leave the batch
        for lane, move in zip(lanes, moves):
            for phase, seconds in (("draft", draft_s), ("forward", forward_s), ("verify", verify_s), ("learn", learn_s)):
                lane.stats.phase_s[phase] += seconds
            lane.emit(move.new)
        return finished + self._retire()

    def _propose(self, lane: Lane) -> Move:
        """What the lane's sources draft after its current token, within its room and space (nothing while the
        planner holds it dormant, or in plain decoding)."""
        cfg = self.config
        room, space = self._limits(lane)
        drafting = lane.lookahead and self.planner.proposes(lane.ledger, lane.stats.steps, len(self.lanes))
        tree = lane.state.propose(lane.out[-1], cfg, min(cfg.tree_budget if drafting else 0, space), room, lane.suffix)
        levels = lane.window.levels_within(room) if lane.window and drafting else 0
        return Move(tree, levels if levels * cfg.window <= space else 0, space, lane.ledger, lane.lookahead and not drafting)

    def _layout(self, lanes: list[Lane], moves: list[Move]) -> tuple[BatchLayout, np.ndarray]:
        """The step's rows: each lane's layout, padded to the widest, and its input ids (B, width)."""
        for move in moves:
            move.layout = build_layout(self.config.window, move.levels, move.tree)
        step = stack([move.layout for move in moves])
        ids = np.zeros((len(moves), step.size), np.int64)
        for b, (lane, move) in enumerate(zip(lanes, moves)):
            ids[b, 0] = lane.out[-1]
            if move.layout.size > 1:
                window = lane.window.active[: move.levels].ravel() if move.levels else np.empty(0, np.int64)
                ids[b, 1 : move.layout.size] = np.concatenate([window, move.tree.tokens])
        return step, ids

    def _ranked(self, lanes: list[Lane], moves: list[Move], logits: torch.Tensor) -> np.ndarray | None:
        """(B, U, recycle_k) the likeliest tokens of every row of the step, largest first (``host_kernels.top_k``: a row's
        first is its argmax), where some lane's sources learn from them (``_teach``); else None."""
        if not any(map(teaches, lanes, moves)):
            return None
        return self.top_k(logits, min(self.config.recycle_k, logits.shape[-1]))

    @staticmethod
    def _verify(lane: Lane, move: Move) -> None:
        """The model's verdict on the lane's tree, and the tokens it emits (cut at a stop or the length)."""
        first, _, tree_logits = move.layout.split_logits(move.logits)
        best = None
        if move.best is not None:  # each row's argmax, known: the rows need not be read again
            top, _, tree_top = move.layout.split_logits(move.best)
            best = np.concatenate([top[None], tree_top])
        history = lane.prompt + lane.out
        move.verdict = lane.rules.verify(history, first, tree_logits, move.tree, best)
        move.new, lane.done = until_stop(lane.rules, history, move.verdict.tokens[: lane.rules.max_new_tokens - len(lane.out)])
        if lane.rules.logprobs is not None:  # each emitted token's row: the current token's, then its accepted parent's
            lane.logprobs += lane.rules.logprobs_of(torch.cat([first[None], tree_logits[move.verdict.path]]), move.new)

    def _teach(self, lanes: list[Lane], moves: list[Move], ids: np.ndarray) -> None:
        """The drafting lanes' windows advance; the shared sources take the trajectories, the new tokens and every
        row's top-k (``_ranked``). A resting lane (``Move.rests``) gives its tokens to its own suffix source alone: the
        shared sources learn nothing from a step that drafted nothing."""
        cfg = self.config
        for lane, move in zip(lanes, moves):
            if move.rests:
                lane.suffix.extend(np.asarray(move.new))
        if not any(map(teaches, lanes, moves)):
            return
        observed = []
        for b, (lane, move) in enumerate(zip(lanes, moves)):
            if not teaches(lane, move):
                continue
            trajectories = lane.window.advance(self._last_level(move)) if move.levels else np.empty((0, cfg.ngram), np.int64)
            row_tokens, row_topk = ranked_rows(move.layout, ids[b, : move.layout.size], move.ranked, move.verdict.path)
            history_tail = (lane.prompt[-(cfg.ngram - 1):] + lane.out)[-(cfg.ngram - 1):]
            observed.append(Observed(move.tree, move.verdict.path, move.new, trajectories, row_tokens, row_topk, history_tail, lane.suffix))
        shared_state(lanes).learn(cfg, observed)

    @staticmethod
    def _last_level(move: Move) -> np.ndarray:
        """(W,) the model's tokens after the last Jacobi level's rows: their argmax, the first of their top-k where known."""
        if move.best is not None:
            return move.layout.split_logits(move.best)[1]
        return host_kernels.argmax(move.layout.split_logits(move.logits)[1])

    def _limits(self, lane: Lane) -> tuple[int, int]:
        """(room, space) of ``Reach.limits`` for the lane, each hole or padding column of the cache taking a key slot
        from the context (the step's keys are the whole cache's length plus its rows, in every sequence)."""
        room, space = self.reach.limits(lane.position, lane.last_position)
        return room, space - (self.cache.length - lane.position)

    def _squeeze_if_costly(self) -> None:
        """Close the cache's holes (``kv.BatchCache.squeeze``, one gather over the cache) once they are a quarter
        of it (every step attends over them), or once they narrow a step before the end of the context."""
        spare, widest = self.cache.spare, 1 + self.config.tree_budget + self.config.window * (self.config.ngram - 1)
        if spare and (4 * spare >= self.cache.length or any(self._limits(lane)[1] < widest for lane in self.lanes)):
            self.cache.squeeze()

    def _retire(self) -> list[Lane]:
        """The finished lanes leave the batch (their cache rows go at once)."""
        done = [lane.finished for lane in self.lanes]  # once: a deadline may pass meanwhile
        finished = [lane for lane, d in zip(self.lanes, done) if d]
        if finished:
            for b, lane in enumerate(self.lanes):
                if done[b] and lane.keeps_keys:  # every key but the current token's (``Lane.position``), before they go
                    held = (lane.prompt + lane.out)[: lane.position]
                    cache = self.cache.sequence(b, len(held))
                    lane.keys = kv.HeldKeys(held, cache) if cache is not None else None
            self.cache.keep([b for b, d in enumerate(done) if not d])
            self.lanes = [lane for lane, d in zip(self.lanes, done) if not d]
            for lane in finished:
                self._finish(lane)
        return finished

    @staticmethod
    def _finish(lane: Lane) -> None:
        lane.stats.decode_s = lane.clock.total() - lane.stats.prefill_s
        lane.stats.new_tokens = len(lane.out)
        if lane.streamer is not None:
            lane.streamer.end()


def teaches(lane: Lane, move: Move) -> bool:
    """Whether the lane's step teaches the shared sources: it drafts (lookahead), and the planner did not rest it."""
    return lane.lookahead and not move.rests


def ranked_rows(layout: StepLayout, ids: np.ndarray, topk: np.ndarray, path: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Input token (R,) and top-k next tokens (R, k) of every row with logits (``topk``: theirs, in row order),
    the accepted rows last (they win). A step has a few dozen rows at most: the order is a list."""
    if layout.size == 1:  # a plain step: the current token's row
        return ids[:1], topk[:1]
    rows = layout.logit_rows.numpy()  # (U,)
    first_tree = rows.size - (layout.size - layout.first_tree_row)
    trusted = [0] + [first_tree + n for n in path]
    order = [r for r in range(rows.size) if r not in trusted] + trusted
    return ids[rows[order]], topk[order]
