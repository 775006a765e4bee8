"""The cost curve: how much a step of T tokens costs on this machine, measured once.

A forward that feeds T new tokens costs c(T) = c(1) x r(T), and r depends on the machine, the dtype and
the thread count far more than on the model's name (a 2-core CPU: r(16) from 1.2 to 2.1). ``probe`` times
forwards of T = 1..64 tokens over a realistic cache once; the curve is cached on disk per (model, dtype,
device, kernels, threads, CPU, torch), so the price (a few seconds) is paid once. What each step runs on
that curve is ``planner``'s.
"""

from __future__ import annotations

import functools
import hashlib
import json
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from transformers import PreTrainedModel

from lookahead import models, native, support
from lookahead.kernels import available, kernels_of, own_kernel
from lookahead.layout import build_layout, stack
from lookahead.passes import forward, prefill
from lookahead.planner import chain_tree, choose

PROBE_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)
PROBE_CONTEXT = 256
BATCH, BATCH_WIDTHS = 8, (1, 2, 4)  # the batch the probe also times: 8 sequences x 1, 2 and 4 rows
CURVE_FORMAT = 5  # 2: fastest of interleaved rounds, monotone envelope; 3: packed models attend with grouped_sdpa;
# 4: the loop's own forward (4D mask, logits to the host; without a mask c(1) read ~20% high on Zen 5); 5: the
# batch axis (older curves are re-probed)
AUTO_DTYPES = ("float32", "bfloat16")  # what --dtype auto chooses from (float16 on CPU is slow and lossy)
# what --dtype auto expects of drafting before anything is measured: a chain of 16 drafts, each accepted with
# probability 0.5 given its parent (~2 tokens per forward at full width, what the default shape measured)
REFERENCE_CHAIN = (0.5, 16)


@dataclass(frozen=True)
class CostCurve:
    """r(T) = c(T)/c(1) at the measured sizes for one sequence, c(1) itself, and what ``BATCH`` sequences of
    ``BATCH_WIDTHS`` rows each cost (over c(1); empty: not measured)."""

    sizes: tuple[int, ...]
    ratios: tuple[float, ...]
    ms_at_1: float
    probe_s: float = 0.0  # what measuring it cost
    batch_ratios: tuple[float, ...] = ()  # c(BATCH sequences x w rows) / c(1), for w in BATCH_WIDTHS

    def ratio(self, tokens: int | np.ndarray, batch: int = 1) -> float | np.ndarray:
        """c(``tokens`` rows over ``batch`` sequences) / c(1); an array of T gives an array.

        One sequence: r(T), interpolated between measured sizes and extrapolated linearly beyond the largest.
        A batch's rows cost more than one sequence's (each sequence reads its own cache; SmolLM2 bf16 on Zen 5:
        8 x 2 rows cost 1.37x 8 x 1, one sequence's 16 rows 1.16x its 8): r(T) times the measured factor
        f(w) = c(BATCH x w) / (c(1) r(BATCH w)) at the width w = T / batch, taken to the power
        log(batch) / log(BATCH) for other batch sizes."""
        sizes, ratios = np.asarray(self.sizes, float), np.asarray(self.ratios, float)
        slope = (ratios[-1] - ratios[-2]) / (sizes[-1] - sizes[-2])
        t = np.asarray(tokens, float)
        r = np.where(t <= sizes[-1], np.interp(t, sizes, ratios), ratios[-1] + slope * (t - sizes[-1]))
        if batch > 1 and self.batch_ratios:
            widths = np.asarray(BATCH_WIDTHS, float)
            factor = np.asarray(self.batch_ratios) / self.ratio(BATCH * widths)  # f(w) at the measured widths
            r = r * np.interp(t / batch, widths, factor) ** (np.log(batch) / np.log(BATCH))
        return r if r.ndim else float(r)

    @classmethod
    def from_json(cls, text: str) -> "CostCurve":
        """ValueError unless ``text`` is a curve written by ``to_json`` with sane values."""
        try:
            data = json.loads(text)
            if data.pop("format") != CURVE_FORMAT:
                raise ValueError("another format")
            curve = cls(tuple(int(s) for s in data["sizes"]), tuple(float(r) for r in data["ratios"]),
                        float(data["ms_at_1"]), float(data.get("probe_s", 0.0)), tuple(float(r) for r in data.get("batch_ratios", ())))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"not a cost curve ({e})") from None
        if len(curve.sizes) < 2 or len(curve.sizes) != len(curve.ratios) or curve.sizes[0] != 1 \
                or list(curve.sizes) != sorted(set(curve.sizes)) or not all(r > 0 for r in curve.ratios + curve.batch_ratios) \
                or len(curve.batch_ratios) not in (0, len(BATCH_WIDTHS)) or not curve.ms_at_1 > 0:
            raise ValueError("not a cost curve (bad values)")
        return curve

    def to_json(self) -> str:
        return json.dumps({"format": CURVE_FORMAT} | asdict(self))


