"""Hostile drafting-state files: every field of every file of a saved state mutated (values, dtypes, shapes,
headers that claim huge arrays, missing and truncated members). Each load is a ``ValueError`` naming the file
and the field, raised before anything large is allocated, or a state that generates exactly."""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import subprocess
import sys
import tracemalloc
import zipfile
from pathlib import Path

import numpy as np
import pytest

from conftest import assert_greedy_equal, hf_greedy, tiny_llama
from lookahead import LookaheadConfig, LookaheadGenerator
from ngram_pool import NGramPool

CONFIG = LookaheadConfig(auto=False, window=3, ngram=4, guess=4, tree_budget=12)
PROMPT = [5, 9, 14, 5, 9, 20, 5, 9, 14, 33, 5, 9]
NEW = 24


@pytest.fixture(scope="module")
def setting(tmp_path_factory):
    """A generator, the reference output, and a state that has learned from a request, saved."""
    model = tiny_llama(seed=4)
    gen = LookaheadGenerator(model, config=CONFIG)
    state = gen.new_state()
    gen.generate(PROMPT, NEW, state=state)
    saved = tmp_path_factory.mktemp("state") / "saved"
    state.save(saved)
    return gen, hf_greedy(model, PROMPT, NEW), saved


def arrays_of(path: Path) -> dict[str, np.ndarray]:
    with np.load(path) as f:
        return dict(f)


def npy_bytes(array: np.ndarray, claimed_shape: tuple | None = None) -> bytes:
    """``array`` as an .npy member, its header claiming ``claimed_shape`` when given."""
    out = io.BytesIO()
    header = np.lib.format.header_data_from_array_1_0(array)
    if claimed_shape is not None:
        header["shape"] = claimed_shape
    np.lib.format.write_array_header_1_0(out, header)
    out.write(array.tobytes())
    return out.getvalue()


def write_npz(path: Path, members: dict[str, bytes]) -> None:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in members.items():
            z.writestr(f"{name}.npy", data)


