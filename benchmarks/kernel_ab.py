"""A kernel change measured against the revision before it, both builds in ONE process on a real model's linears:
every product called once in a forward's order (its weights streamed from memory), the two builds' passes
interleaved; then each product repeated (its weights hot in cache: what its arithmetic costs).

    python -m benchmarks.kernel_ab --before REV [--model qwen2.5-coder-1.5b --dtype int8 --weights gguf --rows 1 --isa avx2]
    python -m benchmarks.kernel_ab --tier avx2 [--model ... --rows 1]

``--before``: a git revision whose ``lookahead/csrc`` is built beside the working tree's. Why one process: on a
2-core VM whose memory rate moved 31-60 GB/s between runs, a change that measured 7% faster in runs before and
after was 15% slower here. The builds' outputs are compared too (an optimisation keeps the bits). ``--tier``: the
working tree's integer kernels of another tier this CPU runs beside its best tier's, on the same blocks (every tier's
integer linear reads one layout) and the same fp32 rows: what a tier costs against another on one CPU, whose bits
may be their own (DESIGN's table of which paths share bits).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.profile_step import stream_rate
from benchmarks.run import hardware
from lookahead import linear_kernels, models, native
from lookahead.kernels import PackedLinear

CSRC = "lookahead/csrc"


def sources_at(revision: str, directory: Path) -> Path:
    """``revision``'s kernel sources, written into ``directory``; SystemExit where git has no such revision."""
    listed = subprocess.run(["git", "ls-tree", "--name-only", f"{revision}:{CSRC}"], capture_output=True, text=True)
    if listed.returncode:
        raise SystemExit(f"no kernel sources at {revision!r}: {(listed.stderr.strip().splitlines() or ['?'])[0]}")
    names = listed.stdout.split()
    for name in names:
        (directory / name).write_bytes(subprocess.run(["git", "show", f"{revision}:{CSRC}/{name}"], capture_output=True, check=True).stdout)
    return directory


def products(model: torch.nn.Module) -> list[linear_kernels.Linear]:
    """The model's products on our kernels, each once, in the order a forward calls them."""
    seen: dict[int, linear_kernels.Linear] = {}
    for module in model.modules():
        if isinstance(module, PackedLinear) and module.product.native is not None:
            seen.setdefault(id(module.product), module.product.native)
    return list(seen.values())


def check_tier(tier: str, dtype: str) -> None:
    """SystemExit where ``--tier`` cannot be compared with the process's tier."""
    if dtype != native.INTEGER:
        raise SystemExit(f"--tier compares the integer kernels, which read one layout on every tier: use --dtype {native.INTEGER}")
    if not native.runs(tier):
        raise SystemExit(f"this CPU cannot run the {tier} kernels")
    if tier == native.best_tier():
        raise SystemExit(f"{tier} is this CPU's best tier, which the process runs: name another")


def passes(calls: list[tuple], lib, hot: int = 1) -> float:
    """Seconds to run every product (``hot`` > 1: each that many times, its fastest counted) on build ``lib``."""
    total = 0.0
    for linear, x, y in calls:
        run, best = getattr(lib, linear.run.__name__), float("inf")
        for _ in range(hot):
            start = time.perf_counter()
            linear.into(x, y, run)
            best = min(best, time.perf_counter() - start)
        total += best
    return total


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    against = parser.add_mutually_exclusive_group(required=True)
    against.add_argument("--before", help="the git revision to compare the working tree's kernels with")
    against.add_argument("--tier", choices=list(native.TIERS), help="a lower tier of this CPU to compare its best tier's integer kernels with")
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--dtype", default=native.INTEGER)
    parser.add_argument("--weights", choices=models.WEIGHTS, default="gguf")
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--isa", choices=list(native.TIERS), help="hold our kernels to this tier (default: the CPU's best)")
    args = parser.parse_args(argv)
    if args.isa and args.tier:
        parser.error("--tier compares with the CPU's best tier: leave out --isa")
    if args.isa:
        native.library(tier=args.isa)  # before the model loads them
    with tempfile.TemporaryDirectory() as tmp:
        if args.tier:
            check_tier(args.tier, args.dtype)  # said before the model loads, as a wrong revision is
        else:
            sources = sources_at(args.before, Path(tmp))
        model = models.load(args.model, dtype=args.dtype, kernels="packed", weights=args.weights)[0]
        tier = native.tier()
        if tier is None:
            raise SystemExit(f"our kernels do not run here: {native.library()}")
        other = native.build(native.library.directory, args.tier) if args.tier else native.build(Path(tmp), tier, sources)
        if isinstance(other, str):
            raise SystemExit(f"{args.tier or args.before}'s kernels: {other}")
        builds = {f"{args.tier} (working tree)": other, f"{tier} (working tree)": native.library()} if args.tier else \
            {f"before ({args.before})": other, "after (working tree)": native.library()}
        found = [linear for linear in products(model) if linear.integer or not args.tier]
        dtype = torch.float32 if args.tier else None  # fp32 rows: the lower tiers' integer linear takes no bf16
        calls = [(linear, torch.randn(args.rows, linear.k).to(dtype or linear.dtype), torch.empty(args.rows, linear.n, dtype=dtype or linear.dtype))
                 for linear in found]
        outputs = []
        for lib in builds.values():
            passes(calls, lib)
            outputs.append([y.clone() for _, _, y in calls])
        streamed: dict[str, list[float]] = {name: [] for name in builds}
        for _ in range(args.rounds):
            for name, lib in builds.items():
                streamed[name].append(passes(calls, lib))
        hot = {name: float("inf") for name in builds}  # interleaved too: one build's run after the other's moved 10% with the VM
        for _ in range(3):
            for name, lib in builds.items():
                hot[name] = min(hot[name], passes(calls, lib, hot=3))
    megabytes = sum(linear.packed.nbytes() if isinstance(linear.packed, linear_kernels.QuantLayout) else linear.packed.nbytes for linear in found) / 1e6
    hw = hardware()
    print(f"# {args.model} {args.dtype} ({args.weights}), {len(found)} products ({megabytes:.0f} MB), {args.rows} row(s), "
          f"{' against '.join(builds) if args.tier else f'{tier} kernels'}; {hw['cpu']}, "
          f"{hw['cores']} cores, commit {hw['commit']}; ms, {args.rounds} interleaved passes\n")
    print("| build | streamed: fastest | median | GB/s | hot |\n|---|---|---|---|---|")
    for name, times in streamed.items():
        print(f"| {name} | {min(times) * 1e3:.2f} | {statistics.median(times) * 1e3:.2f} | {megabytes / min(times) / 1e3:.1f} | {hot[name] * 1e3:.2f} |")
    same = all(torch.equal(a, b) for a, b in zip(*outputs))
    apart = max(float(((a - b).abs().max() / b.abs().max().clamp_min(1e-30))) for a, b in zip(*outputs))
    verdict = "equal bit for bit" if same else f"apart by up to {apart:.1e} of a product's largest output" if args.tier else "NOT equal"
    print(f"\nThe builds' outputs are {verdict}. Memory reads at {stream_rate():.0f} GB/s here now (a sum over 512 MB).")


if __name__ == "__main__":
    main()
