"""What the Jacobi window earns, and whether lookahead ever loses a prompt: lookahead with the window and without it
(``window=0``), beside our plain loop, on the same model, weights, dtype and prompts, one request at a time,
interleaved prompt by prompt (each prompt once per configuration, so a slow spell of the machine lands on all of
them); with each prompt's speed against our plain loop, how many steps the planner ran the window and how many
draft tokens its trajectories got accepted.

    python -m benchmarks.window --model qwen2.5-coder-1.5b --dtype int8 --limit 1 --max-new-tokens 64

Each configuration has its own generator, whose drafting state (and the window's worth) is kept across its
requests, as a server's is: warm from the earlier prompts only."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from benchmarks import datasets
from benchmarks.results_log import count, same, write_json
from benchmarks.run import hardware
from lookahead import LookaheadConfig, LookaheadGenerator, models

WHOLE_PRIOR = LookaheadConfig(recycle_prior_s=float("inf"))  # the prior a user has after a few runs, whatever it costs once
CONFIGS = {"lookahead": WHOLE_PRIOR, "lookahead without the window": dataclasses.replace(WHOLE_PRIOR, window=0), "our plain loop": None}


def run_all(args) -> dict:
    cache_dir = args.cache_dir or models.default_cache_dir()
    model, tok = models.load(args.model, dtype=args.dtype, cache_dir=cache_dir, kernels="packed", weights=args.weights)
    prompts = datasets.load(args.sets, args.limit, cache_dir)
    ids = [p.ids(tok) for p in prompts]
    gens = {name: LookaheadGenerator(model, tok, config or WHOLE_PRIOR, cache_dir=cache_dir) for name, config in CONFIGS.items()}
    runs = datasets.interleaved(gens, {name: config is not None for name, config in CONFIGS.items()}, prompts, ids, args.max_new_tokens,
                                lambda stats: {"steps": stats.steps, "window_steps": stats.window_steps, "rested_steps": stats.rested_steps,
                                               "trajectory_tokens": stats.accepted_by_source.get("trajectory", 0)},
                                lambda run: f"{len(run['tokens']) / run['seconds']:.1f} tok/s")
    return {"hardware": hardware(), "model": args.model, "dtype": args.dtype, "weights": args.weights,
            "max_new_tokens": args.max_new_tokens, "runs": runs}


def write_report(results: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "results.json", results)  # the token ids as digests
    runs, hw = results["runs"], results["hardware"]
    tps = {m: sum(count(r["tokens"]) for r in rs) / sum(r["seconds"] for r in rs) for m, rs in runs.items()}
    plain = runs["our plain loop"]
    lines = [f"# {results['model']}: what the Jacobi window earns, prompt by prompt against our plain loop", "",
             f"{hw['cpu']}, {hw['cores']} cores; torch {hw['torch']}; commit {hw['commit']}; {results['dtype']}, "
             f"{results['weights']} weights; {len(plain)} prompts, {results['max_new_tokens']} new tokens, greedy, one request at a time, "
             "the configurations interleaved prompt by prompt.", "",
             "| configuration | tokens/s | vs our plain loop | slowest prompt vs our plain loop | steps | rested steps | steps that ran the window "
             "| accepted draft tokens its trajectories proposed | same tokens as our plain loop |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, rs in runs.items():
        alike = sum(same(r["tokens"], q["tokens"]) for r, q in zip(rs, plain)) / len(rs)
        slowest = min(q["seconds"] / r["seconds"] for r, q in zip(rs, plain))
        lines.append(f"| {name} | {tps[name]:.1f} | {tps[name] / tps['our plain loop']:.2f}x | {slowest:.2f}x | {sum(r['steps'] for r in rs)} | "
                     f"{sum(r.get('rested_steps', 0) for r in rs)} | {sum(r['window_steps'] for r in rs)} | {sum(r['trajectory_tokens'] for r in rs)} | {alike:.0%} |")
    (out / "results.md").write_text("\n".join(lines) + "\n")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=models.DEFAULT_MODEL)
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(models.DTYPES))
    parser.add_argument("--weights", default="auto", choices=models.WEIGHTS)
    datasets.add_arguments(parser, limit=2)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/window-latest"))
    args = parser.parse_args(argv)
    write_report(run_all(args), args.out)
    print((args.out / "results.md").read_text())


if __name__ == "__main__":
    main()
