"""The cost model: how much a step of T tokens costs on this machine, and what step is worth running.

A forward that feeds T new tokens costs c(T) = c(1) x r(T), and r depends on the machine, the dtype and
the thread count far more than on the model's name (a 2-core CPU: r(16) from 1.2 to 2.1). ``probe`` times
forwards of T = 1..64 tokens over a realistic cache once; the curve is cached on disk per (model, dtype,
device, threads, CPU, torch), so the price (a few seconds) is paid once.

Each step, ``choose`` takes the drafted tree and the estimated value of the Jacobi branch and picks the
tree size k and whether to feed the window, maximising expected tokens per unit of cost:

    value(k, window) = (1 + S(k) + window x J) / r(1 + k + window x W(N-1))

where S(k) is the sum of the k best node scores (each the estimated probability that the node is
accepted, so the sum is the expected number of accepted draft tokens) and J the Jacobi branch's measured
worth (draft tokens accepted per step that only its trajectories proposed). Plain decoding is value 1: when
nothing beats it, the step is plain (T = 1), and the tree keeps being drafted (cheap), so an input-grounded
stretch (a long suffix match) turns drafting back on by itself.
"""

from __future__ import annotations

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

from lookahead import kv, models, support
from lookahead.kernels import available, kernels_of
from lookahead.tree import TokenTree

PROBE_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)
PROBE_CONTEXT = 256
CURVE_FORMAT = 3  # 2: fastest of interleaved rounds, monotone envelope; 3: packed models attend with grouped_sdpa (older curves are re-probed)
AUTO_DTYPES = ("float32", "bfloat16")  # what --dtype auto chooses from (float16 on CPU is slow and lossy)
JACOBI_PRIOR = 0.05  # draft tokens per step credited to the Jacobi branch before any is measured (SmolLM2: ~0)
JACOBI_DECAY = 0.05  # weight of each step in its running estimate
JACOBI_RETRY = 64  # steps after which a Jacobi branch the chooser left off runs once more, to re-measure it
# what --dtype auto expects of drafting before anything is measured: a chain of 16 drafts, each accepted with
# probability 0.5 given its parent (~2 tokens per forward at full width, what the default shape measured)
REFERENCE_CHAIN = (0.5, 16)
LIVE_WEIGHT = 0.1  # weight of each of the loop's own forward timings in the curve's online correction
CALIBRATION_DECAY = 0.95  # a sequence's calibration remembers its last ~20 drafting steps
CALIBRATION_PRIOR = 1.0  # ... and starts as if one promised draft token had come (factor 1)


@dataclass(frozen=True)
class CostCurve:
    """r(T) = c(T)/c(1) at the measured sizes, and c(1) itself."""

    sizes: tuple[int, ...]
    ratios: tuple[float, ...]
    ms_at_1: float
    probe_s: float = 0.0  # what measuring it cost

    def ratio(self, tokens: int | np.ndarray, batch: int = 1) -> float | np.ndarray:
        """r(T), interpolated between measured sizes and extrapolated linearly beyond the largest (the probe fed
        one sequence: ``batch`` is for ``LiveCurve``'s signature); an array of T gives an array."""
        sizes, ratios = np.asarray(self.sizes, float), np.asarray(self.ratios, float)
        slope = (ratios[-1] - ratios[-2]) / (sizes[-1] - sizes[-2])
        t = np.asarray(tokens, float)
        r = np.where(t <= sizes[-1], np.interp(t, sizes, ratios), ratios[-1] + slope * (t - sizes[-1]))
        return r if r.ndim else float(r)

    @classmethod
    def from_json(cls, text: str) -> "CostCurve":
        """ValueError unless ``text`` is a curve written by ``to_json`` with sane values."""
        try:
            data = json.loads(text)
            if data.pop("format") != CURVE_FORMAT:
                raise ValueError("another format")
            curve = cls(tuple(int(s) for s in data["sizes"]), tuple(float(r) for r in data["ratios"]),
                        float(data["ms_at_1"]), float(data.get("probe_s", 0.0)))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"not a cost curve ({e})") from None
        if len(curve.sizes) < 2 or len(curve.sizes) != len(curve.ratios) or curve.sizes[0] != 1 \
                or list(curve.sizes) != sorted(set(curve.sizes)) or not all(r > 0 for r in curve.ratios) or not curve.ms_at_1 > 0:
            raise ValueError("not a cost curve (bad values)")
        return curve

    def to_json(self) -> str:
        return json.dumps({"format": CURVE_FORMAT} | asdict(self))


