"""The index of ``benchmarks/results/``: one row per folder (when it was recorded, commit, CPU, model, tokens,
headline ratios), read from each folder's ``results.json`` (``benchmarks.run``, ``benchmarks.peers``,
``benchmarks.vllm_bench``, ``benchmarks.window``, ``benchmarks.load`` or ``benchmarks.big_gguf``), then one row per
dropped folder (``results/dropped.json``: its files live in git history at the commit named); written between the
index markers of ``RESULTS.md``, whose hand-written log follows it.

Token ids are recorded as digests (``compact``): a run's ``tokens`` (vLLM's ``outputs``: one per prompt) become
``{"n": count, "sha256": digest of the ids}``, which is what the reports and this index read of them (counts,
and whether two runs gave the same tokens). The writers compute their reports from the ids in memory and write
the digests.

    python -m benchmarks.results_log                    # rewrite the index in benchmarks/RESULTS.md
    python -m benchmarks.results_log --compact          # every results/*/*.json's token ids -> digests (idempotent)
    python -m benchmarks.results_log --drop FOLDER ...  # record folders' rows in results/dropped.json, then git rm -r them
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
from pathlib import Path

HERE = Path(__file__).parent
BEGIN, END = "<!-- index: python -m benchmarks.results_log -->", "<!-- end of index -->"
OURS, PLAIN, GREEDY = "lookahead default", "plain loop (--no-lookahead)", "hf_greedy"
DROPPED = "dropped.json"  # under the results folder: {folder: its index row and the commit that last held its files}
TOKEN_KEYS = ("tokens", "outputs")  # the keys under which runs record token ids
COLUMNS = ("recorded", "commit", "machine", "model", "headline")  # a row's cells after the folder's name, as ``row`` gives them


def digest(ids: list[int]) -> dict:
    """A run's token ids as recorded: their count and a sha256 of them written as "1,2,3"."""
    return {"n": len(ids), "sha256": hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()}


def count(tokens: list[int] | dict) -> int:
    """How many tokens a run gave, from its ids or their digest."""
    return tokens["n"] if isinstance(tokens, dict) else len(tokens)


def same(a: list[int] | dict, b: list[int] | dict) -> bool:
    """Whether two runs gave the same tokens, from their ids or their digests."""
    return (a if isinstance(a, dict) else digest(a)) == (b if isinstance(b, dict) else digest(b))


def _is_ids(value) -> bool:
    return isinstance(value, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in value)


def compact(results):
    """``results`` with every list of token ids under a key of ``TOKEN_KEYS`` (or a list of such lists) replaced by
    its ``digest``; a new object, the input unchanged. Counts (an int under those keys) and digests stay as they are."""
    if isinstance(results, list):
        return [compact(v) for v in results]
    if not isinstance(results, dict):
        return results
    out = {}
    for key, value in results.items():
        if key in TOKEN_KEYS and _is_ids(value):
            out[key] = digest(value)
        elif key in TOKEN_KEYS and isinstance(value, list) and value and all(_is_ids(v) for v in value):
            out[key] = [digest(v) for v in value]
        else:
            out[key] = compact(value)
    return out


def write_json(path: Path, results: dict) -> None:
    """A run's ``results.json``, its token ids as digests."""
    path.write_text(json.dumps(compact(results), indent=1))


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
    if "first_run" in results:  # benchmarks.load --first-runs
        first, warm = results["first_run"], results["warm_run"]
        tune = f"; tune {results['tune']['seconds']:.0f} s, {results['tune']['peak_rss_gb']:.2f} GB" if "tune" in results else ""
        return (f"a {results['file_gb']:.2f} GB GGUF's first run: first token at {first['first_byte_s']:.0f} s, peak "
                f"{first['peak_rss_gb']:.2f} GB; the next at {warm['first_byte_s']:.0f} s, {warm['peak_rss_gb']:.2f} GB{tune}")
    if "turns" in results:  # benchmarks.chat
        last, kept = results["turns"][-1], "a finished request's" if results.get("served") else "the last turn's"
        return (f"{results['dtype']} chat{' served' * bool(results.get('served'))}, turn {len(results['turns'])} ({last['prompt_tokens']} "
                f"tokens): first token at {last['reused_first_token_s']:.2f} s from {kept} keys, {last['whole_first_token_s']:.2f} s prefilled whole")
    runs = results.get("runs", {})  # benchmarks.peers, benchmarks.window
    tps = {m: sum(count(r["tokens"]) for r in rs) / sum(r["seconds"] for r in rs) for m, rs in runs.items()}
    if "counts" in results:  # benchmarks.drafting_counts
        counts = [c for c in results["counts"].values() if c["sources"] == "all"]
        return f"{results['dtype']}, all sources: " + ", ".join(
            f"{c['rows']} rows {sum(p['tokens'] for p in c['prompts']) / sum(p['forwards'] for p in c['prompts']):.2f}" for c in counts) + " tokens a forward"
    if "curve" in results:  # benchmarks.step_cost
        forward = {m: sum(r["forward_s"] for r in rs) / sum(r["steps"] for r in rs) for m, rs in runs.items()}
        shapes = ", ".join(f"{m.removeprefix('up to ')} {forward[m] / forward['our plain loop']:.2f}" for m in runs if m.startswith("up to "))
        return (f"{results['dtype']} on {results.get('isa', '?')}: a step's forward over the plain one, {shapes}; the planner "
                f"{tps['the planner'] / tps['our plain loop']:.2f}x our plain loop")
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