def mutants(saved: Path):
    """(description, file, {member: bytes}) for every field of every file: bad values, dtypes, shapes, claims."""
    for file in ("pool.npz", "recycle.npz", "acceptance.npz"):
        arrays = arrays_of(saved / file)
        members = {k: npy_bytes(v) for k, v in arrays.items()}
        for name, value in arrays.items():
            yield f"{file}:{name} missing", file, {k: v for k, v in members.items() if k != name}
            other = value.astype(np.float64 if value.dtype.kind in "iu" else np.int64)
            yield f"{file}:{name} as {other.dtype}", file, members | {name: npy_bytes(other)}
            yield f"{file}:{name} one axis more", file, members | {name: npy_bytes(value[..., None])}
            if value.size:
                yield f"{file}:{name} one element less", file, members | {name: npy_bytes(value.ravel()[1:])}
            yield f"{file}:{name} claims 2**40 elements", file, members | {name: npy_bytes(value, (2**20, 2**20))}
            yield f"{file}:{name} claims its shape x1024", file, members | {name: npy_bytes(value, (1024,) + value.shape)}
            bad_values = [np.nan, np.inf, -1.0, 1e300] if value.dtype.kind == "f" else [-2, -1, 255, 256, 1000, 2**31 - 1, -2**31]
            for i in sorted({0, value.size // 2, value.size - 1}) if value.size else []:
                for bad in bad_values:
                    changed = value.copy()
                    changed.flat[i] = np.array(bad).astype(value.dtype) if value.dtype.kind != "f" else bad
                    yield f"{file}:{name}[{i}] = {bad}", file, members | {name: npy_bytes(changed)}
        raw = (saved / file).read_bytes()
        yield f"{file} truncated", file, raw[: len(raw) // 2]
        yield f"{file} garbage", file, b"PK\x03\x04" + b"\x00" * 64


def test_every_mutated_field_is_a_named_value_error_or_a_state_that_generates_exactly(setting, tmp_path):
    gen, reference, saved = setting
    loaded, refused = 0, 0
    for description, file, content in mutants(saved):
        directory = tmp_path / "mutant"
        shutil.rmtree(directory, ignore_errors=True)
        shutil.copytree(saved, directory)
        if isinstance(content, bytes):
            (directory / file).write_bytes(content)
        else:
            write_npz(directory / file, content)
        try:
            state = gen.load_state(directory)
        except ValueError as e:
            assert str(e).startswith(str(directory / file)), f"{description}: {e}"
            refused += 1
            continue
        out = gen.generate(PROMPT, NEW, state=state)
        assert_greedy_equal(gen.model, PROMPT, out.tokens, reference)
        loaded += 1
    assert refused > 100 and loaded > 0  # most mutations are refused; some (a hit count lowered) are harmless


def test_an_origin_code_outside_a_byte_is_refused_not_an_index_error_later(setting, tmp_path):
    gen, reference, saved = setting
    shutil.copytree(saved, tmp_path / "state")
    arrays = arrays_of(saved / "pool.npz")
    for code in (256, 1000, -1):
        table = arrays["table"].copy()
        table[np.nonzero(arrays["counts"])[0][0], 0, -1] = code
        np.savez_compressed(tmp_path / "state" / "pool.npz", **arrays | {"table": table})
        with pytest.raises(ValueError, match="pool.npz: n-gram pool: table: an origin code outside"):
            gen.load_state(tmp_path / "state")


def test_a_header_claiming_a_huge_pool_allocates_nothing_before_it_is_refused(tmp_path):
    path = tmp_path / "pool.npz"
    NGramPool(vocab_size=50, n=3).save(path)
    arrays = arrays_of(path)
    for claim in ([2**26, 3, 1024, 0], [2**20, 3, 64, 0], [50, 3, 2**30, 1]):  # 768 GiB, 768 MiB, 600 GiB
        np.savez_compressed(path, **arrays | {"shape": np.array(claim, np.int64)})
        tracemalloc.start()
        try:
            with pytest.raises(ValueError, match="pool.npz: n-gram pool: "):
                NGramPool.load(path)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 2**20, f"{claim}: {peak} bytes allocated before the refusal"


LOAD_BOXED = """
import resource, sys
from lookahead.drafting import DraftState
pages = int(open("/proc/self/statm").read().split()[0])
size = pages * resource.getpagesize() + 2**30  # what is mapped now and a gigabyte: an unbounded read fails fast
resource.setrlimit(resource.RLIMIT_AS, (size, size))
try:
    DraftState.load(sys.argv[1])
except ValueError as e:
    print(e)
"""


@pytest.mark.parametrize("kind", ["a symlink to /dev/zero", "a FIFO"])
def test_a_state_file_that_is_not_a_regular_file_is_refused_by_name(setting, tmp_path, kind):
    """/dev/zero would be read without end, a FIFO would block the open itself: the load runs boxed (a memory
    limit, a timeout), so that a regression fails here instead of eating the machine or hanging."""
    directory = tmp_path / "state"
    shutil.copytree(setting[2], directory)
    pool = directory / "pool.npz"
    pool.unlink()
    pool.symlink_to("/dev/zero") if kind.startswith("a symlink") else os.mkfifo(pool)
    done = subprocess.run([sys.executable, "-c", LOAD_BOXED, str(directory)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.startswith(f"{pool}: not a regular file"), done.stdout + done.stderr[-2000:]
    assert len(done.stdout.strip().splitlines()) == 1


STATE_FILES = ("pool.npz", "recycle.npz", "acceptance.npz")


@pytest.mark.parametrize("failing", range(len(STATE_FILES)))
def test_a_save_that_fails_midway_leaves_the_saved_state_whole(setting, tmp_path, monkeypatch, failing):
    """The ``failing``-th file's write stops after a few bytes (a full disk; a kill leaves the same file behind):
    that file is the old one, byte for byte, no temporary file is left, and the state loads and generates exactly."""
    gen, reference, saved = setting
    directory = tmp_path / "state"
    shutil.copytree(saved, directory)
    old = {name: (directory / name).read_bytes() for name in STATE_FILES}
    state = gen.load_state(directory)
    gen.generate(PROMPT[::-1], NEW, state=state)  # the state learns: the new files differ from the old
    writes = []

    def failing_after(write):
        def write_part(file, *args, **kwargs):
            writes.append(file)
            if len(writes) - 1 != failing:
                return write(file, *args, **kwargs)
            with open(file, "wb") if isinstance(file, (str, os.PathLike)) else contextlib.nullcontext(file) as out:
                out.write(b"PK\x03\x04" + bytes(64))
            raise OSError(28, "No space left on device")
        return write_part

    monkeypatch.setattr(np, "savez", failing_after(np.savez))
    monkeypatch.setattr(np, "savez_compressed", failing_after(np.savez_compressed))
    with pytest.raises(OSError, match="No space left"):
        state.save(directory)
    monkeypatch.undo()
    assert (directory / STATE_FILES[failing]).read_bytes() == old[STATE_FILES[failing]]
    assert sorted(p.name for p in directory.iterdir()) == sorted(STATE_FILES)
    out = gen.generate(PROMPT, NEW, state=gen.load_state(directory))
    assert_greedy_equal(gen.model, PROMPT, out.tokens, reference)
