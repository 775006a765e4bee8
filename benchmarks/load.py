"""Loading a GGUF model: wall time and peak resident memory of our direct load from an empty cache and again warm,
a whole first ``lookahead generate`` from an empty cache, a warm one and ``lookahead tune`` (first token, peak resident
memory, the cache they leave), a warm ``lookahead generate``'s first token on the user's cache, and llama.cpp's
``llama-server`` loading the same file, each in a process of its own, one after another (never two at once).

    python -m benchmarks.load                                  # Qwen2.5-Coder-1.5B Q4_K_M (fetched once, 1.1 GB)
    python -m benchmarks.load --model smollm2-135m --out benchmarks/results/load-smollm2-135m
    python -m benchmarks.load --gguf path/to/model.gguf        # any GGUF file
    python -m benchmarks.load --gguf ~/.cache/lookahead/gguf/synthetic-qwen2-7b.gguf --first-runs  # benchmarks.big_gguf's

An empty cache is a fresh directory holding only the downloads (wheels, assembled GGUFs) and the kernels' build:
the blocks are laid out anew. The first token is timed on the user's cache, after one run that measures whatever
a first run measures. The issue's goal for the peak: the file's size + the dense embedding table + 1 GB."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.results_log import write_json
from benchmarks.run import hardware
from lookahead import models

CHILD = """
import json, resource, sys, time
start = time.perf_counter()
from lookahead import models
imported = time.perf_counter()
model, tok = models.load(sys.argv[1], dtype=sys.argv[2], kernels="packed", weights="gguf")
loaded = time.perf_counter() - imported
import torch
with torch.inference_mode():
    model(torch.tensor([[1, 2, 3, 4]]))
print(json.dumps({"import_s": imported - start, "load_s": loaded, "first_forward_s": time.perf_counter() - imported - loaded,
                  "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6}))
"""


def ours(spec: str, dtype: str, cache: Path) -> dict:
    """One load in a fresh process with ``cache`` as its cache (``XDG_CACHE_HOME``)."""
    env = {**os.environ, "XDG_CACHE_HOME": str(cache.parent)}
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", CHILD, spec, dtype], env=env, capture_output=True, text=True, check=True)
    return {**json.loads(out.stdout.strip().splitlines()[-1]), "process_s": time.perf_counter() - start}


PROMPT = "Write a Python function that reverses a string."


def cli_run(cache: Path, *args: str) -> dict:
    """``lookahead ARGS`` in a process of its own with ``cache`` as its cache: seconds to the first byte it prints on
    stdout (a generate's first token), in all, and its peak resident memory."""
    env = {**os.environ, "XDG_CACHE_HOME": str(cache.parent)}
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "lookahead.cli", *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    proc.stdout.read(1)
    first = time.perf_counter() - start
    proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    return {"first_byte_s": first, "seconds": time.perf_counter() - start, "peak_rss_gb": usage.ru_maxrss / 1e6,
            "exit": os.waitstatus_to_exitcode(status)}


def empty_cache(base: Path, user: Path) -> Path:
    """A fresh cache directory under ``base`` holding only the downloads (wheels, assembled GGUFs) and the kernels'
    build, shared with ``user``'s: what a first run measures, not what it fetches."""
    cache = base / "lookahead"
    cache.mkdir(parents=True)
    for shared in ("wheels", "gguf", "kernels"):
        (user / shared).mkdir(parents=True, exist_ok=True)
        (cache / shared).symlink_to(user / shared, target_is_directory=True)
    return cache


def cache_gb(cache: Path) -> dict[str, float]:
    """What ``cache`` holds beyond the shared downloads, by folder, in GB."""
    return {p.name: sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) / 1e9 for p in cache.iterdir() if not p.is_symlink()}


def llama_cpp(gguf: Path, cache_dir: Path) -> dict:
    """llama-server from start to answering /health, and its peak resident memory then (it maps the file)."""
    from benchmarks.peers import build_llama_cpp, start_server

    start = time.perf_counter()
    proc, _ = start_server(build_llama_cpp(cache_dir), gguf, os.cpu_count() or 1, ("--no-repack",))
    seconds = time.perf_counter() - start
    peak = peak_rss_gb(proc.pid)
    proc.kill()
    proc.wait()
    return {"load_s": seconds, "peak_rss_gb": peak}


def peak_rss_gb(pid: int) -> float:
    """A running process's peak resident memory (``VmHWM``), in GB."""
    return next(int(line.split()[1]) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("VmHWM")) * 1024 / 1e9


def save(results: dict, out: Path) -> None:
    """``out/results.json`` (indexed by ``benchmarks.results_log``), and the same on stdout."""
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "results.json", results)  # a decode's token ids as a digest
    print(json.dumps(results, indent=2))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b", help="an embedded model's name")
    parser.add_argument("--gguf", type=Path, help="a GGUF file instead of an embedded model")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--no-llama-cpp", action="store_true")
    parser.add_argument("--first-runs", action="store_true",
                        help="only a first generate from an empty cache, the warm one and tune after it (a 7B-class file's loads take minutes)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/load-latest"))
    args = parser.parse_args(argv)
    user = models.default_cache_dir()
    spec = str(args.gguf.resolve()) if args.gguf else args.model
    gguf = args.gguf or models.fetch_embedded(args.model, user, print)
    name = gguf.name if args.gguf else spec  # what the results call the model
    generate = ("generate", "--model", spec, "--max-new-tokens", "8", PROMPT)
    if args.first_runs:
        with tempfile.TemporaryDirectory(prefix="lookahead-load-") as base:
            first = empty_cache(Path(base) / "first", user)
            results = {"hardware": hardware(), "model": name, "file_gb": gguf.stat().st_size / 1e9, "first_run": cli_run(first, *generate),
                       "warm_run": cli_run(first, *generate), "tune": cli_run(first, "tune", "--model", spec), "first_run_cache": cache_gb(first)}
        save(results, args.out)
        return
    with tempfile.TemporaryDirectory(prefix="lookahead-load-") as base:
        cache = empty_cache(Path(base) / "load", user)
        results = {"hardware": hardware(), "model": name, "dtype": args.dtype, "file_gb": gguf.stat().st_size / 1e9,
                   "cold": ours(spec, args.dtype, cache), "warm": ours(spec, args.dtype, cache), "cache": cache_gb(cache)}
        first = empty_cache(Path(base) / "first", user)  # a whole first run: layout, probes, prior, its first token
        results |= {"first_run": cli_run(first, *generate), "warm_run": cli_run(first, *generate),
                    "tune": cli_run(first, "tune", "--model", spec), "first_run_cache": cache_gb(first)}
    cli_run(user, *generate)  # once to measure what the first run measures (cost curves, prior), and to warm the page cache
    results["first_token_s"] = [cli_run(user, *generate)["first_byte_s"] for _ in range(3)]
    if not args.no_llama_cpp:
        results["llama_cpp"] = llama_cpp(gguf, user)
    save(results, args.out)


if __name__ == "__main__":
    main()
