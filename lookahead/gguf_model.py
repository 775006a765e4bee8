"""A model built straight from a GGUF file: its linears on the file's own blocks, never a dense copy of them.

The first load of a file reads it once (``prepare``): its header checked against its bytes as llama.cpp checks it
(``read_header``: gguf-py's and transformers' readers trust it), its config (transformers', made of a copy of the
header without the vocabulary: ``_config``), tokenizer and chat template (transformers' GGUF reader), which of its
tensors becomes what (transformers' name mapping and tensor processor for the architecture, on a skeleton of the
model), into ``<cache>/blocks/<file>-<key>/``: the small files and ``index.json``. The first load that runs the
blocks with a kind of activations lays every linear's blocks out for those kernels (``_lay_out``), one tensor at a
time, beside them: ``blocks.bin`` for fp32 and bf16 activations (``linear_kernels.pack_quantized``), ``integer.bin``
for int8 ones (values in the integer kernel's lanes' order, the K types' scales per 256 k's, the legacy types' fp16
ones), each with its own index (``blocks.json``, ``integer.json``). A run lays out (and maps) only the one it reads.
Each load (``load``) then builds the model on the meta device (parameters only: buffers such as RoPE's frequencies
are computed as usual), memory-maps the laid-out blocks into the linears (``kernels.pack``), looks the embedding up
from the file's own blocks (``quants.QuantEmbedding``) and dequantizes the few small tensors (norms, biases) from the
file, through the processor (Gemma's norm offset). The file's metadata and the mapping are not read again.

A file is read only once what it says agrees with itself: its header with its bytes (``read_header``), its
metadata with the tensors it describes (``check_metadata``: the vocabulary against the embedding's rows, the heads
against the projections, before a config is made from it), and every tensor with the parameter the config gives it,
shape for shape (``_entries``, on a model on the meta device: nothing is allocated from the metadata). The cache
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

import collections
import contextlib
import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
from torch import nn

from lookahead import cpu, linear_kernels, quants
from lookahead.cache_entries import Progress, bar, check_files, directory_whole, held, leftovers, remove, sha256, sweep
from lookahead.gguf_header import (Header, ModelLoadError, _regular, check_metadata, config_of, hf_names, one_line, read_header,
                                    save_tokenizer, tokenizer_of, wrong_shape)
from lookahead.kernels import SIBLINGS
from ngram_pool.files import written_whole

LAYOUT = 9  # the cache's layout: a change to it (or to pack_quantized's or pack_supers' blocks) must bump this
LAYOUTS = {"blocks": "fp32 and bf16", "integer": "int8"}  # the laid-out blocks a load maps, and the activations they serve
ALIGN = 64  # each laid-out weight starts at a multiple of this in its layout's file
PLACED = ("bits", "group", "offsets", "integer", "supers", "halves")  # what a layout's index keeps of each QuantLayout
CHUNK = 4096  # rows decoded and laid out at a time (a multiple of linear_kernels.BLOCK: blocks of rows are independent)
LAYING_THREADS = 2  # chunks decoded and laid out at once (numpy and torch let go of the GIL in their loops)
DERIVED = ("rope_freqs.weight",)  # Llama 3.x files' RoPE factors, which transformers derives from the config: left unread, as ever


@dataclass(frozen=True)
class Prepared:
    """A GGUF file's cache directory, ready to ``load``."""

    directory: Path
    index: dict  # index.json: {"gguf", "architecture", "tensors": [...], "left": [...], "source", "files", "check"}
    layout: str | None = None  # the layout laid out and checked for this load ("blocks", "integer"), if one was asked for
    placed: dict | None = None  # <layout>.json: {"tensors": {hf name: where and how each is laid out}, "files", "check"}


def cache_key(gguf: Path, status: os.stat_result) -> str:
    """The file's cache directory name: its name, and a hash of its path, size and modification time (``status``) and ``LAYOUT``."""
    key = hashlib.sha256(f"{gguf.resolve()}|{status.st_size}|{status.st_mtime_ns}|{LAYOUT}".encode()).hexdigest()[:12]
    return f"{gguf.stem}-{key}"


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
    so a product of them is one view of its layout's file."""
    parent, _, leaf = name.rpartition(".")
    order = [leaf_name for names in SIBLINGS for leaf_name in names]
    return parent, order.index(leaf) if leaf in order else len(order), leaf