def _git(folder: Path, *args: str) -> str:
    """git's answer about ``folder`` (run in it), or "" outside a repository or where git is missing."""
    try:
        out = subprocess.run(["git", *args], cwd=folder, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


def recorded(folder: Path) -> str:
    """The day the folder was first committed ("–": not yet)."""
    days = _git(folder, "log", "--diff-filter=A", "--format=%cs", "--", ".").splitlines()
    return days[-1] if days else "–"


def row(folder: Path) -> dict:
    """A folder's cells of the index."""
    file = folder / "results.json"
    if not file.is_file():
        others = ", ".join(sorted(p.name for p in folder.iterdir() if p.suffix == ".md")) or "no results file"
        return {"recorded": recorded(folder), "commit": "", "machine": "", "model": "", "headline": f"see {others}"}
    results = json.loads(file.read_text())
    hw = results.get("hardware", {})
    cpu = hw.get("gpu") or str(hw.get("cpu", "?")).split(";")[0].replace("|", "/")  # the device measured
    if cpu.count("(") > cpu.count(")"):  # "AMD EPYC (Zen 4, family 25 model 17; avx2 ...)": the name and model
        cpu += ")"
    return {"recorded": recorded(folder), "commit": hw.get("commit", "?"), "machine": cpu,
            "model": f"{results.get('model', '?')}, {results.get('max_new_tokens', '?')}", "headline": headline(results)}


def _cells(*cells: str) -> str:
    """A table row; an empty cell as "| |"."""
    return "|" + "|".join(f" {c} " if c else " " for c in cells) + "|"


def index(results_dir: Path) -> list[str]:
    """The tables: one row per folder, in name order; then the dropped folders', from ``DROPPED``."""
    rows = ["| folder | recorded | commit | machine | model, new tokens | headline |", "|---|---|---|---|---|---|"]
    for folder in sorted(p for p in results_dir.iterdir() if p.is_dir()):
        r = row(folder)
        rows.append(_cells(f"`{folder.name}`", *(r[k] for k in COLUMNS)))
    dropped = results_dir / DROPPED
    if dropped.is_file():
        rows += ["", "Dropped folders: the record is the row here and the log below; their files are in git history at the "
                     "commit named (`git show COMMIT:benchmarks/results/FOLDER/results.md`).", "",
                 "| folder | recorded | commit | machine | model, new tokens | headline | files at |", "|---|---|---|---|---|---|---|"]
        for name, r in sorted(json.loads(dropped.read_text()).items()):
            rows.append(_cells(name, *(r[k] for k in (*COLUMNS, "files_at"))))
    return rows


def drop(results_dir: Path, names: list[str]) -> None:
    """Record each folder's row in ``DROPPED``, with the last commit that changed it (its files as they were there)."""
    file = results_dir / DROPPED
    dropped = json.loads(file.read_text()) if file.is_file() else {}
    for name in names:
        folder = results_dir / name
        files_at = _git(folder, "log", "-1", "--format=%h", "--", ".")
        if not files_at or _git(folder, "status", "--porcelain", "--", "."):
            raise SystemExit(f"{folder}: commit it as it is first (its files must be in git history to be dropped)")
        dropped[name] = {**row(folder), "files_at": files_at}
    file.write_text(json.dumps(dict(sorted(dropped.items())), indent=1) + "\n")


def compact_folder(folder: Path) -> int:
    """Rewrite the folder's JSON files with their token ids as digests; the bytes saved."""
    saved = 0
    for file in sorted(folder.glob("*.json")):
        before = file.read_text()
        after = json.dumps(compact(json.loads(before)), indent=1)
        if after != json.dumps(json.loads(before), indent=1):
            file.write_text(after)
            saved += len(before) - len(after)
    return saved


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
    parser.add_argument("--compact", action="store_true", help="token ids in every folder's JSON files -> digests")
    parser.add_argument("--drop", nargs="+", metavar="FOLDER", help="record these folders' rows in results/dropped.json")
    args = parser.parse_args(argv)
    if args.compact:
        saved = sum(compact_folder(folder) for folder in sorted(p for p in args.results.iterdir() if p.is_dir()))
        print(f"{args.results}: token ids as digests, {saved / 1e6:.1f} MB less")
    if args.drop:
        drop(args.results, args.drop)
        print(f"recorded in {args.results / DROPPED}; now: git rm -r -q " + " ".join(str(args.results / n) for n in args.drop))
    rewrite(args.log, args.results)
    kept = sum(1 for p in args.results.iterdir() if p.is_dir())
    print(f"{args.log}: {kept} folders indexed")


if __name__ == "__main__":
    main()
