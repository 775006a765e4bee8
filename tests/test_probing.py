"""The cost model: the planner on synthetic curves and trees, the probe and its on-disk cache."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import hf_greedy, tiny_llama
from lookahead import LookaheadConfig, LookaheadGenerator, cpu
from lookahead.tree import TokenTree
from lookahead.drafting import DraftState
from lookahead.planner import (DORMANT, DORMANT_STRIDE, PACE_RETRY, PACE_SAMPLES, Calibration, JacobiWorth, Ledger, LiveCurve, Pace,
                               choose, plan)
from lookahead.verify import accept, accepted_after
from lookahead.curve import BATCH_WIDTHS, CostCurve
from lookahead.probing import cached_curve, curve_file, lookahead_speed, probe

FLAT = CostCurve((1, 64), (1.0, 1.05), 10.0)
STEEP = CostCurve((1, 2, 64), (1.0, 3.0, 60.0), 10.0)  # a row costs more than a step: no draft can pay, however sure


def chain(scores: list[float]) -> TokenTree:
    n = len(scores)
    return TokenTree.merge(np.arange(n), np.arange(n) - 1, np.array(scores), np.ones(n, np.int64), n)


def test_steep_curve_decodes_plain():
    choice = choose(STEEP, chain([0.6, 0.4, 0.2]), window_rows=6, window_value=0.2)
    assert choice.nodes == 0 and not choice.window and choice.value == 1.0


def test_flat_curve_and_high_acceptance_verify_a_wide_tree():
    scores = [0.9 ** (i + 1) for i in range(40)]
    choice = choose(FLAT, chain(scores), window_rows=6, window_value=0.2)
    assert choice.nodes == 40 and choice.window and choice.value > 5


def test_moderate_curve_keeps_only_the_nodes_that_pay():
    curve = CostCurve((1, 8, 32), (1.0, 1.2, 2.4), 10.0)  # each node beyond 8 costs ~0.05 of a step
    choice = choose(curve, chain([0.9, 0.8, 0.7] + [0.01] * 20), window_rows=0, window_value=0.0)
    assert choice.nodes == 3


def test_curve_interpolates_and_extrapolates():
    curve = CostCurve((1, 8, 16), (1.0, 1.5, 2.0), 5.0)
    assert curve.ratio(4) == pytest.approx(1 + 3 / 14) and curve.ratio(24) == pytest.approx(2.5)


def test_jacobi_branch_is_retried_after_a_while():
    worth = JacobiWorth()
    runs = [worth.runs(False) for _ in range(140)]
    assert sum(runs) == 2 and worth.runs(True)


def test_a_jacobi_run_is_credited_with_what_its_ngrams_got_accepted_until_the_next_run():
    every, rarely = JacobiWorth(), JacobiWorth()
    for step in range(1000):  # the same trajectory-only tokens: 0.2 a step, run every step or once in 10
        every.update(step % 5 == 0, True)
        rarely.update(step % 5 == 0, step % 10 == 0)
    assert every.value == pytest.approx(0.2, abs=0.05)
    assert rarely.value == pytest.approx(2.0, abs=0.2)  # 10 steps' worth per run, not a step's share


def test_probe_is_cached_and_bad_files_are_reprobed(tmp_path):
    model = tiny_llama()
    curve = cached_curve(model, tmp_path)
    path = curve_file(model, tmp_path)
    assert path.is_file() and CostCurve.from_json(path.read_text()) == curve
    assert curve.sizes[0] == 1 and curve.ratios[0] == 1.0 and curve.ms_at_1 > 0
    assert cached_curve(model, tmp_path) == curve  # read back, not measured again
    for junk in ("{not json", '{"format": 3, "sizes": [1], "ratios": [1.0], "ms_at_1": 1.0}', '{"format": 99}', "[]"):
        path.write_text(junk)
        with pytest.raises(ValueError, match="not a cost curve"):
            CostCurve.from_json(junk)
        fresh = cached_curve(model, tmp_path)
        assert fresh.sizes[0] == 1 and CostCurve.from_json(path.read_text()) == fresh


def test_auto_off_on_a_steep_curve_is_plain_and_exact():
    model = tiny_llama(seed=2)
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]
    gen = LookaheadGenerator(model, config=LookaheadConfig(), cost=STEEP)
    out = gen.generate(prompt, max_new_tokens=30)
    assert out.tokens == hf_greedy(model, prompt, 30)
    assert out.stats.plain_steps == out.stats.steps - out.stats.window_steps and out.stats.tree_nodes == 0
    wide = LookaheadGenerator(model, config=LookaheadConfig(), cost=FLAT).generate(prompt, max_new_tokens=30)
    assert wide.tokens == out.tokens and wide.stats.tree_nodes > 0 and wide.stats.plain_steps <= 2 < out.stats.plain_steps


def test_drafts_the_cost_model_keeps_declining_are_proposed_only_every_few_steps(monkeypatch):
    """After DORMANT forwards in a row without an accepted draft the loop proposes every DORMANT_STRIDE-th step,
    and teaches the shared sources only then (host time saved: a resting step's tokens go to its suffix source
    alone); the output stays exact."""
    model = tiny_llama(seed=2)
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]
    proposed, taught = [], []
    original, learn = DraftState.propose, DraftState.learn
    monkeypatch.setattr(DraftState, "propose", lambda self, current, cfg, budget, *rest: proposed.append(budget > 0) or original(self, current, cfg, budget, *rest))
    monkeypatch.setattr(DraftState, "learn", lambda self, cfg, steps: taught.append(len(steps)) or learn(self, cfg, steps))
    gen = LookaheadGenerator(model, config=LookaheadConfig(), cost=STEEP)
    out = gen.generate(prompt, max_new_tokens=41)
    assert out.tokens == hf_greedy(model, prompt, 41) and out.stats.tree_nodes == 0 and len(proposed) == 40
    assert proposed[: DORMANT + 1] == [True] * (DORMANT + 1)  # the forward of step i is the i-th plain one in a row
    assert proposed[DORMANT + 1 :] == [(i % DORMANT_STRIDE == 0) for i in range(DORMANT + 1, 40)]
    assert taught == [1] * sum(proposed)  # the resting steps taught nothing shared
    proposed.clear()
    gen.generate(prompt[::-1], max_new_tokens=12)  # the cost model is still dormant: a new request drafts its first steps
    assert gen.live_cost.dormant and proposed[:DORMANT] == [True] * DORMANT


def test_dormancy_counts_accepted_drafts_and_deepens_the_longer_none_come():
    """Drafting steps that accept nothing keep the loop dormant (they gained nothing, and proposing costs host
    time); an accepted draft wakes it. The stride doubles after every RETRY idle forwards, twice at most."""
    from lookahead.planner import DORMANT_DEEPEST, RETRY

    live = LiveCurve(STEEP)
    for _ in range(DORMANT + 1):
        live.observe(1, 0.01)
    assert live.dormant and live.idle_run == DORMANT + 1
    live.observe(5, 0.02)  # a step that drafted and accepted nothing
    assert live.dormant and live.plain_run == 0
    live.observe(5, 0.02, accepted=2)
    assert not live.dormant and live.idle_run == 0
    drafts = []
    for _ in range(DORMANT + 4 * RETRY):
        drafts.append(not live.dormant)
        live.observe(1, 0.01)
    strides = [np.diff(np.flatnonzero(drafts[DORMANT + i * RETRY : DORMANT + (i + 1) * RETRY])) for i in range(4)]
    assert [set(s.tolist()) for s in strides] == [{DORMANT_STRIDE << min(i, DORMANT_DEEPEST)} for i in range(4)]


def test_the_loop_is_never_dormant_where_proposing_costs_next_to_nothing():
    """Dormancy saves at most a drafting step's host work: under DORMANT_HOST of a plain forward (a large model) the
    loop keeps proposing however long no draft comes; at or above it (a small model) it goes dormant as ever."""
    from lookahead.planner import DORMANT_HOST

    for host, dormant in ((0.5 * DORMANT_HOST, False), (2 * DORMANT_HOST, True)):
        live = LiveCurve(STEEP)
        plain = live.seconds(1)
        live.observe(5, 2 * plain, host=host * plain, drafted=True)
        for _ in range(DORMANT + 1):
            live.observe(1, plain)
        assert live.idle_run == DORMANT + 2 and live.host_dear is dormant and live.dormant is dormant


def test_a_lane_whose_drafting_steps_lose_rests_and_measures_again_now_and_then():
    """Drafting steps judged whole against a plain step: ~1.1 tokens in 60 ms against 30 ms plain lose, so the lane
    rests but every PACE_RETRY-th step; steps that give 3 tokens in 60 ms win it back."""
    pace = Pace()
    for _ in range(PACE_SAMPLES - 1):
        pace.update(1, 0.06)
    assert not pace.loses(0.03) and not pace.rests(0.03)  # too few drafting steps to judge
    pace.update(2, 0.06)  # ~19 tokens a second, against 33.3 plain
    assert pace.loses(0.03) and not pace.loses(0.1)  # a plain step of 100 ms would be slower
    rests = [pace.rests(0.03) for _ in range(3 * PACE_RETRY)]
    assert [i for i, r in enumerate(rests) if not r] == [PACE_RETRY - 1, 2 * PACE_RETRY - 1, 3 * PACE_RETRY - 1]
    for _ in range(4):
        pace.update(3, 0.06)  # the text turned copyable: 50 a second
    assert not pace.loses(0.03) and not pace.rests(0.03)


def test_a_lane_rests_only_on_a_clear_loss():
    """A lane's first drafting steps, cold for its text, lose a little and then learn (resting would stop the
    learning): drafting ~17% slower than plain steps goes on; ~29% slower rests (PACE_MARGIN, 25%)."""
    for seconds, rests in ((0.036, False), (0.042, True)):
        pace = Pace()
        for _ in range(PACE_SAMPLES):
            pace.update(1, seconds)  # one token a drafting step, against a plain step's 30 ms
        assert pace.loses(0.03) is rests and pace.rests(0.03) is rests


def test_drafting_steps_slower_than_priced_stop_though_the_curve_promises_them(monkeypatch):
    """A curve that never corrects (``live_cost=False``) says a wide step costs 1.05 plain ones (10 ms); here each
    takes 100 ms more, so its ~5 tokens come at half a plain step's pace, a loss past PACE_MARGIN. The lane's pace
    stops its drafting after a few steps, measuring again once in PACE_RETRY steps; the output stays exact, and the
    stats show what was promised against what came."""
    import time

    from lookahead import loop

    model = tiny_llama(seed=2)
    prompt = [5, 6, 7, 5, 6, 7, 5, 6] * 4
    plain = loop.forward

    def slow_when_wide(model, windows, step, cache, ids, *rest):
        if ids.shape[1] > 1:
            time.sleep(0.1)
        return plain(model, windows, step, cache, ids, *rest)

    monkeypatch.setattr(loop, "forward", slow_when_wide)
    gen = LookaheadGenerator(model, config=LookaheadConfig(live_cost=False), cost=FLAT)
    out = gen.generate(prompt, max_new_tokens=120)
    assert out.tokens == hf_greedy(model, prompt, 120)
    drafting = out.stats.as_dict()["drafting_step"]
    assert PACE_SAMPLES <= drafting["steps"] <= PACE_SAMPLES + out.stats.steps // PACE_RETRY + 2
    assert out.stats.rested_steps >= out.stats.steps - drafting["steps"] - 2
    assert drafting["ms"] > 100 > drafting["promised_ms"] and drafting["tokens"] >= 1 and drafting["promised_tokens"] > 1


def test_probe_on_a_short_context_model_stays_inside_it():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(vocab_size=40, n_positions=32, n_embd=32, n_layer=1, n_head=2)).eval()
    curve = probe(model, rounds=1)
    assert max(curve.sizes) <= 16 and len(curve.sizes) >= 2


def test_probe_curve_starts_at_one_and_never_decreases():
    # a tiny model's forwards take ~1 ms, so scheduling noise alone makes raw timings non-monotone
    curve = probe(tiny_llama(), rounds=2)
    assert curve.ratios[0] == 1.0 and list(curve.ratios) == sorted(curve.ratios)
    assert len(curve.batch_ratios) == len(BATCH_WIDTHS) and list(curve.batch_ratios) == sorted(curve.batch_ratios)
    assert CostCurve.from_json(curve.to_json()) == curve and probe(tiny_llama(), rounds=1, batch=False).batch_ratios == ()


def test_a_bounded_probe_measures_no_size_past_one_too_dear_and_no_round_past_its_seconds(monkeypatch):
    """A 7B-class model's probe took 54-151 s in four rounds over every size: a bounded one stops at the first size of
    8+ rows costing over half a row's plain step a row, starts no round once its seconds have passed, and where one
    pass could outlast them, measures the sizes past 8 at powers of two only."""
    from types import SimpleNamespace

    from lookahead import probing

    clock, forwards, real = [0.0], [], probing.forward

    def priced(model, windows, step, on, ids, lengths):  # c(T rows) = max(1, T^2 / 20) x 10 ms: r(8) 3.2, r(12) 7.2
        forwards.append(ids.numel())
        clock[0] += 0.01 * max(1.0, ids.numel() ** 2 / 20)
        return real(model, windows, step, on, ids, lengths)

    monkeypatch.setattr(probing, "forward", priced)
    monkeypatch.setattr(probing, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    curve = probe(tiny_llama(), rounds=3, seconds=1.0)  # a pass could take 1.1 s (the sizes' T/2 one-row steps)
    assert curve.sizes == (1, 2, 3, 4, 5, 6, 8, 16) and curve.ratios[-2:] == pytest.approx((3.2, 12.8)) and curve.batch_ratios == ()
    assert len(forwards) == 2 + 10 + 3  # two warm-ups and one first pass (9, 12, 17, 24 and 48 skipped) past which 1 s has passed
    forwards.clear()
    curve = probe(tiny_llama(), rounds=3, seconds=1e9)
    assert curve.sizes == (1, 2, 3, 4, 5, 6, 8, 9, 12) and curve.ratios[-3:] == pytest.approx((3.2, 4.05, 7.2))
    assert len(forwards) == 2 + 18 + 2 * (9 + 1)  # every size in the first pass, then those up to the dear one
    forwards.clear()
    assert probe(tiny_llama(), rounds=2, seconds=float("inf")).sizes == probing.PROBE_SIZES  # unbounded: every size


def test_the_probed_batch_axis_prices_a_cold_batch_s_wide_steps():
    """One sequence's 16 rows cost 1.15x its 8; eight sequences' 2 rows each cost 1.4x their 1 (as measured on a
    Zen 5): a tree worth a row to each of eight sequences at the single-sequence shape is not worth it there."""
    single = CostCurve((1, 8, 16, 32), (1.0, 1.2, 1.38, 1.9), 10.0)
    both = CostCurve(single.sizes, single.ratios, 10.0, batch_ratios=(1.44, 2.0, 2.6))
    assert single.ratio(16, 8) == single.ratio(16) and both.ratio(8) == single.ratio(8)  # one sequence: as probed
    assert both.ratio(8, 8) == pytest.approx(1.44) and both.ratio(16, 8) == pytest.approx(2.0) and both.ratio(32, 8) == pytest.approx(2.6)
    assert single.ratio(4, 4) < both.ratio(4, 4) < both.ratio(8, 8)  # between one sequence and eight, geometrically
    tree = chain([0.3])
    assert plan(LiveCurve(single), [tree] * 8, [0] * 8, [0.0] * 8)[0].nodes == 1  # 1.3 / 1.15 > 1: priced as one sequence
    assert plan(LiveCurve(both), [tree] * 8, [0] * 8, [0.0] * 8)[0].nodes == 0  # 1.3 / 1.39 < 1
    with pytest.raises(ValueError):
        CostCurve.from_json(both.to_json().replace("[1.44, 2.0, 2.6]", "[1.44, 2.0]"))


def test_live_curve_corrects_a_probe_that_overstates_the_one_token_step():
    # the probe said c(1) = 10 ms, c(16) = 15 ms; the loop measures 6 ms plain steps and 15 ms at 16
    live = LiveCurve(CostCurve((1, 16, 64), (1.0, 1.5, 4.0), 10.0))
    assert live.ratio(16) == pytest.approx(1.5)  # nothing observed: the probe's curve
    for _ in range(200):
        live.observe(1, 0.006)
        live.observe(16, 0.015)
    assert live.ratio(16) == pytest.approx(2.5, rel=0.01)  # 15 / 6
    assert live.ratio(64) == pytest.approx(4.0 * 2.5 / 1.5, rel=0.01)  # unobserved: the nearest correction (T=16's)
    live.observe(64, 1e-6)  # one absurdly fast sample moves the estimate, never below one plain step
    assert live.ratio(64) >= 1.0


def test_a_curve_that_does_not_correct_prices_as_probed_and_still_counts_plain_steps():
    """``LookaheadConfig(live_cost=False)``: plans on the given curve alone, whatever the forwards took."""
    live = LiveCurve(CostCurve((1, 16, 64), (1.0, 1.5, 4.0), 10.0), corrects=False)
    for _ in range(64):
        live.observe(1, 0.006)
        live.observe(16, 0.015)
    assert live.ratio(16) == pytest.approx(1.5) and live.ratio(64) == pytest.approx(4.0)
    for _ in range(9):
        live.observe(1, 0.006)
    assert live.plain_run == 9 and live.dormant  # (9 plain forwards: past DORMANT, off the stride)
    gen = LookaheadGenerator(tiny_llama(), config=LookaheadConfig(live_cost=False), cost=FLAT)
    gen.generate([1, 2, 3, 1, 2, 3], max_new_tokens=8)
    assert not gen.live_cost.corrects and gen.live_cost.ratio(64) == pytest.approx(1.05)
    with pytest.raises(ValueError, match="live_cost must be True or False"):
        LookaheadConfig(live_cost=1)


def test_live_curve_tables_price_as_the_probed_curve():
    curve = CostCurve((1, 2, 8, 32), (1.0, 1.1, 1.4, 2.5), 10.0, batch_ratios=(1.4, 2.0, 2.6))
    live = LiveCurve(curve)
    for batch in (1, 3, 8):  # a table per batch size, grown past its first 64 rows on demand
        rows = np.arange(1, 300)
        assert np.allclose(live.ratio(rows, batch), np.maximum(1.0, curve.ratio(rows, batch)))
    assert live.ratio(2.5) == pytest.approx(curve.ratio(2.5))  # not a whole number of rows: the curve itself
    live.observe(2, 0.011)  # as probed: no correction
    live.observe(8, 0.028)  # twice the probe: corrected up
    # 4 rows sit as far from 2 as from 8 (in log rows): the first cell observed wins, as before the tables
    assert live.ratio(4) == pytest.approx(curve.ratio(4)) and live.ratio(8) > curve.ratio(8)
    with pytest.raises(ValueError, match="whole number of rows"):
        live.observe(0, 0.01)


def test_live_curve_keeps_each_batch_size_apart():
    # one sequence of 8 rows costs 11 ms; eight sequences of one row each (also 8 rows) cost 16 ms, of 4 rows 48
    live = LiveCurve(CostCurve((1, 8, 32), (1.0, 1.1, 2.0), 10.0))
    for _ in range(300):
        live.observe(1, 0.010)
        live.observe(8, 0.011)
        live.observe(8, 0.016, batch=8)
        live.observe(32, 0.048, batch=8)
    assert live.ratio(8) == pytest.approx(1.1, rel=0.01) and live.ratio(8, 8) == pytest.approx(1.6, rel=0.01)
    assert live.ratio(32, 8) / live.ratio(8, 8) == pytest.approx(3.0, rel=0.01)  # what drafting costs a batch of 8
    assert live.ratio(32, 4) == live.ratio(32, 8)  # a batch size never seen: the nearest observed cell's correction
    for batch in (1, 4, 8):  # what ``plan`` prices widths by, in one kernel: ``ratio`` at B x T rows
        assert np.allclose(live.widths(40, batch), live.ratio(batch * np.arange(1, 41), batch), rtol=1e-12)
        assert np.allclose(live.widths(40, batch), [live.ratio(batch * t, batch) for t in range(1, 41)], rtol=1e-12)  # one width's path
        assert np.allclose(LiveCurve(live.curve).widths(40, batch), np.maximum(1.0, live.curve.widths(40, batch)), rtol=1e-12)
    tree = chain([0.25, 0.2])  # worth a row to one sequence, not to each of eight (16 rows cost 2.04 against 1.6)
    assert plan(live, [tree], [0], [0.0])[0].nodes >= 1 and plan(live, [tree] * 8, [0] * 8, [0.0] * 8)[0].nodes == 0


def test_a_stall_while_drafting_does_not_keep_drafting_off_for_good():
    # drafting 8 rows costs 1.1 plain steps; a stall of the machine triples the forwards of 60 drafting steps,
    # then the machine is itself again: the loop must find its way back to drafting
    live, tree = LiveCurve(CostCurve((1, 2, 8, 32), (1.0, 1.0, 1.1, 2.0), 10.0)), chain([0.5, 0.3, 0.2, 0.1, 0.1, 0.05, 0.05])
    for _ in range(20):
        live.observe(1, 0.010)
        live.observe(8, 0.011)
    assert plan(live, [tree], [0], [0.0])[0].nodes == 7
    for _ in range(30):
        live.observe(2, 0.030)
        live.observe(8, 0.033)
    assert plan(live, [tree], [0], [0.0])[0].nodes == 0  # priced out: only a re-measurement can bring it back
    explored = drafted = 0
    for _ in range(400):
        choice = plan(live, [tree], [0], [0.0], explore=live.stale)[0]
        explored += live.stale
        drafted += choice.nodes > 0 and not live.stale
        rows = 1 + choice.nodes
        live.observe(rows, 0.010 * (1.0 if rows <= 2 else 1.1))
    assert 1 <= explored <= 3 and drafted > 250
    assert plan(live, [chain([])], [0], [0.0], explore=True)[0].nodes == 0  # nothing drafted: nothing to explore


def test_auto_dtype_prefers_the_curve_where_lookahead_runs_fastest():
    # a slightly slower plain step with cheap wide steps beats a faster plain step with steep ones
    cheap_wide, steep = CostCurve((1, 16, 64), (1.0, 1.1, 2.0), 11.0), CostCurve((1, 2, 64), (1.0, 1.9, 60.0), 10.0)
    assert lookahead_speed(cheap_wide) > lookahead_speed(steep) == pytest.approx(100.0)


def test_a_sequence_whose_drafts_fare_worse_than_promised_drafts_less():
    calibration = Calibration()
    assert calibration.factor == 1.0
    for _ in range(60):
        calibration.update(promised=2.0, got=0)  # its trees promised two accepted tokens a step and none came
    assert calibration.factor < 0.05
    curve = CostCurve((1, 8, 32), (1.0, 1.2, 2.4), 10.0)
    tree = chain([0.9, 0.8, 0.7])
    trusted, doubted = plan(curve, [tree, tree], [0, 0], [0.0, 0.0], [1.0, calibration.factor])
    assert trusted.nodes == 3 and trusted.value > 1.0 / curve.ratio(2)  # the pair still drafts for the trusted one
    alone = plan(curve, [tree], [0], [0.0], [calibration.factor])[0]
    assert alone.nodes == 0  # alone, the doubted sequence's step is plain
    for _ in range(60):
        calibration.update(promised=0.5, got=3)  # far better than promised: scores scale up, at most 1 a node
    assert calibration.factor > 1 and plan(curve, [chain([0.2] * 3)], [0], [0.0], [calibration.factor])[0].nodes == 3
    seeded = Calibration(0.5)  # a sequence joining after others got half of what was promised starts there
    assert seeded.factor == 0.5
    seeded.update(promised=1.0, got=1)  # and its own steps take over
    assert 0.5 < seeded.factor < 1.0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=4), min_size=1, max_size=6), st.lists(st.integers(0, 3), max_size=6))
def test_a_declined_tree_is_judged_in_hindsight_as_verification_would_have(drafts, came):
    """``accepted_after`` on the tokens that came equals ``accept``'s walk with those tokens as the model's argmax,
    once they decide it (None before)."""
    tokens = np.concatenate([np.asarray(d) for d in drafts])
    starts = np.cumsum([0] + [len(d) for d in drafts])[:-1]
    parents = np.concatenate([[-1] + list(range(s, s + len(d) - 1)) for s, d in zip(starts, drafts)])
    tree = TokenTree.merge(tokens, parents.astype(np.int64), np.linspace(0.9, 0.1, tokens.size), np.ones(tokens.size, np.int64), tokens.size)
    calls = iter(came + [4])  # 4: a token no draft has, after the ones that came
    verdict = accept(lambda node: next(calls), tree)
    got = accepted_after(tree, came)
    decided = len(verdict.path) < len(came) or (len(verdict.path) == len(came) and not tree.children(verdict.path[-1] if verdict.path else -1).size)
    assert got == (len(verdict.path) if decided else None)


def test_a_calibration_that_fell_low_recovers_on_plain_steps():
    """The cost model declines drafts while a calibration is low, so only the declined proposals, judged when
    their tokens have come, can raise it: without that, a low pooled calibration kept every later request plain."""
    model = tiny_llama(seed=2)
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]
    curve = CostCurve((1, 8, 32), (1.0, 1.2, 2.4), 10.0)
    ref = hf_greedy(model, prompt, 40)

    def drafted(judge: bool) -> int:
        gen = LookaheadGenerator(model, config=LookaheadConfig(window=0), cost=curve)
        gen._calibration = Calibration(0.01)  # every sequence so far got 1% of what its drafts promised
        with pytest.MonkeyPatch.context() as mp:
            if not judge:
                mp.setattr(Ledger, "hindsight", lambda self, out: [])
            out = gen.generate(prompt, max_new_tokens=40)
        assert out.tokens == ref
        return out.stats.tree_nodes

    assert drafted(judge=False) == 0 < drafted(judge=True)


def test_cpu_name_tells_apart_amd_generations_that_share_a_name():
    assert [cpu._zen(f, m) for f, m in ((0x17, 0x31), (0x19, 0x01), (0x19, 0x11), (0x19, 0x61), (0x1A, 0x02), (6, 0x6A))] \
        == ["Zen 2", "Zen 3", "Zen 4", "Zen 4", "Zen 5", None]
    assert "family" in cpu.cpu_name() or not cpu.Path("/proc/cpuinfo").exists()


def reference_plan(curve, trees, window_rows, window_values, factors, explore):
    """``plan`` by brute force: every width, each sequence's best use of it, the narrowest best width."""
    gains = [np.concatenate([[0.0], np.cumsum(np.minimum(np.sort(t.scores)[::-1] * f, 1.0))]) for t, f in zip(trees, factors)]
    widest = max(g.size + w for g, w in zip(gains, window_rows))
    candidates = []
    for width in range(2 if explore and widest > 1 else 1, widest + 1):
        uses = []
        for g, rows, worth in zip(gains, window_rows, window_values):
            options = [(g[min(width - 1, g.size - 1)], min(width - 1, g.size - 1), False)]
            if rows and width - 1 >= rows:
                options.append((g[min(width - 1 - rows, g.size - 1)] + worth, min(width - 1 - rows, g.size - 1), True))
            uses.append(max(options, key=lambda o: o[0] - (1e-12 if o[2] else 0)))  # the window only where it gains
        value = sum(1 + u[0] for u in uses) / float(curve.ratio(len(trees) * width, len(trees)))
        candidates.append((value, [(n, w) for _, n, w in uses]))
    top = max(v for v, _ in candidates)
    return next(uses for v, uses in candidates if v >= top - 1e-9)


def test_plan_matches_a_brute_force_reference():
    rng = np.random.default_rng(0)
    sizes = (1, 2, 4, 8, 12, 16, 24, 32)
    for _ in range(500):
        ratios = np.concatenate([[1.0], 1 + np.cumsum(rng.random(len(sizes) - 1) * 0.3)])
        curve = CostCurve(sizes, tuple(float(r) for r in ratios), 10.0, 0.0, tuple(float(r) for r in 1 + rng.random(3)))
        b = int(rng.integers(1, 4))
        trees = [chain(list(np.sort(rng.random(int(rng.integers(0, 12))))[::-1] * rng.random())) for _ in range(b)]
        rows, worths = [int(rng.choice([0, 3, 6])) for _ in range(b)], [float(rng.random() / 2) for _ in range(b)]
        factors, explore = [float(0.5 + rng.random()) for _ in range(b)], bool(rng.random() < 0.2)
        got = plan(curve, trees, rows, worths, factors, explore)
        assert [(c.nodes, c.window) for c in got] == reference_plan(curve, trees, rows, worths, factors, explore)