def prepare(gguf: Path, cache_dir: Path, progress: Progress, layout: str | None = None) -> Prepared:
    """``gguf``'s cache directory, with ``layout`` (one of ``LAYOUTS``) laid out where one is asked for; each made on
    first use and made again where it is not whole (``_checked``: one line says why); a ``ModelLoadError`` for a
    file it cannot read."""
    with _entry(gguf, cache_dir, progress, layout) as prepared:
        return prepared


@contextlib.contextmanager
def _entry(gguf: Path, cache_dir: Path, progress: Progress, layout: str | None) -> Iterator[Prepared]:
    """``prepare``'s entry, checked, and kept from being made again by another process while the block reads it.
    Processes loading one file at once wait for the one that makes its entry or lays it out (its lock, ``held``),
    then read it."""
    status = _regular(gguf)
    target = cache_dir / "blocks" / cache_key(gguf, status)
    sweep(target.parent)
    for shared in (True, False):  # read under a shared lock; where it must be made, again under the writer's
        with held(target, progress, shared):
            index, why = _checked(target, gguf)
            if index is None and not shared:
                progress(f"making {target} again: {why}" if why else
                         f"reading {gguf.name} once: its config and tokenizer (cached in {target})")
                index = _build(gguf, status, target)
                for older, size in _remove_older(target, index["gguf"]):
                    progress(f"removed {older} ({size / 1e9:.2f} GB): an older entry of the same file, which no load reads")
            placed, why = _checked_layout(target, layout) if index is not None and layout else (None, "")
            if placed is None and layout and index is not None and not shared:
                progress(f"laying out {target / layout}.bin again: {why}" if why else
                         f"laying out {gguf.name}'s blocks once for the {LAYOUTS[layout]} kernels (in {target / layout}.bin)")
                placed = _lay_out(gguf, index, target, layout, progress)
            if index is not None and (placed is not None or not layout):
                yield Prepared(target, index, layout, placed)
                return


def _remove_older(target: Path, source: str) -> list[tuple[Path, int]]:
    """Remove the entries made before ``target`` for the same file (``source``: an older size, modification time or
    ``LAYOUT``; an upgrade had left the 1.5B's 2.3 GB beside its new entry), each under its lock, not waited for: one
    another process reads stays; a link alone, never what it points to. (entry, bytes freed) removed; one that could
    not be removed is not said to be."""
    removed = []
    for older in (entry for entry in target.parent.glob(f"{Path(source).stem}-*") if entry != target):
        with held(older, None) as mine:
            if mine and (_read_index(older / "index.json")[0] or {}).get("gguf") == source:
                size = 0 if older.is_symlink() else sum(f.stat().st_size for f in older.iterdir() if f.is_file())
                try:
                    remove(older)
                except OSError:
                    continue
                removed.append((older, size))
    return removed


def _index_check(index: dict) -> str:
    """The digest an index holds of the rest of itself: an index.json edited, or cut short, is not believed."""
    return hashlib.sha256(json.dumps({k: v for k, v in index.items() if k != "check"}, sort_keys=True).encode()).hexdigest()


def _read_index(path: Path) -> tuple[dict | None, str]:
    """(the index at ``path``, "") where it is the one written (its digest of itself, ``_index_check``), else (None,
    why not: "" where there is none)."""
    try:
        index = json.loads(path.read_text())
    except FileNotFoundError:
        return None, ""
    except (OSError, ValueError) as e:
        return None, f"its {path.name} is unreadable ({one_line(e)})"
    if not isinstance(index, dict) or index.get("check") != _index_check(index):
        return None, f"its {path.name} is an older version's, without checksums" if "check" not in index and "tensors" in index \
            else f"its {path.name} is not the one written"
    return index, ""


def _listed(target: Path, index: dict) -> dict[str, tuple[Path, int, str]]:
    """The files ``index`` lists, as ``check_files`` takes them."""
    return {name: (target / name, size, digest) for name, (size, digest) in index["files"].items()}


def _checked(target: Path, gguf: Path) -> tuple[dict | None, str]:
    """(the entry's index, "") where its index and every file it lists are as written (``check_files``) and ``gguf``
    is the file they were made from (its size and sha256: another file given the same name, size and time is not);
    else (None, why not: "" where there is no entry)."""
    index, why = _read_index(target / "index.json")
    if index is not None:
        why = check_files({gguf.name: (gguf, *index["source"]), **_listed(target, index)}, target / "verified.json") or ""
    return (None, why) if why or index is None else (index, "")


