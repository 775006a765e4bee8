"""Where a forward's time goes: one plain (T = 1) and one wide (T = 16) forward over a 256-token cache, per op
class (linears, attention, norms, the rest), plus what the engine adds around the model (the step's 4D masks).

    python -m benchmarks.profile_step [--model smollm2-135m --dtypes float32,bfloat16 --kernels packed --weights dense --sizes 1,16]

Op times are torch.profiler's self CPU times (the profiler's own cost included, so they overstate slightly);
"outside ops" is the wall time of an unprofiled forward minus the ops' sum: Python, module dispatch and what
no op accounts for. Each number is the fastest of ``--reps`` forwards. Where a step's decoder layers are one C call
each (on our kernels: ``layer_kernels.decoder_layer``), their products, attention and norms are that call's
time ("layers in one call"), and the columns that need them apart say "–".

Then how close each forward is to what the machine allows: the linears' roofline, the larger of streaming
their weights once from memory (at the rate a sum over a tensor far larger than the caches reads) and their
arithmetic at the rate the model's widest MLP product reaches hot on 64 rows (the best these kernels do here);
attention's arithmetic rate; and r(T) as it would be with the linears at their roofline, all else as measured.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from contextlib import contextmanager

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from benchmarks.run import hardware
from lookahead import kv, layer_kernels, linear_kernels, models
from lookahead.kernels import PackedLinear, kernels_of, pack
from lookahead.layout import build_layout, stack
from lookahead.tree import TokenTree
from lookahead.planner import chain_tree

CLASSES = {  # op name fragment -> class, first match wins
    # our own kernels' calls, seen through ``annotated``, are "bf16_linear" and "tree_attention"
    "linear": "linears", "tree_attention": "attention", "addmm": "linears", "aten::mm": "linears", "matmul": "linears", "bmm": "attention",
    "scaled_dot_product": "attention", "softmax": "attention",
    "decoder_layer": "layers in one call", "rms_norm": "norms", "layer_norm": "norms", "aten::pow": "norms", "aten::mean": "norms", "aten::rsqrt": "norms",
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


@contextmanager
def annotated():
    """Our own kernels are ctypes calls, no torch ops: while profiling, each call is a ``record_function`` span
    named for its C function (~4 us each, so only here). The linears call a ``linear_kernels.Linear`` each, the norms
    ``layer_kernels.rms_norm`` and the attention ``layer_kernels.attention``."""
    spans = [(linear_kernels.Linear, "__call__", "bf16_linear"), (layer_kernels, "attention", "tree_attention"),
             (layer_kernels, "rms_norm", "rms_norm"), (layer_kernels, "decoder_layer", "decoder_layer")]
    plain = [getattr(owner, name) for owner, name, _ in spans]

    def spanned(span: str, function):
        def call(*args):
            with record_function(span):
                return function(*args)
        return call

    for (owner, name, span), function in zip(spans, plain):
        setattr(owner, name, spanned(span, function))
    try:
        yield
    finally:
        for (owner, name, _), function in zip(spans, plain):
            setattr(owner, name, function)


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
            with annotated(), profile(activities=[ProfilerActivity.CPU]) as prof:
                forward_once(model, cache, size, context, mask)
            by = defaultdict(float)
            for event in prof.key_averages():
                by[classify(event.key)] += event.self_cpu_time_total / 1000
            if best is None or sum(by.values()) < sum(best.values()):
                best = dict(by)
    ops = sum(best.values())
    return {"wall_ms": wall * 1000, "ops_ms": ops, "outside_ops_ms": max(wall * 1000 - ops, 0.0), "mask_ms": mask_ms, "by_class_ms": best}


def linear_flops(model, size: int) -> float:
    """Multiply-adds x 2 of every linear projection (``lm_head`` included) for ``size`` rows."""
    return 2.0 * size * sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, (torch.nn.Linear, PackedLinear)))


def attention_flops(model, size: int, context: int) -> float:
    """QK^T and PV of every layer for ``size`` query rows over ``context + size`` keys (masked ones included)."""
    config = model.config.get_text_config()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 4.0 * config.num_hidden_layers * config.num_attention_heads * size * (context + size) * head_dim


def linear_bytes(model) -> int:
    """Bytes of every linear projection's weight (what a forward streams from memory at least once): a quantized
    product's layout (integers, scales, offsets) counted once for its siblings."""
    dense = sum(m.in_features * m.out_features for m in model.modules()
                if isinstance(m, torch.nn.Linear) or isinstance(m, PackedLinear) and not m.product.quantized)
    quantized = {id(m.product): m.product.packed.packed.nbytes for m in model.modules() if isinstance(m, PackedLinear) and m.product.quantized}
    return dense * model.dtype.itemsize + sum(quantized.values())


