"""Per-decode-step cost of the n-gram pool: ``NGramPool`` vs the pure-Python dict-of-lists pool.

One simulated lookahead step inserts W n-grams of length N (the window's trajectories) and looks up
up to G candidates for the last token. Both pools get the same pre-generated steps, each in its
natural input form (numpy arrays / Python lists), timed in the same run:

    python -m benchmarks.pool_bench [--window 15 --guess 15 --ngram 5 --steps 20000]
"""

from __future__ import annotations

import argparse
import platform
import time

import numpy as np

from ngram_pool import NGramPool
from ngram_pool.reference import PyNGramPool


def make_steps(steps: int, window: int, ngram: int, vocab: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Token ids from a Zipf law (as in text), so keys repeat and lookups hit."""
    rng = np.random.default_rng(seed)
    ids = (rng.zipf(1.3, size=(steps, window, ngram)) - 1) % vocab
    keys = (rng.zipf(1.3, size=steps) - 1) % vocab
    return ids.astype(np.int32), keys.astype(np.int32)


def time_pool(step, n_steps: int) -> float:
    start = time.perf_counter()
    for i in range(n_steps):
        step(i)
    return (time.perf_counter() - start) / n_steps


def run(window: int, guess: int, ngram: int, steps: int, vocab: int = 49152, slots: int = 16, seed: int = 0) -> dict:
    grams, keys = make_steps(steps, window, ngram, vocab, seed)
    grams_list, keys_list = grams.tolist(), keys.tolist()
    fast, fused, slow = NGramPool(vocab, ngram, slots), NGramPool(vocab, ngram, slots), PyNGramPool(ngram, slots)

    def fast_step(i: int) -> None:
        fast.insert_many(grams[i])
        fast.lookup(int(keys[i]), guess)

    def fused_step(i: int) -> None:  # what the engine calls once per decode step
        fused.insert_and_lookup(grams[i], int(keys[i]), guess)

    def slow_step(i: int) -> None:
        slow.insert_many(grams_list[i])
        slow.lookup(keys_list[i], guess)

    t_fast, t_fused, t_slow = (time_pool(f, steps) for f in (fast_step, fused_step, slow_step))
    return {
        "separate_us": t_fast * 1e6, "fused_us": t_fused * 1e6, "python_us": t_slow * 1e6,
        "speedup_separate": t_slow / t_fast, "speedup_fused": t_slow / t_fused,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--window", type=int, default=15)
    parser.add_argument("--guess", type=int, default=15)
    parser.add_argument("--ngram", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20000)
    args = parser.parse_args()
    r = run(args.window, args.guess, args.ngram, args.steps)
    print(f"{platform.processor() or platform.machine()}, W={args.window} G={args.guess} N={args.ngram}, {args.steps} steps")
    print(f"dict-of-lists pool (pure Python):        {r['python_us']:6.2f} us/step")
    print(f"NGramPool insert_many + lookup:          {r['separate_us']:6.2f} us/step  {r['speedup_separate']:5.1f}x faster")
    print(f"NGramPool insert_and_lookup (the engine): {r['fused_us']:6.2f} us/step  {r['speedup_fused']:5.1f}x faster")


if __name__ == "__main__":
    main()
