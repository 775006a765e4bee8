"""Lookahead side by side with the engine CPU users already run: llama.cpp's ``llama-server`` (plain and each of
its n-gram speculation modes, on bf16 weights and on the original quantized GGUF), beside stock HF greedy, HF
prompt lookup, our plain loop and lookahead (bf16 weights, and the GGUF's own blocks with bf16 and fp32
activations, and int8 ones on the integer kernel where it runs), on the same prompts given as token ids (chat template applied), greedy, one request at a time.

    python -m benchmarks.peers                                # SmolLM2-135M, 3 prompts a set, 128 new tokens
    python -m benchmarks.peers --model qwen2.5-coder-0.5b
    python -m benchmarks.peers --build-only                   # just build llama.cpp (~16 min on 2 cores, once)

llama.cpp is built once from the source vendored in PyPI's ``llama-cpp-python`` sdist (``-DGGML_NATIVE=ON``,
static, into ``<cache>/peers``); its bf16 runs read the embedded GGUF re-saved in bf16 by its own
``llama-quantize``, so every bf16 engine here streams the same weights. Each request is timed whole, prefill
included, as ``generate()`` is; the report also gives each engine's plain decode step against the time two
cores take to stream the weights once (bytes of every linear, ``lm_head`` included, over the measured read
bandwidth). Engines run one after another, never two at once (llama.cpp's OpenMP threads stall beside
other work), in ``--rounds`` passes over all of them, each pass taking every rounds-th prompt: a slow spell of a
shared machine (this VM's speed moves by up to ~1.5x within minutes) then lands on every engine, not on one."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import tarfile
import tempfile
import time
import urllib.request
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import torch

from benchmarks import datasets
from benchmarks.profile_step import linear_bytes, stream_rate
from benchmarks.results_log import count, same, write_json
from benchmarks.run import hardware, hf_generate
from lookahead import LookaheadConfig, LookaheadGenerator, models, native

LLAMA_CPP = "llama-cpp-python==0.3.36"  # its sdist vendors llama.cpp at commit 0c1e570
TOOLS = ("llama-server", "llama-quantize")
LOOKAHEAD = LookaheadConfig(recycle_prior_s=float("inf"))  # the whole prior, as a user has it after a few runs
MODES = ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache")  # llama.cpp's draft-free speculation


# llama.cpp's CPU features for a tier of ours held below the CPU's best (``--isa``): built for it, not natively
GGML_AVX2 = ("-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON", "-DGGML_BMI2=ON")
GGML_TIERS = {"avx2": GGML_AVX2, "avx-vnni": (*GGML_AVX2, "-DGGML_AVX_VNNI=ON"), "avx512f": (*GGML_AVX2, "-DGGML_AVX512=ON")}


def held(isa: str | None) -> str | None:
    """``--isa`` where it holds our kernels below the CPU's best tier (llama.cpp is then built for it too), else None."""
    return isa if isa != native.best_tier() else None


