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

from lookahead import linear_kernels, quants
from lookahead.cache_entries import Progress, check_files, directory_whole, held, sha256, sweep
from lookahead.gguf_header import ModelLoadError, _regular, check_header, check_metadata, one_line, wrong_shape
from lookahead.kernels import SIBLINGS

LAYOUT = 8  # the cache's layout: a change to it (or to pack_quantized's or pack_supers' blocks) must bump this
ALIGN = 64  # each laid-out weight starts at a multiple of this in blocks.bin
CHUNK = 4096  # rows decoded and laid out at a time (a multiple of linear_kernels.BLOCK: blocks of rows are independent)
@dataclass(frozen=True)
class Prepared:
    """A GGUF file's cache directory, ready to ``load``."""

    directory: Path
    index: dict  # index.json: {"gguf", "architecture", "tensors": [...], "left": [...], "source", "files", "check"}


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
