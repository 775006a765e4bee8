"""``CostCurve``: what a forward of T rows costs on this machine, relative to one row, as ``probing`` measured it
and ``planner`` reads it. Plain data: it imports nothing of the engine."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import numpy as np

BATCH, BATCH_WIDTHS = 8, (1, 2, 4)  # the batch the probe also times: 8 sequences x 1, 2 and 4 rows
CURVE_FORMAT = 6  # 2: fastest of interleaved rounds, monotone envelope; 3: packed models attend with grouped_sdpa;
# 4: the loop's own forward (4D mask, logits to the host; without a mask c(1) read ~20% high on Zen 5); 5: the
# batch axis; 6: 3, 5 and 6 rows probed (the integer kernel's r(3) is its r(4): interpolated, it was priced ~6% low)
# (older curves are re-probed)


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

    def widths(self, widest: int, batch: int = 1) -> np.ndarray:
        """(widest,) ``ratio`` at B x T rows for T = 1 .. widest, B = ``batch``: a step's widths, as ``planner.plan`` prices them."""
        return np.asarray(self.ratio(batch * np.arange(1, widest + 1), batch), np.float64)

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
