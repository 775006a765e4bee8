"""What real steps cost by their rows: a real model decoding real prompts with trees of at most B nodes (the planner
off, no Jacobi window: a step is its tree's nodes + the current token), each step's forward timed, beside our plain
loop's, the planner's own choice, ``lookahead tune``'s r(T) at the same rows and the arithmetic floor there.

    python -m benchmarks.step_cost --model qwen2.5-coder-1.5b --dtype int8 --weights gguf --budgets 4,8,16,32 --limit 1 [--isa avx2]

All as ratios to the plain loop's forward in the same run: the configurations interleaved prompt by prompt (each
prompt once per configuration, each its own generator and drafting state), so a slow spell of the VM lands on all of
them. r(T) is the probe's forward over a 256-token cache at T rows (``probing``: what the planner prices a step by);
a real step's rows vary, so it is read at the mean. The floor: T rows' multiply-adds of every linear at the CPU's
8-bit dot-product peak (``benchmarks.arithmetic_floor``; AMX tiles not counted), over the one-row forward. ``--isa``
holds our kernels to a tier below the CPU's best (an AVX-512 CPU measuring its AVX2 kernels), the floor its dot product's."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import torch

from benchmarks import datasets
from benchmarks.arithmetic_floor import dot_peak
from benchmarks.profile_step import linear_flops
from benchmarks.results_log import count, same, write_json
from benchmarks.run import hardware
from lookahead import LookaheadConfig, LookaheadGenerator, models, native
from lookahead.curve import CostCurve

PLAIN, PLANNER = "our plain loop", "the planner"
HOST = ("draft", "verify", "learn")  # a step's phases on the host around its forward (the layout is in the forward's)


def configs(budgets: list[int]) -> dict[str, LookaheadConfig | None]:
    """None: the plain loop; trees of at most B nodes, fixed (no window, no planner); the planner as shipped."""
    fixed = LookaheadConfig(auto=False, window=0, recycle_prior_s=float("inf"))
    return {PLAIN: None, **{f"up to {b} nodes": dataclasses.replace(fixed, tree_budget=b) for b in budgets},
            PLANNER: LookaheadConfig(recycle_prior_s=float("inf"))}


def run_all(args) -> dict:
    cache_dir = args.cache_dir or models.default_cache_dir()
    model, tok = models.load(args.model, dtype=args.dtype, cache_dir=cache_dir, kernels="packed", weights=args.weights)
    prompts = datasets.load(args.sets, args.limit, cache_dir)
    ids = [p.ids(tok) for p in prompts]
    shapes = configs(args.budgets)
    gens = {name: LookaheadGenerator(model, tok, config or LookaheadConfig(), cache_dir=cache_dir) for name, config in shapes.items()}
    runs = datasets.interleaved(gens, {name: config is not None for name, config in shapes.items()}, prompts, ids, args.max_new_tokens,
                                lambda stats: {"steps": stats.steps, "tree_nodes": stats.tree_nodes, "forward_s": stats.phase_s["forward"],
                                               "host_s": sum(stats.phase_s[phase] for phase in HOST)},
                                lambda run: f"{run['forward_s'] / max(run['steps'], 1) * 1e3:.1f} ms a forward")
    what, peak = dot_peak(torch.get_num_threads(), tier=args.isa)
    curve = gens[PLANNER].cost
    return {"hardware": hardware(), "isa": native.isa(), "model": args.model, "dtype": args.dtype, "weights": args.weights,
            "max_new_tokens": args.max_new_tokens, "runs": runs, "curve": {"sizes": curve.sizes, "ratios": curve.ratios},
            "peak": {"what": what, "macs_a_s": peak, "macs_a_row": linear_flops(model, 1) / 2, "one_row_ms": curve.ms_at_1}}


def write_report(results: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "results.json", results)  # the token ids as digests
    runs, hw, peak = results["runs"], results["hardware"], results["peak"]
    sizes, ratios = results["curve"]["sizes"], results["curve"]["ratios"]
    total = {name: {key: sum(r[key] for r in rs) for key in ("steps", "tree_nodes", "forward_s", "host_s", "seconds")} | {
        "tokens": sum(count(r["tokens"]) for r in rs)} for name, rs in runs.items()}
    plain = total[PLAIN]
    plain_ms, plain_host = plain["forward_s"] / plain["steps"], plain["host_s"] / plain["steps"]
    lines = [f"# {results['model']}: what real steps cost by their rows", "",
             f"{hw['cpu']}, {hw['cores']} cores; our kernels {results['isa']}; torch {hw['torch']}; commit {hw['commit']}; "
             f"{results['dtype']}, {results['weights']} weights; {len(runs[PLAIN])} prompts x {results['max_new_tokens']} new tokens, "
             "greedy, one request at a time, the configurations interleaved prompt by prompt. Rows: a step's tree nodes + 1 "
             f"(no window). Floor: the rows' multiply-adds at {peak['what']}'s peak ({peak['macs_a_s'] / 1e9:.0f} G a second) "
             "over the probe's one-row forward. Host work: a step's drafting, verification and learning (its layout is in "
             "the forward's time); drafting's share: what it adds to the plain step's, over the whole step.", "",
             "| configuration | rows a step (mean) | forward a step (ms) | vs the plain forward | tune's r(T) there | floor there "
             "| host work a step (ms) | drafting's host share | tokens a forward | tokens/s vs our plain loop | same tokens as our plain loop |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, t in total.items():
        rows = 1 + t["tree_nodes"] / max(t["steps"], 1)
        tune = CostCurve(tuple(sizes), tuple(ratios), peak["one_row_ms"]).ratio(rows)
        floor = max(rows * peak["macs_a_row"] / peak["macs_a_s"] * 1e3 / peak["one_row_ms"], 1.0)
        alike = sum(same(r["tokens"], q["tokens"]) for r, q in zip(runs[name], runs[PLAIN])) / len(runs[name])
        speed = (t["tokens"] / t["seconds"]) / (plain["tokens"] / plain["seconds"])
        host = t["host_s"] / t["steps"]
        share = (host - plain_host) / (host + t["forward_s"] / t["steps"])
        lines.append(f"| {name} | {rows:.2f} | {t['forward_s'] / t['steps'] * 1e3:.1f} | {t['forward_s'] / t['steps'] / plain_ms:.2f} | "
                     f"{tune:.2f} | {floor:.2f} | {host * 1e3:.3f} | {share:.1%} | {t['tokens'] / (t['steps'] + len(runs[name])):.2f} | "
                     f"{speed:.2f}x | {alike:.0%} |")
    (out / "results.md").write_text("\n".join(lines) + "\n")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--dtype", default=native.INTEGER, choices=sorted(models.DTYPES))
    parser.add_argument("--weights", default="gguf", choices=models.WEIGHTS)
    parser.add_argument("--budgets", default=[4, 8, 16, 32], type=lambda text: [int(b) for b in text.split(",")],
                        help="the trees' most nodes, comma-separated")
    datasets.add_arguments(parser, limit=1)
    parser.add_argument("--isa", choices=list(native.TIERS), help="hold our kernels to this tier (default: the CPU's best)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/step-cost-latest"))
    args = parser.parse_args(argv)
    if args.isa:
        native.library(tier=args.isa)  # before the model loads them
    write_report(run_all(args), args.out)
    print((args.out / "results.md").read_text())


if __name__ == "__main__":
    main()
