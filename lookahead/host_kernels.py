"""Pieces of a step's host work on our kernels, where they are loaded (``native.loaded``): the recycled top-k over
the vocabulary and the greedy argmax (``csrc/top_k.c``, in place of ``torch.topk`` and numpy), the KV compaction's
moves in one call (``csrc/move_columns.c``, in place of three torch ops a K/V tensor), and a GGUF embedding's new
rows decoded (``csrc/gguf_rows.c``, in place of ``quants.from_blocks``' numpy). A process whose models run stock
kernels runs no C of ours: these fall back on torch and numpy."""

from __future__ import annotations

import ctypes
import weakref

import numpy as np
import torch

from lookahead.native import GGUF_ROWS, loaded

def top_k(scores: torch.Tensor, k: int) -> np.ndarray:
    """Indices (..., k) of the ``k`` largest of each row of host fp32 or bf16 ``scores`` (..., V), largest first, a tie the
    lower index first and a NaN above all: so a row's first is its ``argmax`` (greedy verification reads it). Ours where
    the kernels are loaded and k is at most 64, else ``torch.topk``'s, its rows where ties or NaNs reach the top k ranked
    again (it orders those as it likes)."""
    return TopK()(scores, k)


class TopK:
    """``top_k`` into a buffer of its own, kept from call to call: what it returns is overwritten by its next call (a
    decode step's top-k is read before the next step's). A new array and its address were ~9 us of the step's call,
    cold after the forward."""

    def __init__(self) -> None:
        self._out, self._address = np.empty(0, np.int64), 0

    def __call__(self, scores: torch.Tensor, k: int) -> np.ndarray:
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        if not k:
            return np.empty((*scores.shape[:-1], 0), np.int64)
        lib = loaded()
        ours = hasattr(lib, "top_k") and k <= min(64, scores.shape[-1]) and scores.dtype in (torch.float32, torch.bfloat16) \
            and scores.is_cpu
        if ours:
            x = scores.contiguous()
            rows = x.numel() // x.shape[-1]
            if self._out.size < rows * k:
                self._out = np.empty(max(rows * k, 2 * self._out.size), np.int64)
                self._address = self._out.ctypes.data
            if not lib.top_k(x.data_ptr(), x.dtype == torch.bfloat16, rows, x.shape[-1], k, self._address, torch.get_num_threads()):
                return self._out[: rows * k].reshape(*x.shape[:-1], k)
        values, indices = torch.topk(scores, min(k + 1, scores.shape[-1]))  # where ours does not run, or could not allocate
        tied = values.isnan().any(-1) | (values[..., 1:] == values[..., :-1]).any(-1)  # one more: a tie at the k-th too
        if tied.any():
            indices[tied] = torch.sort(scores[tied], dim=-1, descending=True, stable=True).indices[..., : indices.shape[-1]]
        return indices[..., :k].contiguous().numpy()


