"""The step layout against the diagram drawn in ``lookahead/layout.py``."""

import torch

import lookahead.layout as layout_module
from lookahead.layout import build_layout


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


def test_layout_matches_the_drawn_diagram():
    names, allowed, positions = diagram_from_docstring()
    layout = build_layout(window=3, ngram=3, levels=2, n_cands=2)
    assert names == ["c", "a0", "a1", "a2", "b0", "b1", "b2", "v0", "v1", "w0", "w1"]
    assert torch.equal(layout.allowed, allowed)
    assert layout.offsets.tolist() == positions
    # logits: the current token, the last level (b0..b2) and every candidate token
    assert layout.logit_rows.tolist() == [0, 4, 5, 6, 7, 8, 9, 10]


def test_every_row_is_a_causal_sequence_of_consecutive_positions():
    # for any shape, each row's visible rows (plus the cache) form positions 0..offset exactly once
    for w, n, levels, cands in [(1, 2, 1, 0), (4, 5, 3, 2), (5, 4, 2, 5), (2, 3, 0, 1)]:
        layout = build_layout(w, n, levels, cands)
        for row in range(layout.size):
            seen = sorted(layout.offsets[layout.allowed[row]].tolist())
            assert seen == list(range(int(layout.offsets[row]) + 1)), (w, n, levels, cands, row)


def test_additive_mask_hides_keys_beyond_the_sliding_window():
    layout = build_layout(window=2, ngram=2, levels=1, n_cands=0)  # rows c, a0, a1 at offsets 0, 1, 2
    # cache holds positions 10..13 (kv_offset 10), current token at 14, window 4: query 14+d sees keys > 10+d
    mask = layout.additive_mask(kv_length=4 + 3, kv_offset=10, position=14, sliding_window=4, dtype=torch.float32)
    visible = (mask[0, 0] == 0).int().tolist()
    assert visible == [
        [0, 1, 1, 1, 1, 0, 0],  # c  (14) sees 11..13 and itself
        [0, 0, 1, 1, 1, 1, 0],  # a0 (15) sees 12..13, c, itself
        [0, 0, 0, 1, 1, 1, 1],  # a1 (16) sees 13, c, a0, itself
    ]
    full = layout.additive_mask(kv_length=7, kv_offset=0, position=14, sliding_window=None, dtype=torch.bfloat16)
    assert full.dtype == torch.bfloat16 and (full[0, 0, :, :4] == 0).all()
