"""Two pieces of a step's host work on our kernels, where they are loaded (``native.loaded``): the recycled
top-k over the vocabulary and the greedy argmax (``csrc/top_k.c``, in place of ``torch.topk`` and numpy), and the
KV compaction's moves in one call (``csrc/move_columns.c``, in place of three torch ops a K/V tensor). A process
whose models run stock kernels runs no C of ours: these fall back on torch and numpy."""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from lookahead.native import loaded

def top_k(scores: torch.Tensor, k: int) -> np.ndarray:
    """Indices (..., k) of the ``k`` largest of each row of host fp32 or bf16 ``scores`` (..., V), largest first, a tie the
    lower index first and a NaN above all: so a row's first is its ``argmax`` (greedy verification reads it). Ours where
    the kernels are loaded and k is at most 64, else ``torch.topk``'s, its rows where ties or NaNs reach the top k ranked
    again (it orders those as it likes)."""
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    if not k:
        return np.empty((*scores.shape[:-1], 0), np.int64)
    lib = loaded()
    ours = hasattr(lib, "top_k") and 0 < k <= min(64, scores.shape[-1]) and scores.dtype in (torch.float32, torch.bfloat16) \
        and scores.is_cpu
    if ours:
        x = scores.contiguous()
        out = np.empty((*x.shape[:-1], k), np.int64)
        if not lib.top_k(x.data_ptr(), x.dtype == torch.bfloat16, x.numel() // x.shape[-1], x.shape[-1], k, out.ctypes.data,
                         torch.get_num_threads()):
            return out
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
    lib = loaded()
    if lib is None or not tensors or any(not t.is_cpu or t.dim() != 4 or t.stride(3) != 1
                                                  or t.shape != tensors[0].shape or t.dtype != tensors[0].dtype for t in tensors):
        return False
    b, h, _, d = tensors[0].shape
    pointers = (ctypes.c_void_p * len(tensors))(*(t.data_ptr() for t in tensors))
    strides = (ctypes.c_long * (3 * len(tensors)))(*(s for t in tensors for s in t.stride()[:3]))
    index = np.ascontiguousarray(index, np.int64)
    lib.move_columns(pointers, strides, len(tensors), tensors[0].element_size(), b, h, d, start, index.ctypes.data, index.shape[1])
    return True