def stream_rate(megabytes: int = 512, reps: int = 5) -> float:
    """GB/s at which this machine reads memory: a sum over a tensor far larger than its caches."""
    x = torch.ones(megabytes << 18)  # float32: 4 bytes each
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return x.numel() * 4 / best / 1e9


def peak_rate(model, kernels: str, rows: int = 64, reps: int = 50) -> float:
    """GFLOP/s of the model's widest MLP product (hidden -> intermediate) on ``rows`` rows, weights hot in cache,
    on the kernels the model runs: what its linears reach here at best."""
    config = model.config.get_text_config()
    width = getattr(config, "intermediate_size", None) or 4 * config.hidden_size
    mlp = torch.nn.Sequential(torch.nn.Linear(config.hidden_size, width, bias=False, dtype=model.dtype))
    pack(mlp, kernels)
    x = torch.randn(1, rows, config.hidden_size, dtype=model.dtype)
    with torch.inference_mode():
        for _ in range(5):
            mlp(x)
        best = float("inf")
        for _ in range(reps):
            start = time.perf_counter()
            mlp(x)
            best = min(best, time.perf_counter() - start)
    return 2.0 * rows * config.hidden_size * width / best / 1e9


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=models.DEFAULT_MODEL)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--kernels", choices=["packed", "stock"], default="packed")
    parser.add_argument("--weights", choices=models.WEIGHTS, default="dense")
    parser.add_argument("--sizes", default="1,16")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args(argv)
    hw = hardware()
    print(f"# Per-op profile: {args.model}, {hw['cpu']}, {hw['cores']} cores, torch {hw['torch']}, commit {hw['commit']}; "
          f"{args.context}-token cache, ms (fastest of {args.reps})\n")
    sizes = sorted({1} | {int(s) for s in args.sizes.split(",")})  # T = 1: the denominator of r(T)
    stream = stream_rate()  # GB/s
    rows, bounds = [], []
    for dtype in args.dtypes.split(","):
        model = models.load(args.model, dtype=dtype, kernels=args.kernels, weights=args.weights)[0]
        name, peak = f"{dtype} {kernels_of(model)}", peak_rate(model, args.kernels)  # GFLOP/s
        by_size = {size: profile_size(model, size, args.context, args.reps) for size in sizes}
        for size, r in by_size.items():
            rows.append((name, size, r))
            linears, attention = (r["by_class_ms"].get(c, 0.0) for c in ("linears", "attention"))
            roof = max(linear_bytes(model) / stream, linear_flops(model, size) / peak) / 1e6  # ms
            apart = "layers in one call" not in r["by_class_ms"]  # else most linears and the attention are inside that call
            bounds.append((name, size, linears if apart else None, roof,
                           attention_flops(model, size, args.context) / attention / 1e6 if apart and attention else None,
                           r["wall_ms"] / by_size[1]["wall_ms"], (r["wall_ms"] - linears + roof) / by_size[1]["wall_ms"] if apart else None))
        print(f"{name}: weights stream at {stream:.0f} GB/s, the hot 64-row product runs at {peak:.0f} GFLOP/s")
    classes = sorted({c for *_, r in rows for c in r["by_class_ms"]})
    print("\n| dtype, kernels | T | forward (wall) | " + " | ".join(classes) + " | outside ops | step mask (ours) |")
    print("|---|---|---|" + "---|" * (len(classes) + 2))
    for name, size, r in rows:
        print(f"| {name} | {size} | {r['wall_ms']:.1f} | " + " | ".join(f"{r['by_class_ms'].get(c, 0.0):.1f}" for c in classes)
              + f" | {r['outside_ops_ms']:.1f} | {r['mask_ms']:.2f} |")
    print("\n| dtype, kernels | T | linears (ms) | their roofline (ms) | attention GFLOP/s | r(T) | r(T), linears at roofline |")
    print("|---|---|---|---|---|---|---|")
    for name, size, linears, roof, attention, ratio, at_roof in bounds:
        print(f"| {name} | {size} | {_or_dash(linears, '.1f')} | {roof:.1f} | {_or_dash(attention, '.0f')} | {ratio:.2f} | {_or_dash(at_roof, '.2f')} |")


def _or_dash(value: float | None, spec: str) -> str:
    return "–" if value is None else format(value, spec)


if __name__ == "__main__":
    main()
