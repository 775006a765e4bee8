"""The step layout against the diagram drawn in ``lookahead/layout.py``, and the tree against ``lookahead/tree.py``."""

import numpy as np
import pytest
import torch

import lookahead.layout as layout_module
import lookahead.tree as tree_module
from lookahead import kv
from lookahead.layout import BatchLayout, build_layout, stack
from lookahead.tree import TokenTree, draft_rows


def diagram_from_docstring():
    """Parse the docstring's drawing into (column names, allowed (T, T) bool, position offsets)."""
    lines = layout_module.__doc__.splitlines()
    top = next(i for i, line in enumerate(lines) if line.split()[:2] == ["c", "a0"])
    header = lines[top]
    names = header.split()
    columns = [header.index(f" {name} ") + 1 if f" {name} " in header else header.rindex(name) for name in names]
    allowed, positions = [], None
    for line in lines[top + 1 :]:
        if line.split()[0] == "pos":
            positions = [int(v) for v in line.split()[1:]]
            break
        allowed.append([col < len(line) and line[col] == "x" for col in columns])
    return names, torch.tensor(allowed), positions


def drawn_tree() -> TokenTree:
    """The example of ``tree.py``: suffix 7 9 4, pool 7 9 5, recycled 7 2 and 3, merged under a budget of 6."""
    tokens = np.array([7, 9, 4, 7, 9, 5, 7, 2, 3])
    parents = np.array([-1, 0, 1, -1, 3, 4, -1, 6, -1])
    scores = np.array([0.9, 0.8, 0.7, 0.9, 0.8, 0.6, 0.5, 0.3, 0.4])
    sources = np.array([1, 1, 1, 2, 2, 2, 4, 4, 4])
    return TokenTree.merge(tokens, parents, scores, sources, budget=6)


def drawn_table() -> np.ndarray:
    """The node table of ``tree.py``'s drawing: (K, 4) rows of node, token, parent, depth."""
    lines = tree_module.__doc__.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[-4:] == ["node", "token", "parent", "depth"])
    return np.array([line.split()[-4:] for line in lines[start + 1 : start + 7]], dtype=np.int64)


def test_tree_merges_shared_prefixes_as_drawn():
    tree, table = drawn_tree(), drawn_table()
    assert table[:, 0].tolist() == list(range(6))
    assert tree.tokens.tolist() == table[:, 1].tolist()
    assert tree.parents.tolist() == table[:, 2].tolist()
    assert tree.depths.tolist() == table[:, 3].tolist()
    assert tree.sources.tolist() == [7, 3, 1, 2, 4, 4]  # 7 and 9 were proposed by several sources
    assert tree.scores.tolist() == [0.9, 0.8, 0.7, 0.6, 0.3, 0.4]
    assert tree.children(-1).tolist() == [0, 5] and tree.children(1).tolist() == [2, 3] and tree.path(3) == [0, 1, 3]
    assert tree.path(2) == [0, 1, 2]  # the chain of best children comes first: accepted, its KV stays where it was written


def test_tree_budget_keeps_the_best_nodes_and_stays_a_tree():
    full = drawn_tree()
    for budget in range(7):
        tree = TokenTree.merge(np.array([7, 9, 4, 7, 9, 5, 7, 2, 3]), np.array([-1, 0, 1, -1, 3, 4, -1, 6, -1]),
                               np.array([0.9, 0.8, 0.7, 0.9, 0.8, 0.6, 0.5, 0.3, 0.4]), np.ones(9, np.int64), budget)
        assert len(tree) == budget
        assert sorted(tree.scores.tolist(), reverse=True) == sorted(full.scores.tolist(), reverse=True)[:budget]
        assert all(p < i for i, p in enumerate(tree.parents))