class LiveCurve:
    """The probed curve, corrected online by the loop's own forward timings, per batch size.

    A probe can disagree with the loop (seen: a bf16 probe's c(1) 40% above what the loop measured), and a
    wrong c(1) skews every ratio. Each timed forward of T rows over B sequences updates a running
    log-correction of c in its cell (B, the probed size nearest T); a step whose cell was never observed
    borrows the nearest observed cell's (in log B and log T), so the curve keeps its probed shape where the
    loop has not been. Batch sizes are kept apart because the probe fed one sequence, and B sequences of T/B
    rows cost more than one of T (each reads its own cache; measured, SmolLM2 fp32 over ~400 keys: 8 x 1 rows
    50 ms, 1 x 8 rows 37 ms). A cell's first samples weigh more (1/2, 1/3, ... down to ``LIVE_WEIGHT``): a
    batch size that comes and goes in a server must learn its cost in a few steps, yet one slow first call
    must not keep a size off for good.
    """

    def __init__(self, curve: CostCurve) -> None:
        self.curve = curve
        self.log_scale: dict[tuple[int, int], float] = {}  # (batch, probed size index) -> log(measured / probed c)
        self.samples: dict[tuple[int, int], int] = {}

    def observe(self, tokens: int, seconds: float, batch: int = 1) -> None:
        """One forward of ``tokens`` rows over ``batch`` sequences took ``seconds``."""
        cell = (batch, int(np.abs(np.asarray(self.curve.sizes) - tokens).argmin()))
        probed = self.curve.ms_at_1 * self.curve.ratio(tokens) / 1000
        error = float(np.log(max(seconds, 1e-9) / probed))
        n = self.samples[cell] = self.samples.get(cell, 0) + 1
        old = self.log_scale.get(cell, 0.0)  # starts from the probe
        self.log_scale[cell] = old + max(LIVE_WEIGHT, 1 / (n + 1)) * (error - old)

    def ratio(self, tokens: int | np.ndarray, batch: int = 1) -> float | np.ndarray:
        """c(T rows over ``batch`` sequences) / c(1 row, one sequence), both corrected, never below 1."""
        r = np.maximum(1.0, self.curve.ratio(tokens) * np.exp(self._near(batch, tokens) - self._near(1, 1)))
        return r if np.ndim(r) else float(r)

    def _near(self, batch: int, tokens: int | np.ndarray) -> float | np.ndarray:
        """The correction of the observed cell nearest (``batch``, ``tokens``) (0: none observed)."""
        if not self.log_scale:
            return 0.0
        cells = np.array(list(self.log_scale))  # (n, 2): batch, probed size index
        rows = np.asarray(self.curve.sizes, float)[cells[:, 1]]
        distance = np.abs(np.log(rows / np.asarray(tokens, float)[..., None])) + np.abs(np.log(cells[:, 0] / batch))
        return np.array(list(self.log_scale.values()))[distance.argmin(-1)]


