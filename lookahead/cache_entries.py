"""A cache entry made whole once and trusted only as far as it was checked: written into a temporary directory
and moved into place whole (``directory_whole``), under a lock that one writer holds alone while readers share it
(``held``: processes loading one file at once make its entry once), what a killed writer left removed by the next
(``leftovers``, ``sweep``), and each file's size and sha256 checked against what its writer recorded, its bytes
hashed again only once the file changed (``check_files``: by its status, ctime included, which no write can set
back). Used by ``gguf_model``'s blocks entries and ``models``' wheels, assembled GGUFs and converted models."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterator

from ngram_pool.files import written_whole

SETTLE_NS = 2 * 10 ** 9  # a file changed this close to its check is checked again next time (``check_files``)
Progress = Callable[[str], None]


def quiet(_: str) -> None:
    """The ``Progress`` that says nothing, and shows no bars."""


def bar(progress: Progress, total: float, what: str, unit: str = "B"):
    """A progress bar of ``total`` (``unit``s) with tqdm's estimate of the time left, for a phase of a first run that
    takes long (laying out a 7B-class file: a minute): on stderr where it is a terminal and ``progress`` is not
    ``quiet``, gone when the phase ends."""
    from tqdm import tqdm

    return tqdm(total=total, desc=what, unit=unit, unit_scale=unit == "B", leave=False, disable=True if progress is quiet else None)


@contextlib.contextmanager
def held(target: Path, progress: Progress | None, shared: bool = False) -> Iterator[bool]:
    """``target``'s lock (``.<name>.lock`` beside it) for the block: shared by processes reading ``target``, or held
    alone by the one writing it, which first removes what a writer that died left (``leftovers``). An flock: the
    kernel drops it when its holder dies, however it dies, so a killed writer never blocks the next. Yields whether
    it is held: ``progress`` None does not wait (False where another process holds it), else a wait is said in one
    line."""
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        lock = open(target.parent / f".{target.name}.lock", "a+b")
    except OSError:
        if not shared:
            raise
        yield True  # a cache no one can write (a read-only disk): no writer to wait for
        return
    with lock:
        mode = fcntl.LOCK_SH if shared else fcntl.LOCK_EX
        try:
            fcntl.flock(lock, mode | fcntl.LOCK_NB)
        except BlockingIOError:
            if progress is None:
                yield False
                return
            progress(f"waiting for another process to finish with {target}")
            fcntl.flock(lock, mode)
        if not shared:
            for path in leftovers(target):
                remove(path)
        yield True


def remove(path: Path) -> None:
    """Remove ``path``: a directory with all it holds, a file, or a link alone, never what it points to (rmtree
    refuses a link: one to a directory left in the cache had failed every later load)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def _owner(name: str) -> str | None:
    """The name whose writer made the file or directory ``name`` (``directory_whole``'s ``.tmp-<name>.<random>`` and
    ``.stale-<name>.<random>``, ``written_whole``'s ``.<name>.<pid>-<thread>.partial``), or None for anything else."""
    for prefix, suffix in ((".tmp-", ""), (".stale-", ""), (".", ".partial")):
        if name.startswith(prefix) and name.endswith(suffix):
            return name[len(prefix): len(name) - len(suffix)].rpartition(".")[0] or None
    return None


def leftovers(target: Path) -> list[Path]:
    """What writers of ``target`` left beside it: to be removed only by one holding its lock alone (``held``). A
    ``.partial`` file of a process still running is kept: an older version wrote them without the lock."""
    found = [path for path in target.parent.iterdir() if _owner(path.name) == target.name] if target.parent.is_dir() else []
    return [path for path in found if not (path.name.endswith(".partial") and _running(path.name))]