def test_drafts_are_cut_at_the_depth_limit_before_the_budget_is_spent():
    chains = np.array([[7, 9, 4, 1], [3, 5, -1, -1]])  # a pool-like chain and a shorter one, -1 padded
    rates = np.stack([np.full(32, 0.9), np.full(32, 0.5)])  # per statistics row and depth
    tree = TokenTree(*draft_rows(chains, np.array([0, 1]), np.array([1, 2]), rates, np.array([8]), np.array([-1]), np.array([0.3]), 4,
                                 np.full(32, 0.6), 5, 2))  # uncut, the best five would be 7 9 4 1 3, three of them too deep
    assert sorted(tree.tokens.tolist()) == [3, 5, 7, 8, 9] and tree.depths.max() == 2
    assert np.allclose(sorted(tree.scores), [0.25, 0.3, 0.5, 0.81, 0.9]) and sorted(tree.sources.tolist()) == [1, 1, 2, 2, 4]


def test_a_recycled_node_a_chain_proposes_too_takes_the_agreement_rate_and_its_descendants_follow():
    """Chain 7 9 4 (rates 0.5 each) and the table's 7 -> 9 -> 4 and 3 (0.2, 0.02, 0.001; 0.1): node 9 is the chain's and the table's, so
    its conditional rate is the agreement rate 0.8 (depth 2), not the chain's 0.5; node 4 below it keeps its own
    conditional 0.5. Node 7 (both too, depth 1) takes 0.9; a node of one source keeps its score; an agreement
    rate below the chain's own (depth 3: 0.3) lowers nothing."""
    rates = np.full((1, 32), 0.5)
    agree = np.array([0.9, 0.8] + [0.3] * 30)
    tree = TokenTree(*draft_rows(np.array([[7, 9, 4]]), np.array([0]), np.array([1]), rates, np.array([7, 9, 3, 4]),
                                 np.array([-1, 0, -1, 1]), np.array([0.2, 0.02, 0.1, 0.001]), 4, agree, 10, 8))
    score = {tuple(tree.tokens[tree.path(n)].tolist()): s for n, s in enumerate(tree.scores)}
    assert score == pytest.approx({(7,): 0.9, (7, 9): 0.72, (7, 9, 4): 0.36, (3,): 0.1})
    assert tree.best(2).tokens.tolist() == [7, 9]  # re-merged (best) keeps the scores as they are
    assert TokenTree.merge(tree.tokens, tree.parents, tree.scores, tree.sources, 4).scores.tolist() == tree.scores.tolist()


def test_tree_drops_missing_tokens_with_their_descendants_and_rejects_bad_parents():
    tree = TokenTree.merge(np.array([5, -1, 6, 8]), np.array([-1, 0, 1, 0]), np.ones(4), np.ones(4, np.int64), 10)
    assert tree.tokens.tolist() == [5, 8]
    with pytest.raises(ValueError, match="draft node 1 has parent 1"):
        TokenTree.merge(np.array([5, 6]), np.array([-1, 1]), np.ones(2), np.ones(2, np.int64), 10)


@pytest.mark.parametrize("scores", [[0.5, 0.9], [0.5, np.nan], [1.5, 0.5], [-0.1, 0.0]])
def test_tree_rejects_scores_that_rise_along_a_branch_or_are_not_probabilities(scores):
    # the best nodes of such scores are no tree (a kept child of a dropped parent): its layout wrote out of bounds
    with pytest.raises(ValueError, match="merged node 1's score|merged node 0's score"):
        TokenTree.merge(np.array([5, 6]), np.array([-1, 0]), np.array(scores), np.ones(2, np.int64), 1)
    with pytest.raises(ValueError, match="budget must be >= 0, got -1"):
        TokenTree.merge(np.array([5, 6]), np.array([-1, 0]), np.array([0.5, 0.4]), np.ones(2, np.int64), -1)


def test_layout_matches_the_drawn_diagram():
    names, allowed, positions = diagram_from_docstring()
    layout = build_layout(window=3, levels=2, tree=drawn_tree())
    assert names == ["c", "a0", "a1", "a2", "b0", "b1", "b2", "t0", "t1", "t2", "t3", "t4", "t5"]
    assert torch.equal(layout.allowed, allowed)
    assert layout.offsets.tolist() == positions
    # logits: the current token, the last level (b0..b2) and every tree node
    assert layout.logit_rows.tolist() == [0, 4, 5, 6, 7, 8, 9, 10, 11, 12]


