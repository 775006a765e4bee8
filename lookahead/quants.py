"""Weight-only quantized linears: a GGUF file's blocks as integers with a scale (and an offset) per group.

Every GGUF type kept here dequantizes as ``W = s q (+ o)`` per output row and group of ``group`` k's, in fp32, a
product and then a sum (gguf-py's numpy does exactly this; its dequantized weights are the model transformers
loads from the file): Q8_0, Q5_0, Q4_0 (``d q``, q signed), IQ4_NL (``d q``, q from a table of 16 int8 values),
IQ4_XS (``(d sc) q``, q from that table), Q6_K and Q3_K (``(d sc) q``, groups of 16), Q4_1 and Q5_1 (``d q + m``),
Q4_K and Q5_K (``(d sc) q - dmin m``), Q2_K (the same, groups of 16). ``Quantized`` holds q as int8 (nibbles once packed, for the 4-bit types), s and
o in fp32, so nothing is re-quantized: the kernels' weights are the dequantized model's, bit for bit. The types
with five or six bits are widened to 8 in the kernels' layout (a Q5_0 weight streams 9 bits instead of 5.5).

``gguf_model`` builds a model on these from a GGUF file (``head_order``: Llama's q and k rows, which llama.cpp
stores interleaved per head, in transformers' order); ``QuantEmbedding`` looks an embedding's rows up from them.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import numpy as np
import torch
from torch import nn

from lookahead import host_kernels

QK = 32  # k's a block of the legacy types (Q4_0 ... Q8_0)
QK_K = 256  # k's a super-block of the K types


def kind(bits: int, group: int, offsets: bool, supers: bool = False, halves: bool = False) -> str:
    """A quantized weight's kind in a few characters: "q8/32" (int8, groups of 32), "q4/32+offsets" ...; "... in
    256s" where the scales are laid out as the K types hold them (``Supers``), "... in fp16" where they are fp16."""
    return f"q{bits}/{group}{'+offsets' if offsets else ''}{' in 256s' if supers else ' in fp16' if halves else ''}"


# each GGUF type's kind once kept here (``from_blocks``)
KINDS = {"Q8_0": kind(8, 32, False), "Q5_0": kind(8, 32, False), "Q4_0": kind(8, 32, False), "Q6_K": kind(8, 16, False),
         "Q3_K": kind(8, 16, False), "Q5_K": kind(8, 32, True), "Q4_1": kind(4, 32, True), "Q4_K": kind(4, 32, True),
         "Q5_1": kind(8, 32, True), "IQ4_NL": kind(8, 32, False), "IQ4_XS": kind(8, 32, False), "Q2_K": kind(8, 16, True)}
IQ4 = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)  # IQ4_NL's and IQ4_XS's values


@dataclass
class Supers:
    """A K type's scales as its file holds them: ``d`` (and ``dmin``) per 256 k's (fp16 in the file), a small
    integer ``sc`` (and ``m``) per group, so that ``scale = d sc`` and ``offset = -(dmin m)``, each one fp32 product.
    The integer kernel's layout keeps these (fp16 d, a byte a group) instead of an fp32 scale and offset a group:
    Q4_K then streams 4.625 bits a weight, not 6."""

    d: torch.Tensor  # (N, K / 256) fp32 (exact in fp16)
    sc: torch.Tensor  # (N, K / group) int8
    dmin: torch.Tensor | None = None  # (N, K / 256) fp32 (exact in fp16), where the type has offsets
    m: torch.Tensor | None = None  # (N, K / group) int8

    def rows(self, index: torch.Tensor | slice) -> "Supers":
        return Supers(self.d[index], self.sc[index], *(None if t is None else t[index] for t in (self.dmin, self.m)))

    @staticmethod
    def cat(parts: list["Supers"]) -> "Supers":
        return Supers(*(None if getattr(parts[0], f) is None else torch.cat([getattr(p, f) for p in parts]) for f in ("d", "sc", "dmin", "m")))


