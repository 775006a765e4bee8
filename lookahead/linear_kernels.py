"""The linears on our kernels: weights laid out once for them, and the product of a step's few rows.

The dense linear (``csrc/linear.c``, ``linear_avx2.c``): bf16 or fp32 weights in blocks of 16 columns (``pack``);
a step's linears must stream every weight from memory, and at 16 rows also do 16x the arithmetic: oneDNN's
small-M product does one after the other, ours prefetches the next weight blocks while it computes (SmolLM2's
products, Zen 5, 2 threads, weights streamed: one row 116 against 163 us a layer, 16 rows 174 against 265). Each
row is summed in the same order whatever the number of rows (row-invariant), and the fp32 sums are rounded to
bf16 once, as oneDNN does; bf16 on AMX tiles where the CPU has them (``csrc/amx_linear.c``).

The quantized linear (``csrc/quant_linear.c``): a GGUF's integers and scales (``lookahead.quants``) laid out once
by ``pack_quantized`` in the same blocks, dequantized in registers inside the product. The integer linear
(``csrc/int_linear.c`` on AVX512-VNNI, ``csrc/int_linear_avx2.c`` on the other tiers: the same bits): the same
blocks, in the lanes' order of the integer dot products (``QuantLayout.integer``), times activations rounded to 8
bits: ``--dtype int8``. ``Linear`` runs any of these layouts."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lookahead import quants
from lookahead.native import PRODUCTS, Product, amx, has, integer_runs, library, prefetch_into_l2, tier

BLOCK = 16  # output columns a packed block holds: N must be a multiple (and K even in bf16)
SCALINGS = ("groups", "supers", "halves")  # csrc/int_linear.c's: a layout's scales fp32 a group, the K types', fp16 a group
def fits(n: int, k: int, dtype: torch.dtype) -> bool:
    """Whether an (n, k) weight of ``dtype`` can be packed for the linear (bf16 or fp32)."""
    return n % BLOCK == 0 and n > 0 and k > 0 and (dtype == torch.float32 or dtype == torch.bfloat16 and k % 2 == 0)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """(N, K) -> the linear's layout: bf16 (N/16, K/2, 16, 2) (block, line = pair of k, column, k in the pair);
    fp32 (N/16, K, 16) (block, line = k, column)."""
    n, k = weight.shape
    if weight.dtype == torch.bfloat16:
        return weight.view(n // BLOCK, BLOCK, k // 2, 2).permute(0, 2, 1, 3).contiguous()
    return weight.view(n // BLOCK, BLOCK, k).permute(0, 2, 1).contiguous()


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """``pack``'s inverse: the dense (N, K) weight."""
    if packed.dtype == torch.bfloat16:
        return packed.permute(0, 2, 1, 3).reshape(packed.shape[0] * BLOCK, packed.shape[1] * 2)
    return packed.permute(0, 2, 1).reshape(packed.shape[0] * BLOCK, packed.shape[1])


@dataclass(frozen=True)
class QuantLayout:
    """A quantized weight in ``csrc/quant_linear.c``'s blocks: the bytes and what the kernel must be told of them."""

    packed: torch.Tensor  # (N / 16, bytes a block) uint8
    n: int
    k: int
    bits: int  # 8: int8 q, 4: nibbles, 6: 6-bit planes (``pack_supers``' int8 K types)
    group: int  # k's a scale covers
    offsets: bool  # whether each group has an offset too
    dtype: torch.dtype  # the activations' (and outputs') dtype: which kernel runs it
    integer: bool = False  # activations rounded to 8 bits, integer products (csrc/int_linear.c), where ``integer_runs()``
    supers: bool = False  # the K types' scales per 256 k's (``pack_supers``: the integer kernel's alone)
    halves: bool = False  # each group's scales (and offsets) as fp16 (``pack_quantized``: the integer kernel's alone)

    @property
    def shape(self) -> tuple[int, int]:
        return self.n, self.k

    @property
    def kind(self) -> str:
        """What must agree for weights to share one product (``quants.kind``)."""
        return quants.kind(self.bits, self.group, self.offsets, self.supers, self.halves)

    @property
    def scaling(self) -> int:
        """How the blocks hold their scales, as the integer kernel is told (``SCALINGS``)."""
        return SCALINGS.index("supers" if self.supers else "halves" if self.halves else "groups")

    def nbytes(self) -> int:
        return self.packed.numel()