@pytest.mark.parametrize("window, levels", [(1, 1), (4, 3), (5, 2), (2, 0), (3, 0)])
def test_every_row_is_a_causal_sequence_of_consecutive_positions(window, levels):
    # for any shape, each row's visible rows (plus the cache) form positions 0..offset exactly once
    for tree in (TokenTree.empty(), drawn_tree()):
        layout = build_layout(window, levels, tree)
        for row in range(layout.size):
            seen = sorted(layout.offsets[layout.allowed[row]].tolist())
            assert seen == list(range(int(layout.offsets[row]) + 1)), (window, levels, row)


def step_mask(layout, cached: list[int], position: int, window: int | None, dtype=torch.float32) -> torch.Tensor:
    """The (1, 1, T, S + T) mask of ``layout`` over a cache holding the positions ``cached`` (-1: a hole)."""
    cache = kv.BatchCache()
    cache.positions = torch.tensor([cached])
    step = stack([layout])
    return cache.masks(step.allowed, position + step.offsets, {"attention": window}, dtype, torch.device("cpu"))["attention"]


def test_additive_mask_hides_keys_beyond_the_sliding_window():
    layout = build_layout(window=2, levels=1, tree=TokenTree.empty())  # rows c, a0, a1 at offsets 0, 1, 2
    # cache holds positions 10..13, current token at 14, window 4: query 14+d sees keys > 10+d
    mask = step_mask(layout, [10, 11, 12, 13], position=14, window=4)
    visible = (mask[0, 0] == 0).int().tolist()
    assert visible == [
        [0, 1, 1, 1, 1, 0, 0],  # c  (14) sees 11..13 and itself
        [0, 0, 1, 1, 1, 1, 0],  # a0 (15) sees 12..13, c, itself
        [0, 0, 0, 1, 1, 1, 1],  # a1 (16) sees 13, c, a0, itself
    ]
    full = step_mask(layout, [10, -1, 12, 13], position=14, window=None, dtype=torch.bfloat16)
    assert full.dtype == torch.bfloat16 and (full[0, 0, :, :4] == 0).sum(0).tolist() == [3, 0, 3, 3]  # never the hole


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window", [None, 3])
def test_masks_are_the_torch_formula_for_a_batch_with_holes(dtype, window):
    # two sequences, holes and padding in the cache, a step of 4 rows with its own visibility: 0 where the torch
    # formula sees the key, the dtype's most negative value elsewhere
    generator = torch.Generator().manual_seed(0)
    cache = kv.BatchCache()
    cache.positions = torch.tensor([[0, 1, -1, 2, 3, 4], [-1, -1, 0, 1, -1, 2]])
    allowed = torch.rand(2, 4, 4, generator=generator) < 0.5
    query = torch.tensor([[5, 6, 6, 7], [3, 4, 5, 4]])
    mask = cache.masks(allowed, query, {"attention": window}, dtype, torch.device("cpu"))["attention"]
    past = (cache.positions >= 0)[:, None, :].expand(-1, 4, -1)
    step = allowed
    if window is not None:
        past = past & ((query[:, :, None] - cache.positions[:, None, :]) < window)
        step = step & ((query[:, :, None] - query[:, None, :]) < window)
    visible = torch.cat([past, step], dim=2)[:, None]
    assert mask.dtype == dtype and mask.shape == (2, 1, 4, 10)
    assert torch.equal(mask, torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, torch.finfo(dtype).min))


