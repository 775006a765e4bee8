"""The suffix matcher, the recycling table and its template against pure-Python references (property
tests), plus their edge cases and persistence; and the drafting state's tree on top of them."""

from __future__ import annotations


import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import hf_greedy, tiny_llama
from lookahead import LookaheadGenerator
from lookahead.config import LookaheadConfig
from lookahead.drafting import AGREE, SOURCES, STATS_MEMORY, SUFFIX, SUFFIX_LONG, DraftState, Observed, stacked_chains
from lookahead.tree import TokenTree
from ngram_pool import RecycleTable, SuffixDrafter, template
from ngram_pool.reference import PyRecycleTable, py_suffix_drafts


@settings(max_examples=200, deadline=None)
@given(seq=st.lists(st.integers(0, 4), min_size=0, max_size=60), max_match=st.integers(1, 6),
       max_drafts=st.integers(0, 5), max_len=st.integers(0, 9), per_match=st.integers(1, 4))
def test_suffix_drafts_match_the_reference(seq, max_match, max_drafts, max_len, per_match):
    drafter = SuffixDrafter(5, max_match=max_match)
    drafter.reset(seq[: len(seq) // 2])
    drafter.extend(seq[len(seq) // 2 :])  # growing in two parts is the same as one
    drafts, lengths = drafter.drafts(max_drafts, max_len, per_match)
    expected = py_suffix_drafts(seq, max_match, max_drafts, max_len, per_match) if len(seq) >= 2 and max_len else []
    assert drafts.shape == (len(expected), max_len) and lengths.tolist() == [k for _, k in expected]
    for row, (draft, _) in zip(drafts.tolist(), expected):
        assert row == draft + [-1] * (max_len - len(draft))


def test_suffix_drafts_prefer_long_matches_and_grow_with_them():
    drafter = SuffixDrafter(100, max_match=8)
    drafter.reset([5, 1, 2, 3, 4, 9, 9, 9, 9, 9, 7, 3, 8, 1, 2, 3])
    drafts, lengths = drafter.drafts(2, 16, tokens_per_match=2)
    assert lengths.tolist() == [3, 1]
    assert drafts[0, :6].tolist() == [4, 9, 9, 9, 9, 9] and drafts[0, 6] == -1  # 3 matched -> 6 tokens
    assert drafts[1, :2].tolist() == [8, 1] and drafts[1, 2] == -1


def test_suffix_drafter_rejects_bad_input():
    drafter = SuffixDrafter(10)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        drafter.extend([3, 10])
    with pytest.raises(ValueError, match="max_len"):
        drafter.drafts(1, -1)
    with pytest.raises(ValueError, match="max_match"):
        SuffixDrafter(10, max_match=0)


@settings(max_examples=200, deadline=None)
@given(k=st.integers(1, 4), updates=st.lists(st.tuples(st.integers(0, 7), st.lists(st.integers(0, 7), min_size=1, max_size=4)), max_size=20),
       shape=st.lists(st.tuples(st.integers(-1, 12), st.integers(0, 3)), max_size=12), root=st.integers(0, 7))
def test_recycle_table_matches_the_reference(k, updates, shape, root):
    table, ref = RecycleTable(8, k), PyRecycleTable(k)
    width = min(len(s) for _, s in updates) if updates else 1
    tokens = np.array([t for t, _ in updates], np.int64)
    successors = np.array([s[:width] for _, s in updates], np.int64).reshape(len(updates), width)
    table.update(tokens, successors)
    ref.update(tokens, successors)
    parents = np.array([min(p, i - 1) for i, (p, _) in enumerate(shape)], np.int64)
    ranks = np.array([min(r, k - 1) for _, r in shape], np.int64)
    assert table.expand(root, parents, ranks).tolist() == ref.expand(root, parents.tolist(), ranks.tolist())


@settings(max_examples=100, deadline=None)
@given(k=st.integers(1, 4), pairs=st.lists(st.tuples(st.integers(0, 7), st.integers(0, 7)), max_size=12),
       rows=st.lists(st.tuples(st.integers(0, 7), st.lists(st.integers(0, 7), min_size=4, max_size=4)), max_size=6))
def test_recycle_ranks_are_counted_against_the_table_before_its_update(k, pairs, rows):
    table = RecycleTable(8, 4)
    table.update(np.arange(8), (np.arange(32).reshape(8, 4) * 5) % 8)
    before_update = table.table.copy()
    before, after = np.array([p for p, _ in pairs], np.int64), np.array([a for _, a in pairs], np.int64)
    tokens, successors = np.array([t for t, _ in rows], np.int64), np.array([s for _, s in rows], np.int64).reshape(len(rows), 4)
    counts = table.rank_then_update(before, after, k, tokens, successors)
    successors_then = before_update[before, :k]
    assert counts[0].tolist() == (successors_then >= 0).sum(0).tolist()
    assert counts[1].tolist() == (successors_then == after[:, None]).sum(0).tolist()
    ref = RecycleTable(8, 4)
    ref.table[:] = before_update
    ref.update(tokens, successors)
    assert np.array_equal(table.table, ref.table)


def expected_acceptance(parents, ranks, rates):
    score = []
    for p, r in zip(parents, ranks):
        score.append(rates[r] * (score[p] if p >= 0 else 1.0))
    return sum(score)


@pytest.mark.parametrize("args, message", [((np.array([np.nan]), 2, 2), "rank_rates must be a 1-D array of probabilities"),
                                           ((np.ones(2) / 2, 2.5, 2), "size must be an integer >= 0, got 2.5"),
                                           ((np.ones(2) / 2, True, 2), "size must be an integer >= 0, got True"),
                                           ((np.ones(2) / 2, 4, None), "max_depth must be an integer >= 0, got None")])
def test_template_rejects_what_is_no_rate_or_size(args, message):
    with pytest.raises(ValueError, match=message):  # a NaN rate went through, a float size was cut to an integer
        template(*args)


@settings(max_examples=60, deadline=None)
@given(rates=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=3), size=st.integers(0, 6), max_depth=st.integers(1, 4))
def test_template_is_the_best_tree_of_its_size(rates, size, max_depth):
    """Brute force over every tree of ``size`` nodes: none expects more accepted tokens than the template."""
    rates = np.array(sorted(rates, reverse=True))
    parents, ranks, depths = template(rates, size, max_depth)
    assert parents.size == min(size, sum(len(rates) ** d for d in range(1, max_depth + 1)))
    assert all(p < i for i, p in enumerate(parents)) and (np.diff(depths) >= 0).all() and depths.max(initial=0) <= max_depth
    assert len({(p, r) for p, r in zip(parents, ranks)}) == parents.size  # no two nodes are the same successor
    best = 0.0
    nodes = [(-1, r, 1) for r in range(len(rates))]

    def grow(chosen, frontier):  # every set of `size` nodes closed under parents, as (parent, rank) lists
        nonlocal best
        if len(chosen) == parents.size:
            best = max(best, expected_acceptance([p for p, _, _ in chosen], [r for _, r, _ in chosen], rates))
            return
        for i, (p, r, d) in enumerate(frontier):
            me = len(chosen)
            kids = [(me, q, d + 1) for q in range(len(rates))] if d < max_depth else []
            grow(chosen + [(p, r, d)], frontier[i + 1 :] + kids)

    grow([], nodes)
    assert expected_acceptance(parents, ranks, rates) >= best - 1e-9


def test_recycle_table_save_load_and_corrupt_files(tmp_path):
    table = RecycleTable(20, 3)
    table.update(np.array([1, 2]), np.array([[3, 4, 5], [6, 7, 8]]))
    table.save(tmp_path / "t.npz")
    assert np.array_equal(RecycleTable.load(tmp_path / "t.npz", vocab_size=20).table, table.table)
    with pytest.raises(ValueError, match=r"table: shape \(20, 3\), expected \(21, 'any'\)"):
        RecycleTable.load(tmp_path / "t.npz", vocab_size=21)
    (tmp_path / "bad.npz").write_bytes(b"not a zip")
    with pytest.raises(ValueError, match="not a readable"):
        RecycleTable.load(tmp_path / "bad.npz")
    np.savez(tmp_path / "big.npz", format_version=np.int64(1), table=np.full((4, 2), 9, np.int32))
    with pytest.raises(ValueError, match="table: a token id outside"):
        RecycleTable.load(tmp_path / "big.npz")


def test_draft_state_merges_every_source_into_one_tree_and_round_trips(tmp_path):
    cfg = LookaheadConfig(window=0, ngram=3, guess=2, tree_budget=12, suffix_drafts=2, suffix_length=4, recycle_k=2)
    state = DraftState.for_config(50, cfg)
    suffix = state.start([1, 2, 3, 9, 1, 2, 4, 1, 2], cfg)  # pool: (2,3,9), (2,4,1); suffix after "1 2": "3 9 1 2", "4 1 2"
    state.recycle.update(np.array([2, 3]), np.array([[3, 7], [9, 8]]))
    tree = state.propose(2, cfg, cfg.tree_budget, max_depth=8, suffix=suffix)
    paths = {tuple(tree.tokens[tree.path(n)].tolist()) for n in range(len(tree))}
    assert {(3, 9, 1, 2), (4, 1, 2), (7,), (3, 8)} <= paths
    three = int(np.flatnonzero((tree.tokens == 3) & (tree.depths == 1))[0])  # proposed by the pool, the suffix and the table
    assert tree.sources[three] == sum(1 << SOURCES.index(s) for s in ("prompt", "suffix", "recycle"))
    assert len(tree) <= 12 and (tree.scores[tree.parents[tree.parents >= 0]] >= tree.scores[tree.parents >= 0] - 1e-12).all()
    assert len(state.propose(2, cfg, 3, max_depth=1, suffix=suffix)) == 3
    state.save(tmp_path / "state")
    loaded = DraftState.load(tmp_path / "state")
    again = loaded.propose(2, cfg, cfg.tree_budget, max_depth=8, suffix=loaded.start([1, 2, 3, 9, 1, 2, 4, 1, 2], cfg))
    assert np.array_equal(again.tokens, tree.tokens) and np.array_equal(again.parents, tree.parents)
    np.savez(tmp_path / "state" / "acceptance.npz", format_version=np.int64(2), tried=loaded.tried[:AGREE], hits=loaded.hits[:AGREE])
    older = DraftState.load(tmp_path / "state")  # saved before the AGREE row: that row starts unmeasured
    assert np.array_equal(older.tried[:AGREE], loaded.tried[:AGREE]) and not older.tried[AGREE].any() and not older.hits[AGREE].any()
    (tmp_path / "state" / "acceptance.npz").write_bytes(b"junk")
    with pytest.raises(ValueError, match="acceptance"):
        DraftState.load(tmp_path / "state")


def test_saving_a_state_onto_a_file_is_a_value_error_naming_it(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=f"{tmp_path / 'file'}: exists and is not a directory"):
        DraftState(50, 3).save(tmp_path / "file")


def test_drafting_modules_leave_torch_out():
    import subprocess
    import sys
    code = "import sys, ngram_pool.suffix, ngram_pool.recycle; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_acceptance_statistics_follow_recent_steps():
    """A state kept across requests forgets: a source accepted for a long stretch, then rejected for as long,
    ends up rated as rejected (counting every step alike would leave it at one half)."""
    cfg = LookaheadConfig(window=0, ngram=3, guess=0, tree_budget=1, suffix_drafts=1, suffix_length=1, recycle_k=0, pool_from_output=False)
    state = DraftState.for_config(50, cfg)
    suffix = state.start([1, 2, 1], cfg)
    tree = TokenTree.merge(np.array([2]), np.array([-1]), np.array([0.5]), np.array([1 << SUFFIX]), 1)
    none = np.empty(0, np.int64)

    def steps(accepted: bool) -> None:
        for _ in range(3 * STATS_MEMORY):
            state.learn(cfg, [Observed(tree, [0] if accepted else [], [2, 5] if accepted else [5], np.empty((0, 3), np.int64),
                                       none, np.empty((0, 0), np.int64), [1, 1], suffix)])

    steps(True)
    assert state.rates()[SUFFIX, 0] > 0.9
    steps(False)
    assert state.rates()[SUFFIX, 0] < 0.1


def reference_count_tried(tree: TokenTree, path: list[int], tried: np.ndarray, hits: np.ndarray) -> None:
    """``count_tried`` in numpy (what it replaced)."""
    from lookahead.drafting import MAX_DEPTH, RECYCLE, STAT_ROWS
    accepted = np.zeros(len(tree) + 1, bool)  # index -1 (the current token) is always accepted
    accepted[path] = True
    accepted[-1] = True
    on_tried = accepted[tree.parents]
    bits = (tree.sources[:, None] >> np.arange(STAT_ROWS)) & 1
    bits[:, AGREE] = bits[:, RECYCLE] & (tree.sources != 1 << RECYCLE)
    depth = np.minimum(tree.depths, MAX_DEPTH) - 1
    for s in range(STAT_ROWS):
        if s != RECYCLE:
            on = on_tried & (bits[:, s] == 1)
            np.add.at(tried[s], depth[on], 1)
            np.add.at(hits[s], depth[on], accepted[:-1][on])


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**31), st.integers(1, 40))
def test_count_tried_matches_the_numpy_reference(seed, size):
    from lookahead.drafting import MAX_DEPTH, RECYCLE, STAT_ROWS, count_tried
    rng = np.random.default_rng(seed)
    parents = np.array([int(rng.integers(-1, i)) for i in range(size)], np.int64)  # parents before children
    scores = rng.random(size)
    for i, p in enumerate(parents):  # a score never above its parent's
        scores[i] *= scores[p] if p >= 0 else 1.0
    tree = TokenTree.merge(rng.integers(0, 5, size), parents, scores, rng.integers(1, 1 << len(SOURCES) + 1, size), size)
    path, node = [], -1
    while (children := tree.children(node)).size and rng.random() < 0.7:
        node = int(children[0])
        path.append(node)
    start = rng.integers(0, 50, (2, STAT_ROWS, MAX_DEPTH)).astype(float)  # tried, hits so far
    ranks = rng.integers(0, 9, (2, 4))  # the recycling table's tried and hit counts by rank
    got, want = start.copy(), start * 0.5
    count_tried(tree.parents, tree.sources, tree.depths, np.asarray(path, np.int64), *got, 0.5, ranks)
    want[:, RECYCLE, :4] += ranks  # faded first, then this step's counts
    reference_count_tried(tree, path, *want)
    assert np.array_equal(got, want)


def test_recycle_table_fill_empty_keeps_what_was_learned():
    table = RecycleTable(6, k=2)
    table.update(np.array([1]), np.array([[5, 4]]))
    table.fill_empty(np.array([[1, 2, 3], [0, 0, 0], [3, -1, -1]]))  # 3 rows of a 3-wide prior into a 2-wide table
    assert table.table.tolist() == [[1, 2], [5, 4], [3, -1], [-1, -1], [-1, -1], [-1, -1]]
    for bad in (np.zeros((7, 2), np.int64), np.array([[6]]), np.array([[-2]]), np.zeros(3, np.int64)):
        with pytest.raises(ValueError):
            table.fill_empty(bad)


class Oracle:
    """A new drafting source, written here and nowhere in the engine: it knows greedy's answer (computed
    beforehand) and proposes the next four of its tokens after wherever the sequence has got to. What a source
    takes is ``ChainSource``'s four members."""

    rows = ("oracle",)

    def __init__(self, prompt: list[int], answer: list[int]) -> None:
        self.prompt, self.answer, self.done = prompt, answer, 0

    def start(self, sequence: np.ndarray, cfg: LookaheadConfig) -> None:
        self.done = len(sequence) - len(self.prompt)  # the prompt and the prefill's first token

    def propose(self, current: int, cfg: LookaheadConfig) -> tuple[np.ndarray, np.ndarray]:
        chains = np.array([self.answer[self.done : self.done + 4]], np.int64)  # (1, L): one chain (L = 0 at the end)
        return chains, np.zeros(1, np.int64)  # in the source's first (only) row

    def learn(self, cfg: LookaheadConfig, steps: list[Observed]) -> None:
        self.done += sum(len(step.emitted) for step in steps)


def test_a_new_chain_source_is_one_class_merged_scored_and_counted_as_the_pool_is():
    model, prompt = tiny_llama(seed=3), [5, 6, 7, 8]
    answer = hf_greedy(model, prompt, 24)
    cfg = LookaheadConfig(auto=False, window=0, guess=0, suffix_drafts=0, recycle_k=0, tree_budget=4)  # only the oracle drafts
    state = DraftState.for_config(model.config.vocab_size, cfg, extra=(Oracle(prompt, answer),))
    out = LookaheadGenerator(model, config=cfg).generate(prompt, max_new_tokens=24, state=state)
    assert out.tokens == answer and out.stats.compression > 3
    assert out.stats.accepted_by_source["oracle"] == out.stats.drafted_by_source["oracle"] > 0
    oracle_row = state.names.index("oracle")
    assert state.hits[oracle_row, 0] == state.tried[oracle_row, 0] > 0 and state.rates()[oracle_row, 0] > 0.5 > state.assumed[oracle_row, 0]
    with pytest.raises(ValueError, match="63 at most"):
        DraftState(50, 3, extra=tuple(Oracle([], []) for _ in range(60)))
    with pytest.raises(ValueError, match="an extra source is a ChainSource .* got object"):  # an AttributeError before
        DraftState(50, 3, extra=(object(),))


class Broken(Oracle):
    """A source whose proposal is not what ``ChainSource.propose`` promises."""

    def __init__(self, chains, rows) -> None:
        super().__init__([], [])
        self.chains, self.own = chains, rows

    def propose(self, current: int, cfg: LookaheadConfig) -> tuple[np.ndarray, np.ndarray]:
        return self.chains, self.own


@pytest.mark.parametrize("chains, rows, message", [
    (np.array([[5, 6]]), np.array([-9]), r"Broken.propose named a statistics row outside \[0, 1\)"),  # hung the loop
    (np.array([[5, 6]]), np.array([1]), r"named a statistics row outside \[0, 1\)"),
    (np.array([[5, 10**6]]), np.array([0]), r"drafted a token outside \[0, 50\) \(-1 ends a chain\)"),  # failed in the embedding
    (np.array([[-5, 6]]), np.array([0]), r"drafted a token outside"),
    (np.array([5, 6]), np.array([0]), r"chains as a 2-D integer array, got int64 of shape \(2,\)"),
    (np.array([[5.0, 6.0]]), np.array([0]), r"chains as a 2-D integer array, got float64"),
    (np.array([[5, 6]]), np.array([0, 0]), r"one integer row a chain, got int64 of shape \(2,\) for 1 chains"),
])
def test_an_extra_sources_proposal_is_checked_before_it_is_merged(chains, rows, message):
    cfg = LookaheadConfig(auto=False, window=0, tree_budget=4)
    state = DraftState.for_config(50, cfg, extra=(Broken(chains, rows),))
    suffix = state.start([1, 2, 3], cfg)
    with pytest.raises(ValueError, match=message):
        state.propose(3, cfg, 4, 8, suffix)
    good = DraftState.for_config(50, cfg, extra=(Broken(np.array([[5, 6]], np.int32), [0]),))  # any integer type, a list
    assert 5 in good.propose(3, cfg, 4, 8, good.start([1, 2, 3], cfg)).tokens


def test_chains_and_suffix_drafts_are_stacked_with_their_rows_and_bits_whatever_their_layout():
    """``stacked_chains``: the pool's chains (views of its rows: C-contiguous or not by their count) and the suffix
    drafts as one array padded with -1, each with its statistics row and source bits (a match of 3 tokens or more:
    SUFFIX_LONG, with SUFFIX's bit too); an extra source's int64 chains the same."""
    rows = np.array([[5, 6, 0], [7, -1, 2]], np.int32)  # two stored n-grams and their origin codes, as the pool gives them
    suffix = np.array([[9, 8, 7, 6, 2], [4, -1, -1, -1, 5], [3, 3, -1, -1, 1]], np.int32)  # drafts, then match lengths
    for chains, drafts, matched in [(rows[:, :-1], suffix[:, :-1], suffix[:, -1]), (rows[:1, :-1], suffix[:1, :-1], suffix[:1, -1]),
                                    (rows[:, :-1].astype(np.int64), suffix[:, :-1], suffix[:, -1])]:
        out, out_rows, bits = stacked_chains(chains, np.array([0, 2][: len(chains)]), drafts, matched)
        c = len(chains)
        assert out.shape == (c + len(drafts), 4) and out[:c, :2].tolist() == chains.tolist() and (out[:c, 2:] == -1).all()
        assert out[c:].tolist() == drafts.tolist() and out_rows[:c].tolist() == [0, 2][:c]
        assert out_rows[c:].tolist() == [SUFFIX, SUFFIX_LONG, SUFFIX][: len(drafts)]  # matched 2, 5, 1 tokens
        assert bits.tolist() == [1, 4][:c] + [1 << SUFFIX, 1 << SUFFIX | 1 << SUFFIX_LONG, 1 << SUFFIX][: len(drafts)]
    empty = np.empty((0, 1), np.int32)
    assert stacked_chains(empty[:, :0], np.empty(0, np.int64), empty[:, :0], empty[:, 0])[0].shape == (0, 0)