def _checked_layout(target: Path, layout: str) -> tuple[dict | None, str]:
    """(``layout``'s index in the entry ``target``, "") where it and its file are as written, else (None, why not: ""
    where it was never laid out)."""
    placed, why = _read_index(target / f"{layout}.json")
    if placed is not None:
        why = check_files(_listed(target, placed), target / "verified.json") or ""
    return (None, why) if why or placed is None else (placed, "")


def _build(gguf: Path, status: os.stat_result, target: Path) -> dict:
    """Read ``gguf`` (see the module doc) into the entry ``target``; its index, which lists every file's size and
    sha256, and the source's."""
    header = read_header(gguf)
    check_metadata(gguf, header)
    try:
        config = config_of(gguf, header)
        model = _skeleton(config, torch.float32, meta=True)
    except Exception as e:  # transformers raises many types for an unsupported file
        raise ModelLoadError(f"cannot read GGUF {gguf}: {one_line(e)}") from None
    tokenizer, unreadable = tokenizer_of(gguf, header, config)
    processor, blocks = _processor(header.architecture, config)
    entries, left = _entries(gguf, header, model, processor, blocks)
    with directory_whole(target) as tmp:
        config.save_pretrained(tmp)
        if tokenizer is not None:
            save_tokenizer(tokenizer, tmp, target)
        for entry in entries:  # the embedding's scales, checked once here (its rows are decoded as they are looked up)
            if entry["role"] == "embedding":
                for q in _decoded(entry, _read(gguf, entry)):
                    _check_finite(gguf, entry, q.scale, q.offset)
        paths = sorted(tmp.iterdir())
        with ThreadPoolExecutor() as pool:
            digests = list(pool.map(sha256, [gguf, *paths]))
        index = {"gguf": str(gguf.resolve()), "architecture": header.architecture, "tensors": entries, "left": left, "unreadable": unreadable,
                 "source": [status.st_size, digests[0]], "files": {p.name: [p.stat().st_size, d] for p, d in zip(paths, digests[1:])}}
        index["check"] = _index_check(index)
        (tmp / "index.json").write_text(json.dumps(index))
    return index


def _entries(gguf: Path, header: Header, model: nn.Module, processor, blocks: str | None) -> tuple[list[dict], list[str]]:
    """(what each of the file's tensors becomes in ``model`` (on the meta device): its index entry, with its role:
    "blocks" (a linear on the file's blocks), "embedding" (looked up from them) or "dense" (dequantized at each
    load); one line for each linear left dense, and why). Each tensor's shape is the one ``model``'s config gives its
    parameter (a ``ModelLoadError`` naming both: the bytes of a 512 x 128 tensor read as 256 x 256 ran scrambled),
    where the architecture's processor keeps shapes (else at load, once processed), every parameter has one, and
    every tensor has a parameter (transformers skips one it has no name for: a model without it runs, wrongly)."""
    mapping = hf_names(gguf, model, processor, header.architecture)
    unused = [tensor.name for tensor in header.tensors if tensor.name not in mapping and tensor.name not in DERIVED]
    if unused:
        raise ModelLoadError(f"cannot read GGUF {gguf}: tensor {unused[0]}" + (f" (and {len(unused) - 1} more)" if len(unused) > 1 else "")
                             + " is in the file, but the model its metadata makes has no parameter for it")
    embedding, output = _module_names(model)
    modules, parameters = dict(model.named_modules()), dict(model.named_parameters())
    tied = getattr(model.config, "tie_word_embeddings", False) and all(t.name != "output.weight" for t in header.tensors)
    entries, left = [], []
    for tensor in header.tensors:
        hf = mapping.get(tensor.name)
        if hf is None:  # DERIVED
            continue
        if blocks is not None and hf in parameters and tensor.rows != list(parameters[hf].shape):
            raise wrong_shape(gguf, tensor.name, tensor.rows, hf, parameters[hf].shape)
        parameters.pop(hf, None)
        kind, (dtype, data_shape) = tensor.kind, tensor.stored()
        entry = {"gguf": tensor.name, "hf": hf, "type": kind, "offset": tensor.offset, "nbytes": tensor.nbytes,
                 "shape": list(tensor.dims), "data_shape": data_shape, "dtype": dtype, "role": "dense"}
        module_name, _, leaf = hf.rpartition(".")
        quantized = kind in quants.DECODERS and leaf == "weight"
        if quantized and module_name == embedding:
            entry["role"] = "embedding"
            if tied and type(modules.get(output)) is nn.Linear:  # the output layer multiplies by the same blocks
                head = modules[output]
                entries.append({**entry, "hf": f"{output}.weight", "role": "blocks", "n": head.out_features, "k": head.in_features})
        elif module_name == embedding and tied and type(modules.get(output)) is nn.Linear:  # on its dense table (``load``)
            left.append(f"{tensor.name} as the tied output layer: type {kind} not run quantized")
        elif type(modules.get(module_name)) is nn.Linear and leaf == "weight":
            linear = modules[module_name]
            why = (f"type {kind} not run quantized" if not quantized else "its architecture's processor changes it" if blocks is None
                   else None if linear_kernels.quant_fits(linear.out_features, linear.in_features, quants.QK) else "a shape the kernel does not take")
            entry.update(role="dense" if why else "blocks", n=linear.out_features, k=linear.in_features)
            if why:
                left.append(f"{tensor.name}: {why}")
        entries.append(entry)
    if parameters:
        raise ModelLoadError(f"cannot read GGUF {gguf}: the file has no tensor for {next(iter(parameters))}"
                             + (f" (and {len(parameters) - 1} more)" if len(parameters) > 1 else ""))
    return entries, left