def test_sliding_window_also_applies_inside_the_step():
    # a chain of 5 tree nodes at depths 1..5 under a window of 3: node at depth d sees only depths > d-3
    chain = TokenTree.merge(np.arange(5), np.arange(-1, 4), np.linspace(1, 0.5, 5), np.ones(5, np.int64), 5)
    layout = build_layout(window=1, levels=0, tree=chain)
    mask = step_mask(layout, [], position=0, window=3)
    visible = (mask[0, 0] == 0).int()
    assert visible[5].tolist() == [0, 0, 0, 1, 1, 1]  # depth 5 sees depths 3, 4 and itself, not c (depth 0)
    assert visible[2].tolist() == [1, 1, 1, 0, 0, 0]


def test_batch_drawing_matches_stack():
    doc = BatchLayout.__doc__.splitlines()
    start = next(i for i, line in enumerate(doc) if line.split()[:2] == ["b=0", "c"])
    block = doc[start : start + 5]  # header, three rows, positions
    split = block[0].index("b=1")
    drawn = []
    for lo, hi in ((0, split), (split, None)):  # the two grids side by side
        lines = [line[lo:hi].rstrip() for line in block]
        columns = lines[0].split()[1:]
        first, width = lines[0].index(columns[0]), lines[0].index(columns[1]) - lines[0].index(columns[0])
        grid = [[line[first + j * width : first + j * width + 2].strip() == "x" for j in range(len(columns))] for line in lines[1:4]]
        drawn.append((grid, [int(p) for p in lines[4].split()[1:]]))
    chain = TokenTree.merge(np.array([5, 6]), np.array([-1, 0]), np.array([0.9, 0.8]), np.ones(2, np.int64), 2)
    one = TokenTree.merge(np.array([5]), np.array([-1]), np.array([0.9]), np.ones(1, np.int64), 1)
    step = stack([build_layout(0, 0, chain), build_layout(0, 0, one)])
    for b, (grid, positions) in enumerate(drawn):
        assert step.allowed[b].tolist() == grid, b
        assert step.offsets[b].tolist() == positions, b
    assert step.logit_rows.tolist() == [0, 1, 2]
    logits = torch.arange(2 * 3 * 4, dtype=torch.float32).reshape(2, 3, 4)
    assert step.logits_of(logits, 1).tolist() == logits[1, :2].tolist()  # b=1 reads c and u0, not the padding


def test_squeeze_drawing_matches_the_cache():
    # kv's drawing: each row's keys keep their order and move right; the columns that were holes in every row go
    doc = kv.__doc__.splitlines()
    start = next(i for i, line in enumerate(doc) if "after squeeze" in line)
    grids = [[], []]
    for line in doc[start + 1 : start + 3]:
        before, after = line.split("->")
        for grid, text in zip(grids, (before.split()[1:], after.split())):
            grid.append([-1 if t == "." else int(t) for t in text])
    cache = kv.BatchCache()
    cache.cache.update(*(torch.tensor(grids[0], dtype=torch.float32)[:, None, :, None].expand(-1, 2, -1, 3).contiguous(),) * 2, 0)
    cache.positions = torch.tensor(grids[0])
    assert cache.spare == 2
    cache.squeeze()
    assert cache.positions.tolist() == grids[1] and cache.spare == 0
    keys = cache.cache.layers[0].keys  # (B, heads, S, head_dim), each key holding its own position
    valid = cache.positions >= 0
    assert torch.equal(keys[:, 0, :, 0][valid], cache.positions[valid].float())


