"""The KV cache of a batch of sequences through the transformers 5.x ``Cache`` API: the only module that
knows cache internals.

B sequences share one ``DynamicCache`` (``GrowingCache``) whose layers hold (B, heads, S, head_dim): a sequence joins with its
own prefilled cache (the shorter side padded on the left), leaves by batch index, and each step appends T
columns for every sequence, of which each keeps its own accepted rows. A sequence that keeps fewer rows than
another leaves holes; ``positions`` (B, S) records each column's position, -1 for a hole or padding, and the
masks hide those columns. Row b = 1 keeps 2 rows of a step, row b = 0 keeps 3 (``.``: a hole):

    positions   0  1  2  3  4  5  6      after the prompts (b=1 left-padded) and one step
        b=0     0  1  2  3  4  5  6
        b=1     .  .  .  0  1  2  .

Every layer is a full (unwindowed) layer: a sliding window is drawn in the masks from these positions, so
holes never push a key the window still needs out of the cache. Holes are paid for twice: every step attends
over them, and each takes a key slot from the context (buffers such as GPT-Neo's causal mask end there);
``squeeze`` closes them, moving each sequence's keys to the right in order:

    positions   0  1  2  3  4  5  6  7         after squeeze
        b=0     0  1  2  .  3  4  .  5    ->     0  1  2  3  4  5
        b=1     .  .  .  0  1  .  .  2    ->     .  .  .  0  1  2
"""

from __future__ import annotations

import ctypes
import inspect
import threading
from dataclasses import dataclass
from functools import cache as memoize

import numpy as np
import torch
from numba import njit
from torch.nn import functional as F
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer

from lookahead import host_kernels, native


def cache_kwarg(model: torch.nn.Module, cache: Cache) -> dict[str, Cache]:
    """The forward keyword that takes ``cache``: ``cache`` since transformers 5.24, ``past_key_values`` before
    (and in remote code that kept it); the old name still works there, with a FutureWarning on every call."""
    return {_cache_name(type(model)): cache}


@memoize
def _cache_name(cls: type) -> str:
    return "cache" if "cache" in inspect.signature(cls.forward).parameters else "past_key_values"


GROWTH = 1.5  # a full layer's buffer grows to this many times what it must hold, plus ``SLACK`` columns
SLACK = 64


def _fitted_on_read(attribute: str) -> property:
    """A layer's ``keys`` or ``values``: the view in ``attribute``, first fitted to the columns held if a reserve or a
    crop is pending (``_pending``); a tensor put there from outside (a reset, a join) leaves nothing pending."""

    def read(layer: "GrowingLayer") -> torch.Tensor | None:
        if layer._pending:
            layer._fit()
        return getattr(layer, attribute)

    def write(layer: "GrowingLayer", tensor: torch.Tensor | None) -> None:
        setattr(layer, attribute, tensor)
        layer._pending = 0

    return property(read, write)


