"""Speed, compression and exactness of lookahead decoding, side by side with plain HF greedy and HF prompt-lookup
decoding, interleaved in ONE process on the same model, dtypes and prompts.

    python -m benchmarks.run              # quick: 2 prompts per set, 64 new tokens, fp32 and bf16 (~10 min, 2 cores)
    python -m benchmarks.run --full       # every prompt of every set, 128 new tokens
    python -m benchmarks.run --ablation   # also each drafting source alone, and without the Jacobi branch
    python -m benchmarks.run --config default --config tree_budget=32,recycle_k=4   # presets or field=value lists

Speedups are ratios of tokens/s in the same run: against HF greedy in the same dtype, and against the fastest
HF greedy in any dtype measured (a bf16 speedup over a slow bf16 baseline alone would flatter us). HF runs on
the stock model; our loop on the engine's kernels (--kernels, default packed: see lookahead/kernels.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import subprocess
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

import lookahead
from benchmarks import datasets
from benchmarks.results_log import write_json
from benchmarks.prompts import prompt_ids
from lookahead import LookaheadConfig, LookaheadGenerator, models, native, probing
from lookahead.cpu import cpu_name
from lookahead.drafting import SOURCES
from lookahead.hf import generator_for
from lookahead.kernels import kernels_of
from tests.oracle import is_tie

GREEDY, PLD, PLAIN = "hf_greedy", "hf_prompt_lookup", "plain loop (--no-lookahead)"
COLD = "(cold state)"  # a fresh drafting state for the call, where the generator's own has learnt from the prompts before
HF_ENTRY = "generate(custom_generate=lookahead.custom_generate)"  # the first --config through generate(): its overhead


@dataclass
class Run:
    set: str
    prompt: str
    dtype: str
    method: str
    seconds: float
    tokens: list[int]
    steps: int | None = None  # forwards after the prefill (lookahead only)
    accepted_by_source: dict = field(default_factory=dict)
    drafted_by_source: dict = field(default_factory=dict)
    tree_nodes: int = 0
    phase_s: dict = field(default_factory=dict)  # decode time by phase (draft, forward, verify, learn)
    equal: bool | None = None  # same tokens as HF greedy in the same dtype
    equal_or_tie: bool | None = None  # ... or first differs where the reference's top-2 logits tie (see is_tie)


# named configurations: the default (cost model on), its shape run as given, wave 1's fixed W3N3G3 (pool
# candidates only, 6 tree rows, no cost model), and the ablation (each with the cost model)
PRESETS = {
    "default": {},
    "default-fixed": dict(auto=False),
    "wave1-W3N3G3": dict(window=3, ngram=3, guess=3, tree_budget=6, suffix_drafts=0, recycle_k=0, auto=False),
}
ABLATION = {
    "jacobi-pool-only": dict(suffix_drafts=0, recycle_k=0),
    "suffix-only": dict(window=0, guess=0, recycle_k=0),
    "recycle-only": dict(window=0, guess=0, suffix_drafts=0),
    "no-jacobi": dict(window=0),
}


def parse_config(spec: str) -> tuple[str, LookaheadConfig]:
    """A preset name, or ``field=value,...`` over ``LookaheadConfig``'s integer and 0/1 fields -> (method name, config)."""
    if spec in PRESETS | ABLATION:
        return f"lookahead {spec}", LookaheadConfig(**(PRESETS | ABLATION)[spec])
    flags = {f.name for f in dataclasses.fields(LookaheadConfig) if f.type in (bool, "bool")}
    try:
        fields = {k.strip(): int(v) for k, v in (item.split("=") for item in spec.split(","))}
        fields = {k: bool(v) if k in flags else v for k, v in fields.items()}
        return f"lookahead {spec}", LookaheadConfig(**fields)
    except (ValueError, TypeError) as e:
        raise SystemExit(f"--config {spec!r}: a preset ({', '.join(PRESETS | ABLATION)}) or field=value,... ({e})") from None


def hf_generate(model, ids: list[int], max_new_tokens: int, **kwargs) -> tuple[list[int], float]:
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids], device=model.device), max_new_tokens=max_new_tokens, do_sample=False, **kwargs)
    return out[0, len(ids):].tolist(), time.perf_counter() - start