def test_a_sequences_first_keys_are_taken_whole_in_order_or_not_at_all():
    """``BatchCache.sequence``: the keys of positions 0 .. n - 1 of one sequence, holes left out (the drawing's row
    b=0 before its squeeze), as a one-sequence cache a prompt prefills after; None where a position is not held.
    ``HeldKeys.prefix_for``: a prompt's longest common prefix with the held tokens, never its last token."""
    grid = [[0, 1, 2, -1, 3, 4, -1, 5], [-1, -1, -1, 0, 1, -1, -1, 2]]
    cache = kv.BatchCache()
    cache.cache.update(*(torch.tensor(grid, dtype=torch.float32)[:, None, :, None].expand(-1, 2, -1, 3).contiguous(),) * 2, 0)
    cache.positions = torch.tensor(grid)
    first = cache.sequence(0, 5)
    assert first.positions.tolist() == [[0, 1, 2, 3, 4]] and first.length == 5 and first.cache.get_seq_length() == 5
    assert first.cache.layers[0].keys[0, :, :, 0].tolist() == [[0, 1, 2, 3, 4]] * 2
    assert cache.sequence(1, 3).cache.layers[0].keys[0, 0, :, 0].tolist() == [0, 1, 2]
    assert cache.sequence(1, 4) is None and cache.sequence(0, 7) is None  # position 3, or 6, is not held
    first.cache.update(torch.full((1, 2, 1, 3), 9.0), torch.full((1, 2, 1, 3), 9.0), 0)  # a copy: the batch's keys stay
    assert cache.cache.layers[0].keys.shape[-2] == 8 and cache.positions.tolist() == grid
    held = kv.HeldKeys([7, 8, 9, 10, 11, 12], cache.sequence(0, 6))
    assert held.prefix_for([7, 8, 9, 4, 5]).length == 3  # the common prefix
    assert held.prefix_for([7, 8, 9]).length == 2  # never the prompt's last token: its logits come from a prefill
    assert held.prefix_for([7, 8, 9, 10, 11, 12, 13, 14]).length == 6  # all of them, then the rest prefilled
    assert held.prefix_for([1, 8, 9]) is None and held.prefix_for([7]) is None


def held_keys(tokens: list[int]) -> kv.HeldKeys:
    """``tokens`` with keys of one layer, 2 heads of 3 (4 bytes each: 48 bytes a token)."""
    cache = kv.BatchCache()
    cache.cache.update(torch.zeros(1, 2, len(tokens), 3), torch.zeros(1, 2, len(tokens), 3), 0)
    cache.positions = torch.arange(len(tokens))[None]
    return kv.HeldKeys(tokens, cache)


def test_recent_keys_give_the_longest_prefix_held_within_their_budget():
    """``RecentKeys``: a server's finished requests' keys, the most recently used first within a budget of bytes;
    a prompt gets the longest prefix any of them holds, and keys that a newer sequence begins with give way to it."""
    recent = kv.RecentKeys(48 * 10)  # 10 tokens' keys
    recent.add(held_keys([1, 2, 3]))
    recent.add(held_keys([5, 6]))
    assert recent.prefix_for([1, 2, 9, 9]).length == 2 and recent.prefix_for([5, 6, 7]).length == 2
    assert recent.prefix_for([4, 4]) is None
    recent.add(held_keys([1, 2, 3, 4, 5]))  # a chat's next turn: its first 3 tokens were held, and go
    assert [keys.tokens for keys in recent.held] == [[1, 2, 3, 4, 5], [5, 6]]
    assert recent.prefix_for([5, 6, 7]).length == 2  # used: now first
    assert recent.add(held_keys([7, 7, 7, 7])) == 48 * 6  # 4 + 2 + 5 tokens: the least recently used goes
    assert [keys.tokens for keys in recent.held] == [[7, 7, 7, 7], [5, 6]]
    assert recent.add(held_keys(list(range(20, 31)))) == 48 * 6  # alone over the budget: not held, nothing held goes
    assert [keys.tokens for keys in recent.held] == [[7, 7, 7, 7], [5, 6]]
    assert not kv.RecentKeys(0).prefix_for([1, 2])
    with pytest.raises(ValueError, match="budget must be an integer number of bytes >= 0"):
        kv.RecentKeys(-1)