def argmax(scores: torch.Tensor) -> int | np.ndarray:
    """The index of the largest of each row of host ``scores`` (..., V): the first of equal ones, the first NaN above
    all (torch's rule). fp32 and bf16 are read as they are by ours (``csrc/top_k.c``; a bf16 row needs no fp32 copy)
    where the kernels are loaded, else by numpy (~14x faster than torch's argmax on a row of 49152, Zen 5)."""
    lib = loaded()
    if hasattr(lib, "argmax") and scores.dtype in (torch.float32, torch.bfloat16) and scores.is_cpu and scores.shape[-1]:
        x = scores.contiguous()
        if x.dim() == 1:  # a greedy step's row: returned, no output array (each call runs cold after a forward)
            return lib.argmax(x.data_ptr(), x.dtype == torch.bfloat16, 1, x.shape[-1], None)
        index = np.empty(x.shape[:-1], np.int64)
        lib.argmax(x.data_ptr(), x.dtype == torch.bfloat16, x.numel() // x.shape[-1], x.shape[-1], index.ctypes.data)
    else:
        index = (scores if scores.dtype in (torch.float32, torch.float64) else scores.float()).numpy().argmax(-1)
    return int(index) if index.ndim == 0 else index


def move_columns(tensors: list[torch.Tensor], start: int, index: np.ndarray) -> bool:
    """In each host tensor (B, H, S, D) of ``tensors`` (a cache's keys and values), sequence b's columns ``start +
    index[b]`` (``index`` (B, C) int64, each row sorted) move to ``start + 0 .. C - 1``, in place, in one call;
    False (nothing moved) where the kernels are not loaded or a tensor is not of that shape with D contiguous."""
    return ColumnMover()(tensors, start, index)


class ColumnMover:
    """``move_columns`` for one cache, whose tensors stay the same objects from one step's compaction to the next
    (until a buffer grows): their pointers and strides are made once for them, not at every call (~0.14 ms of
    Python a call for a 30-layer cache, cold after the forward). Held weakly, so a replaced buffer is freed."""

    def __init__(self) -> None:
        self._held: list[weakref.ref] = []
        self._arguments: tuple | None = None  # (lib, pointers, strides, count, element size, B, H, D)

    def __call__(self, tensors: list[torch.Tensor], start: int, index: np.ndarray) -> bool:
        if len(tensors) != len(self._held) or any(held() is not t for held, t in zip(self._held, tensors)):
            self._held, self._arguments = [weakref.ref(t) for t in tensors], _move_arguments(tensors)
        if self._arguments is None:
            return False
        lib, *arguments = self._arguments
        index = np.ascontiguousarray(index, np.int64)
        lib.move_columns(*arguments, start, index.ctypes.data, index.shape[1])
        return True


def _move_arguments(tensors: list[torch.Tensor]) -> tuple | None:
    """``lib.move_columns``'s arguments for ``tensors`` but the moves, or None where ours cannot move them."""
    lib = loaded()
    if lib is None or not tensors or any(not t.is_cpu or t.dim() != 4 or t.stride(3) != 1
                                                  or t.shape != tensors[0].shape or t.dtype != tensors[0].dtype for t in tensors):
        return None
    b, h, _, d = tensors[0].shape
    pointers = (ctypes.c_void_p * len(tensors))(*(t.data_ptr() for t in tensors))
    strides = (ctypes.c_long * (3 * len(tensors)))(*(s for t in tensors for s in t.stride()[:3]))
    return lib, pointers, strides, len(tensors), tensors[0].element_size(), b, h, d


class GGUFRows:
    """A GGUF table's rows (``raw``: (V, bytes a row) of type ``kind``, k values a row) looked up in one call of ours
    (``csrc/gguf_rows.c``): what ``quants.from_blocks(raw[ids], ...).dequantize().to(dtype)`` gives, bit for bit. The
    table's address is taken once: each numpy and torch call around it cost 5-40 us, cold after a forward's weights."""

    def __init__(self, raw: np.ndarray, kind: str, k: int) -> None:
        self.raw, self.kind, self.k = np.ascontiguousarray(raw), GGUF_ROWS.index(kind) if kind in GGUF_ROWS else None, k
        self._address = self.raw.ctypes.data

    def __call__(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
        """(N, k) rows of the ``ids`` (any shape, N of them) in fp32 or bf16; None where our kernels are not loaded, do
        not decode this type or do not make ``dtype``. IndexError for an id outside the table."""
        lib = loaded()
        if lib is None or self.kind is None or dtype not in (torch.float32, torch.bfloat16):
            return None
        ids = ids.reshape(-1).to(torch.int64).contiguous()
        out = torch.empty(ids.numel(), self.k, dtype=dtype)
        if lib.gguf_rows(self._address, self.raw.shape[1], self.raw.shape[0], ids.data_ptr(), ids.numel(), self.k, self.kind, out.data_ptr(),
                         dtype == torch.bfloat16) >= 0:
            raise IndexError(f"token ids must be in [0, {self.raw.shape[0]}), got {int(ids.min())} .. {int(ids.max())}")
        return out