def cost_curve(model, sizes: list[int], context: int = 128, reps: int = 5) -> dict[int, float]:
    """c(T)/c(1): time of one forward of the loop's (``probing.step_times``: its cache, its 4D mask, so on our kernels
    our attention) adding T tokens to a ``context``-token cache, relative to T=1; each size's fastest of ``reps``
    rounds over every size in turn, so a machine that slows for a while slows every size alike. (It once timed
    HF's own call without a mask, which on our kernels ran SDPA's attention under HF's bool mask: bf16 r(16) read
    1.43-1.54 where the loop's 16-row forwards took ~1.27x its one-row ones.)"""
    times = probing.step_times(model, tuple(sizes), context, reps)
    base = times[1, sizes[0]]
    return {size: times[1, size] / base for size in sizes} | {"ms_at_1": base * 1000}


def hardware() -> dict:
    cpu = cpu_name()
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True, cwd=Path(__file__).parent).stdout.strip())
    except OSError:
        commit, dirty = "unknown", False
    import numba
    import transformers

    return {
        "cpu": cpu, "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(), "python": platform.python_version(),
        "torch": torch.__version__, "transformers": transformers.__version__, "numba": numba.__version__,
        "lookahead": getattr(lookahead, "__version__", "dev"), "commit": commit + ("+dirty" if dirty else ""),
    }


def run_all(args) -> dict:
    cache_dir = args.cache_dir or models.default_cache_dir()
    machine = hardware()  # before the run, so the commit recorded is the one measured
    configs = dict(parse_config(spec) for spec in args.configs)
    loaded = {dtype: models.load(args.model, dtype=dtype, device=args.device, cache_dir=cache_dir) for dtype in args.dtypes}  # stock: HF's baselines
    # our loop runs on the engine's kernels (packed by default on CPU), a copy of its own; HF's methods on the stock model
    ours = {dtype: models.load(args.model, dtype=dtype, device=args.device, cache_dir=cache_dir, kernels=args.kernels)[0]
            for dtype in args.dtypes}
    tokenizer = next(iter(loaded.values()))[1]
    gens = {(dtype, name): LookaheadGenerator(ours[dtype], tok, c, cache_dir=cache_dir) for dtype, (_, tok) in loaded.items()
            for name, c in configs.items()}
    # the first config again, from a cold drafting state per call, on a generator of its own (its cost corrections
    # and calibration must not learn a prompt just before the warm generator times it)
    colds = {dtype: LookaheadGenerator(ours[dtype], tok, next(iter(configs.values())), cache_dir=cache_dir)
             for dtype, (_, tok) in loaded.items()} if configs else {}
    prompts = datasets.load(args.sets, args.limit, cache_dir)
    # warm up every method once (allocator, numba, first-call overheads) before timing anything
    # (on throwaway drafting states: each generator's own learns from the timed prompts only, in order)
    warm = prompt_ids(tokenizer, prompts[0].text, prompts[0].chat)
    entry = dict(custom_generate=lookahead.custom_generate, lookahead_config=next(iter(configs.values()))) if configs else None
    for dtype, (model, _) in loaded.items():
        hf_generate(model, warm, 4)
        hf_generate(model, warm, 4, prompt_lookup_num_tokens=args.pld_tokens)
        if entry:
            hf_generate(ours[dtype], warm, 4, lookahead_state=generator_for(ours[dtype], entry["lookahead_config"]).new_state(), **entry)
    for gen in [*gens.values(), *colds.values()]:
        gen.generate(warm, max_new_tokens=4, state=gen.new_state())
        gen.generate(warm, max_new_tokens=4, lookahead=False, state=gen.new_state())
    runs: list[Run] = []
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        ids = p.ids(tokenizer)
        for dtype, (model, _) in loaded.items():
            ref, secs = hf_generate(model, ids, args.max_new_tokens)
            runs.append(Run(p.set, p.id, dtype, GREEDY, secs, ref, equal=True, equal_or_tie=True))
            toks, secs = hf_generate(model, ids, args.max_new_tokens, prompt_lookup_num_tokens=args.pld_tokens)
            runs.append(check(Run(p.set, p.id, dtype, PLD, secs, toks), ref, ids, model))
            # our own loop without the lookahead branches (how much of a speedup is the loop, not the algorithm)
            # and the cold-state row, each on a throwaway state; then every config on its generator's own
            first = next(iter(configs), None)
            ours_rows = [(PLAIN, gens[(dtype, first)], False, True), (f"{first} {COLD}", colds[dtype], True, True)] if configs else []
            for name, gen, on, fresh in ours_rows + [(name, gens[(dtype, name)], True, False) for name in configs]:
                state = gen.new_state() if fresh else None
                t0 = time.perf_counter()  # the whole call, as for generate(): setup and detokenising included
                out = gen.generate(ids, max_new_tokens=args.max_new_tokens, lookahead=on, state=state)
                st = out.stats
                run = Run(p.set, p.id, dtype, name, time.perf_counter() - t0, out.tokens, st.steps, dict(st.accepted_by_source),
                          dict(st.drafted_by_source), st.tree_nodes, dict(st.phase_s))
                runs.append(check(run, ref, ids, model))
            if entry:  # the same loop, config and kernels as the first lookahead row, behind generate()'s own preparation
                toks, secs = hf_generate(ours[dtype], ids, args.max_new_tokens, **entry)
                runs.append(check(Run(p.set, p.id, dtype, HF_ENTRY, secs, toks), ref, ids, model))
        elapsed = time.perf_counter() - start
        print(f"[{i + 1}/{len(prompts)}] {p.set}/{p.id} done; {elapsed:.0f} s, about {elapsed / (i + 1) * (len(prompts) - i - 1):.0f} s left",
              flush=True)
    curves = {f"{dtype} {kernels_of(model)}": cost_curve(model, args.cost_sizes)
              for dtype in args.dtypes for model in {id(m): m for m in (loaded[dtype][0], ours[dtype])}.values()}
    return {"hardware": machine, "model": args.model, "device": args.device, "max_new_tokens": args.max_new_tokens, "dtypes": args.dtypes,
            "kernels": {dtype: kernels_of(model) for dtype, model in ours.items()}, "isa": native.isa(),
            "pld_tokens": args.pld_tokens, "summary": summarise(runs), "cost_curve": curves, "runs": [asdict(r) for r in runs]}