def test_spare_kept_across_compactions_is_what_the_positions_say():
    """``BatchCache.spare`` is kept through a compaction that gives every sequence as many keys, recomputed after one
    that leaves a sequence short: after every step it equals the count from the positions."""
    rng = np.random.default_rng(0)
    cache = kv.BatchCache()
    cache.cache.update(torch.zeros(2, 1, 4, 3), torch.zeros(2, 1, 4, 3), 0)
    cache.append(torch.arange(4).repeat(2, 1))
    for _ in range(20):
        step = int(rng.integers(1, 5))
        cache.cache.update(torch.zeros(2, 1, step, 3), torch.zeros(2, 1, step, 3), 0)
        keep = [np.sort(rng.choice(step, int(rng.integers(1, step + 1)), replace=False)) for _ in range(2)]
        keep = [np.union1d([0], k) for k in keep]  # the current token's row always stays
        cache.compact(step, keep, [100 + k for k in keep])
        assert cache.spare == cache.length - int((cache.positions >= 0).sum(1).max())


def test_growing_layer_appends_in_place_and_matches_the_stock_layer():
    # kv.GrowingLayer against transformers' DynamicLayer through the same updates, crops and replacements
    from transformers.cache_utils import DynamicLayer

    torch.manual_seed(0)
    ours, stock = kv.GrowingLayer(), DynamicLayer()
    new = lambda t: (torch.randn(2, 3, t, 4), torch.randn(2, 3, t, 4))  # noqa: E731 (batch, heads, seq, head_dim)
    buffers = set()
    for step, (t, crop) in enumerate([(5, 0), (3, -1), (4, -2), (1, 0), (2, 0), (80, -3), (2, -2), (3, -1), (1, 0)]):
        k, v = new(t)
        outs = [layer.update(k, v) for layer in (ours, stock)]
        assert all(torch.equal(a, b) for a, b in zip(*outs))
        for layer, out in zip((ours, stock), outs):
            assert torch.equal(out[0], layer.keys) and torch.equal(out[1], layer.values)
        for layer in (ours, stock):
            layer.crop(crop)
        assert ours.get_seq_length() == stock.get_seq_length()
        if step % 2 == 0:  # read after the crop; else the next update follows it unread (as in the decode loop)
            assert torch.equal(ours.keys, stock.keys) and torch.equal(ours.values, stock.values)
        buffers.add(outs[0][0].untyped_storage().data_ptr())
        if step == 3:  # a replacement (as BatchCache.keep or squeeze makes) moves into a new buffer at the next update
            ours.keys, ours.values = ours.keys[[1, 0]], ours.values[[1, 0]]
            stock.keys, stock.values = stock.keys[[1, 0]], stock.values[[1, 0]]
    assert len(buffers) == 3  # the first buffer, the replacement's and one growth: the other steps wrote in place
    k, v = new(2)
    for layer in (ours, stock):  # a reset right after a crop, then a new start
        layer.crop(-1)
        layer.reset()
        layer.update(k, v)
    assert torch.equal(ours.keys, stock.keys) and ours.get_seq_length() == stock.get_seq_length() == 2


def test_a_joining_cache_is_stacked_once_into_a_buffer_the_next_step_appends_to():
    # kv.BatchCache.join: the shorter side padded on the left with zeros, as a padded concatenation would give
    torch.manual_seed(0)
    caches = []
    for batch, length in ((2, 5), (1, 9)):
        cache = kv.BatchCache()
        k, v = torch.randn(batch, 3, length, 4), torch.randn(batch, 3, length, 4)
        cache.cache.update(k, v, 0)
        cache.append(torch.arange(length).expand(batch, -1))
        caches.append((cache, k, v))
    (ours, k0, v0), (other, k1, v1) = caches
    ours.join(other)
    layer = ours.cache.layers[0]
    pad = torch.nn.functional.pad
    assert torch.equal(layer.keys, torch.cat([pad(k0, (0, 0, 4, 0)), k1])) and torch.equal(layer.values, torch.cat([pad(v0, (0, 0, 4, 0)), v1]))
    assert ours.positions.tolist() == [[-1] * 4 + list(range(5))] * 2 + [list(range(9))]
    storage = layer.keys.untyped_storage().data_ptr()
    layer.update(torch.randn(3, 3, 2, 4), torch.randn(3, 3, 2, 4))
    assert layer.keys.shape[-2] == 11 and layer.keys.untyped_storage().data_ptr() == storage  # appended in place