def build_llama_cpp(cache_dir: Path, isa: str | None = None) -> Path:
    """The directory holding ``TOOLS``, built on first use, natively or for ``isa`` (``GGML_TIERS``). A build that
    did not finish leaves no ``done`` mark and is started again from scratch."""
    home = cache_dir / "peers" / (LLAMA_CPP.replace("==", "-") + (f"-{isa}" if isa else ""))
    bin_dir, done = home / "build" / "bin", home / "done"
    if done.exists():
        return bin_dir
    shutil.rmtree(home, ignore_errors=True)
    home.mkdir(parents=True)
    print(f"building llama.cpp from the {LLAMA_CPP} sdist into {home} (once; ~16 min on 2 cores)", flush=True)
    subprocess.run(["pip", "download", "--no-deps", "--no-binary", ":all:", LLAMA_CPP, "-d", str(home)], check=True,
                   capture_output=True)
    with tarfile.open(next(home.glob("*.tar.gz"))) as sdist:
        sdist.extractall(home, filter="data")
    source = next(home.glob("*/vendor/llama.cpp"))
    subprocess.run(["cmake", "-S", str(source), "-B", str(home / "build"), "-DCMAKE_BUILD_TYPE=Release",
                    *(GGML_TIERS[isa] if isa else ("-DGGML_NATIVE=ON",)), "-DLLAMA_OPENSSL=OFF", "-DLLAMA_CURL=OFF", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF"],
                   check=True, capture_output=True)
    with open(home / "build.log", "w") as log:  # its compilers' warnings run to megabytes
        subprocess.run(["cmake", "--build", str(home / "build"), "--target", *TOOLS, "-j", str(os.cpu_count())], check=True,
                       stdout=log, stderr=subprocess.STDOUT)
    done.touch()
    return bin_dir


def bf16_gguf(bin_dir: Path, gguf: Path) -> Path:
    """``gguf`` re-saved in bf16 by llama.cpp's own quantizer (the weights ours load, dequantized once), cached beside it."""
    target = gguf.with_name(f"{gguf.stem}.bf16.gguf")
    if not target.exists():
        with tempfile.NamedTemporaryFile(dir=gguf.parent, suffix=".gguf", delete=False) as tmp:
            subprocess.run([str(bin_dir / "llama-quantize"), "--allow-requantize", str(gguf), tmp.name, "BF16"], check=True,
                           capture_output=True)
        Path(tmp.name).replace(target)
    return target


def start_server(bin_dir: Path, gguf: Path, threads: int, extra: tuple[str, ...]) -> tuple[subprocess.Popen, str]:
    """A ``llama-server`` on a free loopback port, one slot, no prompt cache, answering -> (process, its URL)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [str(bin_dir / "llama-server"), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
           "-tb", str(threads), "-np", "1", "-c", "4096", "--no-cache-prompt", "--no-webui", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited with {proc.returncode}: {' '.join(cmd)}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return proc, f"http://127.0.0.1:{port}"
        except OSError:
            if time.monotonic() > deadline:
                proc.kill()
                raise
            time.sleep(0.2)


@contextmanager
def llama_server(bin_dir: Path, gguf: Path, threads: int, extra: tuple[str, ...] = ()):
    """Yields (``complete(ids, n)``, the flags it runs with): ``extra``, and ``--no-repack`` if it crashed without
    (its weight repacking does on some files and CPUs: a Q4_1 GGUF on a Xeon with AMX)."""
    try:
        proc, url = start_server(bin_dir, gguf, threads, extra)
    except RuntimeError as e:
        print(f"{e}; again with --no-repack", flush=True)
        extra = (*extra, "--no-repack")
        proc, url = start_server(bin_dir, gguf, threads, extra)

    def complete(ids: list[int], n: int) -> tuple[list[int], float, dict]:
        body = json.dumps({"prompt": ids, "n_predict": n, "temperature": 0.0, "cache_prompt": False, "return_tokens": True}).encode()
        request = urllib.request.Request(f"{url}/completion", body, {"Content-Type": "application/json"})
        start = time.perf_counter()
        with urllib.request.urlopen(request, timeout=600) as r:
            out = json.loads(r.read())
        return out["tokens"], time.perf_counter() - start, out["timings"]

    try:
        yield complete, extra
    finally:
        proc.terminate()
        proc.wait()


def run_all(args) -> dict:
    cache_dir = args.cache_dir or models.default_cache_dir()
    machine = hardware()
    isa = held(args.isa)
    if isa:
        native.library(cache_dir, tier=isa)  # before anything loads our kernels
    bin_dir = args.llama_cpp or build_llama_cpp(cache_dir, isa)
    quantized = models.fetch_embedded(args.model, cache_dir)
    bf16 = bf16_gguf(bin_dir, quantized)
    prompts = datasets.load(args.sets, args.limit, cache_dir)
    n, threads = args.max_new_tokens, torch.get_num_threads()
    sizes: dict[str, int] = {}  # bytes of every linear: "weights" (dense bf16), and per dtype on the GGUF's blocks
    ids: list[list[int]] = []

    @contextmanager
    def stock(dtype: str):
        model, tokenizer = models.load(args.model, dtype=dtype, cache_dir=cache_dir)
        calls = {f"HF greedy {dtype}": lambda p, k: (*hf_generate(model, p, k), None)}
        if dtype == "bfloat16":  # the first engine opened: it tokenizes the prompts for every engine
            sizes["weights"] = linear_bytes(model)
            ids[:] = ids or [p.ids(tokenizer) for p in prompts]
            calls["HF prompt lookup bfloat16"] = lambda p, k: (*hf_generate(model, p, k, prompt_lookup_num_tokens=10), None)
        yield calls

    @contextmanager
    def ours(dtype: str, weights: str):
        model, tokenizer = models.load(args.model, dtype=dtype, cache_dir=cache_dir, kernels="packed", weights=weights)
        gen = LookaheadGenerator(model, tokenizer, LOOKAHEAD, cache_dir=cache_dir)
        if weights == "gguf":
            sizes["integer" if dtype == native.INTEGER else "blocks"] = linear_bytes(model)

        def call(lookahead: bool):
            def run(prompt: list[int], k: int):
                start = time.perf_counter()
                out = gen.generate(prompt, max_new_tokens=k, lookahead=lookahead, state=gen.new_state())
                return out.tokens, time.perf_counter() - start, out.stats.decode_s * 1000 / max(out.stats.steps, 1)
            return run
        name = dtype if weights == "dense" else f"gguf {dtype}"
        yield {f"our plain loop {name}": call(False), f"lookahead {name}": call(True)}

    @contextmanager
    def llama(method: str, gguf: Path, extra: tuple[str, ...]):
        with llama_server(bin_dir, gguf, threads, extra) as (complete, flags):
            def call(prompt: list[int], k: int):
                tokens, seconds, t = complete(prompt, k)
                return tokens, seconds, t["predicted_ms"] / max(t["predicted_n"] - 1, 1)
            yield {method + (" (--no-repack)" if "--no-repack" in flags else ""): call}

    # the GGUF's own blocks (``--weights gguf``), bf16 or fp32 activations, and int8 ones where the integer kernel runs
    dense = "bfloat16" if native.has("bf16_linear") else "float32"  # PyTorch's bf16 where ours do not run: slow, and not row-invariant
    engines = [partial(stock, "bfloat16"), partial(stock, "float32"), partial(ours, dense, "dense"),
               *[partial(ours, dtype, "gguf") for dtype in (*(["bfloat16"] if native.has("bf16_linear") else []), "float32",
                                                             *([native.INTEGER] if native.integer_runs() else []))],
               *[partial(llama, f"llama.cpp {name} {mode}", gguf, ("--spec-type", mode) if mode != "plain" else ())
                 for name, gguf in (("bf16", bf16), (quantized.name, quantized)) for mode in ("plain", *MODES)]]
    rows: dict[str, dict[int, dict]] = {}
    for round_ in range(args.rounds):  # prompt i in round i mod rounds: a slow spell of the machine lands on every engine
        for engine in engines:
            with engine() as calls:
                for method, call in calls.items():
                    call(ids[0][:16], 4)  # warm-up: first-call costs are not what a server pays per request
                    for i in range(round_, len(prompts), args.rounds):
                        tokens, seconds, step_ms = call(ids[i], n)
                        rows.setdefault(method, {})[i] = {"set": prompts[i].set, "prompt": prompts[i].id, "tokens": tokens,
                                                          "seconds": seconds, "step_ms": step_ms}
        print(f"round {round_ + 1} of {args.rounds} done", flush=True)
    runs = {method: [by[i] for i in sorted(by)] for method, by in rows.items()}
    for method, rs in runs.items():
        print(f"{method}: {sum(len(r['tokens']) for r in rs) / sum(r['seconds'] for r in rs):.1f} tok/s")
    return {"hardware": machine, "model": args.model, "isa": native.isa(), "max_new_tokens": n,
            "llama_cpp": LLAMA_CPP + (f" built for {isa} ({' '.join(GGML_TIERS[isa])})" if isa else ""),
            "rounds": args.rounds, "weight_bytes": sizes["weights"], "quantized_bytes": sizes["blocks"],
            "integer_bytes": sizes.get("integer"), "gguf": quantized.name, "read_bytes_per_s": stream_rate() * 1e9, "runs": runs}


def write_report(results: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "results.json", results)  # the token ids as digests
    runs, hw = results["runs"], results["hardware"]
    tps = {m: sum(count(r["tokens"]) for r in rs) / sum(r["seconds"] for r in rs) for m, rs in runs.items()}
    peers = {m: v for m, v in tps.items() if m.startswith("llama.cpp")}
    best_peer = max(peers, key=peers.get)
    plain = runs.get("our plain loop bfloat16") or runs["our plain loop float32"]  # the dense weights' (fp32 without AVX-512 BF16)
    stream_ms = results["weight_bytes"] / results["read_bytes_per_s"] * 1000
    gguf = results.get("gguf")  # runs of the GGUF's own blocks (ours and llama.cpp's), where this run has them
    on_gguf = {m: v for m, v in peers.items() if gguf and gguf in m}

    def reference(method: str) -> list[dict]:
        """Our plain loop on the same weights: on the GGUF's blocks for runs on them (llama.cpp's: bf16 activations)."""
        if " gguf " in method:
            return runs[f"our plain loop gguf {method.rsplit(' ', 1)[-1]}"]
        blocks = runs.get("our plain loop gguf bfloat16", runs.get("our plain loop gguf float32"))  # bf16 where the CPU has it
        return blocks if gguf and gguf in method else plain
    lines = [f"# {results['model']}: lookahead beside llama.cpp and HF", "",
             f"{hw['cpu']}, {hw['cores']} cores ({hw['torch_threads']} threads for every engine); torch {hw['torch']}, transformers "
             f"{hw['transformers']}; commit {hw['commit']}; our kernels' ISA {results['isa']}; llama.cpp from {results['llama_cpp']}'s sdist. "
             f"{len(plain)} prompts as token ids, {results['max_new_tokens']} new tokens, greedy, one request at a time, in "
             f"{results.get('rounds', 1)} round(s) over the engines; each request timed whole (prefill included).", "",
             f"Streaming the {results['weight_bytes'] / 1e6:.0f} MB of bf16 linear weights once at the measured "
             f"{results['read_bytes_per_s'] / 1e9:.1f} GB/s takes {stream_ms:.1f} ms: a plain decode step's floor"
             + (f"; the {results['quantized_bytes'] / 1e6:.0f} MB of {gguf}'s blocks in our layout, "
                f"{results['quantized_bytes'] / results['read_bytes_per_s'] * 1000:.1f} ms" if gguf else "")
             + (f"; the {results['integer_bytes'] / 1e6:.0f} MB in the integer kernel's (the K types as the file holds them), "
                f"{results['integer_bytes'] / results['read_bytes_per_s'] * 1000:.1f} ms" if results.get("integer_bytes") else "") + ".", "",
             f"| engine | tokens/s | vs {best_peer} | plain decode step (ms) | same tokens as our plain loop on the same weights |",
             "|---|---|---|---|---|"]
    for method, rs in runs.items():
        steps = [r["step_ms"] for r in rs if r["step_ms"] is not None]
        step = f"{sorted(steps)[len(steps) // 2]:.1f}" if steps and ("plain" in method) else "–"
        alike = sum(same(r["tokens"], q["tokens"]) for r, q in zip(rs, reference(method))) / len(rs)
        lines.append(f"| {method} | {tps[method]:.1f} | {tps[method] / peers[best_peer]:.2f}x | {step} | {alike:.0%} |")
    ours = max((m for m in tps if m.startswith("lookahead")), key=tps.get)  # our fastest lookahead, on whichever weights
    worst = min((sum(count(r["tokens"]) for r in ps) / sum(r["seconds"] for r in ps) / (sum(count(q["tokens"]) for q in qs) / sum(q["seconds"] for q in qs)), s)
                for s in sorted({r["set"] for r in plain})
                for ps, qs in [([r for r in runs[ours] if r["set"] == s], [r for r in runs[best_peer] if r["set"] == s])])
    lines += ["", f"Plain decode step: the median over prompts of decode time per forward. The worst prompt set of {ours} against "
                  f"{best_peer}: {worst[1]} at {worst[0]:.2f}x."]
    if on_gguf:
        best_on = max(on_gguf, key=on_gguf.get)
        ours_on = max((m for m in tps if m.startswith("lookahead gguf")), key=tps.get)
        theirs = next(m for m in on_gguf if m.startswith(f"llama.cpp {gguf} plain"))  # its name may say --no-repack
        ours_plain = [m for m in runs if m.startswith("our plain loop gguf ")]
        step = {m: sorted(r["step_ms"] for r in runs[m])[len(runs[m]) // 2] for m in (theirs, *ours_plain)}
        lines += ["", f"On {gguf}'s own blocks: {ours_on} {tps[ours_on]:.1f} tokens/s, {tps[ours_on] / on_gguf[best_on]:.2f}x {best_on}; "
                      f"our plain step {', '.join(f'{step[m]:.1f} ms ({m.split()[-1]} activations)' for m in ours_plain)} "
                      f"against llama.cpp's {step[theirs]:.1f} ms."]
        if f"our plain loop gguf {native.INTEGER}" in runs:  # int8 rounds the activations, as llama.cpp does: how often it changes the text
            integer = runs[f"our plain loop gguf {native.INTEGER}"]
            for other in ("our plain loop gguf float32", theirs):
                agree = [_same_start(r["tokens"], q["tokens"]) for r, q in zip(integer, runs[other])]
                lines.append(f"Greedy tokens of our int8 plain loop equal to {other}'s: {sum(a == len(r['tokens']) for a, r in zip(agree, integer))} "
                             f"of {len(integer)} prompts (the same first {sorted(agree)[len(agree) // 2]} tokens, median).")
    (out / "results.md").write_text("\n".join(lines) + "\n")


def _same_start(a: list[int], b: list[int]) -> int:
    """How many tokens ``a`` and ``b`` (a run's ids, as ``run_all`` returns them: not their digests) begin with alike."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=models.DEFAULT_MODEL, choices=sorted(models.EMBEDDED))
    datasets.add_arguments(parser, limit=3)
    parser.add_argument("--rounds", type=int, default=2, help="passes over the engines, each taking every rounds-th prompt")
    parser.add_argument("--llama-cpp", type=Path, help="a directory holding llama-server and llama-quantize (default: build them)")
    parser.add_argument("--isa", choices=list(native.TIERS), help="hold our kernels to this tier, and build llama.cpp for it "
                        "(default: the CPU's best; torch's own kernels, under the HF rows, keep it)")
    parser.add_argument("--build-only", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/peers-latest"))
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.build_only:
        print(build_llama_cpp(args.cache_dir or models.default_cache_dir(), held(args.isa)))
        return
    write_report(run_all(args), args.out)
    print((args.out / "results.md").read_text())


if __name__ == "__main__":
    main()