def _lay_out(gguf: Path, index: dict, directory: Path, layout: str, progress: Progress) -> dict:
    """Write each "blocks" entry's weight as ``layout``'s kernels read it to ``<layout>.bin`` (siblings adjacent, each
    aligned): "blocks", ``linear_kernels.pack_quantized``'s blocks for fp32 and bf16 activations; "integer", the
    integer kernel's own where it takes the shape (``linear_kernels.lay_out``: values in its lanes' order, the K
    types' scales per 256 k's, the legacy types' fp16 scales), else those blocks. Then ``<layout>.json``, its index:
    where each weight is and how it is laid out, the file's size and sha256. Llama's q and k rows are reordered as
    transformers' processor does. A bar shows the time left (a 7B-class file's: ~60 s on a Zen 3)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(directory)
    heads = _processor(index["architecture"], config)[1] == "heads"
    counts = {"q_proj": config.num_attention_heads, "k_proj": getattr(config, "num_key_value_heads", None) or config.num_attention_heads}
    path, digest, placed = directory / f"{layout}.bin", hashlib.sha256(), {}
    for name in LAYOUTS:  # what a writer killed midway left (its lock held alone here, as ``held`` does beside the entry)
        for left in leftovers(directory / f"{name}.bin") + leftovers(directory / f"{name}.json"):
            left.unlink(missing_ok=True)
    blocks = [e for e in index["tensors"] if e["role"] == "blocks"]
    with written_whole(path) as out, bar(progress, sum(e["nbytes"] for e in blocks), "laying out") as done, \
            ThreadPoolExecutor(LAYING_THREADS) as pool:
        def write(data) -> None:
            out.write(data)
            digest.update(data)

        def order(entry: dict) -> np.ndarray | None:  # Llama's q and k rows as transformers' processor orders them
            leaf = entry["hf"].split(".")[-2]
            return quants.head_order(entry["n"], counts[leaf]).numpy() if heads and leaf in counts and entry["n"] % (2 * counts[leaf]) == 0 else None

        ordered = sorted(blocks, key=lambda e: _sibling_order(e["hf"][: -len(".weight")]))
        chunks = [(gguf, entry, start, order(entry), layout) for entry in ordered for start in range(0, entry["n"], CHUNK)]
        laid_chunks = _in_order(pool, _laid_chunk, chunks, LAYING_THREADS + 1)
        for entry in ordered:
            write(b"\0" * (-out.tell() % ALIGN))
            at = out.tell()
            for _ in range(0, entry["n"], CHUNK):  # every chunk alike: the rows' scales are all the file's
                laid = next(laid_chunks)
                write(laid.packed.numpy().data)
            placed[entry["hf"]] = {"at": at, "size": out.tell() - at} | {field: getattr(laid, field) for field in PLACED}
            done.update(entry["nbytes"])
        size = out.tell()
    placed = {"tensors": placed, "files": {path.name: [size, digest.hexdigest()]}}
    placed["check"] = _index_check(placed)
    with written_whole(directory / f"{layout}.json") as out:
        out.write(json.dumps(placed).encode())
    return placed


def _laid_chunk(gguf: Path, entry: dict, start: int, order: np.ndarray | None, layout: str) -> linear_kernels.QuantLayout:
    """Rows ``start`` .. ``start + CHUNK`` of a "blocks" entry's weight (in ``order`` where given) as ``layout``'s
    kernels read them: the integer kernel's own where it takes the shape, else ``pack_quantized``'s blocks."""
    n, k, row = entry["n"], entry["k"], entry["nbytes"] // entry["n"]
    rows = min(CHUNK, n - start)
    if order is None:  # its rows alone
        raw = np.fromfile(gguf, dtype=np.uint8, count=rows * row, offset=entry["offset"] + start * row)
        if raw.size != rows * row:
            raise ModelLoadError(f"{gguf}: tensor {entry['gguf']} ends past the end of the file")
    else:
        raw = _read(gguf, entry).reshape(n, -1)[order[start:start + rows]]
    q = quants.from_blocks(raw, entry["type"], rows, k)
    _check_finite(gguf, entry, q.scale, q.offset)
    if layout == "integer" and linear_kernels.quant_fits(n, k, q.group, integer=True):
        return linear_kernels.lay_out(q, torch.float32, integer=True)
    return linear_kernels.pack_quantized(q.q, q.scale, q.offset, q.group, q.bits, torch.float32)


def _in_order(pool: ThreadPoolExecutor, function, calls: list[tuple], ahead: int) -> Iterator:
    """``function(*call)`` for each call, run in ``pool`` at most ``ahead`` calls ahead of the one given back."""
    pending: collections.deque = collections.deque()
    for call in calls:
        pending.append(pool.submit(function, *call))
        if len(pending) > ahead:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()


def _decoded(entry: dict, raw: np.ndarray):
    """A tensor's rows decoded ``CHUNK`` at a time (decoding a 150k-row head whole took ~2 GB)."""
    k, n = entry["shape"]
    raw = raw.reshape(n, -1)
    for start in range(0, n, CHUNK):
        yield quants.from_blocks(raw[start:start + CHUNK], entry["type"], min(CHUNK, n - start), k)


