"""Drafting quality by counts: new tokens a forward at fixed rows a step (the planner off: trees of rows - 1 nodes,
and the Jacobi window's rows beside them where it runs), each source alone and all together, on the project's own
prompts and the prompt sets. No timing: any CPU gives the same table (on the same kernels and dtype).

    python -m benchmarks.drafting_counts --model smollm2-135m --dtype int8 --rows 5,9,17,33

Each configuration is a generator of its own whose drafting state is kept across the prompts, taken in order (as a
server's is). The recycling prior is pinned: none (``recycle_prior=0``), or whole (every one of its tokens' successors
predicted, ``recycle_prior_s=inf``), so a run does not depend on how far earlier runs grew the cached one. Every
run's tokens are checked against the plain loop's."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from benchmarks import datasets
from benchmarks.prompts import PROMPTS
from benchmarks.results_log import same, write_json
from benchmarks.run import hardware
from lookahead import LookaheadConfig, LookaheadGenerator, models, native

FIXED = LookaheadConfig(auto=False, window=0)
SOURCES = {  # what drafts: the sources' own switches
    "all": {}, "all, no prior": dict(recycle_prior=0), "all + window": dict(window=3),
    "pool": dict(suffix_drafts=0, recycle_k=0), "suffix": dict(guess=0, recycle_k=0), "recycling": dict(guess=0, suffix_drafts=0),
}


def configs(rows: list[int], sources: list[str] = list(SOURCES)) -> dict[tuple[str, int], LookaheadConfig]:
    """(sources, rows) -> the fixed shape: rows - 1 tree nodes, the prior whole unless the sources say none."""
    return {(name, r): dataclasses.replace(FIXED, tree_budget=r - 1, recycle_prior_s=float("inf"), **SOURCES[name])
            for name in sources for r in rows}


def run_all(args) -> dict:
    cache_dir = args.cache_dir or models.default_cache_dir()
    model, tok = models.load(args.model, dtype=args.dtype, cache_dir=cache_dir, kernels="packed", weights=args.weights)
    prompts = [datasets.Prompt("own", name, text, chat) for name, text, chat in PROMPTS] + datasets.load(args.sets, args.limit, cache_dir)
    ids = [p.ids(tok) for p in prompts]
    plain_gen = LookaheadGenerator(model, tok, FIXED, cache_dir=cache_dir)
    plain = [plain_gen.generate(prompt, args.max_new_tokens, lookahead=False).tokens for prompt in ids]
    counts: dict[str, dict] = {}
    for (name, rows), config in configs(args.rows, args.sources).items():
        gen = LookaheadGenerator(model, tok, config, cache_dir=cache_dir)
        runs = [gen.generate(prompt, args.max_new_tokens) for prompt in ids]
        counts[f"{name} @ {rows}"] = {"sources": name, "rows": rows, "window_rows": config.window * (config.ngram - 1), "prompts": [
            {"set": p.set, "prompt": p.id, "tokens": len(out.tokens), "forwards": out.stats.steps + 1, "same": same(out.tokens, want)}
            for p, out, want in zip(prompts, runs, plain)]}
        print(f"{name} @ {rows} rows: {sum(len(o.tokens) for o in runs) / sum(o.stats.steps + 1 for o in runs):.2f} tokens a forward", flush=True)
    return {"hardware": hardware(), "isa": native.isa(), "model": args.model, "dtype": args.dtype, "weights": args.weights,
            "max_new_tokens": args.max_new_tokens, "counts": counts}


def write_report(results: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "results.json", results)
    counts, hw = results["counts"], results["hardware"]
    rows = sorted({c["rows"] for c in counts.values()})
    sets = list(dict.fromkeys(p["set"] for c in counts.values() for p in c["prompts"]))

    def rate(c: dict, where=lambda p: True) -> float:
        chosen = [p for p in c["prompts"] if where(p)]
        return sum(p["tokens"] for p in chosen) / sum(p["forwards"] for p in chosen)

    first = next(iter(counts.values()))
    lines = [f"# {results['model']}: new tokens a forward by rows a step and source", "",
             f"{results['dtype']}, {results['weights']} weights, our kernels {results['isa']} ({hw['cpu']}); commit {hw['commit']}; "
             f"{len(first['prompts'])} prompts ({', '.join(sets)}) x {results['max_new_tokens']} new tokens, greedy, in order, a "
             "drafting state a configuration kept across them; the planner off. Rows: tree nodes + 1 (+ the window's where it "
             "runs); the prior whole unless said. Counts, not times: any CPU gives them on these kernels.", "",
             "| sources | " + " | ".join(f"{r} rows" for r in rows) + " | same tokens as the plain loop |",
             "|---|" + "---|" * (len(rows) + 1)]
    for name in dict.fromkeys(c["sources"] for c in counts.values()):
        cells = [counts[f"{name} @ {r}"] for r in rows]
        extra = f" (+{cells[0]['window_rows']} window rows)" if cells[0]["window_rows"] else ""
        alike = sum(p["same"] for c in cells for p in c["prompts"]) / sum(len(c["prompts"]) for c in cells)
        lines.append(f"| {name}{extra} | " + " | ".join(f"{rate(c):.2f}" for c in cells) + f" | {alike:.0%} |")
    if f"all @ {rows[0]}" in counts:
        lines += ["", "By prompt set, all sources:", "", "| set | " + " | ".join(f"{r} rows" for r in rows) + " |", "|---|" + "---|" * len(rows)]
        for s in sets:
            lines.append(f"| {s} | " + " | ".join(f"{rate(counts[f'all @ {r}'], lambda p: p['set'] == s):.2f}" for r in rows) + " |")
    (out / "results.md").write_text("\n".join(lines) + "\n")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=models.DEFAULT_MODEL)
    parser.add_argument("--dtype", default=native.INTEGER, choices=sorted(models.DTYPES))
    parser.add_argument("--weights", default="auto", choices=models.WEIGHTS)
    parser.add_argument("--rows", default=[5, 9, 17, 33], type=lambda text: [int(r) for r in text.split(",")], help="rows a step, comma-separated")
    parser.add_argument("--sources", default=list(SOURCES), type=lambda text: text.split(";"),
                        help=f"which of {'; '.join(SOURCES)}, semicolon-separated (default all of them)")
    datasets.add_arguments(parser, limit=1, sets=tuple(datasets.SETS))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/drafting-counts-latest"))
    args = parser.parse_args(argv)
    write_report(run_all(args), args.out)
    print((args.out / "results.md").read_text())


if __name__ == "__main__":
    main()