def _running(partial: str) -> bool:
    """Whether the process ``written_whole`` names in ``partial`` (``.<name>.<pid>-<thread>.partial``) runs."""
    pid = partial.removesuffix(".partial").rpartition(".")[2].partition("-")[0]
    try:
        os.kill(int(pid), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:  # another user's
        pass
    return True


def sweep(directory: Path) -> None:
    """Remove what writers that died left in ``directory`` (a kill or a full disk mid-write left a 2.4 GB
    ``.tmp-`` entry of the 1.5B's): each owner's lock is taken without waiting, so a live writer's are kept."""
    for owner in {_owner(path.name) for path in directory.iterdir()} - {None} if directory.is_dir() else ():
        with contextlib.suppress(OSError), held(directory / owner, None):  # a read-only cache's stay
            pass


@contextlib.contextmanager
def directory_whole(target: Path) -> Iterator[Path]:
    """A directory to fill that becomes ``target`` only when the block ends (a temporary one beside it, renamed):
    a cache entry a reader finds whole or not at all; on an exception the temporary one is removed. The caller holds
    ``target``'s lock (``held``): a damaged ``target`` is moved aside, then removed (a process that mapped its files
    keeps them: they are unlinked, never written); a link there is removed, not what it points to (a directory
    cannot be renamed over a link, nor a link over a directory)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".tmp-{target.name}."))
    try:
        yield tmp
        if target.is_symlink():
            target.unlink()
        elif target.exists():
            stale = tempfile.mkdtemp(dir=target.parent, prefix=f".stale-{target.name}.")
            os.replace(target, stale)
            shutil.rmtree(stale, ignore_errors=True)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _status(status: os.stat_result) -> list[int]:
    """What changes whenever a file's bytes are written through the filesystem: its ctime, which no one can set back
    (a copy, a truncation, an edit or a file renamed over it change it; ``touch -d`` sets the mtime, and moves the
    ctime to now)."""
    return [status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns, status.st_ctime_ns]


def check_files(files: dict[str, tuple[Path, int | None, str]], stamps: Path | None) -> str | None:
    """Why the first of ``files`` ({what to call it: (path, its size or None, its sha256)}) is not the file recorded,
    or None.

    A size is checked always (a short file is never mapped: the kernels read past its end, a SIGSEGV). The bytes are
    hashed only where ``stamps`` (a JSON file: key -> the status its file had when its bytes were last found whole)
    does not hold the file's status now: every write through the filesystem moves a file's ctime (``_status``), so
    a file hashes once after it is written, copied or edited, not at each load (a 1.5B's laid-out blocks are ~2.5 GB,
    seconds to hash; a stat is microseconds). A file changed less than ``SETTLE_NS`` before its check is not
    stamped: timestamps are coarser than writes, and a write in the same tick would keep its status."""
    known = _stamps(stamps)
    started, found, hashing = time.time_ns(), {}, {}
    for key, (path, size, _) in files.items():
        try:
            found[key] = path.stat()
        except OSError:
            return f"{key} is missing"
        if size is not None and found[key].st_size != size:
            return f"{key} is {found[key].st_size} bytes, not the {size} expected"
        if known.get(key) != _status(found[key]):
            hashing[key] = path
    with ThreadPoolExecutor() as pool:  # hashlib lets go of the GIL: the files hash side by side
        digests = dict(zip(hashing, pool.map(sha256, hashing.values())))
    for key, digest in digests.items():
        if digest != files[key][2]:
            return f"{key} has sha256 {digest[:16]}..., not the {files[key][2][:16]}... expected"
    settled = {key: _status(found[key]) for key in digests if found[key].st_ctime_ns < started - SETTLE_NS}
    if stamps is not None and settled:
        with contextlib.suppress(OSError):  # a cache on a read-only disk is checked at each load instead
            with written_whole(stamps) as out:
                out.write(json.dumps(_stamps(stamps) | settled).encode())
    return None


def _stamps(stamps: Path | None) -> dict:
    """``check_files``' stamps (none where the file is missing or not a JSON object of them)."""
    try:
        known = json.loads(stamps.read_text()) if stamps is not None else {}
    except (OSError, ValueError):
        return {}
    return known if isinstance(known, dict) else {}
