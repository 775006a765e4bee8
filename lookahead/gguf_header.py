"""A GGUF file's header and metadata, read only once they agree with the file's bytes and with each other:
``read_header`` reads the header as llama.cpp checks it (gguf-py's and transformers' readers trust it), and
``check_metadata`` bounds the metadata by the tensors it describes (the vocabulary against the embedding's rows,
the heads against the projections) and by what a forward can run (an epsilon above 0), before a config is made from
it (``config_of``, with its tokenizer: ``tokenizer_of``). A file that lies is refused with ``ModelLoadError``, one
line naming the tensor or key and both values."""

from __future__ import annotations

import dataclasses
import logging
import math
import mmap
import os
import stat
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path


GGUF_VERSIONS = (2, 3)  # the versions gguf-py reads
MAX_DIMS = 4  # GGML_MAX_DIMS
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}  # GGUF value types' formats
STRING, ARRAY, UINT32 = 8, 9, 4  # the other GGUF value types, and general.alignment's
CUT = ": the file is cut short, or its header lies"
VALUES = {"F32": "float32", "F16": "float16", "F64": "float64", "I8": "int8", "I16": "int16", "I32": "int32", "I64": "int64"}  # types of values, not blocks
POSITIVE = ("attention.layer_norm_rms_epsilon", "attention.layer_norm_epsilon", "rope.freq_base",  # 0 or less: a NaN forward
            "context_length", "attention.sliding_window")  # 0: no token has room, no key is in the window
TOKEN_IDS = ("bos", "eos", "unknown", "padding")  # tokenizer.ggml.<name>_token_id: the special tokens transformers looks up


class ModelLoadError(ValueError):
    """A model could not be found, fetched, converted or loaded; the message says which and why, in one line."""


