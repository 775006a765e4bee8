"""What machine this is, for the layers that adapt to it: the CPU's /proc/cpuinfo fields, its name (a cost curve's
cache key), AMD's core generation (the linears' prefetch choice), and the user's cache directory where kernels,
converted models and measurements are kept; and handing the C heap's freed pages back to the OS. The bottom of the
house: it imports nothing of the engine."""

from __future__ import annotations

import ctypes
import functools
import os
import platform
from pathlib import Path


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/lookahead``, else ``~/.cache/lookahead``: where a call that names no ``cache_dir`` keeps things."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "lookahead"


ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")  # what decides which kernels oneDNN runs


@functools.cache  # the CPU does not change under a running process: read /proc/cpuinfo once
def _cpu_fields() -> dict[str, str]:
    """The first processor's block of /proc/cpuinfo (empty where there is none)."""
    cpuinfo, fields = Path("/proc/cpuinfo"), {}
    for line in cpuinfo.read_text().splitlines() if cpuinfo.exists() else []:
        if not line.strip():
            break  # the first processor's block says it
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    return fields


def _family_model() -> tuple[int, int]:
    fields = _cpu_fields()
    return int(fields.get("cpu family", 0) or 0), int(fields.get("model", 0) or 0)


def cpu_generation() -> str | None:
    """AMD's core generation ("Zen 4"), None for other CPUs."""
    return _zen(*_family_model()) if _cpu_fields().get("vendor_id") == "AuthenticAMD" else None


def cpu_name() -> str:
    """The CPU's name with its family/model and vector extensions: a name alone says "AMD EPYC" for Zen 3, 4
    and 5 alike, whose cost curves differ (a cached curve is keyed by this), e.g.
    "AMD EPYC (Zen 5, family 26 model 2; avx2 avx512f avx512_bf16)"."""
    fields = _cpu_fields()
    if not fields:
        return platform.processor() or platform.machine()
    (family, model), zen = _family_model(), cpu_generation()
    isa = [f for f in ISA_FLAGS if f in flags()]
    return f"{fields.get('model name', platform.machine())} ({zen + ', ' if zen else ''}family {family} model {model}; {' '.join(isa) or 'no avx2'})"


def _zen(family: int, model: int) -> str | None:
    """AMD's core generation from the CPUID family and model (AMD's published family/model ranges)."""
    if family == 0x17:
        return "Zen 2" if model >= 0x30 else "Zen/Zen+"
    if family == 0x19:
        return "Zen 4" if 0x10 <= model <= 0x1F or 0x60 <= model <= 0xAF else "Zen 3"
    return "Zen 5" if family == 0x1A else None


def flags() -> list[str]:
    """The CPU's feature flags (``avx512_bf16``, ...); empty where /proc/cpuinfo has none."""
    return _cpu_fields().get("flags", "").split()


def release_freed_memory() -> None:
    """Hand the C heap's free pages back to the OS (glibc's ``malloc_trim``; elsewhere nothing). A model's load frees
    gigabytes of transient arrays (dequantized tensors, blocks being laid out) in pieces glibc keeps in its heap:
    measured, Qwen2.5-Coder-0.5B loaded in fp32 on the stock kernels and on ours held 7.14 GB (5.63 trimmed at the
    end of each load), and once both were deleted left 3.38 GB resident (0.71 after a trim)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return
    trim(0)