def layout_for(integer: bool) -> str:
    """The layout a load maps for int8 activations (``integer``), or for fp32 and bf16 ones."""
    return "integer" if integer else "blocks"


def keep_layouts(gguf: Path, cache_dir: Path, layouts: set[str]) -> list[tuple[Path, int]]:
    """Remove ``gguf``'s laid-out blocks but ``layouts``', index first (a layout without its index is laid out again
    when asked for): what ``lookahead tune`` leaves once it has measured them all, so the cache holds the layout that
    runs load, not every one. The (file, bytes) removed. A process that mapped one keeps its pages."""
    target = cache_dir / "blocks" / cache_key(gguf, _regular(gguf))
    removed = []
    with held(target, None) as mine:
        if mine and target.is_dir():
            for other in sorted(set(LAYOUTS) - layouts):
                blocks = target / f"{other}.bin"
                (target / f"{other}.json").unlink(missing_ok=True)
                if blocks.is_file():
                    removed.append((blocks, blocks.stat().st_size))
                    blocks.unlink()
    return removed


def weight_kinds(prepared: Prepared) -> str:
    """What ``kernels.weight_kinds`` will say of the model ``load`` builds on ``prepared``'s layout (the cost curve's
    key), from its index."""
    kinds = {quants.kind(w["bits"], w["group"], w["offsets"], w["supers"], w["halves"]) for w in prepared.placed["tensors"].values()}
    return ", ".join(sorted(kinds | ({"dense"} if prepared.index["left"] else set()))) or "dense"