def probe(model: PreTrainedModel, sizes: tuple[int, ...] = PROBE_SIZES, context: int = PROBE_CONTEXT, rounds: int = 4,
          progress: Callable[[str], None] = lambda _: None) -> CostCurve:
    """Time one forward adding T tokens to a ``context``-token cache for each T.

    Timing noise on a shared CPU only ever adds time, and drifts: so the sizes are measured in ``rounds``
    interleaved passes, each size keeps its fastest time, and the curve is the lower envelope that never
    decreases (a step of more tokens cannot really cost less; a single slow sample of r(2) above r(4) would
    otherwise keep every two-token step off for good).
    """
    start = time.perf_counter()
    limit = support.context_length(model.config.get_text_config(decoder=True)) or 1 << 20
    sizes = tuple(s for s in sizes if s <= limit // 2) or sizes[:2]  # a tiny context: the sizes it can hold
    context = max(1, min(context, limit - max(sizes)))
    vocab = models.vocab_size(model)
    progress(f"measuring forward cost for {len(sizes)} step sizes (once for this machine, model and dtype)")
    device = model.device
    times = dict.fromkeys(sizes, float("inf"))
    with torch.inference_mode():
        cache = kv.BatchCache().cache  # every layer full, as the loop's
        model(input_ids=torch.randint(0, vocab, (1, context), device=device), past_key_values=cache, logits_to_keep=1)
        for size in (sizes[0],) * 2 + sizes * rounds:  # two warm-up forwards, then the interleaved rounds
            ids = torch.randint(0, vocab, (1, size), device=device)
            t0 = time.perf_counter()
            model(input_ids=ids, past_key_values=cache, logits_to_keep=size)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times[size] = min(times[size], time.perf_counter() - t0)
            cache.crop(-size)  # back to the context (a negative count in transformers 5.x)
    envelope = np.minimum.accumulate([times[s] for s in sizes][::-1])[::-1]  # non-decreasing in T
    base = envelope[0]
    return CostCurve(tuple(sizes), tuple(float(t / base) for t in envelope), base * 1000, time.perf_counter() - start)


def curve_file(model: PreTrainedModel, cache_dir: Path) -> Path:
    """Where this (model, dtype, device, kernels, threads, CPU, torch)'s curve is cached."""
    name = model.config._name_or_path or hashlib.sha256(model.config.to_json_string().encode()).hexdigest()[:16]
    return curve_path(str(name), model.dtype, model.device.type, cache_dir, kernels_of(model))


def curve_path(name: str, dtype: torch.dtype, device: str, cache_dir: Path, kernels: str = "stock") -> Path:
    """``curve_file`` before loading: ``name`` is the directory the model is loaded from."""
    key = json.dumps([name, str(dtype), torch.device(device).type, torch.get_num_threads(), _cpu(), torch.__version__, kernels])
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
    return "packed" if packs else "stock"


def cached_curve(model: PreTrainedModel, cache_dir: Path, progress: Callable[[str], None] = lambda _: None) -> CostCurve:
    """The cached curve, or a new probe (also when the file is missing, unreadable or corrupt), saved."""
    path = curve_file(model, cache_dir)
    try:
        return CostCurve.from_json(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        curve = probe(model, progress=progress)
        progress(f"forward cost measured in {curve.probe_s:.1f} s: r(16) = {curve.ratio(16):.2f}, r(32) = {curve.ratio(32):.2f}")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(curve.to_json())
        except OSError:
            pass  # a read-only cache: probe again next time
        return curve


def _cpu() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


@dataclass(frozen=True)
class Choice:
    nodes: int  # tree nodes verified (the best ``nodes`` by score)
    window: bool  # whether the Jacobi branch runs
    value: float  # expected tokens per unit of plain-step cost (plain decoding: 1.0)


def choose(curve: CostCurve | LiveCurve, tree: TokenTree, window_rows: int, window_value: float) -> Choice:
    """The step that maximises expected emitted tokens per cost for one sequence (see the module docstring)."""
    return plan(curve, [tree], [window_rows], [window_value])[0]


def plan(curve: CostCurve | LiveCurve, trees: list[TokenTree], window_rows: list[int], window_values: list[float],
         factors: list[float] | None = None) -> list[Choice]:
    """The step of a batch: one width T for every sequence (the step is padded to its widest), each filling
    it with its best nodes (and its Jacobi branch where that gains more), maximising

        value(T) = sum over sequences of (1 + gain_b(T)) / r(B x T)

    so drafting shrinks as the batch grows, and stops where the batch alone fills the machine. B = 1 is the
    single-sequence rule of the module docstring. ``factors``: each sequence's ``Calibration.factor`` (its
    node scores times it, at most 1 a node)."""
    factors = factors or [1.0] * len(trees)
    gains = [np.concatenate([[0.0], np.cumsum(np.minimum(np.sort(tree.scores)[::-1] * f, 1.0))]) for tree, f in zip(trees, factors)]  # S_b(k)
    widest = max(1 + g.size - 1 + w for g, w in zip(gains, window_rows))
    costs = curve.ratio(len(trees) * np.arange(1, widest + 1), len(trees))  # (widest,): r(B x T) for T = 1..widest
    best, best_value = [Choice(0, False, 1.0)] * len(trees), len(trees) / float(costs[0])
    for width in range(1, widest + 1):
        choices = []
        for g, rows, worth in zip(gains, window_rows, window_values):
            nodes = min(width - 1, g.size - 1)
            choice = (g[nodes], Choice(nodes, False, 0.0))
            if rows and width - 1 >= rows:
                with_window = min(width - 1 - rows, g.size - 1)
                if g[with_window] + worth > choice[0] + 1e-12:
                    choice = (g[with_window] + worth, Choice(with_window, True, 0.0))
            choices.append(choice)
        value = sum(1.0 + gain for gain, _ in choices) / float(costs[width - 1])
        if value > best_value + 1e-9:
            best_value, best = value, [c for _, c in choices]
    per_sequence = best_value / len(trees)
    return [Choice(c.nodes, c.window, per_sequence) for c in best]


class Calibration:
    """Draft tokens a sequence got accepted per token its trees' scores promised, over its recent drafting steps.

    The scores come from acceptance statistics shared by every sequence of a batch (and across requests), per
    source and depth: a sequence whose drafts fare worse than the mix (a chat answer beside a summary) would be
    planned with the mix's hopes. Measured, 8 sequences x 256 tokens: the scores promised 1.94 accepted tokens
    per drafting step and 1.41 came (one sequence alone: 0.99 promised, 1.19 came)."""

    def __init__(self) -> None:
        self.promised = self.got = CALIBRATION_PRIOR

    @property
    def factor(self) -> float:
        return self.got / self.promised

    def update(self, promised: float, got: int) -> None:
        """One step verified a tree whose scores summed to ``promised``; ``got`` of its nodes were accepted."""
        self.promised = CALIBRATION_DECAY * self.promised + promised
        self.got = CALIBRATION_DECAY * self.got + got


class JacobiWorth:
    """Running estimate of the draft tokens per step that only the Jacobi trajectories proposed; a branch
    left off is retried now and then, since its worth is only measured while it runs."""

    def __init__(self) -> None:
        self.value, self.idle = JACOBI_PRIOR, 0

    def runs(self, chosen: bool) -> bool:
        """Whether the branch runs this step: when chosen, or after ``JACOBI_RETRY`` steps without."""
        self.idle = 0 if chosen or self.idle >= JACOBI_RETRY else self.idle + 1
        return self.idle == 0

    def update(self, tokens: int) -> None:
        self.value += JACOBI_DECAY * (tokens - self.value)


def chain_tree(p: float, length: int) -> TokenTree:
    """A chain of ``length`` drafts, each accepted with probability ``p`` given its parent (what ``tune`` prints for)."""
    scores = p ** np.arange(1, length + 1)
    return TokenTree.merge(np.zeros(length, np.int64), np.arange(length) - 1, scores, np.ones(length, np.int64), length)


def plot_curves(curves: dict[str, CostCurve], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, curve in curves.items():
        ax.plot(curve.sizes, curve.ratios, marker="o", label=f"{name} (c(1) = {curve.ms_at_1:.1f} ms)")
    ax.set_xlabel("tokens T fed in one forward")
    ax.set_ylabel("r(T) = c(T) / c(1)")
    ax.set_title(_cpu(), fontsize=8)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
