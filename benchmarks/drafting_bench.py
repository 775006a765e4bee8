"""A whole step's drafting work (``DraftState.propose`` + ``learn``: pool, suffix matcher, recycling table,
tree merge) next to one forward of the model that step feeds, timed in the same run:

    python -m benchmarks.drafting_bench [--budget 16 --prompt-tokens 1024 --steps 2000]

The sequence is Zipf-distributed ids (keys repeat, lookups hit, the suffix matcher finds matches); the
step's inputs have the shapes the engine gives them (W trajectories, every logit row's top-k).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from lookahead import LookaheadConfig, kv, models
from lookahead.drafting import DraftState, Observed
from lookahead.tree import TokenTree


def drafting_us(cfg: LookaheadConfig, vocab: int, prompt_tokens: int, steps: int, seed: int = 0) -> float:
    """Mean microseconds of one step's ``propose`` + ``learn`` (after a warm-up)."""
    rng = np.random.default_rng(seed)
    seq = ((rng.zipf(1.2, size=prompt_tokens + steps * 2) - 1) % vocab).astype(np.int64)
    state = DraftState.for_config(vocab, cfg)
    suffix = state.start(seq[:prompt_tokens].tolist(), cfg)
    rows = 1 + cfg.window + cfg.tree_budget
    topk = ((rng.zipf(1.2, size=(steps, rows, cfg.recycle_k)) - 1) % vocab).astype(np.int64)
    trajectories = ((rng.zipf(1.2, size=(steps, cfg.window, cfg.ngram)) - 1) % vocab).astype(np.int64)
    pos, total = prompt_tokens, 0.0
    for i in range(steps):
        start = time.perf_counter()
        tree = state.propose(int(seq[pos - 1]), cfg, cfg.tree_budget, 64, suffix)
        path = _accepted_path(tree, seq[pos:])
        emitted = seq[pos : pos + len(path) + 1].tolist()
        row_tokens = np.concatenate([[seq[pos - 1]], rng.integers(0, vocab, rows - 1)])
        state.learn(cfg, [Observed(tree, path, emitted, trajectories[i], row_tokens, topk[i], seq[pos - cfg.ngram + 1 : pos].tolist(), suffix)])
        total += time.perf_counter() - start if i >= 100 else 0.0
        pos += len(emitted)
    return total / max(steps - 100, 1) * 1e6


def _accepted_path(tree: TokenTree, upcoming: np.ndarray) -> list[int]:
    node, path = -1, []
    for token in upcoming[:32]:
        match = next((c for c in tree.children(node) if tree.tokens[c] == token), None)
        if match is None:
            break
        node = int(match)
        path.append(node)
    return path


def forward_ms(model, rows: int, context: int = 512, reps: int = 20) -> float:
    """Median milliseconds of one forward adding ``rows`` tokens to a ``context``-token cache."""
    from transformers import DynamicCache

    times = []
    with torch.inference_mode():
        for _ in range(reps):
            cache = DynamicCache(config=model.config)
            model(input_ids=torch.randint(100, 1000, (1, context)), **kv.cache_kwarg(model, cache), logits_to_keep=1)
            start = time.perf_counter()
            model(input_ids=torch.randint(100, 1000, (1, rows)), **kv.cache_kwarg(model, cache), logits_to_keep=rows)
            times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1000


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=models.DEFAULT_MODEL)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--budget", type=int, default=LookaheadConfig.tree_budget)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=2000)
    args = parser.parse_args(argv)
    model, _ = models.load(args.model, dtype=args.dtype)
    cfg = LookaheadConfig(tree_budget=args.budget)
    vocab = models.vocab_size(model)
    draft = drafting_us(cfg, vocab, args.prompt_tokens, args.steps)
    fwd = forward_ms(model, 1 + cfg.window * (cfg.ngram - 1) + cfg.tree_budget)
    print(f"{args.model} ({args.dtype}), vocab {vocab}, budget {args.budget}, {args.prompt_tokens}-token prompt, {args.steps} steps")
    print(f"drafting per step (propose + learn): {draft:8.1f} us")
    print(f"one forward of the step:             {fwd * 1000:8.1f} us")
    print(f"drafting / forward:                  {draft / (fwd * 1000):8.1%}")


if __name__ == "__main__":
    main()