def quant_fits(n: int, k: int, group: int, integer: bool = False) -> bool:
    """Whether an (n, k) quantized weight with groups of ``group`` k's can be laid out for the kernel (for the
    integer one: 4 k's a lane, 32 an activation scale)."""
    fits = n % BLOCK == 0 and n > 0 and k > 0 and group % 2 == 0 and k % group == 0
    return fits and (not integer or group in (16, 32) and k % 32 == 0)


def pack_quantized(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None, group: int, bits: int,
                   dtype: torch.dtype, integer: bool = False, halves: bool = False) -> QuantLayout:
    """q (N, K) int8 (0 .. 15 where ``bits`` is 4), scale and offset (N, K / group) fp32 -> the kernel's blocks, for
    ``dtype`` activations (rounded to 8 bits where ``integer``): per block of 16 rows and group, the 16 scales, the 16 offsets, then steps of 32 values
    (k's 16 columns, then k + 1's; nibbles: value i in byte i % 16, the high nibble from i = 16; for the integer
    kernel, the values in its lanes' order: ``_lanes``). ``halves``: the
    scales and offsets as fp16, for the integer kernel (a ValueError where one is not exact in fp16)."""
    n, k = q.shape
    groups = k // group
    if halves and not (integer and halves_exact(scale, offset)):
        raise ValueError("fp16 scales are for the integer kernel, and for scales and offsets exact in fp16")
    heads = [_columns(t.half() if halves else t.float(), groups) for t in (scale, offset) if t is not None]  # (NB, G, 64 or 32) each
    values = _lanes(q, group, bits) if integer else _steps(q, group, bits)
    packed = torch.cat([*heads, values], dim=-1).reshape(n // BLOCK, -1).contiguous()
    return QuantLayout(packed, n, k, bits, group, offset is not None, dtype, integer, halves=halves)


def halves_exact(scale: torch.Tensor, offset: torch.Tensor | None) -> bool:
    """Whether the scales (and offsets) are exact in fp16: a GGUF's d, m and dmin are fp16 in its file."""
    return all(torch.equal(t.half().float(), t.float()) for t in (scale, offset) if t is not None)


def supers_fit(q: quants.Quantized) -> bool:
    """Whether ``q`` can be laid out by ``pack_supers``: a K type's (``q.supers``, d and dmin exact in fp16), K a
    multiple of 256."""
    return (q.supers is not None and q.shape[1] % 256 == 0 and quant_fits(*q.shape, q.group, integer=True)
            and halves_exact(q.supers.d, q.supers.dmin))


def lay_out(q: quants.Quantized, dtype: torch.dtype, integer: bool = False) -> QuantLayout:
    """``q`` for the quantized kernel with ``dtype`` activations, or for the integer one where ``integer``: in the
    K types' own scales where they fit (``pack_supers``), else ``pack_quantized``'s (with fp16 scales where they are
    exact in fp16)."""
    if integer and supers_fit(q):
        return pack_supers(q, dtype)
    return pack_quantized(q.q, q.scale, q.offset, q.group, q.bits, dtype, integer, halves=integer and halves_exact(q.scale, q.offset))


def pack_supers(q: quants.Quantized, dtype: torch.dtype) -> QuantLayout:
    """A K type's weight (``q.supers`` set; K a multiple of 256) -> the integer kernel's blocks: per block of 16
    rows and 256 k's, the 16 d (and dmin) as fp16 (the file's), then each group's 16 int8 sc (and then each group's m), then the
    values: nibbles in the integer kernel's order (``_octets``); the int8 ones (Q6_K, Q5_K, Q3_K: -32 .. 31)
    as 6 bits (``_planes``). Q4_K: 2368 bytes for 4096 weights (4.625 bits each; the file's 4.5) where
    ``pack_quantized`` takes 3072; Q6_K 3360 (6.5625 bits, as in the file) where it takes 5120. A ValueError where
    d or dmin is not exact in fp16."""
    n, k = q.shape
    supers, groups = q.supers, k // q.group
    per = 256 // q.group  # groups a super-block
    if not halves_exact(supers.d, supers.dmin):
        raise ValueError("a K type's d and dmin are fp16 in its file: these are not exact in fp16")
    wide = [_columns(t.half(), k // 256) for t in (supers.d, supers.dmin) if t is not None]  # (NB, S, 32) each
    small = [_columns(t, groups).reshape(n // BLOCK, k // 256, per * BLOCK) for t in (supers.sc, supers.m) if t is not None]
    values = _planes(q.q) if q.bits == 8 else _octets(q.q, q.group)
    packed = torch.cat([*wide, *small, values.reshape(n // BLOCK, k // 256, -1)], dim=-1).reshape(n // BLOCK, -1).contiguous()
    return QuantLayout(packed, n, k, 6 if q.bits == 8 else q.bits, q.group, supers.dmin is not None, dtype, integer=True, supers=True)


def _planes(q: torch.Tensor) -> torch.Tensor:
    """q (N, K) int8 in -32 .. 31 -> (N / 16, K / 16, 192): per 16 k's, u = q + 32 (6 bits) in the integer kernel's
    own order, four quads of 64 bytes (byte 4c + j: k + 4t + j of column c, quad t): 64 bytes of quads 0 and 1's
    low nibbles (0's low), 64 of quads 2 and 3's, then 64 of the four quads' high two bits (quad t's at bit 2t)."""
    n, k = q.shape
    if q.numel() and (int(q.min()) < -32 or int(q.max()) > 31):
        raise ValueError("6-bit planes hold values in -32 .. 31")
    u = (q + 32).to(torch.uint8).view(n // BLOCK, BLOCK, k // 16, 4, 4).permute(0, 2, 3, 1, 4).reshape(n // BLOCK, k // 16, 4, 64)
    low, high = u & 15, u >> 4
    return torch.cat([low[:, :, 0] | (low[:, :, 1] << 4), low[:, :, 2] | (low[:, :, 3] << 4),
                      high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)], dim=-1)


def _unplanes(planes: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """``_planes``' inverse: (N / 16, K / 16, 192) -> q (N, K) int8."""
    a, b, h = planes[..., :64], planes[..., 64:128], planes[..., 128:]
    low = torch.stack([a & 15, a >> 4, b & 15, b >> 4], dim=2)  # (NB, K / 16, 4, 64)
    high = torch.stack([(h >> (2 * t)) & 3 for t in range(4)], dim=2)
    u = (low | (high << 4)).view(n // BLOCK, k // 16, 4, BLOCK, 4).permute(0, 3, 1, 2, 4).reshape(n, k)
    return u.to(torch.int8) - 32


def _lanes(q: torch.Tensor, group: int, bits: int) -> torch.Tensor:
    """q (N, K) -> (N / 16, K / group, bytes): a group's values in the integer kernel's lanes, 16 columns of 4 k's
    (vpdpbusd's), so a quad is a load (int8: ``_quads``) or a mask and a shift (nibbles: ``_octets``)."""
    return _octets(q, group) if bits == 4 else _quads(q, group)


def _unlanes(values: torch.Tensor, n: int, k: int, bits: int) -> torch.Tensor:
    """``_lanes``' inverse: (N / 16, K / group, bytes) -> q (N, K) int8."""
    return _unoctets(values, n, k) if bits == 4 else _unquads(values, n, k)


def _quads(q: torch.Tensor, group: int) -> torch.Tensor:
    """q (N, K) int8 -> (N / 16, K / group, group * 16): per 4 k's, 64 bytes, byte 4c + j holding column c's k + j
    plus 128 (vpdpbusd multiplies unsigned weights; the kernel takes 128 sum_k qx[k] off, exactly)."""
    n, k = q.shape
    lanes = q.view(n // BLOCK, BLOCK, k // 4, 4).permute(0, 2, 1, 3).reshape(n // BLOCK, k // group, group * BLOCK)
    return (lanes.to(torch.int16) + 128).to(torch.uint8)


def _unquads(quads: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """``_quads``' inverse: (N / 16, K / group, bytes) -> q (N, K) int8."""
    lanes = (quads.reshape(n // BLOCK, k // 4, BLOCK, 4).to(torch.int16) - 128).to(torch.int8)
    return lanes.permute(0, 2, 1, 3).reshape(n, k)


def _octets(q: torch.Tensor, group: int) -> torch.Tensor:
    """q (N, K) in 0 .. 15 -> (N / 16, K / group, group * 8): per 8 k's, 64 bytes in the integer kernel's lanes,
    byte 4c + j holding column c's k + j (low nibble) and k + 4 + j (high), so a mask and a shift make the two
    quads vpdpbusd multiplies: no byte permutes."""
    n, k = q.shape
    lanes = q.to(torch.uint8).view(n // BLOCK, BLOCK, k // 8, 2, 4).permute(0, 2, 3, 1, 4).reshape(n // BLOCK, k // 8, 2, 64)
    return (lanes[:, :, 0] | (lanes[:, :, 1] << 4)).reshape(n // BLOCK, k // group, -1)


def _unoctets(octets: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """``_octets``' inverse: (N / 16, K / group (or K / 256), bytes) -> q (N, K) int8."""
    octets = octets.reshape(n // BLOCK, k // 8, 1, 64)
    lanes = torch.cat([octets & 15, octets >> 4], dim=2).view(n // BLOCK, k // 8, 2, BLOCK, 4)
    return lanes.permute(0, 3, 1, 2, 4).reshape(n, k).to(torch.int8)


def _columns(t: torch.Tensor, groups: int) -> torch.Tensor:
    """(N, groups) values -> (N / 16, groups, 16 values' bytes): each group's values for a block's 16 columns."""
    return t.view(t.shape[0] // BLOCK, BLOCK, groups).transpose(1, 2).contiguous().view(torch.uint8)


def _steps(q: torch.Tensor, group: int, bits: int) -> torch.Tensor:
    """q (N, K) -> (N / 16, K / group, bytes): each group's steps of 32 values (k's 16 columns, then k + 1's),
    nibbles two a byte (value i in byte i % 16, the high nibble from i = 16) where ``bits`` is 4."""
    n, k = q.shape
    steps = q.view(n // BLOCK, BLOCK, k // group, group // 2, 2).permute(0, 2, 3, 4, 1).reshape(n // BLOCK, k // group, group // 2, 32)
    steps = steps.contiguous().view(torch.uint8)
    if bits == 4:
        steps = steps[..., :16] | (steps[..., 16:] << 4)
    return steps.reshape(n // BLOCK, k // group, -1)


def cat_layouts(parts: list[QuantLayout], dtype: torch.dtype, integer: bool = False) -> QuantLayout:
    """Laid-out weights of one kind and width stacked by rows, for ``dtype`` activations (rounded to 8 bits where
    ``integer``): a view where each part's
    bytes follow the last's in one storage (``gguf_model`` lays siblings out so), else a copy."""
    if integer:  # the integer kernel reads values in its lanes' order: the fp32 kernel's laid out again (a copy)
        parts = [p if p.integer else _relaid(p) for p in parts]
    first = parts[0]
    if any((p.k, p.kind) != (first.k, first.kind) for p in parts):
        raise ValueError("laid-out weights of different kinds or widths cannot be stacked")
    n = sum(p.n for p in parts)
    storage = first.packed.untyped_storage()
    adjacent = all(p.packed.is_contiguous() and p.packed.untyped_storage().data_ptr() == storage.data_ptr() for p in parts) and all(
        a.packed.data_ptr() + a.packed.numel() == b.packed.data_ptr() for a, b in zip(parts, parts[1:]))
    if adjacent:
        packed = torch.empty(0, dtype=torch.uint8).set_(storage, first.packed.storage_offset(), (n // BLOCK, first.packed.shape[1]))
    else:
        packed = torch.cat([p.packed for p in parts])
    return QuantLayout(packed, n, first.k, first.bits, first.group, first.offsets, dtype, integer or first.integer, first.supers,
                       first.halves)


def _relaid(layout: QuantLayout) -> QuantLayout:
    """A layout of the fp32 kernel's, laid out for the integer one (``_lanes``)."""
    q, scale, offset = unpack_quantized(layout)
    return pack_quantized(q, scale, offset, layout.group, layout.bits, layout.dtype, integer=True)


def unpack_quantized(layout: QuantLayout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``pack_quantized``'s (and ``pack_supers``') inverse: (q, scale, offset)."""
    if layout.supers:
        return _unpack_supers(layout)
    n, k, group, heads = layout.n, layout.k, layout.group, 2 if layout.offsets else 1
    blocks, size, of = layout.packed.view(n // BLOCK, k // group, -1), 32 if layout.halves else 64, torch.float16 if layout.halves else torch.float32
    floats = [blocks[..., size * i:size * (i + 1)].contiguous().view(of).float().transpose(1, 2).reshape(n, -1) for i in range(heads)]
    values = blocks[..., size * heads:]
    q = _unlanes(values, n, k, layout.bits) if layout.integer else _unsteps(values, n, k, group, layout.bits)
    return q, floats[0], floats[1] if layout.offsets else None


def _unpack_supers(layout: QuantLayout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``pack_supers``' inverse: the scales ``d sc`` and offsets ``-(dmin m)`` as the decoders compute them."""
    n, k, heads, per = layout.n, layout.k, 2 if layout.offsets else 1, 256 // layout.group
    blocks = layout.packed.view(n // BLOCK, k // 256, -1)
    at = [32 * i for i in range(heads)] + [32 * heads + 16 * per * i for i in range(heads + 1)]  # d, dmin, sc, m, values
    wide = [blocks[..., at[i]:at[i] + 32].contiguous().view(torch.float16).float().transpose(1, 2).reshape(n, -1, 1) for i in range(heads)]
    small = [blocks[..., at[heads + i]:at[heads + i + 1]].contiguous().view(torch.int8).view(n // BLOCK, k // 256, per, BLOCK)
             .permute(0, 3, 1, 2).reshape(n, -1, per).float() for i in range(heads)]
    values = blocks[..., at[-1]:]
    q = _unplanes(values.reshape(n // BLOCK, k // 16, 192), n, k) if layout.bits == 6 else _unoctets(values, n, k)
    return q, (wide[0] * small[0]).reshape(n, -1), -(wide[1] * small[1]).reshape(n, -1) if layout.offsets else None


def _unsteps(steps: torch.Tensor, n: int, k: int, group: int, bits: int) -> torch.Tensor:
    """``_steps``' inverse: (N / 16, K / group, bytes) -> q (N, K) int8."""
    steps = steps.reshape(n // BLOCK, k // group, group // 2, -1)
    if bits == 4:
        steps = torch.cat([steps & 15, steps >> 4], dim=-1)
    steps = steps.contiguous().view(torch.int8).view(n // BLOCK, k // group, group // 2, 2, BLOCK)
    return steps.permute(0, 4, 1, 2, 3).reshape(n, k)


class Linear:
    """(..., K) -> (..., N) in the weight's dtype (bf16 or fp32): x W^T (+ bias, fp32), W packed by ``pack`` (or by
    ``pack_quantized``: a ``QuantLayout``); the sizes, pointers and kernel looked up once (a forward makes 121 calls:
    ~1 us each less than doing it per call). Holds ``packed`` and ``bias``, so the pointers stay valid."""

    def __init__(self, packed: torch.Tensor | QuantLayout, bias: torch.Tensor | None, tiles: bool | None = None) -> None:
        """``tiles``: bf16 on AMX tiles (None: where ``amx()``; True where they are not is a ValueError)."""
        self.packed, self.bias = packed, bias
        if tiles and not amx():
            raise ValueError("this CPU or process cannot use AMX tiles")
        quantized = isinstance(packed, QuantLayout)
        integer = quantized and packed.integer  # the integer kernel: bf16 or fp32 activations, said in its last argument
        if integer and not integer_runs():
            raise ValueError("no integer linear runs here (no kernels, or an AVX-512 BF16 CPU without AVX512-VNNI)")
        if integer and packed.dtype == torch.bfloat16 and not has("bf16_linear"):
            raise ValueError(f"the {tier()} integer linear takes fp32 activations, not bf16")
        if quantized:
            self.dtype, self.n, self.k = packed.dtype, packed.n, packed.k
            self.format = (packed.bits, packed.group, int(packed.offsets)) + ((packed.scaling,) if integer else ())  # the kernels' extra arguments
            weights = packed.packed
        else:
            self.dtype = packed.dtype
            self.n, self.k = packed.shape[0] * BLOCK, packed.shape[1] * (2 if packed.dtype == torch.bfloat16 else 1)
            self.format, weights = (), packed
        bf16 = self.dtype == torch.bfloat16
        on_tiles = bf16 and self.k % 32 == 0 and not integer and (amx() if tiles is None else tiles)
        name = f"amx_{'quant' if quantized else 'bf16'}_linear" if on_tiles else f"{'quant_' if quantized else ''}{'bf16' if bf16 else 'fp32'}_linear"
        self.run = getattr(library(), "int_linear" if integer else name)
        self.integer = integer  # its kernel takes fp32 or bf16 rows, said in its last argument
        self.pointers = weights.data_ptr(), None if bias is None else bias.data_ptr()
        self.l2 = prefetch_into_l2()
        kernel = "int_linear" if integer else name
        self.product = Product(PRODUCTS.index(kernel), *self.pointers, self.n, self.k, *(self.format + (0,) * 4)[:4], self.l2) \
            if kernel in PRODUCTS else None  # what ``decoder_layer`` calls

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.dtype:
            raise TypeError(f"the {self.dtype} linear takes {self.dtype} input, got {x.dtype}")
        if x.shape[-1] != self.k:  # the kernel reads K columns a row: never let it read past x
            raise ValueError(f"input has {x.shape[-1]} features, the weight {self.k}")
        x = x.contiguous()
        y = torch.empty(*x.shape[:-1], self.n, dtype=self.dtype)
        if self.into(x, y):
            raise MemoryError(f"the quantized linear could not allocate {x.numel() // self.k} x {self.k} floats")
        return y

    def into(self, x: torch.Tensor, y: torch.Tensor, run=None) -> int:
        """The kernel on ``x`` (contiguous, checked) into ``y``: its status (1: out of memory; 2: bf16 rows on a tier
        without). ``run``: the same kernel of another build (``benchmarks.kernel_ab``: of another tier too, whose integer
        linear takes fp32 rows of a bf16 model's, as ``x`` and ``y`` are)."""
        rows = x.numel() // self.k
        tail = (int(x.dtype == torch.bfloat16),) if self.integer else ()
        return rows and (run or self.run)(x.data_ptr(), *self.pointers, y.data_ptr(), rows, self.n, self.k, *self.format,
                                          torch.get_num_threads(), self.l2, *tail)


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``Linear(packed, bias)(x)``, for one call."""
    return Linear(packed, bias)(x)
