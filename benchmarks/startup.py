"""Where a warm start goes: a real ``lookahead generate`` call timed to its first streamed text and to its end,
then the same work in-process, phase by phase (import, the dtype choice, loading and packing, the generator's
probes and warm-ups, the prefill and first token, the rest of the decode).

    python -m benchmarks.startup [--model smollm2-135m --prompt "Write a haiku about the sea." --runs 3]

"Warm" means the models are converted and the curves and the prior cached: run it once before reading it. Each
number is the fastest of ``--runs`` processes (the first of them, if the cache was cold, is not counted)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

PHASES = """
import json, time
t0 = time.perf_counter()
from lookahead import LookaheadConfig, LookaheadGenerator, models, probing
marks = {"import": time.perf_counter()}
spec, prompt = SPEC, PROMPT
dtype, weights, loaded = probing.fastest(spec, "cpu", models.default_cache_dir(), kernels="packed", weights="auto")
marks["dtype choice"] = time.perf_counter()
model, tok = loaded or models.load(spec, dtype=dtype, kernels="packed", weights=weights)
marks["load and pack"] = time.perf_counter()
gen = LookaheadGenerator(model, tok, LookaheadConfig())
marks["probes and warm-ups"] = time.perf_counter()

class First:
    seen = 0
    def put(self, ids):
        self.seen += 1
        if self.seen == 2:
            marks["prefill and first token"] = time.perf_counter()
    def end(self):
        pass

gen.generate(prompt, 128, chat=True, streamer=First())
marks["rest of the decode"] = time.perf_counter()
last, out = t0, {}
for name, t in marks.items():
    out[name], last = t - last, t
print(json.dumps(out))
"""


def cli_times(model: str, prompt: str) -> tuple[float, float]:
    """(seconds to the first byte of text on stdout, seconds to exit) of one ``lookahead generate`` process."""
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "lookahead.cli", "generate", "--model", model, prompt],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    proc.stdout.read(1)
    first = time.perf_counter() - start
    proc.stdout.read()
    proc.wait()
    return first, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prompt", default="Write a haiku about the sea.")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    cli_times(args.model, args.prompt)  # warms every cache
    cli = min((cli_times(args.model, args.prompt) for _ in range(args.runs)), key=lambda t: t[0])
    code = PHASES.replace("SPEC", repr(args.model)).replace("PROMPT", repr(args.prompt))
    runs = [json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
            for _ in range(args.runs)]
    print(f"lookahead generate {args.prompt!r} ({args.model}): first text at {cli[0]:.2f} s, done at {cli[1]:.2f} s")
    print("| phase (in-process, fastest of runs) | seconds |\n|---|---|")
    for name in runs[0]:
        print(f"| {name} | {min(r[name] for r in runs):.2f} |")


if __name__ == "__main__":
    main()
