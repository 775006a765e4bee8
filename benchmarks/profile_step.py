"""Where a forward's time goes: one plain (T = 1) and one wide (T = 16) forward over a 256-token cache, per op
class (linears, attention, norms, the rest), plus what the engine adds around the model (the step's 4D masks).

    python -m benchmarks.profile_step [--model smollm2-135m --dtypes float32,bfloat16 --kernels packed --sizes 1,16]

Op times are torch.profiler's self CPU times (the profiler's own cost included, so they overstate slightly);
"outside ops" is the wall time of an unprofiled forward minus the ops' sum: Python, module dispatch and what
no op accounts for. Each number is the fastest of ``--reps`` forwards.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.run import hardware
from lookahead import kv, models
from lookahead.kernels import kernels_of
from lookahead.layout import build_layout, stack
from lookahead.tree import TokenTree
from lookahead.planner import chain_tree

CLASSES = {  # op name fragment -> class, first match wins
    "linear": "linears", "addmm": "linears", "aten::mm": "linears", "matmul": "linears", "bmm": "attention",
    "scaled_dot_product": "attention", "softmax": "attention",
    "rms_norm": "norms", "layer_norm": "norms", "aten::pow": "norms", "aten::mean": "norms", "aten::rsqrt": "norms",
    "aten::cos": "rotary", "aten::sin": "rotary", "cat": "copies and views", "copy_": "copies and views",
    "contiguous": "copies and views", "clone": "copies and views",
}


def classify(name: str) -> str:
    return next((cls for frag, cls in CLASSES.items() if frag in name), "other ops")


def forward_once(model, cache: kv.BatchCache, size: int, context: int, mask: torch.Tensor) -> float:
    ids = torch.randint(100, 1000, (1, size))
    start = time.perf_counter()
    model(input_ids=ids, position_ids=torch.arange(context, context + size)[None], attention_mask=mask,
          **kv.cache_kwarg(model, cache.cache), use_cache=True, logits_to_keep=size)
    seconds = time.perf_counter() - start
    cache.cache.crop(-size)
    return seconds


def profile_size(model, size: int, context: int, reps: int) -> dict:
    cache = kv.BatchCache()
    with torch.inference_mode():
        model(input_ids=torch.randint(100, 1000, (1, context)), **kv.cache_kwarg(model, cache.cache), logits_to_keep=1)
        cache.append(torch.arange(context)[None])
        step = stack([build_layout(0, 0, chain_tree(0.5, size - 1) if size > 1 else TokenTree.empty())])  # a chain: the causal mask
        start = time.perf_counter()
        for _ in range(reps):
            mask = cache.masks(step.allowed, context + step.offsets, {"full_attention": None}, model.dtype, model.device)["full_attention"]
        mask_ms = (time.perf_counter() - start) / reps * 1000
        wall = min(forward_once(model, cache, size, context, mask) for _ in range(reps + 2))
        best: dict[str, float] | None = None
        for _ in range(reps):
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                forward_once(model, cache, size, context, mask)
            by = defaultdict(float)
            for event in prof.key_averages():
                by[classify(event.key)] += event.self_cpu_time_total / 1000
            if best is None or sum(by.values()) < sum(best.values()):
                best = dict(by)
    ops = sum(best.values())
    return {"wall_ms": wall * 1000, "ops_ms": ops, "outside_ops_ms": max(wall * 1000 - ops, 0.0), "mask_ms": mask_ms, "by_class_ms": best}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=models.DEFAULT_MODEL)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--kernels", choices=["packed", "stock"], default="packed")
    parser.add_argument("--sizes", default="1,16")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args(argv)
    hw = hardware()
    print(f"# Per-op profile: {args.model}, {hw['cpu']}, {hw['cores']} cores, torch {hw['torch']}, commit {hw['commit']}; "
          f"{args.context}-token cache, ms (fastest of {args.reps})\n")
    rows = []
    for dtype in args.dtypes.split(","):
        model = models.load(args.model, dtype=dtype, kernels=args.kernels)[0]
        for size in (int(s) for s in args.sizes.split(",")):
            rows.append((f"{dtype} {kernels_of(model)}", size, profile_size(model, size, args.context, args.reps)))
    classes = sorted({c for *_, r in rows for c in r["by_class_ms"]})
    print("| dtype, kernels | T | forward (wall) | " + " | ".join(classes) + " | outside ops | step mask (ours) |")
    print("|---|---|---|" + "---|" * (len(classes) + 2))
    for name, size, r in rows:
        print(f"| {name} | {size} | {r['wall_ms']:.1f} | " + " | ".join(f"{r['by_class_ms'].get(c, 0.0):.1f}" for c in classes)
              + f" | {r['outside_ops_ms']:.1f} | {r['mask_ms']:.2f} |")


if __name__ == "__main__":
    main()