def _regular(gguf: Path) -> os.stat_result:
    """``gguf``'s status, or a ``ModelLoadError`` where it is no regular file (a directory, a device such as
    /dev/zero, a FIFO: reading one would never end, or never start) or is not there."""
    try:
        status = gguf.stat()
    except OSError as e:
        raise ModelLoadError(f"cannot read GGUF {gguf}: {'a link to nothing' if gguf.is_symlink() else e.strerror}") from None
    if not stat.S_ISREG(status.st_mode):
        raise ModelLoadError(f"cannot read GGUF {gguf}: {'a directory' if stat.S_ISDIR(status.st_mode) else 'not a regular file'}")
    return status


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as the file's header describes it."""

    name: str
    kind: str  # its GGML type's name: "Q4_K", "F32", ...
    dims: tuple[int, ...]  # as the file writes them, the fastest-moving first
    offset: int  # of its bytes, from the start of the file
    nbytes: int

    @property
    def rows(self) -> list[int]:
        """Its shape as torch holds it (rows, columns)."""
        return list(reversed(self.dims))

    def stored(self) -> tuple[str, list[int]]:
        """(numpy dtype, shape) of its bytes as gguf-py's reader gives them: the values of a float or integer type,
        the bytes of each row's blocks of any other."""
        if self.kind in VALUES:
            return VALUES[self.kind], self.rows
        return "uint8", [*self.rows[:-1], self.nbytes // max(1, math.prod(self.rows[:-1]))]


@dataclass(frozen=True)
class Header:
    """What ``read_header`` read of a file, every count and offset checked against its bytes."""

    architecture: str
    values: dict[str, object]  # each key's value (a number, a bool or a string); an array's, its item count
    arrays: frozenset[str]  # the keys whose values are arrays
    tensors: tuple[TensorInfo, ...]
    order: str  # the byte order of its numbers, as struct writes it: "<" or ">"
    spans: dict[str, tuple[int, int]]  # where each key and its value are in the file: [start, end)
    table: tuple[int, int]  # where the tensor infos are
    data: int  # where the tensors' bytes start
    alignment: int
    size: int  # the file's


def read_header(gguf: Path) -> Header:
    """``gguf``'s header, read as llama.cpp checks it before gguf-py's and transformers' readers trust it; a
    ``ModelLoadError`` naming ``gguf`` and what is wrong where its bytes do not bear it out (a count of 2^40 or a
    key length of 2^60 made them fail far away, blaming a config file; a wrong type or offset read other bytes as
    weights). Every count and length is bounded by the bytes left: nothing is allocated or looped over beyond the
    file's size."""
    from gguf import GGML_QUANT_SIZES

    types = {int(t): (t.name, *sizes) for t, sizes in GGML_QUANT_SIZES.items()}  # id: (name, block, the block's bytes)
    size = _regular(gguf).st_size
    if not size:
        raise ModelLoadError(f"cannot read GGUF {gguf}: the file is empty")
    values, spans, arrays = {}, {}, set()
    try:
        with open(gguf, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            header = _Header(gguf, data)
            if (magic := bytes(data[header.skip(4, "the magic"): 4])) != b"GGUF":
                raise header.bad(f"not a GGUF file (it starts with {magic!r}, not b'GGUF')")
            at = header.skip(4, "the version")
            header.order = ">" if data[at: at + 2] == b"\0\0" else "<"  # the version's low half 0: big-endian, as gguf-py reads it
            if (version := struct.unpack_from(header.order + "I", data, at)[0]) not in GGUF_VERSIONS:
                raise header.bad(f"GGUF version {version}, not one of {GGUF_VERSIONS}")
            tensor_count = header.count("tensor_count", 8 + 4 + 8 + 4 + 8)  # a name's length, n_dims, a dimension, type, offset
            for i in range(header.count("kv_count", 8 + 4 + 1)):  # a key's length, its value's type, a byte
                start = header.at
                key = header.text(f"key {i}")
                kind = header.number("I", f"{key}'s value type")
                if key == "general.alignment" and kind != UINT32:
                    raise header.bad(f"general.alignment has value type {kind}, not UINT32 ({UINT32})")
                values[key], spans[key] = header.value(kind, key), (start, header.at)
                if kind == ARRAY:
                    arrays.add(key)
            alignment = values.get("general.alignment", 32)
            if alignment & (alignment - 1) or not alignment:
                raise header.bad(f"general.alignment {alignment} is not a power of two")
            table = header.at
            tensors = [header.tensor(i, types) for i in range(tensor_count)]
    except OSError as e:
        raise ModelLoadError(f"cannot read GGUF {gguf}: {e.strerror or one_line(e)}") from None
    start, end, seen = -(-header.at // alignment) * alignment, 0, set()  # the data, after the header padded to the alignment
    for info in tensors:  # one after the other, each padded to the alignment, as llama.cpp reads them
        tensor, offset, nbytes = f"tensor {info.name}", info.offset, info.nbytes
        if info.name in seen:
            raise header.bad(f"{tensor} is in the file twice")
        seen.add(info.name)
        if offset % alignment:
            raise header.bad(f"{tensor}'s offset {offset} is not a multiple of the alignment {alignment}")
        if nbytes > size - start - offset:
            raise header.bad(f"{tensor} ({nbytes} bytes at offset {offset}) ends past the end of the file ({size} bytes){CUT}")
        if offset != end:
            raise header.bad(f"{tensor} is at offset {offset}, but the tensors before it end at {end}: a type or shape is not as written")
        end = offset + -(-nbytes // alignment) * alignment
    if not isinstance(architecture := values.get("general.architecture"), str):
        raise header.bad("its metadata has no general.architecture")
    return Header(architecture, values, frozenset(arrays), tuple(dataclasses.replace(t, offset=start + t.offset) for t in tensors), header.order,
                  spans, (table, header.at), start, alignment, size)


def without_vocabulary(gguf: Path, header: Header, path: Path) -> None:
    """Write at ``path`` a copy of ``gguf``'s header without the tokenizer's arrays (the vocabulary, its merges and
    scores), its length written as the architecture's ``vocab_size`` where the file has none (transformers takes it
    from the vocabulary then), its tensors' bytes a hole of the same size (a sparse file: nothing written): what
    transformers makes a config of, read in a fraction of a second, where gguf-py's reader takes a value at a time
    through 300,000 strings (the 1.5B: 12 s)."""
    dropped = {key for key in header.arrays if key.startswith("tokenizer.")}
    vocabulary, key = header.values.get("tokenizer.ggml.tokens"), f"{header.architecture}.vocab_size"
    added = b""
    if isinstance(vocabulary, int) and "tokenizer.ggml.tokens" in dropped and key not in header.values:
        added = struct.pack(f"{header.order}Q", len(key)) + key.encode() + struct.pack(f"{header.order}II", UINT32, vocabulary)
    with open(gguf, "rb") as source, open(path, "wb") as out:
        def copy(start: int, end: int) -> None:
            source.seek(start)
            out.write(source.read(end - start))

        copy(0, 16)  # the magic, the version and tensor_count
        out.write(struct.pack(f"{header.order}Q", len(header.spans) - len(dropped) + bool(added)))
        for key, (start, end) in header.spans.items():
            if key not in dropped:
                copy(start, end)
        out.write(added)
        copy(*header.table)
        out.write(b"\0" * (-out.tell() % header.alignment))
        out.truncate(out.tell() + header.size - header.data)


class _Header:
    """A GGUF header read front to back, each read checked against the end of the file."""

    def __init__(self, gguf: Path, data: mmap.mmap) -> None:
        self.gguf, self.data, self.at, self.order = gguf, data, 0, "<"

    def bad(self, what: str) -> ModelLoadError:
        return ModelLoadError(f"cannot read GGUF {self.gguf}: {what}")

    def skip(self, size: int, what: str) -> int:
        """Where the next ``size`` bytes (``what``) start, read past; a ``ModelLoadError`` where they pass the end."""
        if size > len(self.data) - self.at:
            raise self.bad(f"{what} ({size} bytes at byte {self.at}) ends past the end of the file ({len(self.data)} bytes){CUT}")
        self.at += size
        return self.at - size

    def number(self, form: str, what: str) -> int:
        return struct.unpack_from(self.order + form, self.data, self.skip(struct.calcsize(form), what))[0]

    def count(self, what: str, least: int) -> int:
        """A count (uint64) of items ``least`` bytes long at least: no more than the rest of the file holds."""
        n = self.number("Q", what)
        if n * least > len(self.data) - self.at:
            raise self.bad(f"{what} is {n}, more than the {len(self.data) - self.at} bytes after it hold{CUT}")
        return n

    def text(self, what: str) -> str:
        size = self.number("Q", f"{what}'s length")
        try:
            return str(self.data[self.skip(size, what): self.at], "utf-8")
        except UnicodeDecodeError:
            raise self.bad(f"{what} is not UTF-8") from None

    def value(self, kind: int, key: str) -> object:
        """``key``'s value, of GGUF value type ``kind``; an array's, its item count (its strings checked: transformers
        decodes them)."""
        if kind == ARRAY:
            item = self.number("I", f"{key}'s item type")
            if item == STRING:
                count = self.count(f"{key}'s item count", 8)
                for _ in range(count):
                    self.text(f"a string of {key}")
            elif item in SCALARS:
                size = struct.calcsize(SCALARS[item])
                self.skip((count := self.count(f"{key}'s item count", size)) * size, key)
            else:
                raise self.bad(f"{key} is an array of value type {item}, which GGUF does not have (or an array of arrays)")
            return count
        if kind == STRING:
            return self.text(key)
        if kind in SCALARS:
            return self.number(SCALARS[kind], key)
        raise self.bad(f"{key} has value type {kind}, which GGUF does not have")

    def tensor(self, i: int, types: dict[int, tuple[str, int, int]]) -> TensorInfo:
        """Tensor ``i``'s info (its offset from the data's start), checked: 1 to ``MAX_DIMS`` positive dimensions, a
        type gguf-py knows (``types``: id: (name, block, the block's bytes)), rows of whole blocks."""
        name = self.text(f"tensor {i}'s name")
        tensor = f"tensor {name or i}"
        n_dims = self.number("I", f"{tensor}'s n_dims")
        if not 1 <= n_dims <= MAX_DIMS:
            raise self.bad(f"{tensor} has {n_dims} dimensions, not 1 to {MAX_DIMS}")
        dims = [self.number("Q", f"{tensor}'s dimensions") for _ in range(n_dims)]
        kind, offset = self.number("I", f"{tensor}'s type"), self.number("Q", f"{tensor}'s offset")
        if 0 in dims:
            raise self.bad(f"{tensor} has a dimension of 0: {dims}")
        if kind not in types:
            raise self.bad(f"{tensor} has type id {kind}, which is no GGML type gguf-py knows")
        type_name, block, block_bytes = types[kind]
        if dims[0] % block:
            raise self.bad(f"{tensor}'s rows of {dims[0]} are not whole {type_name} blocks of {block}")
        return TensorInfo(name, type_name, tuple(dims), offset, math.prod(dims) // block * block_bytes)


def check_metadata(gguf: Path, header: Header) -> None:
    """A ``ModelLoadError`` naming the key, the tensor and both values where the metadata a config is made from
    contradicts the tensors it describes, or is out of range, before anything is made from it: the vocabulary and
    width against the embedding's rows and columns, the heads against the attention's projections, the blocks against
    those the file holds, the special tokens against the vocabulary, ``POSITIVE``'s keys above 0 (a ``vocab_size`` of
    2e9 asked torch for 512 GB; ``head_count_kv`` 3 of 4 heads failed inside attention; a ``block_count`` of 1e9
    would build 1e9 layers, one of 1 ran the first of 2 blocks; a ``rope.freq_base`` of 0 made the logits NaN).
    Every other size is checked tensor by tensor (``_entries``)."""
    architecture = header.architecture

    def number(key: str) -> int | float | None:
        value = header.values.get(key)
        return value if isinstance(value, (int, float)) and key not in header.arrays else None

    def scalar(key: str) -> int | None:
        value = number(f"{architecture}.{key}")
        return None if value is None else int(value)

    def refused(what: str) -> ModelLoadError:
        return ModelLoadError(f"cannot read GGUF {gguf}: {what}")

    def bad(what: str) -> ModelLoadError:
        return refused(f"{architecture}.{what}")

    for key in POSITIVE:
        if (value := number(f"{architecture}.{key}")) is not None and not 0 < value < math.inf:
            raise bad(f"{key} is {value:g}, not a finite number above 0")
    tokens = header.values.get("tokenizer.ggml.tokens") if "tokenizer.ggml.tokens" in header.arrays else None
    for name in TOKEN_IDS if tokens is not None else ():
        if (token := number(f"tokenizer.ggml.{name}_token_id")) is not None and not 0 <= token < tokens:
            raise refused(f"tokenizer.ggml.{name}_token_id is {token}, but tokenizer.ggml.tokens holds {tokens} tokens")
    rows = {t.name: t.rows for t in header.tensors}
    blocks = {int(name.split(".")[1]) for name in rows if name.startswith("blk.") and name.split(".")[1].isdigit()}
    if (count := scalar("block_count")) is not None and count != len(blocks):
        raise bad(f"block_count is {count}, but the file holds tensors for {len(blocks)} blocks")
    embedding = rows.get("token_embd.weight")
    for key, value, found, what in (("vocab_size", scalar("vocab_size"), embedding and embedding[0], "rows"),
                                    ("embedding_length", scalar("embedding_length"), embedding and embedding[-1], "columns")):
        if value is not None and found and value != found:
            raise bad(f"{key} is {value}, but token_embd.weight has {found} {what}")
    heads, kv_heads, width = scalar("attention.head_count"), scalar("attention.head_count_kv"), scalar("embedding_length")
    if heads is None:
        return
    kv_heads = heads if kv_heads is None else kv_heads
    if not 0 < kv_heads <= heads or heads % kv_heads:
        raise bad(f"attention.head_count {heads} is not a multiple of {architecture}.attention.head_count_kv {kv_heads}")
    head = scalar("attention.key_length") or (width // heads if width else None)
    if head == 0:
        raise bad(f"attention.head_count {heads} is more than {architecture}.embedding_length {width}: heads of 0")
    for key, count, tensor in (("attention.head_count", heads, "blk.0.attn_q.weight"), ("attention.head_count_kv", kv_heads, "blk.0.attn_k.weight")):
        if head and tensor in rows and rows[tensor][0] != count * head:
            raise bad(f"{key} {count} (heads of {head}) makes {count * head} rows, but {tensor} has {rows[tensor][0]}")


def wrong_shape(gguf: Path, tensor: str, stored: list[int], parameter: str, shape) -> ModelLoadError:
    return ModelLoadError(f"cannot read GGUF {gguf}: tensor {tensor} is {' x '.join(map(str, stored))} in the file, but the "
                          f"config makes {parameter} {' x '.join(map(str, shape))}")


def one_line(e: BaseException) -> str:
    """An exception's first line (its type where it says nothing)."""
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def config_of(gguf: Path, header: Header):
    """transformers' config of ``gguf``, made from a copy of its header without the vocabulary
    (``without_vocabulary``: 11 -> 0.04 s for the 1.5B's); from the file itself where that config's vocabulary is not
    the file's (an architecture whose vocab_size transformers takes only from the vocabulary)."""
    from transformers import AutoConfig

    log = logging.getLogger("transformers.modeling_gguf_pytorch_utils")  # it warns of the vocabulary the copy lacks
    level = log.level
    with tempfile.TemporaryDirectory(prefix="lookahead-header-") as tmp:
        without_vocabulary(gguf, header, Path(tmp) / gguf.name)
        try:
            log.setLevel(logging.ERROR)
            config = AutoConfig.from_pretrained(tmp, gguf_file=gguf.name)
        finally:
            log.setLevel(level)
    config.name_or_path = str(gguf.parent)  # as read from the file itself
    vocabulary = header.values.get(f"{header.architecture}.vocab_size", header.values.get("tokenizer.ggml.tokens"))
    if vocabulary is not None and config.vocab_size != vocabulary:
        config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    return config


def tokenizer_of(gguf: Path, header: Header, config) -> tuple[object | None, str]:
    """(``gguf``'s tokenizer, ""), or (None, "") for a file without one (no ``tokenizer.ggml.tokens``: token ids only),
    or (None, why) where transformers cannot read the one it has (said, so that a text prompt's refusal is not all a
    user learns: dropped silently, it had been told the model had none). Its class is the one ``AutoTokenizer`` picks
    for ``config`` (a GGUF names none of its own), made directly: asked to pick, ``AutoTokenizer`` parses the whole
    file again for a config where transformers' fast reader does not cover the architecture (SmolLM2's Llama: 6.5 ->
    0.5 s)."""
    from transformers import TokenizersBackend
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING

    if "tokenizer.ggml.tokens" not in header.values:
        return None, ""
    try:
        return TOKENIZER_MAPPING.get(type(config), TokenizersBackend).from_pretrained(gguf.parent, gguf_file=gguf.name), ""
    except Exception as e:  # transformers raises many types for a tokenizer it cannot read
        return None, f"{gguf.name}'s tokenizer cannot be read ({type(e).__name__}: {one_line(e)})"


def save_tokenizer(tokenizer, directory: Path, entry: Path) -> None:
    """``tokenizer`` saved into ``directory`` (the one ``entry`` is made in); an ``OSError`` naming ``entry`` where
    that fails: the tokenizers library raises a bare ``Exception`` for a failed write ("No space left on device"),
    which reached the user as a traceback."""
    try:
        tokenizer.save_pretrained(directory)
    except Exception as e:
        raise OSError(f"cannot write {entry}: {one_line(e)}") from None


def hf_names(gguf: Path, model, processor, architecture: str) -> dict[str, str]:
    """transformers' ``get_gguf_hf_weights_map`` (the file's tensor names -> ``model``'s parameters) with one gguf-py
    name map for the whole model: transformers builds one for every module it recurses into, ~25 ms each (SmolLM2's
    397 modules: 10 s of a first load)."""
    import gguf as gguf_py

    arch = next((a for a, name in gguf_py.MODEL_ARCH_NAMES.items() if name == architecture), None)
    if arch is None:
        raise ModelLoadError(f"cannot read GGUF {gguf}: gguf-py names no tensors of architecture {architecture!r}")
    name_map = gguf_py.get_tensor_name_map(arch, model.config.num_hidden_layers)

    def walk(module, qual: str) -> dict[str, str]:
        found = {}
        for hf in map(processor.preprocess_name, module.state_dict()):
            name, dot, suffix = hf.rpartition(".") if hf.endswith((".weight", ".bias")) else (hf, "", "")
            if (gguf_name := name_map.get_name(name)) is None:
                processor.perform_fallback_tensor_mapping(found, dot + suffix, qual, hf)
            else:
                found[gguf_name + dot + suffix] = qual + hf
        for name, child in module.named_children():  # Bloom-like files: converted from a submodule
            found.update({k: v for k, v in walk(child, f"{qual}{name}.").items() if k not in found})
        return found

    return walk(model, "")
