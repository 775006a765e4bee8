"""The cost curve: how much a step of T tokens costs on this machine, measured once.

A forward that feeds T new tokens costs c(T) = c(1) x r(T), and r depends on the machine, the dtype and
the thread count far more than on the model's name (a 2-core CPU: r(16) from 1.2 to 2.1). ``probe`` times
forwards of T = 1..64 tokens over a realistic cache once; the curve is cached on disk per (model, dtype,
device, kernels, threads, CPU, torch), so the price (a few seconds) is paid once. What each step runs on
that curve is ``planner``'s.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from transformers import PreTrainedModel

from lookahead import capability, gguf_model, models, native
from lookahead.cache_entries import Progress, bar, quiet
from lookahead.cpu import cpu_name
from lookahead.curve import BATCH, BATCH_WIDTHS, CostCurve
from lookahead.kernels import INTEGER_KERNELS, available, kernels_of, own_kernel, weight_kinds
from lookahead.layout import build_layout, stack
from lookahead.model_forward import forward, prefill
from lookahead.native import INTEGER
from lookahead.planner import chain_tree, choose
from lookahead.tree import TokenTree

# every width of the small trees CPUs run, and one past each of the int8 kernels' passes of 8 rows (AVX-512) and of
# 4 (AVX2): the 1.5B int8 on a Xeon, r(8) 1.58, r(9) 1.90-2.07 (a second pass), r(16) 2.93-2.99, r(17) 3.06-3.24, where
# sizes 8 and 12 alone priced 9 rows across that cliff
PROBE_SIZES = (1, 2, 3, 4, 5, 6, 8, 9, 12, 16, 17, 24, 32, 48, 64)
PROBE_CONTEXT = 256
# a probe's time after its first pass over the sizes: four rounds for an embedded model (SmolLM2 int8 on a Zen 3: ~6 s),
# one or two for a 7B-class one (its four rounds took 54 s in int8 and 151 s in fp32 on a Zen 4)
PROBE_SECONDS = 15.0
DEAR_FROM = 8  # the narrowest step a bounded probe may find too dear to measure wider ones
# what --dtype auto chooses from (float16 on CPU is slow and lossy); int8 (``native.INTEGER``) where quantized
# weights run and our integer kernel does
AUTO_DTYPES = ("float32", "bfloat16", INTEGER)
# what --dtype auto expects of drafting before anything is measured: 16 drafts that together add one token a
# forward, each worth as much as another (the default shape's ~2 tokens a forward come from steps of 8-16 rows).
# A chain of drafts accepted with p = 0.5 each earns that token from 4-5 rows: it undervalued flat curves, and
# chose fp32 for SmolLM2's Q4_1 on the Xeon (121 against 118 tokens/s expected) where bf16 lookahead ran 1.16x
# faster (and 1.31x and 1.18x for Gemma 3's and Qwen's GGUFs); this reference picks bf16 on all three.
REFERENCE_DRAFTS = 16
# what a candidate's weights may take beyond the GGUF file (bytes), so that a run stays within the file + 1.5 GB: the
# rest is the run's own (beside its weights: 0.9 GB in the 1.5B's tune, 1.45 GB in the 7B-class file's)
WEIGHTS_HEADROOM = 0.5e9


def probe(model: PreTrainedModel, sizes: tuple[int, ...] = PROBE_SIZES, context: int = PROBE_CONTEXT, rounds: int = 4,
          progress: Progress = quiet, batch: bool = True, seconds: float = PROBE_SECONDS) -> CostCurve:
    """Time one forward adding T tokens to a ``context``-token cache for each T; with ``batch``, also ``BATCH``
    such caches taking ``BATCH_WIDTHS`` rows each (a model whose sequences cannot share a step: ``batch=False``).

    Timing noise on a shared CPU only ever adds time, and drifts: so the sizes are measured in ``rounds``
    interleaved passes, each size keeps its fastest time, and the curve is the lower envelope that never
    decreases (a step of more tokens cannot really cost less; a single slow sample of r(2) above r(4) would
    otherwise keep every two-token step off for good). A large model's probe is bounded (``step_times``'s
    ``seconds``): fewer rounds, and no size past one too dear to pay; the curve extrapolates beyond its sizes.
    """
    start = time.perf_counter()
    limit = capability.context_length(model.config.get_text_config(decoder=True)) or 1 << 20
    sizes = tuple(s for s in sizes if s <= limit // 2) or sizes[:2]  # a tiny context: the sizes it can hold
    context = max(1, min(context, limit - max(sizes)))
    more = f", then up to {seconds:.0f} s more" if seconds < float("inf") and rounds > 1 else ""
    progress(f"measuring forward cost for {len(sizes)} step sizes (a pass over them{more}; once for this machine, model and dtype)")
    widths = BATCH_WIDTHS if batch else ()
    times = step_times(model, sizes, context, rounds, widths, seconds, progress)
    sizes = tuple(s for s in sizes if (1, s) in times)
    widths = tuple(w for w in widths if (BATCH, w) in times)
    widths = widths if len(widths) == len(BATCH_WIDTHS) else ()  # the batch axis whole, or not at all
    envelope = np.minimum.accumulate([times[1, s] for s in sizes][::-1])[::-1]  # non-decreasing in T
    base = float(envelope[0])
    wide = np.minimum.accumulate([times[BATCH, w] for w in widths][::-1])[::-1] / base if widths else ()  # likewise
    return CostCurve(tuple(sizes), tuple(float(t / base) for t in envelope), base * 1000, time.perf_counter() - start,
                     tuple(float(r) for r in wide))


def step_times(model: PreTrainedModel, sizes: tuple[int, ...], context: int, rounds: int,
               widths: tuple[int, ...] = (), seconds: float = float("inf"), progress: Progress = quiet) -> dict[tuple[int, int], float]:
    """Seconds of the loop's own forward (its cache, a 4D mask, logits of every row on the host) adding T tokens to
    a ``context``-token cache, keyed (1, T) for each T of ``sizes`` and (``BATCH``, w) for ``BATCH`` such caches
    taking w rows each, for w in ``widths``: each the fastest of ``rounds`` interleaved passes.

    With ``seconds`` finite, a bounded probe: the first pass drops every size (and batch width) past the first T of
    at least ``DEAR_FROM`` rows that costs over T/2 one-row steps (it pays only where over half its rows are
    accepted tokens: the planner's linear extrapolation prices what lies beyond), and another pass starts only while
    ``seconds`` have not passed since the first began. Where one pass could outlast ``seconds`` (each size at most
    T/2 one-row steps, as the warm-up timed one: a 7B-class model), it skips the sizes past ``DEAR_FROM`` between
    powers of two (9, 12, 17, 24, 48: interpolated). The first pass shows a bar by rows (a wide step costs about its rows:
    the estimate of the time left)."""
    vocab = models.vocab_size(model)
    rng = torch.Generator().manual_seed(0)  # private: the global RNG (unseeded sampling) is the user's
    windows = capability.mask_windows(model.config.get_text_config(decoder=True))
    with torch.inference_mode():
        prompt = torch.randint(0, vocab, (context,), generator=rng).tolist()
        cache, _ = prefill(model, prompt)
        batched = cache.sequence(0, context) if widths else None  # copies of the same prompt's keys: no prefill of their
        for _ in range(BATCH - 1 if widths else 0):  # own (a 7B-class model's 256 tokens took ~15 s on a Zen 3)
            batched.join(cache)
        runs = [(1, size) for size in sizes] + [(BATCH, width) for width in widths]
        times: dict[tuple[int, int], float] = {}

        def timed(sequences: int, size: int) -> float:
            step = stack([build_layout(0, 0, chain_tree(0.5, size - 1))] * sequences)
            ids = torch.randint(0, vocab, (sequences, size), generator=rng)
            on = cache if sequences == 1 else batched
            t0 = time.perf_counter()
            forward(model, windows, step, on, ids, torch.full((sequences,), context))  # returns on the host: synchronised
            took = time.perf_counter() - t0
            on.cache.crop(-size)  # back to the context (a negative count in transformers 5.x)
            return took

        one = [timed(*runs[0]) for _ in range(2)][-1]  # two warm-up forwards
        if one * sum(max(1.0, t / 2) for s, t in runs if s == 1) > seconds:  # a pass could outlast the bound: fewer sizes
            runs = [(s, t) for s, t in runs if s > 1 or t <= DEAR_FROM or t & (t - 1) == 0]
        began = time.perf_counter()
        for round_ in range(rounds):
            if round_ and time.perf_counter() - began > seconds:
                break
            with bar(progress if not round_ else quiet, sum(s * t for s, t in runs), "forward cost", "row") as rows:
                for sequences, size in runs:
                    took = timed(sequences, size)
                    times[sequences, size] = min(times.get((sequences, size), float("inf")), took)
                    rows.update(sequences * size)
            if not round_ and seconds < float("inf"):  # the bounded probe's sizes
                one = times[1, runs[0][1]]
                dear = next((t for s, t in runs if s == 1 and t >= DEAR_FROM and times[1, t] > one * t / 2), None)
                if dear is not None:
                    runs = [(s, t) for s, t in runs if s * t <= dear]
                    times = {run: times[run] for run in runs}
    return times


def model_name(model: PreTrainedModel) -> str:
    """What names a model in the on-disk caches: the directory it was loaded from, else a hash of its config."""
    return str(model.config._name_or_path or hashlib.sha256(model.config.to_json_string().encode()).hexdigest()[:16])


def curve_file(model: PreTrainedModel, cache_dir: Path) -> Path:
    """Where this (model, dtype, device, kernels, weights, threads, CPU, torch)'s curve is cached."""
    return curve_path(model_name(model), model.dtype, model.device.type, cache_dir, kernels_of(model), weight_kinds(model))


def curve_path(name: str, dtype: torch.dtype, device: str, cache_dir: Path, kernels: str = "stock", weights: str = "dense") -> Path:
    """``curve_file`` before loading: ``name`` is the directory the model is loaded from, ``weights`` its
    ``weight_kinds``."""
    build = [native.isa(), native.build_id(native.tier()), native.prefetch_into_l2()] if kernels.startswith("packed-own") else None  # ours, as run
    key = json.dumps([name, str(dtype), torch.device(device).type, torch.get_num_threads(), cpu_name(), torch.__version__, kernels, build]
                     + ([weights] if weights != "dense" else []))  # a dense model's key as before: its curves stay found
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_dir / "costs" / f"{Path(name).name or 'model'}-{str(dtype).split('.')[-1]}-{kernels}-{digest}.json"


def lookahead_speed(curve: CostCurve) -> float:
    """Expected tokens per second of lookahead on this curve: the best step over ``REFERENCE_DRAFTS`` sibling drafts
    worth 1 / ``REFERENCE_DRAFTS`` token each, per c(1)."""
    n = REFERENCE_DRAFTS
    drafts = TokenTree.merge(np.arange(n), np.full(n, -1), np.full(n, 1 / n), np.ones(n, np.int64), n)
    return choose(curve, drafts, 0, 0.0).value * 1000 / curve.ms_at_1


def choices(spec: str, dtype: str, weights: str, kernels: str, device: str, cache_dir: Path,
            progress: Progress = quiet, dense: bool = False) -> list[tuple[str, str]]:
    """The (dtype, weights) pairs ``fastest`` compares: ``AUTO_DTYPES`` where ``dtype`` is "auto" (for a first run only
    those that can win here: ``can_win``), on the weights ``weights`` runs; with ``dense`` (``lookahead tune``), for
    ``weights`` "auto" on a GGUF model whose blocks our kernel runs, its dequantized weights too. Of a GGUF model's
    candidates, "auto" keeps those whose weights fit beside the file (``weights_fit``), said in a line for the
    others (a 7B-class file's fp32 and bf16 activations read a layout 1.3x the file). (``--weights auto`` itself
    keeps to the blocks: dequantizing a GGUF at each load cost ~20 s on the 1.5B, more than its faster dense steps save
    in a request.)"""
    dtypes = AUTO_DTYPES if dtype == "auto" else (dtype,)
    found, gguf = [], None
    for name in dtypes:
        try:
            mode, file = models.weights_mode(spec, weights, kernels, cache_dir, progress, name, device)
            gguf = gguf or file
        except models.ModelLoadError:
            if dtype == "auto" and name == INTEGER:  # auto: int8 only where it runs
                continue
            raise
        if dtype == "auto" and name == INTEGER and mode == "q8" and weights != "q8":
            continue  # auto quantizes no dense model on its own
        found.append((name, mode))
        if dense and weights == "auto" and mode == "gguf" and name != INTEGER:
            found.append((name, "dense"))
    if dtype == "auto" and not dense:
        found = can_win(found, kernels, device, cache_dir)
    chosen = [(name, mode) for name, mode in found if (mode, weights) == ("dense", "auto") or (mode, dtype) == ("gguf", "auto")]
    if gguf is not None and any(name != INTEGER for name, _ in chosen):  # chosen, not asked for: only what fits
        prepared = gguf_model.prepare(gguf, cache_dir, progress)  # (the blocks' cache entry, which the others load)
        left = [(name, mode) for name, mode in chosen if not weights_fit(gguf, prepared, name, mode)]
        if len(left) < len(found):  # (where nothing fits, a run still needs a candidate)
            for name, mode in left:
                progress(f"{name} on {'its dequantized weights' if mode == 'dense' else 'the blocks'} not measured: its weights would "
                         f"not fit beside the file (within {(gguf.stat().st_size + WEIGHTS_HEADROOM) / 1e9:.1f} GB); --dtype {name}"
                         f"{' --weights dense' if mode == 'dense' else ''} measures it")
            found = [pair for pair in found if pair not in left]
    return found


def can_win(found: list[tuple[str, str]], kernels: str, device: str, cache_dir: Path) -> list[tuple[str, str]]:
    """Of ``--dtype auto``'s candidates, those that could be the fastest here, so that a first run probes no other:
    int8 alone on a GGUF's blocks where no AMX tiles run bf16 (on a Zen 4 int8 lookahead ran 1.6-2.2x bf16's on
    each of four GGUFs, on a Zen 3 the 1.5B's int8 plain step 2.9x faster than fp32 activations'); else none on
    PyTorch's own kernels where ours run another (bf16 without AVX-512 BF16)."""
    if (INTEGER, "gguf") in found and not native.amx():
        return [(INTEGER, "gguf")]
    ours = [(name, mode) for name, mode in found if _kernels_for(kernels, name, device, cache_dir) != "stock"]
    return ours or found


def weights_fit(gguf: Path, prepared: gguf_model.Prepared, dtype: str, mode: str) -> bool:
    """Whether a GGUF model's weights as ``dtype`` runs them on ``mode`` ("dense": dequantized to ``dtype``; "gguf":
    the layout its activations read) fit within ``WEIGHTS_HEADROOM`` bytes beyond the file and in half the memory
    this machine has free now (the rest: activations, the cache and whatever else runs), so that measuring them
    keeps a run's memory near the file's. int8's layout (``integer.bin``) is the file's size: it always fits."""
    if mode == "gguf" and dtype == INTEGER:
        return True
    size = (torch.finfo(models.torch_dtype(dtype)).bits // 8 * gguf_model.dense_parameters(prepared) if mode == "dense"
            else gguf_model.blocks_bytes(gguf, prepared))
    try:
        free = next(int(line.split()[1]) * 1024 for line in Path("/proc/meminfo").read_text().splitlines() if line.startswith("MemAvailable"))
    except (OSError, StopIteration, ValueError):
        return False
    return size <= min(free / 2, gguf.stat().st_size + WEIGHTS_HEADROOM)


def fastest(spec: str, device: str, cache_dir: Path, progress: Progress = quiet, kernels: str = "stock",
            weights: str = "dense", dtype: str = "auto", dense: bool = False):
    """(dtype name, weights, (model, tokenizer) if it had to be loaded for measuring, else None): of ``choices``, the
    pair where lookahead is expected to be fastest here (``lookahead_speed``: the plain step's cost and how cheap
    wide steps are), from the cached curves (probed where missing); said in one line, with the others' speeds."""
    candidates = choices(spec, dtype, weights, kernels, device, cache_dir, progress, dense)
    if len(candidates) == 1:  # nothing to choose: nothing to measure
        if dtype == "auto":
            progress(f"--dtype auto: {candidates[0][0]}, the one that can win here (lookahead tune measures every dtype)")
        return *candidates[0], None
    gguf = models.gguf_file(spec, cache_dir, progress)
    source = str(gguf) if gguf else models.resolve(spec, cache_dir, progress)  # a GGUF model is named by its file
    best, speeds = None, []
    for name, mode in candidates:
        loaded = None
        try:
            runs_on = _kernels_for(kernels, name, device, cache_dir)
            laid = gguf_model.prepare(gguf, cache_dir, progress, gguf_model.layout_for(name == INTEGER)) if gguf and mode == "gguf" else None
            kinds = {"dense": "dense", "q8": "q8/32"} | ({"gguf": gguf_model.weight_kinds(laid)} if laid else {})
            path = curve_path(source, models.torch_dtype(name), device, cache_dir, runs_on,  # our kernels alone run quantized weights
                              kinds[mode] if runs_on in ("packed-own", INTEGER_KERNELS) else "dense")
            curve = CostCurve.from_json(path.read_text())
        except (OSError, UnicodeDecodeError, ValueError):
            loaded = models.load(spec, dtype=name, device=device, cache_dir=cache_dir, progress=progress, kernels=kernels, weights=mode)
            curve = cached_curve(loaded[0], cache_dir, progress)
        speeds.append((lookahead_speed(curve), name, mode))
        if best is None or speeds[-1][0] > best[0]:
            best = (*speeds[-1], loaded, curve)  # a model loaded for measuring is kept only while it is the best
    speed, name, mode, loaded, curve = best
    several = len({m for _, _, m in speeds}) > 1  # weights compared too: each pair names them
    what = f"{name}, {'its GGUF blocks' if mode == 'gguf' else mode + ' weights'}" if several else name
    others = "; ".join(f"{d}{' ' + m if several else ''} ~{s:.0f}" for s, d, m in speeds if (d, m) != (name, mode))
    progress(f"fastest here: {what} (plain step {curve.ms_at_1:.1f} ms, r(16) {curve.ratio(16):.2f}; ~{speed:.0f} tokens/s expected; "
             f"{others})")
    return name, mode, loaded


def _kernels_for(kernels: str, dtype: str, device: str, cache_dir: Path) -> str:
    """The kernel set a model loaded with ``kernels`` will run (packing falls back to stock where unavailable)."""
    if kernels == "packed":
        native.library(cache_dir)  # where ``models.load`` would build them
    packs = kernels == "packed" and torch.device(device).type == "cpu" and available(models.torch_dtype(dtype)) is None
    if packs and dtype == INTEGER:
        return INTEGER_KERNELS
    return "stock" if not packs else "packed" if own_kernel(models.torch_dtype(dtype)) else "packed-own"


def cached_curve(model: PreTrainedModel, cache_dir: Path, progress: Progress = quiet,
                 batch: Callable[[], bool] = lambda: True) -> CostCurve:
    """The cached curve, or a new probe (also when the file is missing, unreadable or corrupt), saved; ``batch()``:
    as ``probe``'s ``batch``, asked only when probing (the answer may cost a capability probe)."""
    path = curve_file(model, cache_dir)
    try:
        return CostCurve.from_json(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        curve = probe(model, progress=progress, batch=batch())
        progress(f"forward cost measured in {curve.probe_s:.1f} s: r(16) = {curve.ratio(16):.2f}, r(32) = {curve.ratio(32):.2f}")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(curve.to_json())
        except OSError:
            pass  # a read-only cache: probe again next time
        return curve


def plot_curves(curves: dict[str, CostCurve], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, curve in curves.items():
        ax.plot(curve.sizes, curve.ratios, marker="o", label=f"{name} (c(1) = {curve.ms_at_1:.1f} ms)")
    ax.set_xlabel("tokens T fed in one forward")
    ax.set_ylabel("r(T) = c(T) / c(1)")
    ax.set_title(cpu_name(), fontsize=8)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
