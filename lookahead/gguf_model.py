"""A model built straight from a GGUF file: its linears on the file's own blocks, never a dense copy of them.

The first load of a file reads it once (``prepare``): its header checked against its bytes as llama.cpp checks it
(``check_header``: gguf-py's and transformers' readers trust it), its config, tokenizer and chat template from its
metadata (transformers' GGUF readers), which of its tensors becomes what (transformers' name mapping and tensor
processor for the architecture, on a skeleton of the model), and every linear's blocks decoded and laid out for the
kernels (``linear_kernels.pack_quantized``), one tensor at a time, into ``<cache>/blocks/<file>-<key>/``: ``blocks.bin``,
``integer.bin`` (the integer kernel's layouts: values in its lanes' order, the K types' scales per 256 k's, the legacy types' fp16 ones),
the small files, and ``index.json``. Each load (``load``) then builds the model on the meta device (parameters only:
buffers such as RoPE's frequencies are computed as usual), memory-maps the laid-out blocks into the linears
(``kernels.pack``), looks the embedding up from the file's own blocks (``quants.QuantEmbedding``) and dequantizes
the few small tensors (norms, biases) from the file, through the processor (Gemma's norm offset). The GGUF
reader, ~7 s on a 150k vocabulary, and the mapping are not run again.

A file is read only once what it says agrees with itself: its header with its bytes (``check_header``), its
metadata with the tensors it describes (``check_metadata``: the vocabulary against the embedding's rows, the heads
against the projections, before a config is made from it), and every tensor's shape with the one the config gives
its parameter (``_entries``, on a model on the meta device: nothing is allocated from the metadata). The cache
trusts nothing it did not check (``_checked``): its index holds a digest of itself, each file's size and sha256
and the GGUF's; each load checks the sizes (a short file is never mapped) and hashes the files that changed since
they were last found whole (``check_files``), and an entry that is not whole is made again, in one line saying
why. Processes loading one file at once take its lock (``held``): one makes the entry while the others wait, and
what a writer killed midway left is removed by the next (``sweep``).

What the tensors hold is exactly what transformers' dequantizing load gives (the dense route ``models.convert_gguf``,
kept as the tests' oracle): a linear's blocks dequantize to its weight bit for bit (``quants``), Llama's q and k
rows in transformers' order (``quants.head_order``). A linear whose type the kernels do not run, or whose
architecture's processor changes linears in ways not mirrored here, is dequantized at each load instead (the
report says which).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import math
import mmap
import os
import shutil
import stat
import struct
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch
from torch import nn

from lookahead import linear_kernels, quants
from lookahead.kernels import SIBLINGS
from ngram_pool.files import written_whole

LAYOUT = 8  # the cache's layout: a change to it (or to pack_quantized's or pack_supers' blocks) must bump this
ALIGN = 64  # each laid-out weight starts at a multiple of this in blocks.bin
CHUNK = 4096  # rows decoded and laid out at a time (a multiple of linear_kernels.BLOCK: blocks of rows are independent)
GGUF_VERSIONS = (2, 3)  # the versions gguf-py reads
MAX_DIMS = 4  # GGML_MAX_DIMS
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}  # GGUF value types' formats
STRING, ARRAY, UINT32 = 8, 9, 4  # the other GGUF value types, and general.alignment's
CUT = ": the file is cut short, or its header lies"
SETTLE_NS = 2 * 10 ** 9  # a file changed this close to its check is checked again next time (``check_files``)
Progress = Callable[[str], None]


class ModelLoadError(ValueError):
    """A model could not be found, fetched, converted or loaded; the message says which and why, in one line."""


@dataclass(frozen=True)
class Prepared:
    """A GGUF file's cache directory, ready to ``load``."""

    directory: Path
    index: dict  # index.json: {"gguf", "architecture", "tensors": [...], "left": [...], "source", "files", "check"}


@contextlib.contextmanager
def held(target: Path, progress: Progress | None, shared: bool = False) -> Iterator[bool]:
    """``target``'s lock (``.<name>.lock`` beside it) for the block: shared by processes reading ``target``, or held
    alone by the one writing it, which first removes what a writer that died left (``leftovers``). An flock: the
    kernel drops it when its holder dies, however it dies, so a killed writer never blocks the next. Yields whether
    it is held: ``progress`` None does not wait (False where another process holds it), else a wait is said in one
    line."""
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        lock = open(target.parent / f".{target.name}.lock", "a+b")
    except OSError:
        if not shared:
            raise
        yield True  # a cache no one can write (a read-only disk): no writer to wait for
        return
    with lock:
        mode = fcntl.LOCK_SH if shared else fcntl.LOCK_EX
        try:
            fcntl.flock(lock, mode | fcntl.LOCK_NB)
        except BlockingIOError:
            if progress is None:
                yield False
                return
            progress(f"waiting for another process to finish with {target}")
            fcntl.flock(lock, mode)
        if not shared:
            for path in leftovers(target):
                shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
        yield True