@dataclass
class Quantized:
    """One linear's weight (N, K) as ``scale * q (+ offset)`` per row and group of ``group`` k's."""

    q: torch.Tensor  # (N, K) int8
    scale: torch.Tensor  # (N, K / group) fp32
    offset: torch.Tensor | None  # (N, K / group) fp32, or None
    group: int
    bits: int  # 8, or 4 (q in 0 .. 15: packed as nibbles)
    supers: Supers | None = None  # the K types': where scale and offset came from

    def __post_init__(self) -> None:
        n, k = self.q.shape
        if self.q.dtype != torch.int8 or k % self.group or self.scale.shape != (n, k // self.group) or self.bits not in (4, 8):
            raise ValueError(f"not a quantized weight: q {self.q.dtype} {tuple(self.q.shape)}, scale {tuple(self.scale.shape)}, "
                             f"group {self.group}, bits {self.bits}")

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    @property
    def kind(self) -> str:
        """What must agree for weights to share one product (``kind``)."""
        return kind(self.bits, self.group, self.offset is not None)

    def dequantize(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """(N, K) fp32, as gguf-py computes it: the product rounded, then the offset added; written into ``out`` where
        given (no temporaries: a dense load of the 1.5B made and dropped ~30 GB of them)."""
        out = torch.empty(self.q.shape) if out is None else out
        w = out.view(self.q.shape[0], -1, self.group)
        w.copy_(self.q.reshape(w.shape)).mul_(self.scale.unsqueeze(-1))  # (int8 times fp32 in one call: 2x slower)
        if self.offset is not None:
            w.add_(self.offset.unsqueeze(-1))
        return out

    def rows(self, index: torch.Tensor | slice) -> "Quantized":
        return Quantized(self.q[index], self.scale[index], None if self.offset is None else self.offset[index], self.group, self.bits,
                         None if self.supers is None else self.supers.rows(index))

    @staticmethod
    def cat(parts: list["Quantized"]) -> "Quantized":
        """The weights stacked by rows (one ``kind``; ``supers`` kept where every part has them)."""
        if len({p.kind for p in parts}) != 1:
            raise ValueError("quantized weights of different kinds cannot be stacked")
        offsets = None if parts[0].offset is None else torch.cat([p.offset for p in parts])
        supers = Supers.cat([p.supers for p in parts]) if all(p.supers is not None for p in parts) else None
        return Quantized(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]), offsets, parts[0].group, parts[0].bits, supers)

    def nbytes(self) -> int:
        """Bytes in the kernels' layout."""
        n, k = self.shape
        return n * k * self.bits // 8 + self.scale.numel() * 4 * (1 if self.offset is None else 2)


# -- GGUF blocks -> Quantized --------------------------------------------------------------------