def blocks_bytes(gguf: Path, prepared: Prepared) -> int:
    """The bytes ``blocks.bin`` (the layout for fp32 and bf16 activations) takes, laid out or not: each linear's
    first row decoded, times its rows (a layout widens the file's 4.5-6.6 bits a weight to 6-10)."""
    first = lambda e: np.fromfile(gguf, dtype=np.uint8, count=e["nbytes"] // e["n"], offset=e["offset"])  # noqa: E731
    return sum(e["n"] * quants.from_blocks(first(e), e["type"], 1, e["k"]).nbytes() for e in prepared.index["tensors"] if e["role"] == "blocks")


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
    with _entry(gguf, cache_dir, progress, None if dense else layout_for(integer)) as prepared:  # mapped while no one makes it again
        if prepared.index.get("unreadable"):
            progress(f"{prepared.index['unreadable']}: token ids only (--ids)")
        return _built(gguf, prepared, dtype)


def _built(gguf: Path, prepared: Prepared, dtype: torch.dtype):
    """``load``'s model, from its entry ``prepared``, checked."""
    from transformers import AutoConfig, AutoTokenizer

    directory, index = prepared.directory, prepared.index
    config = AutoConfig.from_pretrained(directory)
    config._name_or_path = str(gguf)  # the cost curves' key: the file, not its cache directory
    tokenizer = AutoTokenizer.from_pretrained(directory) if (directory / "tokenizer_config.json").is_file() else None
    model = _skeleton(config, dtype)
    processor, _ = _processor(index["architecture"], config)
    dense = prepared.layout is None
    blocks = _blocks(directory / f"{prepared.layout}.bin") if not dense else None
    layouts = {}
    for entry in index["tensors"]:
        module_name, _, leaf = entry["hf"].rpartition(".")
        if dense and entry["role"] == "blocks" and entry["gguf"] == "token_embd.weight":
            continue  # a tied output layer: the embedding's own table (tied below)
        if not dense and entry["role"] == "blocks":
            where = prepared.placed["tensors"][entry["hf"]]
            packed = blocks[where["at"]: where["at"] + where["size"]].view(entry["n"] // linear_kernels.BLOCK, -1)
            layouts[module_name] = linear_kernels.QuantLayout(packed, entry["n"], entry["k"], dtype=dtype, **{field: where[field] for field in PLACED})
        elif not dense and entry["role"] == "embedding":
            original = model.get_submodule(module_name)
            raw = np.memmap(gguf, dtype=np.uint8, mode="r", offset=entry["offset"], shape=(entry["nbytes"],))
            table = quants.QuantEmbedding(raw, entry["type"], original.num_embeddings, original.embedding_dim, dtype,
                                          getattr(original, "embed_scale", None))
            parent, _, child = module_name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, table)
        else:
            weights = processor.process(weights=_dequantized(gguf, entry), name=entry["gguf"]).weights
            cpu.release_freed_memory()  # the intermediates, between the weights kept: the 1.5B's fp32 load peaked 8.4 GB, 7.6 so
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


def _dequantized(gguf: Path, entry: dict) -> np.ndarray:
    """A tensor's values, checked finite, bit for bit as gguf-py's ``dequantize`` gives them: a matrix of a type
    ``quants`` decodes, ``CHUNK`` rows at a time into one array (2.3x faster: Qwen 0.5B's 6.8 -> 3.0 s), any other
    tensor by gguf-py."""
    import gguf as gguf_py

    raw = _read(gguf, entry)
    if entry["type"] not in quants.DECODERS or len(entry["shape"]) != 2:
        weights = gguf_py.dequantize(raw, gguf_py.GGMLQuantizationType[entry["type"]])
        _check_finite(gguf, entry, torch.from_numpy(np.asarray(weights)))
        return weights
    k, n = entry["shape"]
    weights = torch.empty(n, k)
    for start, q in zip(range(0, n, CHUNK), _decoded(entry, raw)):
        _check_finite(gguf, entry, q.scale, q.offset)  # the values then are: q is small
        q.dequantize(out=weights[start: start + CHUNK])
    return weights.numpy()


def _check_finite(gguf: Path, entry: dict, *tensors: torch.Tensor | None) -> None:
    """A ``ModelLoadError`` where a tensor's values (or its blocks' scales) are not all finite: a corrupt file, or a
    tensor read at the wrong offset or as the wrong type, which would otherwise run as NaNs and fail far away."""
    if not all(t is None or bool(torch.isfinite(t).all()) for t in tensors):
        raise ModelLoadError(f"{gguf}: tensor {entry['gguf']} ({entry['type']}) holds values that are not finite: the file is corrupt")


def _blocks(path: Path) -> torch.Tensor:
    """A layout's file memory-mapped (private: the pages stay the file's until written, which nothing does)."""
    size = path.stat().st_size
    return torch.from_file(str(path), shared=False, size=size, dtype=torch.uint8) if size else torch.empty(0, dtype=torch.uint8)