class GrowingLayer(DynamicLayer):
    """A ``DynamicLayer`` that appends in place into spare columns of a buffer.

    The stock layer concatenates (copies) the whole cache on every forward: measured, 8 sequences x ~450 keys
    on SmolLM2 spent ~8 ms of a ~75 ms step in those copies. Here ``keys``/``values`` are views of the buffer's
    first columns; a step writes its T columns after them, and neither a reserve nor a crop makes new views: each
    only counts the columns it adds or drops (``_pending``), the views are fitted when next read, and the next update
    writes over dropped columns. Cutting 60 views after every step that rejected drafts was ~0.1 ms of a ~16 ms bf16
    step (SmolLM2, Zen 5), and growing them at every one-call layer's reserve 2 of its ~25 microseconds of Python
    (Zen 4), where nothing reads them before the next step's reserve. Whatever else replaces ``keys``/``values``
    (``BatchCache.join``, ``keep``, ``squeeze``) is moved into a new buffer at the next update
    (``self._key_view is not self._view[0]``)."""

    _view = None  # the (keys, values) views this layer last made
    _pending = 0  # columns reserved (+) or cropped (-) since: the views are fitted at the next read
    _strides = None  # (the buffers' first three strides as ``layer_kernels.decoder_layer`` takes them, the keys' buffer they are of)

    keys = _fitted_on_read("_key_view")  # (batch, heads, seq, head_dim)
    values = _fitted_on_read("_value_view")

    def _fit(self) -> None:
        length = self._key_view.shape[-2] + self._pending
        self._key_view, self._value_view = self._view = self._keys.narrow(2, 0, length), self._values.narrow(2, 0, length)
        self._pending = 0

    def get_seq_length(self) -> int:
        if not self.is_initialized or self._key_view.numel() == 0 and not self._pending:
            return 0
        return self._key_view.shape[-2] + self._pending

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        rows = key_states.shape[-2]
        held = self.reserve(rows, key_states, value_states)
        self._keys.narrow(2, held, rows).copy_(key_states)  # narrow, not indexing: ~3x cheaper a call
        self._values.narrow(2, held, rows).copy_(value_states)
        return self.keys, self.values

    def reserve(self, rows: int, key_like: torch.Tensor, value_like: torch.Tensor) -> int:
        """Room in the buffers (``_keys``, ``_values``) for ``rows`` more columns, their values for the caller to
        write, the views over them made when next read: how many columns were held before. ``key_like``,
        ``value_like``: tensors of the layer's (batch, heads, ., head_dim) and dtype, for a new buffer."""
        held = self.get_seq_length()  # (batch, heads, seq, head_dim)
        length = held + rows
        if self._in_buffer and length <= self._keys.shape[-2]:
            self._pending += rows
            return held
        self._keys, self._values = self._grown(self.keys, key_like, held, length), self._grown(self.values, value_like, held, length)
        self.keys, self.values = self._view = self._keys.narrow(2, 0, length), self._values.narrow(2, 0, length)
        return held

    def stack(self, other: "GrowingLayer", pad_self: int, pad_other: int) -> None:
        """Append ``other``'s sequences after this layer's, each side padded on the left with zero (masked)
        columns to one length, written once into a new buffer with room to grow: padded copies and their
        concatenation moved every key four times (measured: a 2048-token prompt joining 7 sequences, SmolLM2
        fp32, 2.1 s)."""
        length = self.keys.shape[-2] + pad_self
        mine = self.keys.shape[0]
        for name in ("keys", "values"):
            a, b = getattr(self, name), getattr(other, name)  # (batch, heads, seq, head_dim)
            buffer = a.new_empty(a.shape[0] + b.shape[0], a.shape[1], int(length * GROWTH) + SLACK, a.shape[3])
            buffer[:mine, :, :pad_self] = 0  # padding must be finite: a masked key still meets its value with weight 0
            buffer[:mine, :, pad_self:length] = a
            buffer[mine:, :, :pad_other] = 0
            buffer[mine:, :, pad_other:length] = b
            setattr(self, "_" + name, buffer)
        self.keys, self.values = self._view = self._keys[:, :, :length], self._values[:, :, :length]

    @staticmethod
    def _grown(old: torch.Tensor, new: torch.Tensor, held: int, length: int) -> torch.Tensor:
        """A buffer for ``length`` columns and room to grow, holding ``old``'s ``held`` columns."""
        buffer = new.new_empty(*new.shape[:2], int(length * GROWTH) + SLACK, new.shape[3])
        if held:
            buffer[:, :, :held].copy_(old)
        return buffer

    def buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The tensors holding ``keys`` and ``values`` in their first columns, for moving columns in place without
        fitting the views first: the buffers, or the views themselves where something else replaced them."""
        return (self._keys, self._values) if self._in_buffer else (self.keys, self.values)

    @property
    def _in_buffer(self) -> bool:
        """Whether ``keys``/``values`` are still the views of the buffer this layer handed out (they go together)."""
        return self._view is not None and self._key_view is self._view[0]

    def crop(self, tokens_to_remove: int) -> None:
        view = self._view  # ``_in_buffer`` and ``get_seq_length`` inline: a step's compaction crops every layer
        if tokens_to_remove < 0 and view is not None and self._key_view is view[0] and -tokens_to_remove <= view[0].shape[-2] + self._pending:
            self._pending += tokens_to_remove  # the views are cut when read, the columns overwritten by the next update
            return
        super().crop(tokens_to_remove)


def reservable(cache: Cache, layer_idx: int, shape: tuple[int, int, int], dtype: torch.dtype, held: int | None = None
               ) -> GrowingLayer | None:
    """Layer ``layer_idx`` of ``cache`` where ``reserve`` makes room in it (nothing done here): a ``GrowingLayer`` of keys
    and values (batch, heads, ., head_dim = ``shape``) of ``dtype`` holding ``held`` columns (any, where None)."""
    layers = getattr(cache, "layers", ())
    layer = layers[layer_idx] if layer_idx < len(layers) else None
    if not isinstance(layer, GrowingLayer) or not layer.is_initialized or held is not None and layer.get_seq_length() != held:
        return None
    keys, values = layer._key_view, layer._value_view  # their shapes and dtype: not cut first (``reserve`` makes new views)
    if keys.dim() != 4 or keys.dtype != dtype or (keys.shape[0], keys.shape[1], keys.shape[3]) != shape or values.shape != keys.shape:
        return None
    return layer


def reserve(cache: Cache, layer_idx: int, rows: int, shape: tuple[int, int, int], dtype: torch.dtype, held: int | None = None
            ) -> tuple[torch.Tensor, torch.Tensor, int, ctypes.Array] | None:
    """Room for ``rows`` more columns of layer ``layer_idx``'s keys and values (batch, heads, ., head_dim = ``shape``)
    of ``dtype``, for a fused layer's kernel to write: its buffers (B, G, capacity, D), the columns held before, and the
    buffers' first three strides (``native.Longs``, made once a buffer); None, with nothing done, where that layer is not
    ``reservable``."""
    layer = reservable(cache, layer_idx, shape, dtype, held)
    return None if layer is None else room(layer, rows)


def rooms(cache: Cache, layers: tuple[int, ...], heads: tuple[tuple[int, int], ...], batch: int, dtype: torch.dtype, rows: int,
          held: int | None) -> list[tuple[torch.Tensor, torch.Tensor, int, ctypes.Array]] | None:
    """``reserve`` of ``rows`` columns in each of ``layers`` at once (keys and values (``batch``, ``heads[i]``'s heads, .,
    its head size) of ``dtype``), every one holding ``held`` columns (where None: as many as each other): a step's
    layers in one call; None, with nothing done, where one is not ``reservable``. Where each layer still hands out views
    of the buffer this found last (``GrowingCache.found``), a layer's checks are its buffer's identity and its columns:
    each one's ``reservable`` and ``room`` took ~3.5 us of Python a layer cold after a forward, 109 us a step of
    SmolLM2's ~5.3 ms (Zen 4; 43 us now)."""
    found = getattr(cache, "found", None)
    if found is not None:
        fast = _rooms_as_found(cache.layers, layers, found[1], rows, held) if found[0] == (layers, heads, batch, dtype) else None
        if fast is not None:
            return fast
        cache.found = found = None  # its buffers let go: a layer that grows below frees its old one at once, as before
    each = [reservable(cache, i, (batch, *shape), dtype, held) for i, shape in zip(layers, heads)]
    if any(layer is None for layer in each) or held is None and len({layer.get_seq_length() for layer in each}) != 1:
        return None
    made = [room(layer, rows) for layer in each]
    if isinstance(cache, GrowingCache):
        cache.found = ((layers, heads, batch, dtype), [layer._keys for layer in each])
    return made


