"""The index of ``benchmarks/results/``: one row per folder (commit, CPU, model, tokens, headline ratios), read
from each folder's ``results.json`` (``benchmarks.run``, ``benchmarks.peers``, ``benchmarks.vllm_bench``, ``benchmarks.load``
or ``benchmarks.big_gguf``); written between the index
markers of ``RESULTS.md``, whose hand-written history follows it.

    python -m benchmarks.results_log            # rewrite the index in benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

HERE = Path(__file__).parent
BEGIN, END = "<!-- index: python -m benchmarks.results_log -->", "<!-- end of index -->"
OURS, PLAIN, GREEDY = "lookahead default", "plain loop (--no-lookahead)", "hf_greedy"


def headline(results: dict) -> str:
    """What the run shows in one line: lookahead's tokens/s and its ratios, in its last dtype (bf16 where run)."""
    if "summary" in results:  # benchmarks.run
        overall = {(r["dtype"], r["method"]): r for r in results["summary"] if r["set"] == "all"}
        dtype = (results.get("dtypes") or [d for d, _ in overall])[-1]
        ours, plain = overall.get((dtype, OURS)), overall.get((dtype, PLAIN))
        if ours is None:
            return "no default lookahead row"
        line = f"{dtype}: {ours['tokens_per_s']:.1f} tok/s, {ours['speedup_vs_fastest_greedy']:.2f}x fastest HF greedy"
        return line + (f", {ours['tokens_per_s'] / plain['tokens_per_s']:.2f}x our plain loop" if plain else "")
    if "methods" in results:  # benchmarks.vllm_bench
        def tps(method: str, run: str) -> float:
            r = results["methods"][method]["runs"][run]
            return r["tokens"] / r["seconds"]
        ours, ngram, plain = "lookahead proposer", "vLLM ngram", "vLLM plain"
        return (f"in vLLM, {results['dtype']}: {tps(ours, 'one at a time'):.1f} tok/s one at a time, "
                f"{tps(ours, 'one at a time') / tps(ngram, 'one at a time'):.2f}x vLLM ngram; all at once "
                f"{tps(ours, 'all at once') / tps(plain, 'all at once'):.2f}x vLLM plain")
    if "cold" in results:  # benchmarks.load, benchmarks.big_gguf
        llama = results.get("llama_cpp")
        return (f"a {results['file_gb']:.2f} GB GGUF loaded in {results['cold']['load_s']:.0f} s cold, {results['warm']['load_s']:.1f} s "
                f"warm; peak {max(results['cold']['peak_rss_gb'], results['warm']['peak_rss_gb']):.2f} GB"
                + (f"; llama.cpp {llama['load_s']:.1f} s, {llama['peak_rss_gb']:.2f} GB" if llama else ""))
    runs = results.get("runs", {})  # benchmarks.peers, benchmarks.window
    tps = {m: sum(len(r["tokens"]) for r in rs) / sum(r["seconds"] for r in rs) for m, rs in runs.items()}
    if "lookahead without the window" in runs:
        ran, steps = (sum(r[key] for r in runs["lookahead"]) for key in ("window_steps", "steps"))
        return (f"{results['dtype']}: the window ran on {ran} of {steps} steps; lookahead {tps['lookahead']:.1f} tok/s, "
                f"{tps['lookahead'] / tps['lookahead without the window']:.2f}x without it")
    peers = {m: v for m, v in tps.items() if m.startswith("llama.cpp")}
    if "lookahead bfloat16" not in tps or not peers:
        return "no lookahead or llama.cpp rows"
    best = max(peers, key=peers.get)
    line = f"bf16: {tps['lookahead bfloat16']:.1f} tok/s, {tps['lookahead bfloat16'] / peers[best]:.2f}x {best}"
    on_blocks = [m for m in tps if m.startswith("lookahead gguf ")]
    if on_blocks:  # also on the GGUF's own blocks (the fastest of our activations), against llama.cpp on that file
        ours = max(on_blocks, key=tps.get)
        on_file = {m: v for m, v in peers.items() if results["gguf"] in m}
        best_on = max(on_file, key=on_file.get)
        line += f"; on the GGUF ({ours.split()[-1]}) {tps[ours]:.1f} tok/s, {tps[ours] / on_file[best_on]:.2f}x {best_on}"
    return line


def index(results_dir: Path) -> list[str]:
    """The table, one row per folder, in name order."""
    rows = ["| folder | commit | machine | model, new tokens | headline |", "|---|---|---|---|---|"]
    for folder in sorted(p for p in results_dir.iterdir() if p.is_dir()):
        file = folder / "results.json"
        if not file.is_file():
            others = ", ".join(sorted(p.name for p in folder.iterdir() if p.suffix == ".md")) or "no results file"
            rows.append(f"| `{folder.name}` | | | | see {others} |")
            continue
        results = json.loads(file.read_text())
        hw = results.get("hardware", {})
        cpu = hw.get("gpu") or str(hw.get("cpu", "?")).split(";")[0].replace("|", "/")  # the device measured
        rows.append(f"| `{folder.name}` | {hw.get('commit', '?')} | {cpu} | {results.get('model', '?')}, "
                    f"{results.get('max_new_tokens', '?')} | {headline(results)} |")
    return rows


def rewrite(log: Path, results_dir: Path) -> None:
    """Replace the index between the markers of ``log`` (or put one at its top, after the title and intro)."""
    text = log.read_text()
    block = "\n".join([BEGIN, "", *index(results_dir), "", END])
    if BEGIN in text and END in text:
        text = text[: text.index(BEGIN)] + block + text[text.index(END) + len(END):]
    else:
        head, _, rest = text.partition("\n\n**")
        text = head + "\n\n" + block + "\n\n**" + rest
    log.write_text(text)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--log", type=Path, default=HERE / "RESULTS.md")
    parser.add_argument("--results", type=Path, default=HERE / "results")
    args = parser.parse_args(argv)
    rewrite(args.log, args.results)
    print(f"{args.log}: {len(index(args.results)) - 2} folders indexed")


if __name__ == "__main__":
    main()