def check(run: Run, ref: list[int], ids: list[int], model) -> Run:
    run.equal = run.tokens == ref
    run.equal_or_tie = equal_or_tie(model, ids, run.tokens, ref)
    return run


def equal_or_tie(model, prompt: list[int], got: list[int], ref: list[int]) -> bool:
    """``got`` equals the reference ``ref``, or first differs from it where the reference's top-2 logits tie."""
    at = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), None)
    return got == ref or (at is not None and is_tie(model, prompt, ref[:at]))


def summarise(runs: list[Run]) -> list[dict]:
    """Per (set, dtype, method) and overall: tokens/s, both speedups, compression, acceptance, equality."""
    groups = defaultdict(list)
    for r in runs:
        groups[(r.set, r.dtype, r.method)].append(r)
        groups[("all", r.dtype, r.method)].append(r)
    tps = {k: sum(len(r.tokens) for r in rs) / sum(r.seconds for r in rs) for k, rs in groups.items()}
    greedy_s = {(r.set, r.prompt, r.dtype): r.seconds / len(r.tokens) for r in runs if r.method == GREEDY}
    plain = {(r.set, r.prompt, r.dtype): r.tokens for r in runs if r.method == PLAIN}
    rows = []
    for (set_, dtype, method), rs in sorted(groups.items(), key=lambda kv: (kv[0][0] == "all", kv[0])):
        fastest = max(v for (s, _, m), v in tps.items() if s == set_ and m == GREEDY)
        row = {"set": set_, "dtype": dtype, "method": method, "prompts": len(rs), "tokens": sum(len(r.tokens) for r in rs),
               "tokens_per_s": tps[(set_, dtype, method)], "speedup_same_dtype": tps[(set_, dtype, method)] / tps[(set_, dtype, GREEDY)],
               "speedup_vs_fastest_greedy": tps[(set_, dtype, method)] / fastest,
               "equal_rate": sum(bool(r.equal) for r in rs) / len(rs),
               # the worst single prompt: its tokens/s over HF greedy's on that prompt, same dtype
               "worst_prompt_speedup": min(greedy_s[(r.set, r.prompt, r.dtype)] * len(r.tokens) / r.seconds for r in rs)}
        row["equal_or_tie_rate"] = sum(bool(r.equal_or_tie) for r in rs) / len(rs)
        if (set_, dtype, PLAIN) in groups and method != PLAIN:  # our plain loop on the same kernels: 100% if they are row-invariant
            row["equal_plain_rate"] = sum(r.tokens == plain.get((r.set, r.prompt, r.dtype)) for r in rs) / len(rs)
        if rs[0].steps is not None:
            steps = sum(r.steps for r in rs)
            sources = sum((Counter(r.accepted_by_source) for r in rs), Counter())
            drafted = sum((Counter(r.drafted_by_source) for r in rs), Counter())
            phases = sum((Counter(r.phase_s) for r in rs), Counter())
            row |= {"compression": row["tokens"] / (steps + len(rs)), "mean_tree_nodes": sum(r.tree_nodes for r in rs) / max(steps, 1),
                    "accepted_by_source": dict(sources), "drafted_by_source": dict(drafted),
                    "phase_ms_per_step": {k: v * 1000 / max(steps, 1) for k, v in phases.items()}}
        rows.append(row)
    return rows