def _rooms_as_found(cache_layers: list, layers: tuple[int, ...], buffers: list[torch.Tensor], rows: int, held: int | None
                    ) -> list[tuple[torch.Tensor, torch.Tensor, int, ctypes.Array]] | None:
    """``rooms`` where every layer holds the buffer ``rooms`` last found it to (so its shapes and dtype), its views still
    of that buffer (nothing replaced them) and its strides made for it; None, with nothing done, where one does not or
    the columns do not fit. Each layer's ``get_seq_length`` and ``reserve``'s in-buffer branch are inline here (as
    ``GrowingLayer.crop`` inlines them): a change to how a layer counts its columns changes them here too."""
    if len(cache_layers) <= max(layers):
        return None
    each, lengths = [], set()
    for i, keys in zip(layers, buffers):
        layer = cache_layers[i]
        view = layer._view
        if layer._keys is not keys or view is None or layer._key_view is not view[0] or layer._strides[1] is not keys:
            return None
        length = view[0].shape[-2] + layer._pending
        if length + rows > keys.shape[-2]:
            return None
        each.append(layer)
        lengths.add(length)
    if len(lengths) != 1 or held is not None and held not in lengths:
        return None
    start = lengths.pop()
    for layer in each:
        layer._pending += rows
    return [(layer._keys, layer._values, start, layer._strides[0]) for layer in each]


def room(layer: GrowingLayer, rows: int) -> tuple[torch.Tensor, torch.Tensor, int, ctypes.Array]:
    """``reserve``'s room in a layer ``reservable`` found."""
    start = layer.reserve(rows, layer._key_view, layer._value_view)
    if layer._strides is None or layer._strides[1] is not layer._keys:  # a new buffer (keys and values: alike)
        layer._strides = (native.Longs(*layer._keys.stride()[:3]), layer._keys)
    return layer._keys, layer._values, start, layer._strides[0]