def _f16(raw: np.ndarray) -> np.ndarray:
    return raw.copy().view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """Bytes (..., B) -> (..., 2B) values: the low nibbles first, then the high ones (llama.cpp's order)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _legacy(raw: np.ndarray, n: int, k: int, kind: str) -> Quantized:
    """Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL: blocks of 32 k's, an fp16 d (and m) first."""
    sizes = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34, "IQ4_NL": 18}
    b = raw.reshape(n, k // QK, sizes[kind])
    d = _f16(b[..., 0:2]).reshape(n, -1)
    offset = None
    if kind == "Q8_0":
        q, bits = b[..., 2:].view(np.int8), 8
    elif kind == "Q4_0":
        q, bits = _nibbles(b[..., 2:]).astype(np.int8) - 8, 8
    elif kind == "Q4_1":
        offset, q, bits = _f16(b[..., 2:4]).reshape(n, -1), _nibbles(b[..., 4:]).astype(np.int8), 4
    elif kind == "IQ4_NL":
        q, bits = IQ4[_nibbles(b[..., 2:])], 8
    else:  # Q5_0, Q5_1: the fifth bits in a little-endian 32-bit word (after Q5_1's m)
        at = 2 if kind == "Q5_0" else 4
        offset = None if kind == "Q5_0" else _f16(b[..., 2:4]).reshape(n, -1)
        high = (b[..., at:at + 4].copy().view(np.uint32) >> np.arange(32, dtype=np.uint32)) & 1
        q, bits = (_nibbles(b[..., at + 4:]) | (high.astype(np.uint8) << 4)).astype(np.int8) - (16 if offset is None else 0), 8
    return Quantized(torch.from_numpy(np.ascontiguousarray(q).reshape(n, k)), torch.from_numpy(d),
                     None if offset is None else torch.from_numpy(offset), QK, bits)


def _k_scales(s: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's and Q5_K's 12 bytes of 6-bit scales and mins a super-block -> (n, blocks, 8) each, as fp32."""
    s = s.reshape(n, -1, 3, 4)
    ds, ms, mix = s[..., 0, :], s[..., 1, :], s[..., 2, :]
    sc = np.concatenate([ds & 0x3F, (mix & 0x0F) | ((ds >> 2) & 0x30)], axis=-1).astype(np.float32)
    mn = np.concatenate([ms & 0x3F, (mix >> 4) | ((ms >> 2) & 0x30)], axis=-1).astype(np.float32)
    return sc, mn


def _q4_k(raw: np.ndarray, n: int, k: int) -> Quantized:
    """Q4_K: super-blocks of 256 k's, eight groups of 32 with 6-bit scales and mins."""
    b = raw.reshape(n, k // QK_K, 144)
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    sc, mn = _k_scales(b[..., 4:16], n)
    qs = b[..., 16:].reshape(n, -1, 4, 32)  # four chunks of 32 bytes: groups 2c (low nibbles), 2c + 1 (high)
    q = np.stack([qs & 0x0F, qs >> 4], axis=3).reshape(n, k).astype(np.int8)
    return _with_supers(q, d, sc, dmin, mn, QK, 4)


def _q5_k(raw: np.ndarray, n: int, k: int) -> Quantized:
    """Q5_K: Q4_K's groups and scales, each q's fifth bit in 32 bytes of bit planes (group j: bit j)."""
    b = raw.reshape(n, k // QK_K, 176)
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    sc, mn = _k_scales(b[..., 4:16], n)
    qs = b[..., 48:].reshape(n, -1, 4, 32)
    low = np.stack([qs & 0x0F, qs >> 4], axis=3).reshape(n, -1, 8, 32)
    high = (b[..., 16:48].reshape(n, -1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)) & 1
    q = (low | (high << 4)).astype(np.int8).reshape(n, k)
    return _with_supers(q, d, sc, dmin, mn, QK, 8)


def _q3_k(raw: np.ndarray, n: int, k: int) -> Quantized:
    """Q3_K: super-blocks of 256 k's, sixteen groups of 16 with 6-bit signed scales, q = 2 low bits - 4 (high bit 0)."""
    b = raw.reshape(n, k // QK_K, 110)
    hmask, qs, s, d = b[..., :32], b[..., 32:96], b[..., 96:108], _f16(b[..., 108:110])
    low = (s[..., :8].reshape(n, -1, 1, 8) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)).reshape(n, -1, 16) & 0x0F
    high = (s[..., 8:].reshape(n, -1, 1, 4) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)).reshape(n, -1, 16) & 3
    sc = ((low | (high << 4)).astype(np.int8) - 32).astype(np.float32)
    ql = (qs.reshape(n, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 1, 4, 1)) & 3
    qh = ((hmask.reshape(n, -1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)) & 1) ^ 1
    q = (ql.reshape(n, -1, 256).astype(np.int8) - (qh.reshape(n, -1, 256) << 2).astype(np.int8)).reshape(n, k)
    return _with_supers(q, d, sc, None, None, 16, 8)


def _q6_k(raw: np.ndarray, n: int, k: int) -> Quantized:
    """Q6_K: super-blocks of 256 k's, sixteen groups of 16 with int8 scales, q in 6 bits."""
    b = raw.reshape(n, k // QK_K, 210)
    ql, qh, sc, d = b[..., :128], b[..., 128:192], b[..., 192:208].view(np.int8).astype(np.float32), _f16(b[..., 208:210])
    low = np.stack([ql.reshape(n, -1, 2, 64) & 0x0F, ql.reshape(n, -1, 2, 64) >> 4], axis=3).reshape(n, -1, 2, 4, 32)
    high = (qh.reshape(n, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 1, 4, 1)) & 3
    q = ((low | (high << 4)).astype(np.int8) - 32).reshape(n, k)
    return _with_supers(q, d, sc, None, None, 16, 8)


def _iq4_xs(raw: np.ndarray, n: int, k: int) -> Quantized:
    """IQ4_XS: super-blocks of 256 k's, eight groups of 32 with 6-bit scales (sc - 32), q from ``IQ4``. Its scales are
    kept as fp32 ``d sc`` (``Supers`` are the 6-bit q's of the integer kernel's layout; these q's take 8)."""
    b = raw.reshape(n, k // QK_K, 136)
    d, high, low = _f16(b[..., 0:2]), b[..., 2:4].copy().view(np.uint16), b[..., 4:8]
    low = np.stack([low & 0x0F, low >> 4], axis=-1).reshape(n, -1, 8)
    high = (high >> np.arange(0, 16, 2, dtype=np.uint16)) & 3
    sc = ((low | (high.astype(np.uint8) << 4)).astype(np.int8) - 32).astype(np.float32)
    q = IQ4[_nibbles(b[..., 8:].reshape(n, -1, 8, 16))].reshape(n, k)
    return Quantized(torch.from_numpy(q), torch.from_numpy((d * sc).reshape(n, -1)), None, QK, 8)


def _q2_k(raw: np.ndarray, n: int, k: int) -> Quantized:
    """Q2_K: super-blocks of 256 k's, sixteen groups of 16 with 4-bit scales and mins, q in 2 bits. Kept as fp32
    scales and offsets (``d sc``, ``-(dmin m)``), not as ``Supers``: no type the integer kernel lays out in its own
    scales has groups of 16 with offsets."""
    b = raw.reshape(n, k // QK_K, 84)
    s, qs, d, dmin = b[..., :16], b[..., 16:80], _f16(b[..., 80:82]), _f16(b[..., 82:84])
    q = ((qs.reshape(n, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 1, 4, 1)) & 3).astype(np.int8)
    scale, offset = d * (s & 0x0F).astype(np.float32), -(dmin * (s >> 4).astype(np.float32))
    return Quantized(torch.from_numpy(q.reshape(n, k)), torch.from_numpy(scale.reshape(n, -1)), torch.from_numpy(offset.reshape(n, -1)), 16, 8)


def _with_supers(q: np.ndarray, d: np.ndarray, sc: np.ndarray, dmin: np.ndarray | None, mn: np.ndarray | None, group: int,
                 bits: int) -> Quantized:
    """A K type's ``Quantized``: ``d`` (and ``dmin``) (n, super-blocks, 1), ``sc`` (and ``mn``) (n, super-blocks,
    groups) small integers as fp32; scale ``d sc``, offset ``-(dmin mn)``, and those factors kept (``Supers``)."""
    n = q.shape[0]
    flat = lambda a: torch.from_numpy(np.ascontiguousarray(a).reshape(n, -1))  # noqa: E731
    small = lambda a: flat(a.astype(np.int8))  # noqa: E731
    supers = Supers(flat(d), small(sc), None if dmin is None else flat(dmin), None if mn is None else small(mn))
    return Quantized(torch.from_numpy(q), flat(d * sc), None if dmin is None else flat(-(dmin * mn)), group, bits, supers)


DECODERS = {**{kind: partial(_legacy, kind=kind) for kind in ("Q8_0", "Q5_0", "Q4_0", "Q4_1", "Q5_1", "IQ4_NL")}, "Q4_K": _q4_k,
            "Q5_K": _q5_k, "Q6_K": _q6_k, "Q3_K": _q3_k, "IQ4_XS": _iq4_xs, "Q2_K": _q2_k}  # KINDS' keys


def from_blocks(raw: np.ndarray, kind: str, n: int, k: int) -> Quantized:
    """A GGUF tensor's blocks (any shape of ``n`` rows' bytes) of type ``kind`` ("Q8_0" ...) -> ``Quantized``."""
    if kind not in DECODERS:
        raise ValueError(f"GGUF type {kind} is not one the quantized kernels run (they run {', '.join(DECODERS)})")
    raw = np.ascontiguousarray(raw).view(np.uint8).reshape(n, -1)
    return DECODERS[kind](raw, n, k)


def quantize_q8_0(weight: torch.Tensor) -> Quantized:
    """A dense (N, K) weight as Q8_0 (llama.cpp's rounding, through gguf-py), for ``--weights q8``."""
    import gguf

    n, k = weight.shape
    blocks = gguf.quants.quantize(weight.detach().float().numpy(), gguf.GGMLQuantizationType.Q8_0)
    return from_blocks(blocks, "Q8_0", n, k)


def q8_linears(model: nn.Module) -> dict[str, Quantized]:
    """{module name: weight as Q8_0} for each of ``model``'s ``nn.Linear`` whose width Q8_0 takes (a multiple of its
    blocks of 32): ``--weights q8``."""
    return {name: quantize_q8_0(m.weight) for name, m in model.named_modules() if type(m) is nn.Linear and m.in_features % QK == 0}


def is_gguf_linear(module: nn.Module) -> bool:
    """Whether ``module`` is transformers' ``GgufLinear`` (a GGUF's blocks as ``weight``: (out_features, bytes a row))."""
    return type(module).__name__ == "GgufLinear" and type(module).__module__.startswith("transformers.")


def from_gguf_linear(module: nn.Module) -> Quantized | None:
    """A ``GgufLinear``'s weight as ``Quantized`` (its blocks are the file's, as ``from_blocks`` reads them); None where
    its type is not one here or it gathers its input first (``input_permutation``: a permutation across blocks)."""
    import gguf

    kind = gguf.GGMLQuantizationType(module.ggml_type).name
    if kind not in DECODERS or getattr(module, "input_permutation", None) is not None:
        return None
    return from_blocks(module.weight.detach().numpy(), kind, module.out_features, module.in_features)


def head_order(rows: int, heads: int) -> torch.Tensor:
    """transformers' reverse of llama.cpp's per-head interleave of Llama's q and k rows, as a row index."""
    return torch.arange(rows).view(heads, rows // heads // 2, 2).transpose(1, 2).reshape(-1)


class QuantEmbedding(nn.Module):
    """An embedding table kept as a GGUF tensor's blocks (``raw``: its bytes, memory-mapped from the file): the rows
    looked up are decoded and dequantized as gguf-py does (``from_blocks``), then cast to ``dtype``, and scaled as the
    module it replaces scales them (``embed_scale``: Gemma's). Nothing of the table is resident but the rows read:
    a 150k-token table is ~1 GB dense in fp32, and decoding all of it at each load took ~3 s.

    The legacy types (``native.GGUF_ROWS``) decode every row looked up in one call of ours where our kernels are loaded
    (``host_kernels.GGUFRows``: SmolLM2's Q8_0 rows a step ~0.14 -> ~0.05 ms, Xeon m167). Others, or without our
    kernels, decode through ``from_blocks``, ~0.14 ms a row of SmolLM2's ~5.5 ms one-row forward (Zen 4): there a
    step's few rows are kept once decoded (the last ``KEPT`` tokens a step met, ~10-25 MB), since a step's tokens are
    mostly ones met before. Each row is the same elementwise arithmetic however it is looked up: the same bits."""

    KEPT = 4096  # decoded rows kept (the oldest go first)
    STEP = 64  # lookups of at most this many tokens go through the kept rows (a step's); more (a prompt's) decode at once

    def __init__(self, raw: np.ndarray, kind: str, num_embeddings: int, embedding_dim: int, dtype: torch.dtype,
                 embed_scale: torch.Tensor | None = None) -> None:
        super().__init__()
        if kind not in DECODERS:
            raise ValueError(f"GGUF type {kind} is not one the quantized kernels run (they run {', '.join(DECODERS)})")
        self.rows = raw.reshape(num_embeddings, -1)  # (V, bytes a row)
        self.kind, self.num_embeddings, self.embedding_dim, self.dtype = kind, num_embeddings, embedding_dim, dtype
        self.embed_scale = embed_scale
        self.kept: dict[int, torch.Tensor] = {}  # token id -> its row (D,), scaled, in ``dtype``
        self.ours = host_kernels.GGUFRows(self.rows, kind, embedding_dim)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # (...) -> (..., D)
        rows = self.ours(input_ids.cpu(), self.dtype)  # (N, D), or None where ours do not run
        if rows is not None:
            rows = rows if self.embed_scale is None else rows * self.embed_scale.to(self.dtype)
            return rows.view(*input_ids.shape, self.embedding_dim).to(input_ids.device)
        ids = input_ids.reshape(-1).cpu().numpy()
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_embeddings):
            raise IndexError(f"token ids must be in [0, {self.num_embeddings}), got {int(ids.min())} .. {int(ids.max())}")
        if ids.size > self.STEP:
            rows = self._decoded(ids)
        else:
            listed = ids.tolist()
            found = {i: self.kept.get(i) for i in listed}
            new = [i for i, row in found.items() if row is None]
            for i, row in zip(new, self._decoded(np.array(new)) if new else ()):
                if len(self.kept) >= self.KEPT:
                    del self.kept[next(iter(self.kept))]
                found[i] = self.kept[i] = row.clone()  # its own storage: a view would keep its whole decoded batch alive
            rows = torch.stack([found[i] for i in listed])
        return rows.view(*input_ids.shape, self.embedding_dim).to(input_ids.device)

    def _decoded(self, ids: np.ndarray) -> torch.Tensor:
        """Rows (len(ids), D) of ``ids`` through ``from_blocks``: decoded, dequantized, cast and scaled."""
        rows = from_blocks(self.rows[ids], self.kind, ids.size, self.embedding_dim).dequantize().to(self.dtype)
        return rows if self.embed_scale is None else rows * self.embed_scale.to(self.dtype)

    @property
    def weight(self) -> torch.Tensor:
        """The whole table, dense (V, D), for code that reads it (made anew at each read)."""
        return from_blocks(np.asarray(self.rows), self.kind, self.num_embeddings, self.embedding_dim).dequantize().to(self.dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.kind} blocks from the file"