def fmt(v, spec=".2f") -> str:
    return "–" if v is None else format(v, spec)


def write_report(results: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "results.json", results)  # the token ids as digests
    hw = results["hardware"]
    lines = [f"# Lookahead benchmark: {results['model']}", "",
             (f"{hw['gpu']} (device {results.get('device', 'cpu')}); " if hw.get("gpu") else "")
             + f"{hw['cpu']}, {hw['cores']} cores ({hw['torch_threads']} torch threads); torch {hw['torch']}, transformers "
             f"{hw['transformers']}; commit {hw['commit']}; {results['max_new_tokens']} new tokens per prompt, greedy.", "",
             "HF methods run on the stock model; ours (plain loop, lookahead) on kernels "
             + ", ".join(f"{k} in {d}" for d, k in results.get("kernels", {}).items())
             + f" (see lookahead/kernels.py); our kernels' ISA: {results.get('isa', 'not recorded')}.", "",
             "equal: same tokens as HF greedy in the same dtype; equal or tie: or the first difference is at a step where the "
             "reference's top-2 logits tie (fp32: margin < 1e-4; bf16: margin within that step's own rounding noise, measured by computing it in two orders); "
             "equal to plain loop: same tokens as our plain loop on the same kernels.", "",
             "| set | dtype | method | prompts | tokens/s | speedup vs HF greedy (same dtype) | worst prompt (same dtype) | vs fastest HF greedy | compression | tree nodes per step | equal | equal or tie | equal to plain loop |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results["summary"]:
        lines.append(f"| {r['set']} | {r['dtype']} | {r['method']} | {r['prompts']} | {r['tokens_per_s']:.2f} | {r['speedup_same_dtype']:.2f}x | "
                     f"{r['worst_prompt_speedup']:.2f}x | {r['speedup_vs_fastest_greedy']:.2f}x | {fmt(r.get('compression'))} | {fmt(r.get('mean_tree_nodes'), '.1f')} | "
                     f"{r['equal_rate']:.0%} | {r['equal_or_tie_rate']:.0%} | {fmt(r.get('equal_plain_rate'), '.0%')} |")
    overall = [r for r in results["summary"] if r["set"] == "all" and "phase_ms_per_step" in r]
    lines += ["", "Overall, by drafting source (accepted / drafted tree nodes) and where a step's time goes (ms per step):", "",
              "| dtype | method | " + " | ".join(SOURCES) + " | draft | forward | verify | learn |", "|---|---|" + "---|" * (len(SOURCES) + 4)]
    for r in overall:
        acc, dr, ph = r["accepted_by_source"], r["drafted_by_source"], r["phase_ms_per_step"]
        lines.append(f"| {r['dtype']} | {r['method']} | " + " | ".join(f"{acc.get(s, 0)} / {dr.get(s, 0)}" for s in SOURCES)
                     + " | " + " | ".join(fmt(ph.get(k)) for k in ("draft", "forward", "verify", "learn")) + " |")
    lines += ["", "Forward cost c(T)/c(1) of adding T tokens to a 128-token cache:", "",
              "| dtype, kernels | ms at T=1 | " + " | ".join(f"T={t}" for t in next(iter(results["cost_curve"].values())) if t != "ms_at_1") + " |",
              "|---|---|" + "---|" * (len(next(iter(results["cost_curve"].values()))) - 1)]
    for dtype, curve in results["cost_curve"].items():
        lines.append(f"| {dtype} | {curve['ms_at_1']:.1f} | " + " | ".join(f"{v:.2f}" for t, v in curve.items() if t != "ms_at_1") + " |")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    plot(results, out)


def plot(results: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.5))
    rows = [r for r in results["summary"] if r["method"] != GREEDY]
    sets = sorted({r["set"] for r in rows}, key=lambda s: (s == "all", s))
    series = sorted({(r["dtype"], r["method"]) for r in rows})
    width = 0.8 / max(len(series), 1)
    for k, (dtype, method) in enumerate(series):
        vals = [next((r["speedup_vs_fastest_greedy"] for r in rows if r["set"] == s and r["dtype"] == dtype and r["method"] == method), 0) for s in sets]
        left.bar([i + k * width for i in range(len(sets))], vals, width, label=f"{method} ({dtype})")
    left.axhline(1.0, color="black", lw=0.8)
    left.set_xticks([i + width * (len(series) - 1) / 2 for i in range(len(sets))], sets)
    left.set_ylabel("speedup vs fastest HF greedy (any dtype)")
    left.legend(fontsize=7)
    for dtype, curve in results["cost_curve"].items():
        pts = [(int(t), v) for t, v in curve.items() if t != "ms_at_1"]
        right.plot([t for t, _ in pts], [v for _, v in pts], marker="o", label=dtype)
    right.set_xscale("log", base=2)
    right.set_xlabel("new tokens T in one forward")
    right.set_ylabel("c(T) / c(1)")
    right.legend()
    fig.suptitle(f"{results['model']} on {results['hardware']['cpu']} ({results['hardware']['cores']} cores)", fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "speedup.png", dpi=110)
    plt.close(fig)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="every prompt, 128 new tokens (default: quick)")
    parser.add_argument("--model", default=models.DEFAULT_MODEL)
    parser.add_argument("--sets", default=",".join(datasets.TIMED_SETS), help=f"comma-separated prompt sets of {', '.join(datasets.SETS)}")
    parser.add_argument("--limit", type=int, help="prompts per set (quick: 2, full: all)")
    parser.add_argument("--max-new-tokens", type=int, help="quick: 64, full: 128")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--config", dest="configs", action="append",
                        help="a preset (" + ", ".join(PRESETS | ABLATION) + ") or field=value,... (repeatable)")
    parser.add_argument("--ablation", action="store_true", help="add each source alone and the no-Jacobi configuration")
    parser.add_argument("--pld-tokens", type=int, default=10, help="HF prompt_lookup_num_tokens")
    parser.add_argument("--cost-sizes", default="1,2,4,8,16,32,64,128")
    parser.add_argument("--kernels", choices=["packed", "stock"], default="packed", help="the kernels our loop runs on")
    parser.add_argument("--isa", choices=list(native.TIERS), help="hold our kernels to this tier (default: the CPU's best)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, ... (packed kernels are CPU-only: elsewhere ours run as loaded)")
    parser.add_argument("--cache-dir", type=Path)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/latest"))
    args = parser.parse_args(argv)
    args.sets = args.sets.split(",")
    args.dtypes = args.dtypes.split(",")
    args.limit = args.limit if args.limit is not None else (None if args.full else 2)
    args.max_new_tokens = args.max_new_tokens or (128 if args.full else 64)
    args.configs = (args.configs or list(PRESETS)) + (list(ABLATION) if args.ablation else [])
    args.cost_sizes = [int(v) for v in args.cost_sizes.split(",")]
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.isa:
        native.library(args.cache_dir, tier=args.isa)  # before anything loads them
    results = run_all(args)
    write_report(results, args.out)
    print((args.out / "results.md").read_text())


if __name__ == "__main__":
    main()