class GrowingCache(DynamicCache):
    """A ``DynamicCache`` of ``GrowingLayer``s (every layer full: see the module docstring)."""

    def __init__(self) -> None:
        Cache.__init__(self, layer_class_to_replicate=GrowingLayer)
        self.found: tuple | None = None  # ((layers, heads, batch, dtype), each layer's key buffer): what ``rooms`` found last


class BatchCache:
    """A ``GrowingCache`` for B sequences and the position of every cached key, per sequence."""

    def __init__(self) -> None:
        self.cache = GrowingCache()
        self.positions = torch.empty(0, 0, dtype=torch.long)  # (B, S), -1: hole or padding
        self._mover = host_kernels.ColumnMover()  # ``compact``'s moves

    @property
    def positions(self) -> torch.Tensor:
        """(B, S) a view of the first S columns of a buffer with spare columns, so a step appends its columns in place
        (a new tensor a step, one ``torch.cat``, was ~0.04 ms of each step's host work, cold after the forward)."""
        return self._buffer[:, : self._length]

    @positions.setter
    def positions(self, value: torch.Tensor) -> None:
        self._length = value.shape[1]
        self._buffer = torch.full((value.shape[0], max(2 * self._length, 64)), -1, dtype=torch.long)
        self._buffer[:, : self._length] = value
        self._spare = None  # ``spare`` is computed again when next read

    def _append(self, columns: np.ndarray) -> None:
        """Columns (B, C) of positions after the last (the buffer doubled where full); ``spare`` as it was."""
        end = self._length + columns.shape[1]
        if end > self._buffer.shape[1]:
            spare, self.positions = self._spare, torch.cat([self.positions, torch.from_numpy(columns)], dim=1)
            self._spare = spare
            return
        self._buffer.numpy()[:, self._length : end] = columns
        self._length = end

    def __len__(self) -> int:
        return self._buffer.shape[0]

    @property
    def length(self) -> int:
        return self._length

    def _layers(self):
        return [layer for layer in self.cache.layers if layer.is_initialized and layer.keys.numel()]

    def join(self, other: "BatchCache") -> None:
        """Append the sequences of ``other`` (e.g. one just prefilled alone) as the last rows; the shorter side
        is padded on the left with holes."""
        if not len(self):
            self.cache, self.positions = other.cache, other.positions
            return
        pad_self, pad_other = max(other.length - self.length, 0), max(self.length - other.length, 0)
        for mine, theirs in zip(self._layers(), other._layers(), strict=True):
            mine.stack(theirs, pad_self, pad_other)
        self.positions = torch.cat([F.pad(self.positions, (pad_self, 0), value=-1), F.pad(other.positions, (pad_other, 0), value=-1)])

    def keep(self, rows: list[int]) -> None:
        """Keep only the sequences ``rows`` (in that order), and drop the columns that are holes in all of them."""
        index = torch.tensor(rows, dtype=torch.long)
        self.positions = self.positions[index]
        used = (self.positions >= 0).any(0)
        start = int(used.int().argmax()) if bool(used.any()) else self.length
        self.positions = self.positions[:, start:]
        for layer in self._layers():
            on = index.to(layer.keys.device)
            layer.keys, layer.values = layer.keys[on, :, start:], layer.values[on, :, start:]

    @property
    def spare(self) -> int:
        """Columns ``squeeze`` would remove: the cache's length beyond its longest sequence (read every step:
        kept until the positions change, and through a compaction that gave every sequence as many keys)."""
        if self._spare is None:
            self._spare = self.length - int((self.positions >= 0).sum(1).max()) if len(self) else 0
        return self._spare

    def squeeze(self) -> None:
        """Close every sequence's holes (see the module docstring): a gather over the whole cache, so worth it only
        when the holes cost more (``spare`` large, or the context short)."""
        valid = self.positions >= 0  # (B, S)
        length = int(valid.sum(1).max())
        # stable sort puts each row's holes first and its keys after, in order; the last ``length`` columns hold every key
        index = torch.sort(valid.int(), dim=1, stable=True).indices[:, self.length - length:]  # (B, length)
        self.positions = self.positions.gather(1, index)
        for layer in self._layers():
            layer.keys, layer.values = (_gather_columns(states, index) for states in (layer.keys, layer.values))

    def sequence(self, b: int, length: int) -> "BatchCache | None":
        """Sequence ``b``'s keys of positions 0 .. ``length`` - 1 as a one-sequence cache of their own (copies, holes
        left out), which a prompt beginning with the same tokens prefills after (``model_forward.prefill``); None
        where one of those positions is not held."""
        positions = self.positions[b]
        columns = torch.nonzero((positions >= 0) & (positions < length)).flatten()
        if not torch.equal(positions[columns], torch.arange(length)):
            return None
        out = BatchCache()
        for layer in self.cache.layers:
            mine = GrowingLayer()
            if layer.is_initialized:
                keys, values = (states[b : b + 1].index_select(2, columns.to(states.device)) for states in (layer.keys, layer.values))
                mine.lazy_initialization(keys, values)
                mine.keys, mine.values = keys, values
            out.cache.layers.append(mine)
        out.positions = torch.arange(length)[None]
        return out

    def masks(self, allowed: torch.Tensor, query_positions: torch.Tensor, windows: dict[str, int | None],
              dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
        """Per layer type, the (B, 1, T, S + T) additive mask of a step: 0 where attended, dtype-min elsewhere.

        allowed (B, T, T): who sees whom among the step's rows; query_positions (B, T): each row's position.
        A row sees every cached key of its own sequence (not holes), and, in a sliding layer, only keys fewer
        than ``window`` positions behind it. Drawn by one kernel a layer type, as the dtype's bits (a dozen
        torch ops were ~0.08 ms a step)."""
        bits, hidden = _hidden_bits(dtype)
        allowed, query = allowed.numpy(), query_positions.numpy()
        # the cached keys' positions (B, S); a cache that holds no sequence yet (a prompt's first prefill): none
        positions = np.ascontiguousarray(self._buffer.numpy()[:, : self._length]) if len(self) else np.empty((allowed.shape[0], 0), np.int64)
        out = {}
        for kind, window in windows.items():
            mask = np.empty((allowed.shape[0], 1, allowed.shape[1], positions.shape[1] + allowed.shape[1]), bits)
            draw_mask(positions, allowed, query, -1 if window is None else window, hidden, mask)
            mask = torch.from_numpy(mask).view(dtype)
            out[kind] = mask if device.type == "cpu" else mask.to(device)
        return out

    def compact(self, step: int, keep: list[np.ndarray], positions: list[np.ndarray]) -> None:
        """Of the ``step`` columns the last forward appended, sequence b keeps the rows ``keep[b]`` (sorted ints),
        which sit at ``positions[b]``; they move to the front of the step's block, the rest is cropped or a hole.
        The bookkeeping is numpy, not a few small torch ops per sequence (0.75 ms a step at 8 sequences), and a plain
        step's (one row, kept where it is) only its positions."""
        if step == 1:
            self._append(np.array([[p[0]] for p in positions], np.int64))
            return
        keep = [np.asarray(k, dtype=np.int64) for k in keep]
        kept = max(k.size for k in keep)
        new = np.full((len(keep), kept), -1, np.int64)
        for b, p in enumerate(positions):
            new[b, : len(p)] = p
        if any(k.size < kept or k[-1] != kept - 1 for k in keep):  # else (sorted, from 0) rows 0..kept-1 are in place
            index = np.empty((len(keep), kept), np.int64)  # (B, kept): a short row repeats its last column
            for b, k in enumerate(keep):
                index[b, : k.size], index[b, k.size :] = k, k[-1]
            tensors = [states for layer in self.cache.layers if layer.is_initialized for states in layer.buffers()]  # (batch, heads, ., head_dim)
            if not self._mover(tensors, self.length, index):  # one call on CPU, else torch's ops
                rows = torch.from_numpy(index)
                for states in tensors:
                    block = states.narrow(-2, self.length, step)
                    block.narrow(-2, 0, kept).copy_(_gather_columns(block, rows))
        if kept < step:
            self.cache.crop(kept - step)
        self._append(new)
        if not all(k.size == kept for k in keep):  # else every sequence gained ``kept`` keys: as many spare columns as before
            self._spare = None

    def append(self, positions: torch.Tensor) -> None:
        """Record the positions (B, T) of the columns a forward just appended (a prefill's)."""
        if len(self):
            self._append(positions.numpy())
            self._spare = None
        else:
            self.positions = positions


@dataclass
class HeldKeys:
    """A finished sequence's keys (``Lane.keeps_keys``): ``tokens[i]``'s at position i, for a later prompt that
    begins with the same tokens (a chat's next turn begins with the conversation so far)."""

    tokens: list[int]
    cache: BatchCache

    def shared(self, prompt: list[int]) -> int:
        """The length of ``prompt``'s longest common prefix with ``tokens`` (at most all of the prompt but its last
        token, whose logits a prefill must give)."""
        n = min(len(self.tokens), len(prompt) - 1, self.cache.length)
        same = np.asarray(self.tokens[:n]) == np.asarray(prompt[:n])
        return n if same.all() else int(np.argmin(same))

    def prefix_for(self, prompt: list[int]) -> BatchCache | None:
        """The keys of ``prompt``'s longest common prefix with ``tokens`` as a cache of their own, or None where they
        share none."""
        shared = self.shared(prompt)
        return self.cache.sequence(0, shared) if shared else None

    def nbytes(self) -> int:
        return sum(states.nbytes for layer in self.cache._layers() for states in (layer.keys, layer.values))


class RecentKeys:
    """Finished requests' keys (``HeldKeys``), the most recently used first, within ``budget`` bytes: a server's chat
    client sends the whole conversation each turn, and the prefix held of it is not prefilled again. Shared by the
    request threads and the batch's (one lock)."""

    def __init__(self, budget: int) -> None:
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
            raise ValueError(f"the keys' budget must be an integer number of bytes >= 0, got {budget!r}")
        self.budget, self.held, self._lock = budget, [], threading.Lock()  # held: list[HeldKeys], newest first

    def add(self, keys: HeldKeys) -> int:
        """Hold ``keys`` first (those it begins with go: it holds theirs), then as many others as the budget keeps;
        keys over the budget alone are not held. The bytes held then."""
        total = keys.nbytes()
        with self._lock:
            if total > self.budget:
                return sum(other.nbytes() for other in self.held)
            held = [keys]
            for other in self.held:
                if keys.tokens[: len(other.tokens)] != other.tokens and total + other.nbytes() <= self.budget:
                    held.append(other)
                    total += other.nbytes()
            self.held = held
        return total

    def prefix_for(self, prompt: list[int]) -> BatchCache | None:
        """``HeldKeys.prefix_for`` of the held keys that share the longest prefix with ``prompt`` (then used first)."""
        with self._lock:
            shared, best = max(((keys.shared(prompt), keys) for keys in self.held), default=(0, None), key=lambda pair: pair[0])
            if not shared:
                return None
            self.held.remove(best)
            self.held.insert(0, best)
        return best.cache.sequence(0, shared)


@memoize
def _hidden_bits(dtype: torch.dtype) -> tuple[type, int]:
    """The integer type as wide as ``dtype`` and the bits of its most negative value (a mask's hidden entry)."""
    numpy_type, torch_type = {16: (np.int16, torch.int16), 32: (np.int32, torch.int32), 64: (np.int64, torch.int64)}[torch.finfo(dtype).bits]
    return numpy_type, int(torch.tensor(torch.finfo(dtype).min, dtype=dtype).view(torch_type))


@njit(cache=True)
def draw_mask(positions: np.ndarray, allowed: np.ndarray, query: np.ndarray, window: int, hidden: int, mask: np.ndarray) -> None:
    """Into ``mask`` (B, 1, T, S + T), as integer bits: 0 where row i of sequence b sees the column, ``hidden`` elsewhere.
    A row sees its sequence's cached keys (``positions`` (B, S) >= 0) and the step's rows ``allowed`` (B, T, T) lets it,
    each fewer than ``window`` positions behind its ``query`` (B, T) position (-1: any)."""
    batch, keys = positions.shape
    rows = allowed.shape[1]
    for b in range(batch):
        for i in range(rows):
            q = query[b, i]
            for j in range(keys):
                seen = positions[b, j] >= 0 and (window < 0 or q - positions[b, j] < window)
                mask[b, 0, i, j] = 0 if seen else hidden
            for j in range(rows):
                seen = allowed[b, i, j] and (window < 0 or q - query[b, j] < window)
                mask[b, 0, i, keys + j] = 0 if seen else hidden


def _gather_columns(states: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """states (B, heads, S, head_dim) -> (B, heads, C, head_dim): row b's sequence columns ``index[b]`` (C,)."""
    if index.shape[0] == 1:  # one sequence: index_select, ~25% cheaper than gather's expanded index
        return states.index_select(2, index[0].to(states.device))
    return states.gather(2, index.to(states.device)[:, None, :, None].expand(-1, states.shape[1], -1, states.shape[3]))
