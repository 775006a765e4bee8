"""The README's picture: tokens/s by engine and model, from ``benchmarks.peers`` runs on one machine.

    python -m benchmarks.plot benchmarks/results/peers-a benchmarks/results/peers-b --out benchmarks/results/peers.png

For each run (one model): HF greedy in its faster dtype, HF prompt lookup, llama.cpp's plain decode of the GGUF and
its best n-gram mode on it, our plain loop and lookahead on the GGUF's own blocks (each in its faster activations).
The bars are what each run's report says, one run per model, so a model's bars were measured side by side.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.results_log import count

ENGINES = ("HF greedy", "HF prompt lookup", "llama.cpp plain", "llama.cpp best n-gram mode", "our plain loop", "lookahead")
COLORS = ("#a6a6a6", "#cfcfcf", "#6baed6", "#2171b5", "#fdae6b", "#d94801")  # HF grey, llama.cpp blue, ours orange


def rates(results: dict) -> dict[str, float]:
    """A peers run's tokens/s for each of ``ENGINES`` (the best of the runs each stands for)."""
    runs, gguf = results["runs"], results["gguf"]
    tps = {m: sum(count(r["tokens"]) for r in rs) / sum(r["seconds"] for r in rs) for m, rs in runs.items()}
    best = lambda keep: max((v for m, v in tps.items() if keep(m)), default=0.0)  # noqa: E731
    return {"HF greedy": best(lambda m: m.startswith("HF greedy")),
            "HF prompt lookup": best(lambda m: m.startswith("HF prompt lookup")),
            "llama.cpp plain": best(lambda m: m.startswith(f"llama.cpp {gguf} plain")),
            "llama.cpp best n-gram mode": best(lambda m: m.startswith(f"llama.cpp {gguf}") and " plain" not in m),
            "our plain loop": best(lambda m: m.startswith("our plain loop gguf")),
            "lookahead": best(lambda m: m.startswith("lookahead gguf"))}


def draw(runs: list[dict], out: Path) -> None:
    """One group of bars a run (model), one bar an engine, labelled with its tokens/s; the CPU in the title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    width = 0.8 / len(ENGINES)
    fig, ax = plt.subplots(figsize=(10, 4.2))
    for e, engine in enumerate(ENGINES):
        values = [rates(r)[engine] for r in runs]
        bars = ax.bar([i + (e - (len(ENGINES) - 1) / 2) * width for i in range(len(runs))], values, width, label=engine,
                      color=COLORS[e])
        ax.bar_label(bars, fmt="%.0f", fontsize=7, padding=1)
    ax.set_xticks(range(len(runs)), [f"{r['model']}\n({r['gguf']})" for r in runs])
    ax.set_ylabel("tokens/s (greedy, one request at a time)")
    hw = runs[0]["hardware"]
    prompts = len(next(iter(runs[0]["runs"].values())))
    ax.set_title(f"{hw['cpu']}, {hw['cores']} cores: {prompts} prompts x "
                 f"{runs[0]['max_new_tokens']} tokens, the GGUF's own weights", fontsize=9)
    ax.legend(fontsize=8, ncol=len(ENGINES), loc="upper center", bbox_to_anchor=(0.5, -0.16), frameon=False)
    ax.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="benchmarks.peers result folders, one per model")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/peers.png"))
    args = parser.parse_args(argv)
    draw([json.loads((folder / "results.json").read_text()) for folder in args.runs], args.out)
    print(args.out)


if __name__ == "__main__":
    main()
