"""Compression (tokens per forward) and tokens/s of lookahead on the six exactness prompts, next to plain HF
greedy tokens/s in the same dtype, measured in the same run:

    python -m benchmarks.compression [--dtypes float32,bfloat16] [--config PRESET|field=value,... ...] [--max-new-tokens 64]
"""

from __future__ import annotations

import argparse

from benchmarks.prompts import PROMPTS, prompt_ids
from benchmarks.run import PRESETS, hardware, hf_generate, parse_config
from lookahead import LookaheadGenerator, models


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=models.DEFAULT_MODEL)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--config", dest="configs", action="append", help="a preset or field=value,... (repeatable)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    configs = dict(parse_config(spec) for spec in (args.configs or list(PRESETS)))
    hw = hardware()
    print(f"{args.model}, {hw['cpu']}, {hw['cores']} cores, {args.max_new_tokens} new tokens, commit {hw['commit']}\n")
    print("| dtype | method | " + " | ".join(name for name, _, _ in PROMPTS) + " | tokens/s (all) | vs HF greedy |")
    print("|---|---|" + "---|" * (len(PROMPTS) + 2))
    for dtype in args.dtypes.split(","):
        model, tok = models.load(args.model, dtype=dtype)
        prompts = [prompt_ids(tok, text, chat) for _, text, chat in PROMPTS]
        gens = [LookaheadGenerator(model, tok, c) for c in configs.values()]
        hf_generate(model, prompts[0], 4)
        for g in gens:
            g.generate(prompts[0], max_new_tokens=4, state=g.new_state())  # a throwaway state: the timed runs learn from each other only
        greedy_tokens = greedy_secs = 0.0
        rows = {id(g): ([], 0, 0.0) for g in gens}
        for ids in prompts:  # interleaved: each prompt runs every method before the next prompt
            toks, secs = hf_generate(model, ids, args.max_new_tokens)
            greedy_tokens, greedy_secs = greedy_tokens + len(toks), greedy_secs + secs
            for g in gens:
                out = g.generate(ids, max_new_tokens=args.max_new_tokens)
                comps, n, s = rows[id(g)]
                rows[id(g)] = (comps + [out.stats.compression], n + out.stats.new_tokens, s + out.stats.prefill_s + out.stats.decode_s)
        base = greedy_tokens / greedy_secs
        print(f"| {dtype} | HF greedy | " + " | ".join("1.00" for _ in PROMPTS) + f" | {base:.2f} | 1.00x |")
        for name, g in zip(configs, gens):
            comps, n, s = rows[id(g)]
            print(f"| {dtype} | {name} | " + " | ".join(f"{v:.2f}" for v in comps)
                  + f" | {n / s:.2f} | {n / s / base:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
