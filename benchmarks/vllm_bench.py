"""Our drafting inside vLLM (``lookahead.vllm.LookaheadProposer``) beside vLLM's own draft-free methods, on vLLM's
CPU build, same prompts, same run: plain, ``ngram``, ``suffix`` (when its ``arctic-inference`` dependency imports)
and ours; one request at a time and all at once; greedy.

    python -m benchmarks.vllm_bench                        # SmolLM2-135M, bf16, 3 prompts a set, 128 new tokens
    python -m benchmarks.vllm_bench --model qwen2.5-coder-0.5b --dtype float32

Each run is one engine (compiled, as vLLM serves by default), warmed on one short request first. Tokens per step:
a request's tokens over its steps (each step gives one token plus the draft tokens vLLM accepted). Outputs are
compared with plain's, prompt by prompt: in fp32 they must all be equal; in bf16 vLLM's own verification may part
from its plain decode at near-ties, so the report counts how often each method equals plain."""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks import datasets
from benchmarks.results_log import same, write_json
from benchmarks.run import hardware
from lookahead import models
from tests import vllm_cpu

ARCTIC = "arctic-inference==0.3.0"
METHODS = {
    "vLLM plain": None,
    "vLLM ngram": {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, "prompt_lookup_max": 4},
    "vLLM suffix": {"method": "suffix", "num_speculative_tokens": 8},
    "lookahead proposer": {"method": "custom_class", "model": "lookahead.vllm.LookaheadProposer", "num_speculative_tokens": 8},
}


def run_all(args) -> dict:
    cache_dir = args.cache_dir or models.default_cache_dir()
    try:  # vLLM's suffix method needs it; it builds from source (a C++ extension, ~1 minute)
        vllm_cpu.pip(vllm_cpu.venv(cache_dir), "install", ARCTIC)
    except RuntimeError as e:
        print(f"{ARCTIC} did not install: vLLM suffix will be skipped ({str(e).splitlines()[0]})")
    model = models.resolve(args.model, cache_dir)
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = datasets.load(args.sets, args.limit, cache_dir)
    ids = [p.ids(tokenizer) for p in prompts]
    n = args.max_new_tokens
    results = {}
    for method, spec in METHODS.items():
        results[method] = {"runs": {}, "drafts": 0, "draft_tokens": 0, "accepted": 0, "warm_up_tokens": 0}
        for mode, together in (("one at a time", False), ("all at once", True)):
            # an engine of its own for each run: the state that suffix and our proposer keep across requests would
            # otherwise meet the second run's prompts with their answers already in it
            runs = [{"name": "warm-up", "prompts": [ids[0][:16]], "max_tokens": [4], "together": False},
                    {"name": mode, "prompts": ids, "max_tokens": [n] * len(ids), "together": together}]
            job = {"model": model, "dtype": args.dtype, "spec": spec, "max_num_seqs": len(ids), "eager": False, "runs": runs,
                   "kv_bytes": 2 << 30}
            try:
                done = vllm_cpu.run(job, timeout=3600, cache_dir=cache_dir)
            except RuntimeError as e:  # vLLM's suffix method without arctic-inference
                print(f"{method}: skipped ({str(e).strip().splitlines()[-1][:200]})", flush=True)
                del results[method]
                break
            results[method]["runs"][mode] = done["runs"][mode]
            results[method]["warm_up_tokens"] += done["runs"]["warm-up"]["tokens"]
            for counter in ("drafts", "draft_tokens", "accepted"):
                results[method][counter] += done[counter]
            r = done["runs"][mode]
            print(f"{method}, {mode}: {r['tokens'] / r['seconds']:.1f} tok/s", flush=True)
    return {"hardware": hardware(), "model": args.model, "dtype": args.dtype, "vllm": vllm_cpu.VERSION, "max_new_tokens": n,
            "prompts": [{"set": p.set, "id": p.id} for p in prompts], "methods": results}


def write_report(results: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "results.json", results)  # the outputs' token ids as digests
    hw, methods = results["hardware"], results["methods"]
    plain, ngram = methods["vLLM plain"], methods.get("vLLM ngram")
    lines = [f"# {results['model']} in vLLM {results['vllm']} (CPU build): our proposer beside vLLM's own", "",
             f"{hw['cpu']}, {hw['cores']} cores; commit {hw['commit']}; {results['dtype']}; {len(results['prompts'])} prompts, "
             f"{results['max_new_tokens']} new tokens, greedy; each engine compiled and warmed first.", "",
             "| method | one at a time tok/s | vs ngram | tokens/step | all at once tok/s | vs plain | same output as plain (one / all) |",
             "|---|---|---|---|---|---|---|"]
    for method, r in methods.items():
        one, together = r["runs"]["one at a time"], r["runs"]["all at once"]
        tps = one["tokens"] / one["seconds"]
        all_tps = together["tokens"] / together["seconds"]
        tokens = one["tokens"] + together["tokens"] + r["warm_up_tokens"]
        steps = tokens - r["accepted"]  # each step: one token plus the accepted drafts
        vs_ngram = f"{tps / (ngram['runs']['one at a time']['tokens'] / ngram['runs']['one at a time']['seconds']):.2f}x" if ngram else "–"
        vs_plain = all_tps / (plain["runs"]["all at once"]["tokens"] / plain["runs"]["all at once"]["seconds"])
        alike = [sum(same(a, b) for a, b in zip(r["runs"][k]["outputs"], plain["runs"][k]["outputs"])) for k in ("one at a time", "all at once")]
        lines.append(f"| {method} | {tps:.1f} | {vs_ngram} | {tokens / steps:.2f} | {all_tps:.1f} | "
                     f"{vs_plain:.2f}x | {alike[0]}/{len(one['outputs'])} / {alike[1]}/{len(together['outputs'])} |")
    lines += ["", "Each run on an engine of its own (the state kept across requests starts empty), after one 4-token warm-up "
                  "request. tokens/step: over every request of both runs."]
    (out / "results.md").write_text("\n".join(lines) + "\n")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=models.DEFAULT_MODEL, choices=sorted(models.EMBEDDED))
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    datasets.add_arguments(parser, limit=3)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/vllm-latest"))
    args = parser.parse_args(argv)
    write_report(run_all(args), args.out)
    print((args.out / "results.md").read_text())


if __name__ == "__main__":
    main()