def _owner(name: str) -> str | None:
    """The name whose writer made the file or directory ``name`` (``directory_whole``'s ``.tmp-<name>.<random>`` and
    ``.stale-<name>.<random>``, ``written_whole``'s ``.<name>.<pid>-<thread>.partial``), or None for anything else."""
    for prefix, suffix in ((".tmp-", ""), (".stale-", ""), (".", ".partial")):
        if name.startswith(prefix) and name.endswith(suffix):
            return name[len(prefix): len(name) - len(suffix)].rpartition(".")[0] or None
    return None


def leftovers(target: Path) -> list[Path]:
    """What writers of ``target`` left beside it: to be removed only by one holding its lock alone (``held``). A
    ``.partial`` file of a process still running is kept: an older version wrote them without the lock."""
    found = [path for path in target.parent.iterdir() if _owner(path.name) == target.name] if target.parent.is_dir() else []
    return [path for path in found if not (path.name.endswith(".partial") and _running(path.name))]


def _running(partial: str) -> bool:
    """Whether the process ``written_whole`` names in ``partial`` (``.<name>.<pid>-<thread>.partial``) runs."""
    pid = partial.removesuffix(".partial").rpartition(".")[2].partition("-")[0]
    try:
        os.kill(int(pid), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:  # another user's
        pass
    return True


def sweep(directory: Path) -> None:
    """Remove what writers that died left in ``directory`` (a kill or a full disk mid-write left a 2.4 GB
    ``.tmp-`` entry of the 1.5B's): each owner's lock is taken without waiting, so a live writer's are kept."""
    for owner in {_owner(path.name) for path in directory.iterdir()} - {None} if directory.is_dir() else ():
        with contextlib.suppress(OSError), held(directory / owner, None):  # a read-only cache's stay
            pass


@contextlib.contextmanager
def directory_whole(target: Path) -> Iterator[Path]:
    """A directory to fill that becomes ``target`` only when the block ends (a temporary one beside it, renamed):
    a cache entry a reader finds whole or not at all; on an exception the temporary one is removed. The caller holds
    ``target``'s lock (``held``): a damaged ``target`` is moved aside, then removed (a process that mapped its files
    keeps them: they are unlinked, never written)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".tmp-{target.name}."))
    try:
        yield tmp
        if target.exists():
            stale = tempfile.mkdtemp(dir=target.parent, prefix=f".stale-{target.name}.")
            os.replace(target, stale)
            shutil.rmtree(stale, ignore_errors=True)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _status(status: os.stat_result) -> list[int]:
    """What changes whenever a file's bytes are written through the filesystem: its ctime, which no one can set back
    (a copy, a truncation, an edit or a file renamed over it change it; ``touch -d`` sets the mtime, and moves the
    ctime to now)."""
    return [status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns, status.st_ctime_ns]


def check_files(files: dict[str, tuple[Path, int | None, str]], stamps: Path | None) -> str | None:
    """Why the first of ``files`` ({what to call it: (path, its size or None, its sha256)}) is not the file recorded,
    or None.

    A size is checked always (a short file is never mapped: the kernels read past its end, a SIGSEGV). The bytes are
    hashed only where ``stamps`` (a JSON file: key -> the status its file had when its bytes were last found whole)
    does not hold the file's status now: every write through the filesystem moves a file's ctime (``_status``), so
    a file hashes once after it is written, copied or edited, not at each load (a 1.5B's laid-out blocks are ~2.5 GB,
    seconds to hash; a stat is microseconds). A file changed less than ``SETTLE_NS`` before its check is not
    stamped: timestamps are coarser than writes, and a write in the same tick would keep its status."""
    known = _stamps(stamps)
    started, found, hashing = time.time_ns(), {}, {}
    for key, (path, size, _) in files.items():
        try:
            found[key] = path.stat()
        except OSError:
            return f"{key} is missing"
        if size is not None and found[key].st_size != size:
            return f"{key} is {found[key].st_size} bytes, not the {size} expected"
        if known.get(key) != _status(found[key]):
            hashing[key] = path
    with ThreadPoolExecutor() as pool:  # hashlib lets go of the GIL: the files hash side by side
        digests = dict(zip(hashing, pool.map(sha256, hashing.values())))
    for key, digest in digests.items():
        if digest != files[key][2]:
            return f"{key} has sha256 {digest[:16]}..., not the {files[key][2][:16]}... expected"
    settled = {key: _status(found[key]) for key in digests if found[key].st_ctime_ns < started - SETTLE_NS}
    if stamps is not None and settled:
        with contextlib.suppress(OSError):  # a cache on a read-only disk is checked at each load instead
            with written_whole(stamps) as out:
                out.write(json.dumps(_stamps(stamps) | settled).encode())
    return None


def _stamps(stamps: Path | None) -> dict:
    """``check_files``' stamps (none where the file is missing or not a JSON object of them)."""
    try:
        known = json.loads(stamps.read_text()) if stamps is not None else {}
    except (OSError, ValueError):
        return {}
    return known if isinstance(known, dict) else {}


def cache_key(gguf: Path, status: os.stat_result) -> str:
    """The file's cache directory name: its name, and a hash of its path, size and modification time (``status``) and ``LAYOUT``."""
    key = hashlib.sha256(f"{gguf.resolve()}|{status.st_size}|{status.st_mtime_ns}|{LAYOUT}".encode()).hexdigest()[:12]
    return f"{gguf.stem}-{key}"


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


def check_header(gguf: Path) -> None:
    """A ``ModelLoadError`` naming ``gguf`` and what is wrong where it is not a GGUF file whose header its bytes bear
    out, checked as llama.cpp checks it before gguf-py's and transformers' readers trust the header (a count of
    2^40 or a key length of 2^60 made them fail far away, blaming a config file; a wrong type or offset read other
    bytes as weights). Every count and length is bounded by the bytes left: nothing is allocated or looped over
    beyond the file's size."""
    from gguf import GGML_QUANT_SIZES

    types = {int(t): (t.name, *sizes) for t, sizes in GGML_QUANT_SIZES.items()}  # id: (name, block, the block's bytes)
    size = _regular(gguf).st_size
    if not size:
        raise ModelLoadError(f"cannot read GGUF {gguf}: the file is empty")
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
            alignment = 32
            for i in range(header.count("kv_count", 8 + 4 + 1)):  # a key's length, its value's type, a byte
                key = header.text(f"key {i}")
                kind = header.number("I", f"{key}'s value type")
                if key != "general.alignment":
                    header.value(kind, key)
                elif kind != UINT32:
                    raise header.bad(f"general.alignment has value type {kind}, not UINT32 ({UINT32})")
                elif (alignment := header.number("I", key)) & (alignment - 1) or not alignment:
                    raise header.bad(f"general.alignment {alignment} is not a power of two")
            tensors = [header.tensor(i, types) for i in range(tensor_count)]
    except OSError as e:
        raise ModelLoadError(f"cannot read GGUF {gguf}: {e.strerror or one_line(e)}") from None
    start, end = -(-header.at // alignment) * alignment, 0  # the data, after the header padded to the alignment
    for tensor, offset, nbytes in tensors:  # one after the other, each padded to the alignment, as llama.cpp reads them
        if offset % alignment:
            raise header.bad(f"{tensor}'s offset {offset} is not a multiple of the alignment {alignment}")
        if nbytes > size - start - offset:
            raise header.bad(f"{tensor} ({nbytes} bytes at offset {offset}) ends past the end of the file ({size} bytes){CUT}")
        if offset != end:
            raise header.bad(f"{tensor} is at offset {offset}, but the tensors before it end at {end}: a type or shape is not as written")
        end = offset + -(-nbytes // alignment) * alignment


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

    def value(self, kind: int, key: str) -> None:
        """Read past ``key``'s value, of GGUF value type ``kind`` (its strings checked: transformers decodes them)."""
        if kind == ARRAY:
            item = self.number("I", f"{key}'s item type")
            if item == STRING:
                for _ in range(self.count(f"{key}'s item count", 8)):
                    self.text(f"a string of {key}")
            elif item in SCALARS:
                size = struct.calcsize(SCALARS[item])
                self.skip(self.count(f"{key}'s item count", size) * size, key)
            else:
                raise self.bad(f"{key} is an array of value type {item}, which GGUF does not have (or an array of arrays)")
        elif kind == STRING:
            self.text(key)
        elif kind in SCALARS:
            self.skip(struct.calcsize(SCALARS[kind]), key)
        else:
            raise self.bad(f"{key} has value type {kind}, which GGUF does not have")

    def tensor(self, i: int, types: dict[int, tuple[str, int, int]]) -> tuple[str, int, int]:
        """("tensor <name>", its offset, its bytes) from tensor ``i``'s info, checked: 1 to ``MAX_DIMS`` positive
        dimensions, a type gguf-py knows (``types``: id: (name, block, the block's bytes)), rows of whole blocks."""
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
        return tensor, offset, math.prod(dims) // block * block_bytes


def _processor(architecture: str, config):
    """transformers' tensor processor for ``architecture``, and how our blocks follow it: "as stored", "heads"
    (Llama's q and k rows reordered) or None (it changes linears in ways blocks do not mirror: dense)."""
    from transformers.modeling_gguf_pytorch_utils import (TENSOR_PROCESSORS, Gemma2TensorProcessor, LlamaTensorProcessor,
                                                          TensorProcessor)

    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=config.to_dict())
    blocks = {TensorProcessor: "as stored", Gemma2TensorProcessor: "as stored", LlamaTensorProcessor: "heads"}.get(type(processor))
    return processor, blocks


def _skeleton(config, dtype: torch.dtype, meta: bool = False) -> nn.Module:
    """The model of ``config`` with every parameter on the meta device (its buffers computed, on the CPU), or wholly
    there (``meta``: nothing allocated, for shapes alone; ``init_empty_weights`` allocates each parameter first)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with torch.device("meta") if meta else init_empty_weights(include_buffers=False):
        return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


def _module_names(model: nn.Module) -> tuple[str, str]:
    """(the input embedding's module name, the output layer's)."""
    names = {module: name for name, module in model.named_modules()}
    return names[model.get_input_embeddings()], names[model.get_output_embeddings()]


def _read(gguf: Path, entry: dict) -> np.ndarray:
    """A tensor's bytes from the file, shaped as gguf-py's reader gives them."""
    raw = np.fromfile(gguf, dtype=np.uint8, count=entry["nbytes"], offset=entry["offset"])
    if raw.size != entry["nbytes"]:
        raise ModelLoadError(f"{gguf}: tensor {entry['gguf']} ends past the end of the file")
    return raw.view(entry["dtype"]).reshape(entry["data_shape"])


def _sibling_order(name: str) -> tuple[str, int, str]:
    """Sort key that puts a module's sibling linears (q, k, v; gate, up) next to each other in ``SIBLINGS`` order,
    so a product of them is one view of ``blocks.bin``."""
    parent, _, leaf = name.rpartition(".")
    order = [leaf_name for names in SIBLINGS for leaf_name in names]
    return parent, order.index(leaf) if leaf in order else len(order), leaf


def tokenizer_of(gguf: Path, model_type: str):
    """``gguf``'s tokenizer, or None for a file without one (token ids only). Its class named by the config's model
    type: untyped, transformers parses the whole file again (the vocabulary too) for a config that names it
    (Qwen2.5-Coder-0.5B 9.7 -> 1.0 s, Gemma 3 15.0 -> 2.5 s, the same tokenizer); untyped where that type names none."""
    from transformers import AutoTokenizer

    for typed in ({"tokenizer_type": model_type}, {}):
        try:
            return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, **typed)
        except Exception:  # a type that names no tokenizer class; then a file without a tokenizer
            continue
    return None


def prepare(gguf: Path, cache_dir: Path, progress: Progress) -> Prepared:
    """``gguf``'s cache directory, made on first use and made again where it is not whole (``_checked``: one line
    says why); a ``ModelLoadError`` for a file it cannot read."""
    with _entry(gguf, cache_dir, progress) as prepared:
        return prepared


@contextlib.contextmanager
def _entry(gguf: Path, cache_dir: Path, progress: Progress) -> Iterator[Prepared]:
    """``prepare``'s entry, checked, and kept from being made again by another process while the block reads it.
    Processes loading one file at once wait for the one that makes its entry (its lock, ``held``), then read it."""
    status = _regular(gguf)
    target = cache_dir / "blocks" / cache_key(gguf, status)
    sweep(target.parent)
    for shared in (True, False):  # read under a shared lock; where it must be made, again under the writer's
        with held(target, progress, shared):
            index, why = _checked(target, gguf)
            if index is None and not shared:
                progress(f"making {target} again: {why}" if why else
                         f"reading {gguf.name} once: its config, tokenizer and blocks laid out for the kernels (cached in {target})")
                index = _build(gguf, status, target)
            if index is not None:
                yield Prepared(target, index)
                return


def _index_check(index: dict) -> str:
    """The digest an index holds of the rest of itself: an index.json edited, or cut short, is not believed."""
    return hashlib.sha256(json.dumps({k: v for k, v in index.items() if k != "check"}, sort_keys=True).encode()).hexdigest()


def _checked(target: Path, gguf: Path) -> tuple[dict | None, str]:
    """(the entry's index, "") where its index and every file it lists are as written (``check_files``) and ``gguf``
    is the file they were made from (its size and sha256: another file given the same name, size and time is not);
    else (None, why not: "" where there is no entry)."""
    try:
        index = json.loads((target / "index.json").read_text())
    except FileNotFoundError:
        return None, ""
    except (OSError, ValueError) as e:
        return None, f"its index.json is unreadable ({one_line(e)})"
    if not isinstance(index, dict) or index.get("check") != _index_check(index):
        return None, "its index.json is an older version's, without checksums" if "check" not in index and "tensors" in index \
            else "its index.json is not the one written"
    files = {name: (target / name, size, digest) for name, (size, digest) in index["files"].items()}
    why = check_files({gguf.name: (gguf, *index["source"]), **files}, target / "verified.json")
    return (None, why) if why else (index, "")


def _build(gguf: Path, status: os.stat_result, target: Path) -> dict:
    """Read ``gguf`` (see the module doc) into the entry ``target``; its index, which lists every file's size and
    sha256, and the source's."""
    from transformers import AutoConfig

    check_header(gguf)
    try:
        import gguf as gguf_py

        reader = gguf_py.GGUFReader(gguf)
        architecture = str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8")
    except Exception as e:  # gguf-py raises many types for an unreadable file
        raise ModelLoadError(f"cannot read GGUF {gguf}: {one_line(e)}") from None
    check_metadata(gguf, reader, architecture)
    try:
        config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = _skeleton(config, torch.float32, meta=True)
    except Exception as e:  # transformers raises many types for an unsupported file
        raise ModelLoadError(f"cannot read GGUF {gguf}: {one_line(e)}") from None
    tokenizer = tokenizer_of(gguf, config.model_type)
    processor, blocks = _processor(architecture, config)
    entries, left = _entries(gguf, reader, model, processor, blocks)
    with directory_whole(target) as tmp:
        config.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        _lay_out(gguf, entries, model, blocks == "heads", tmp)
        for entry in entries:  # the embedding's scales, checked once here (its rows are decoded as they are looked up)
            if entry["role"] == "embedding":
                for q in _decoded(entry, _read(gguf, entry)):
                    _check_finite(gguf, entry, q.scale, q.offset)
        paths = sorted(tmp.iterdir())
        with ThreadPoolExecutor() as pool:
            digests = list(pool.map(sha256, [gguf, *paths]))
        index = {"gguf": str(gguf.resolve()), "architecture": architecture, "tensors": entries, "left": left,
                 "source": [status.st_size, digests[0]], "files": {p.name: [p.stat().st_size, d] for p, d in zip(paths, digests[1:])}}
        index["check"] = _index_check(index)
        (tmp / "index.json").write_text(json.dumps(index))
    return index


def check_metadata(gguf: Path, reader, architecture: str) -> None:
    """A ``ModelLoadError`` naming the key, the tensor and both values where the metadata a config is made from
    contradicts the tensors it describes, before anything is made from it: the vocabulary and width against the
    embedding's rows and columns, the heads against the attention's projections, the blocks against those the file
    holds (a ``vocab_size`` of 2e9 asked torch for 512 GB; ``head_count_kv`` 3 of 4 heads failed inside attention;
    a ``block_count`` of 1e9 would build 1e9 layers). Every other size is checked tensor by tensor (``_entries``)."""
    def scalar(key: str) -> int | None:
        field = reader.fields.get(f"{architecture}.{key}")
        return int(field.contents()) if field is not None and len(field.types) == 1 and field.types[0] != STRING else None

    def bad(what: str) -> ModelLoadError:
        return ModelLoadError(f"cannot read GGUF {gguf}: {architecture}.{what}")

    rows = {t.name: [int(d) for d in reversed(t.shape)] for t in reader.tensors}  # (rows, columns), as torch holds them
    blocks = {int(name.split(".")[1]) for name in rows if name.startswith("blk.") and name.split(".")[1].isdigit()}
    if (count := scalar("block_count")) is not None and count > len(blocks):
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


def _entries(gguf: Path, reader, model: nn.Module, processor, blocks: str | None) -> tuple[list[dict], list[str]]:
    """(what each of the file's tensors becomes in ``model`` (on the meta device): its index entry, with its role:
    "blocks" (a linear on the file's blocks), "embedding" (looked up from them) or "dense" (dequantized at each
    load); one line for each linear left dense, and why). Each tensor's shape is the one ``model``'s config gives its
    parameter (a ``ModelLoadError`` naming both: the bytes of a 512 x 128 tensor read as 256 x 256 ran scrambled),
    where the architecture's processor keeps shapes (else at load, once processed), and every parameter has one."""
    from transformers.modeling_gguf_pytorch_utils import get_gguf_hf_weights_map

    mapping = get_gguf_hf_weights_map(model, processor)
    embedding, output = _module_names(model)
    modules, parameters = dict(model.named_modules()), dict(model.named_parameters())
    tied = getattr(model.config, "tie_word_embeddings", False) and all(t.name != "output.weight" for t in reader.tensors)
    entries, left = [], []
    for tensor in reader.tensors:
        hf = mapping.get(tensor.name)
        if hf is None:
            continue
        stored = [int(d) for d in reversed(tensor.shape)]
        if blocks is not None and hf in parameters and stored != list(parameters[hf].shape):
            raise wrong_shape(gguf, tensor.name, stored, hf, parameters[hf].shape)
        parameters.pop(hf, None)
        kind = tensor.tensor_type.name
        entry = {"gguf": tensor.name, "hf": hf, "type": kind, "offset": int(tensor.data_offset), "nbytes": int(tensor.n_bytes),
                 "shape": [int(d) for d in tensor.shape], "data_shape": list(tensor.data.shape), "dtype": str(tensor.data.dtype),
                 "role": "dense"}
        module_name, _, leaf = hf.rpartition(".")
        quantized = kind in quants.DECODERS and leaf == "weight"
        if quantized and module_name == embedding:
            entry["role"] = "embedding"
            if tied and type(modules.get(output)) is nn.Linear:  # the output layer multiplies by the same blocks
                entries.append({**entry, "hf": f"{output}.weight", "role": "blocks"})
        elif module_name == embedding and tied and type(modules.get(output)) is nn.Linear:  # on its dense table (``load``)
            left.append(f"{tensor.name} as the tied output layer: type {kind} not run quantized")
        elif type(modules.get(module_name)) is nn.Linear and leaf == "weight":
            linear = modules[module_name]
            why = (f"type {kind} not run quantized" if not quantized else "its architecture's processor changes it" if blocks is None
                   else None if linear_kernels.quant_fits(linear.out_features, linear.in_features, quants.QK) else "a shape the kernel does not take")
            entry["role"] = "dense" if why else "blocks"
            if why:
                left.append(f"{tensor.name}: {why}")
        entries.append(entry)
    if parameters:
        raise ModelLoadError(f"cannot read GGUF {gguf}: the file has no tensor for {next(iter(parameters))}"
                             + (f" (and {len(parameters) - 1} more)" if len(parameters) > 1 else ""))
    return entries, left


def wrong_shape(gguf: Path, tensor: str, stored: list[int], parameter: str, shape) -> ModelLoadError:
    return ModelLoadError(f"cannot read GGUF {gguf}: tensor {tensor} is {' x '.join(map(str, stored))} in the file, but the "
                          f"config makes {parameter} {' x '.join(map(str, shape))}")


def kept_dense(left: list[str]) -> str:
    """``left`` (the lines ``_entries`` gives for the linears left dense, "<tensor>: <why>") as one line: each reason
    with its count and first tensor."""
    reasons: dict[str, list[str]] = {}
    for line in left:
        tensor, _, why = line.partition(": ")
        reasons.setdefault(why, []).append(tensor)
    return "; ".join(f"{len(tensors)} linear{'s' * (len(tensors) > 1)}, {why} ({tensors[0]}{', ...' * (len(tensors) > 1)})"
                     for why, tensors in reasons.items())


def _lay_out(gguf: Path, entries: list[dict], model: nn.Module, heads: bool, directory: Path) -> None:
    """Write each "blocks" entry's weight in the kernels' layout to ``blocks.bin`` and, where the integer kernel runs
    it, in its own (``linear_kernels.lay_out``: values in its lanes' order, the K types' scales per 256 k's, the legacy types'
    fp16 scales) to ``integer.bin`` (siblings adjacent, each aligned), and record where in its entry. ``heads``: Llama's q and
    k rows reordered as transformers' processor does."""
    config = model.config
    counts = {"q_proj": config.num_attention_heads, "k_proj": getattr(config, "num_key_value_heads", None) or config.num_attention_heads}
    with open(directory / "blocks.bin", "wb") as out, open(directory / "integer.bin", "wb") as integer:
        for entry in sorted((e for e in entries if e["role"] == "blocks"), key=lambda e: _sibling_order(e["hf"][: -len(".weight")])):
            linear = model.get_submodule(entry["hf"][: -len(".weight")])
            n, k = linear.out_features, linear.in_features
            raw = _read(gguf, entry).reshape(n, -1)  # (n, bytes a row)
            leaf = entry["hf"].split(".")[-2]
            if heads and leaf in counts and n % (2 * counts[leaf]) == 0:
                raw = raw[quants.head_order(n, counts[leaf]).numpy()]
            for f in (out, integer):
                f.write(b"\0" * (-f.tell() % ALIGN))
            entry.update(at=out.tell(), n=n, k=k, integer_at=integer.tell())
            for q in _decoded(entry, raw):
                _check_finite(gguf, entry, q.scale, q.offset)
                out.write(linear_kernels.pack_quantized(q.q, q.scale, q.offset, q.group, q.bits, torch.float32).packed.numpy().data)
                own = linear_kernels.lay_out(q, torch.float32, integer=True) if linear_kernels.quant_fits(n, k, q.group, integer=True) else None
                if own is not None:  # every chunk alike: the rows' scales are all the file's
                    integer.write(own.packed.numpy().data)
                    entry.update(integer_bits=own.bits, supers=own.supers, halves=own.halves)
            entry.update(size=out.tell() - entry["at"], bits=q.bits, group=q.group, offsets=q.offset is not None)
            entry.update(integer_size=integer.tell() - entry["integer_at"])


def _decoded(entry: dict, raw: np.ndarray):
    """A tensor's rows decoded ``CHUNK`` at a time (decoding a 150k-row head whole took ~2 GB)."""
    k, n = entry["shape"]
    raw = raw.reshape(n, -1)
    for start in range(0, n, CHUNK):
        yield quants.from_blocks(raw[start:start + CHUNK], entry["type"], min(CHUNK, n - start), k)


def weight_kinds(prepared: Prepared, integer: bool = False) -> str:
    """What ``kernels.weight_kinds`` will say of the model ``load`` builds (the cost curve's key), from the index."""
    kinds = {quants.kind(e["integer_bits"], e["group"], e["offsets"], e["supers"], e["halves"]) if integer and e["integer_size"]
             else quants.kind(e["bits"], e["group"], e["offsets"]) for e in prepared.index["tensors"] if e["role"] == "blocks"}
    return ", ".join(sorted(kinds | ({"dense"} if prepared.index["left"] else set()))) or "dense"


def dense_parameters(prepared: Prepared) -> int:
    """The dequantized model's parameters, roughly: its linears' and its embedding's (norms and biases are few)."""
    tensors = prepared.index["tensors"]
    linears = sum(e["n"] * e["k"] for e in tensors if e["role"] == "blocks" and e["gguf"] != "token_embd.weight")
    return linears + sum(int(np.prod(e["shape"])) for e in tensors if e["role"] != "blocks")


def load(gguf: Path, dtype: torch.dtype, cache_dir: Path, progress: Progress, dense: bool = False, integer: bool = False):
    """(model, tokenizer or None, {module name: laid-out blocks}, lines for the linears left dense); see the module
    doc. ``kernels.pack(model, quantized=layouts)`` finishes it: its linears on the blocks are on the meta device
    until then. ``dense``: every tensor dequantized instead (``--weights dense``, the stock kernels), still
    straight from the file: the model holds its dense weights once, and nothing dense is written anywhere.
    ``integer``: for the integer kernel, the blocks as it reads them where it has a layout of its own (``integer.bin``)."""
    with _entry(gguf, cache_dir, progress) as prepared:  # read and mapped while no other process can make it again
        return _built(gguf, prepared, dtype, dense, integer)


def _built(gguf: Path, prepared: Prepared, dtype: torch.dtype, dense: bool, integer: bool):
    """``load``'s model, from its entry ``prepared``, checked."""
    import gguf as gguf_py
    from transformers import AutoConfig, AutoTokenizer

    directory, index = prepared.directory, prepared.index
    config = AutoConfig.from_pretrained(directory)
    config._name_or_path = str(gguf)  # the cost curves' key: the file, not its cache directory
    tokenizer = AutoTokenizer.from_pretrained(directory) if (directory / "tokenizer_config.json").is_file() else None
    model = _skeleton(config, dtype)
    processor, _ = _processor(index["architecture"], config)
    blocks = _blocks(directory / "blocks.bin") if not dense else None
    own = _blocks(directory / "integer.bin") if integer and not dense else None
    layouts = {}
    for entry in index["tensors"]:
        module_name, _, leaf = entry["hf"].rpartition(".")
        if dense and entry["role"] == "blocks" and entry["gguf"] == "token_embd.weight":
            continue  # a tied output layer: the embedding's own table (tied below)
        if not dense and entry["role"] == "blocks":
            on_own = own is not None and entry["integer_size"] > 0
            source, at, size = (own, entry["integer_at"], entry["integer_size"]) if on_own else (blocks, entry["at"], entry["size"])
            packed = source[at: at + size].view(entry["n"] // linear_kernels.BLOCK, -1)
            layouts[module_name] = linear_kernels.QuantLayout(packed, entry["n"], entry["k"], entry["integer_bits"] if on_own else entry["bits"],
                                                      entry["group"], entry["offsets"], dtype, integer=on_own,
                                                      supers=on_own and entry["supers"], halves=on_own and entry["halves"])
        elif not dense and entry["role"] == "embedding":
            original = model.get_submodule(module_name)
            raw = np.memmap(gguf, dtype=np.uint8, mode="r", offset=entry["offset"], shape=(entry["nbytes"],))
            table = quants.QuantEmbedding(raw, entry["type"], original.num_embeddings, original.embedding_dim, dtype,
                                          getattr(original, "embed_scale", None))
            parent, _, child = module_name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, table)
        else:
            weights = gguf_py.dequantize(_read(gguf, entry), gguf_py.GGMLQuantizationType[entry["type"]])
            weights = processor.process(weights=weights, name=entry["gguf"]).weights
            _check_finite(gguf, entry, torch.from_numpy(np.asarray(weights)))
            module = model.get_submodule(module_name)
            if tuple(weights.shape) != tuple(getattr(module, leaf).shape):  # as processed (``_entries`` checked the rest)
                raise wrong_shape(gguf, entry["gguf"], list(weights.shape), entry["hf"], getattr(module, leaf).shape)
            setattr(module, leaf, nn.Parameter(torch.from_numpy(np.ascontiguousarray(weights)).to(dtype), requires_grad=False))
    output = model.get_output_embeddings()
    if output is not None and output.weight.is_meta and _module_names(model)[1] not in layouts and getattr(config, "tie_word_embeddings", False):
        output.weight = model.get_input_embeddings().weight  # a tied output layer on the embedding's dense table (its type not decoded here, or ``dense``)
    missing = [name for name, p in model.named_parameters() if p.is_meta and name.rpartition(".")[0] not in layouts]
    if missing:
        raise ModelLoadError(f"{gguf}: the file has no tensor for {missing[0]}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    return model, tokenizer, layouts, [] if dense else index["left"]


def _check_finite(gguf: Path, entry: dict, *tensors: torch.Tensor | None) -> None:
    """A ``ModelLoadError`` where a tensor's values (or its blocks' scales) are not all finite: a corrupt file, or a
    tensor read at the wrong offset or as the wrong type, which would otherwise run as NaNs and fail far away."""
    if not all(t is None or bool(torch.isfinite(t).all()) for t in tensors):
        raise ModelLoadError(f"{gguf}: tensor {entry['gguf']} ({entry['type']}) holds values that are not finite: the file is corrupt")


def _blocks(path: Path) -> torch.Tensor:
    """``blocks.bin`` memory-mapped (private: the pages stay the file's until written, which nothing does)."""
    size = path.stat().st_size
    return torch.from_file(str(path), shared=False, size=size, dtype=torch.uint8) if size else torch.empty(0, dtype=torch.uint8)


def one_line(e: BaseException) -> str:
    """An exception's first line (its type where it says nothing)."""
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__
