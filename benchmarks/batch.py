"""Batched decoding, side by side in one run: total tokens/s at B = 1, 2, 4, 8 sequences.

    python -m benchmarks.batch [--batch 1,2,4,8 --max-new-tokens 64 --model smollm2-135m --out DIR]
    python -m benchmarks.batch --join 2048 [--chunks 0,256,128,64]

``--join N``: instead, how long a request that joins with an N-token prompt stalls the others (as the server
joins it): B - 1 requests decode, a long prompt joins after a few steps, prefilled whole (chunk 0) or by
chunks between steps; reported: the longest gap between two steps of the running requests, the joining
request's time to its first token, and the running requests' tokens/s.

Rows, each over the same B prompts (drawn from the four prompt sets in turn): HF ``generate()`` greedy on the
left-padded batch (stock kernels, fp32); our plain loop batched (``generate_batch(lookahead=False)``, the
engine's kernels); lookahead batched (``generate_batch``); and today's one-at-a-time lookahead (``generate``
per prompt, in turn). Every row of ours is checked against stock ``generate()`` on that prompt alone.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

import torch

from benchmarks import datasets
from benchmarks.prompts import prompt_ids
from benchmarks.run import equal_or_tie, hardware, hf_generate
from lookahead import LookaheadGenerator, models


def hf_batch(model, tokenizer, batch: list[list[int]], max_new_tokens: int) -> tuple[int, float]:
    """(new tokens up to each row's EOS, seconds) of HF greedy over the left-padded batch."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    width = max(len(ids) for ids in batch)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad)
    secs = time.perf_counter() - start
    eos = set(model.generation_config.eos_token_id if isinstance(model.generation_config.eos_token_id, list)
              else [model.generation_config.eos_token_id])
    tokens = 0
    for row in out[:, width:].tolist():
        tokens += next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
    return tokens, secs


def run(args) -> dict:
    cache_dir = models.default_cache_dir()
    machine = hardware()
    stock, tokenizer = models.load(args.model, dtype="float32", cache_dir=cache_dir)
    packed = models.load(args.model, dtype="float32", cache_dir=cache_dir, kernels=args.kernels)[0]
    gen = LookaheadGenerator(packed, tokenizer, cache_dir=cache_dir)
    sets = [datasets.load([s], None, cache_dir) for s in datasets.TIMED_SETS]
    prompts = [sets[i % len(sets)][i // len(sets)] for i in range(max(args.batch))]  # round-robin over the sets
    ids = [p.ids(tokenizer) for p in prompts]
    refs = [hf_generate(stock, p, args.max_new_tokens)[0] for p in ids]  # stock generate() alone: the reference
    gen.generate_batch(ids[:2], max_new_tokens=4, state=gen.new_state())  # warm up: curve, kernels, numba
    hf_batch(stock, tokenizer, ids[:2], 4)
    rows = []
    for b in args.batch:
        batch = ids[:b]
        tokens, secs = hf_batch(stock, tokenizer, batch, args.max_new_tokens)
        row = {"batch": b, "hf_batched_tok_s": tokens / secs}
        # every call drafts from a cold state (the generator's own would have learnt these prompts' answers at the smaller B)
        for name, call in (("plain_batched", lambda: gen.generate_batch(batch, args.max_new_tokens, lookahead=False, state=gen.new_state())),
                           ("lookahead_batched", lambda: gen.generate_batch(batch, args.max_new_tokens, state=gen.new_state())),
                           ("lookahead_one_at_a_time", lambda: [gen.generate(p, args.max_new_tokens, state=gen.new_state()) for p in batch])):
            start = time.perf_counter()
            results = call()
            secs = time.perf_counter() - start
            row[f"{name}_tok_s"] = sum(len(r.tokens) for r in results) / secs
            row[f"{name}_exact"] = sum(equal_or_tie(stock, p, r.tokens, ref) for p, r, ref in zip(batch, results, refs))
            if name == "lookahead_batched":
                row["compression"] = sum(len(r.tokens) for r in results) / sum(r.stats.steps + 1 for r in results)
        rows.append(row)
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    return {"hardware": machine, "model": args.model, "max_new_tokens": args.max_new_tokens, "kernels": args.kernels, "rows": rows}


def join_stall(gen: LookaheadGenerator, running: list[list[int]], long: list[int], chunk: int, max_new_tokens: int) -> dict:
    """The running requests decode for 4 steps, then ``long`` joins (its prefill by ``chunk``s; 0: whole); the
    gaps between the running requests' steps until they finish, and the joiner's time to its first token."""
    state = gen.new_state()
    lanes = [gen.new_lane(p, max_new_tokens, state=state) for p in running]
    joiner = gen.new_lane(long, max_new_tokens, state=state)
    batch, gaps = gen.new_batch(prefill_chunk=chunk or None), []
    with torch.inference_mode():
        for lane in lanes:
            batch.join(lane)
        start = last = time.perf_counter()
        for step in itertools.count():
            if step == 4:
                batch.join(joiner)
            if not any(lane in batch for lane in lanes):
                break
            batch.step()
            gaps.append(time.perf_counter() - last)
            last = time.perf_counter()
        elapsed = last - start
        while batch:
            batch.step()
    return {"chunk": chunk, "max_gap_s": max(gaps), "joiner_first_token_s": joiner.stats.prefill_s,
            "running_tok_s": sum(len(lane.out) for lane in lanes) / elapsed, "exact": joiner.out == gen.generate(long, max_new_tokens, state=gen.new_state()).tokens}


def run_join(args) -> dict:
    cache_dir = models.default_cache_dir()
    machine = hardware()
    model, tokenizer = models.load(args.model, dtype="float32", cache_dir=cache_dir, kernels=args.kernels)
    gen = LookaheadGenerator(model, tokenizer, cache_dir=cache_dir)
    passages = datasets.load(["summarisation"], None, cache_dir)
    long = sum((prompt_ids(tokenizer, p.text, False) for p in passages), [])[: args.join]
    running = [p.ids(tokenizer) for p in datasets.load(["mt_bench"], max(args.batch) - 1, cache_dir)]
    gen.generate_batch(running[:2], max_new_tokens=4, state=gen.new_state())  # warm up: curve, kernels, numba
    rows = [join_stall(gen, running, long, chunk, args.max_new_tokens) for chunk in args.chunks]
    for row in rows:
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    return {"hardware": machine, "model": args.model, "max_new_tokens": args.max_new_tokens, "kernels": args.kernels,
            "join_tokens": len(long), "running": len(running), "join_rows": rows}


def report(results: dict) -> str:
    hw = results["hardware"]
    if "join_rows" in results:
        lines = [f"# A {results['join_tokens']}-token prompt joining {results['running']} running requests: {results['model']} fp32, "
                 f"{hw['cpu']}, {hw['cores']} cores, torch {hw['torch']}, commit {hw['commit']}", "",
                 "| prefill chunk | longest gap between two steps of the running requests | joiner's first token | running requests' tokens/s | joiner exact |",
                 "|---|---|---|---|---|"]
        for r in results["join_rows"]:
            lines.append(f"| {r['chunk'] or 'whole'} | {r['max_gap_s'] * 1000:.0f} ms | {r['joiner_first_token_s']:.2f} s | "
                         f"{r['running_tok_s']:.1f} | {r['exact']} |")
        return "\n".join(lines) + "\n"
    rows = results["rows"]
    lines = [f"# Batched decoding: {results['model']} fp32, {hw['cpu']}, {hw['cores']} cores, torch {hw['torch']}, commit {hw['commit']}",
             "", f"{results['max_new_tokens']} new tokens per sequence; total tokens/s over the batch; exact: rows equal to stock "
             "generate() alone (ties aside).", "",
             "| B | HF generate (padded batch) | our plain loop, batched | lookahead, one at a time | lookahead, batched | "
             "batched / HF batched | batched / one at a time | tokens per forward | exact |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['hf_batched_tok_s']:.1f} | {r['plain_batched_tok_s']:.1f} | {r['lookahead_one_at_a_time_tok_s']:.1f} | "
                     f"{r['lookahead_batched_tok_s']:.1f} | {r['lookahead_batched_tok_s'] / r['hf_batched_tok_s']:.2f}x | "
                     f"{r['lookahead_batched_tok_s'] / r['lookahead_one_at_a_time_tok_s']:.2f}x | {r['compression']:.2f} | {r['lookahead_batched_exact']}/{r['batch']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", default="1,2,4,8", type=lambda s: [int(b) for b in s.split(",")])
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--model", default=models.DEFAULT_MODEL)
    parser.add_argument("--kernels", choices=["packed", "stock"], default="packed")
    parser.add_argument("--join", type=int, default=0, help="measure a prompt of this many tokens joining B - 1 running requests")
    parser.add_argument("--chunks", default="0,256,128,64", type=lambda s: [int(c) for c in s.split(",")],
                        help="with --join: prefill chunks to compare (0: the whole prompt at once)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/latest-batch"))
    args = parser.parse_args(argv)
    results = run_join(args) if args.join else run(args)
    name = "join" if args.join else "batch"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{name}.json").write_text(json.dumps(results, indent=1))
    (args.out / f"{name}.md").write_text(report(results))
    print(report(results))


if __name__ == "__main__":
    main()