def probe(model: PreTrainedModel, sizes: tuple[int, ...] = PROBE_SIZES, context: int = PROBE_CONTEXT, rounds: int = 4,
          progress: Callable[[str], None] = lambda _: None, batch: bool = True) -> CostCurve:
    """Time one forward adding T tokens to a ``context``-token cache for each T; with ``batch``, also ``BATCH``
    such caches taking ``BATCH_WIDTHS`` rows each (a model whose sequences cannot share a step: ``batch=False``).

    Timing noise on a shared CPU only ever adds time, and drifts: so the sizes are measured in ``rounds``
    interleaved passes, each size keeps its fastest time, and the curve is the lower envelope that never
    decreases (a step of more tokens cannot really cost less; a single slow sample of r(2) above r(4) would
    otherwise keep every two-token step off for good).
    """
    start = time.perf_counter()
    limit = support.context_length(model.config.get_text_config(decoder=True)) or 1 << 20
    sizes = tuple(s for s in sizes if s <= limit // 2) or sizes[:2]  # a tiny context: the sizes it can hold
    context = max(1, min(context, limit - max(sizes)))
    progress(f"measuring forward cost for {len(sizes)} step sizes (once for this machine, model and dtype)")
    widths = BATCH_WIDTHS if batch else ()
    times = step_times(model, sizes, context, rounds, widths)
    envelope = np.minimum.accumulate([times[1, s] for s in sizes][::-1])[::-1]  # non-decreasing in T
    base = envelope[0]
    wide = np.minimum.accumulate([times[BATCH, w] for w in widths][::-1])[::-1] / base if widths else ()  # likewise
    return CostCurve(tuple(sizes), tuple(float(t / base) for t in envelope), base * 1000, time.perf_counter() - start,
                     tuple(float(r) for r in wide))


def step_times(model: PreTrainedModel, sizes: tuple[int, ...], context: int, rounds: int,
               widths: tuple[int, ...] = ()) -> dict[tuple[int, int], float]:
    """Seconds of the loop's own forward (its cache, a 4D mask, logits of every row on the host) adding T tokens to
    a ``context``-token cache, keyed (1, T) for each T of ``sizes`` and (``BATCH``, w) for ``BATCH`` such caches
    taking w rows each, for w in ``widths``: each the fastest of ``rounds`` interleaved passes."""
    vocab = models.vocab_size(model)
    rng = torch.Generator().manual_seed(0)  # private: the global RNG (unseeded sampling) is the user's
    windows = support.mask_windows(model.config.get_text_config(decoder=True))
    with torch.inference_mode():
        prompt = torch.randint(0, vocab, (context,), generator=rng).tolist()
        cache, _ = prefill(model, prompt)
        batched = prefill(model, prompt)[0] if widths else None
        for _ in range(BATCH - 1 if widths else 0):
            batched.join(cache)  # a copy of the same prompt's keys: no prefill of its own
        runs = [(1, size) for size in sizes] + [(BATCH, width) for width in widths]
        times = dict.fromkeys(runs, float("inf"))
        for sequences, size in runs[:1] * 2 + runs * rounds:  # two warm-up forwards, then the interleaved rounds
            step = stack([build_layout(0, 0, chain_tree(0.5, size - 1))] * sequences)
            ids = torch.randint(0, vocab, (sequences, size), generator=rng)
            on = cache if sequences == 1 else batched
            t0 = time.perf_counter()
            forward(model, windows, step, on, ids, torch.full((sequences,), context))  # returns on the host: synchronised
            times[sequences, size] = min(times[sequences, size], time.perf_counter() - t0)
            on.cache.crop(-size)  # back to the context (a negative count in transformers 5.x)
    return times


def model_name(model: PreTrainedModel) -> str:
    """What names a model in the on-disk caches: the directory it was loaded from, else a hash of its config."""
    return str(model.config._name_or_path or hashlib.sha256(model.config.to_json_string().encode()).hexdigest()[:16])


def curve_file(model: PreTrainedModel, cache_dir: Path) -> Path:
    """Where this (model, dtype, device, kernels, threads, CPU, torch)'s curve is cached."""
    return curve_path(model_name(model), model.dtype, model.device.type, cache_dir, kernels_of(model))


def curve_path(name: str, dtype: torch.dtype, device: str, cache_dir: Path, kernels: str = "stock") -> Path:
    """``curve_file`` before loading: ``name`` is the directory the model is loaded from."""
    build = native.build_id() if kernels == "packed-own" else None  # our kernels, as built from today's sources
    key = json.dumps([name, str(dtype), torch.device(device).type, torch.get_num_threads(), cpu_name(), torch.__version__, kernels, build])
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_dir / "costs" / f"{Path(name).name or 'model'}-{str(dtype).split('.')[-1]}-{kernels}-{digest}.json"


def lookahead_speed(curve: CostCurve) -> float:
    """Expected tokens per second of lookahead on this curve: the best step for ``REFERENCE_TREE`` per c(1)."""
    return choose(curve, chain_tree(*REFERENCE_CHAIN), 0, 0.0).value * 1000 / curve.ms_at_1


def fastest_dtype(spec: str, device: str, cache_dir: Path, progress: Callable[[str], None] = lambda _: None,
                  kernels: str = "stock"):
    """(dtype name, (model, tokenizer) if it had to be loaded for measuring, else None): the dtype among
    ``AUTO_DTYPES`` where lookahead is expected to be fastest here (``lookahead_speed``: the plain step's cost
    and how cheap wide steps are), from the cached curves (probed where missing)."""
    source = models.resolve(spec, cache_dir, progress)
    best = None
    for dtype in AUTO_DTYPES:
        loaded = None
        try:
            path = curve_path(source, models.DTYPES[dtype], device, cache_dir, _kernels_for(kernels, dtype, device))
            curve = CostCurve.from_json(path.read_text())
        except (OSError, UnicodeDecodeError, ValueError):
            loaded = models.load(spec, dtype=dtype, device=device, cache_dir=cache_dir, progress=progress, kernels=kernels)
            curve = cached_curve(loaded[0], cache_dir, progress)
        if best is None or lookahead_speed(curve) > best[1]:
            best = (dtype, lookahead_speed(curve), loaded, curve)
    dtype, speed, loaded, curve = best
    progress(f"fastest here: {dtype} (plain step {curve.ms_at_1:.1f} ms, r(16) {curve.ratio(16):.2f}; ~{speed:.0f} tokens/s expected)")
    return dtype, loaded


def _kernels_for(kernels: str, dtype: str, device: str) -> str:
    """The kernel set a model loaded with ``kernels`` will run (packing falls back to stock where unavailable)."""
    packs = kernels == "packed" and torch.device(device).type == "cpu" and available(models.DTYPES[dtype]) is None
    return "stock" if not packs else "packed" if own_kernel(models.DTYPES[dtype]) else "packed-own"


def cached_curve(model: PreTrainedModel, cache_dir: Path, progress: Callable[[str], None] = lambda _: None,
                 batch: bool = True) -> CostCurve:
    """The cached curve, or a new probe (also when the file is missing, unreadable or corrupt), saved; ``batch``:
    as ``probe``'s."""
    path = curve_file(model, cache_dir)
    try:
        return CostCurve.from_json(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        curve = probe(model, progress=progress, batch=batch)
        progress(f"forward cost measured in {curve.probe_s:.1f} s: r(16) = {curve.ratio(16):.2f}, r(32) = {curve.ratio(32):.2f}")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(curve.to_json())
        except OSError:
            pass  # a read-only cache: probe again next time
        return curve


ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")  # what decides which kernels oneDNN runs


@functools.cache  # the CPU does not change under a running process: read /proc/cpuinfo once
def _cpu_fields() -> dict[str, str]:
    """The first processor's block of /proc/cpuinfo (empty where there is none)."""
    cpuinfo, fields = Path("/proc/cpuinfo"), {}
    for line in cpuinfo.read_text().splitlines() if cpuinfo.exists() else []:
        if not line.strip():
            break  # the first processor's block says it
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    return fields


def _family_model() -> tuple[int, int]:
    fields = _cpu_fields()
    return int(fields.get("cpu family", 0) or 0), int(fields.get("model", 0) or 0)


def cpu_generation() -> str | None:
    """AMD's core generation ("Zen 4"), None for other CPUs."""
    return _zen(*_family_model()) if _cpu_fields().get("vendor_id") == "AuthenticAMD" else None


def cpu_name() -> str:
    """The CPU's name with its family/model and vector extensions: a name alone says "AMD EPYC" for Zen 3, 4
    and 5 alike, whose cost curves differ (a cached curve is keyed by this), e.g.
    "AMD EPYC (Zen 5, family 26 model 2; avx2 avx512f avx512_bf16)"."""
    fields = _cpu_fields()
    if not fields:
        return platform.processor() or platform.machine()
    (family, model), zen = _family_model(), cpu_generation()
    flags = [f for f in ISA_FLAGS if f in fields.get("flags", "").split()]
    return f"{fields.get('model name', platform.machine())} ({zen + ', ' if zen else ''}family {family} model {model}; {' '.join(flags) or 'no avx2'})"


def _zen(family: int, model: int) -> str | None:
    """AMD's core generation from the CPUID family and model (AMD's published family/model ranges)."""
    if family == 0x17:
        return "Zen 2" if model >= 0x30 else "Zen/Zen+"
    if family == 0x19:
        return "Zen 4" if 0x10 <= model <= 0x1F or 0x60 <= model <= 0xAF else "Zen 3"
    return "Zen 5" if family == 0x1A else None


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
