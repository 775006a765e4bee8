"""``ArrayFile``: the arrays of an ``.npz`` read only after each one's header is checked, so that a hostile file
(a header claiming 768 GiB, a dtype the kernels do not take) is a ``ValueError`` naming the file and the field
before anything is allocated. ``np.load`` allocates what an array's header claims before it reads a byte.

An array is read only when its dtype and shape are the expected ones and its bytes are what its zip member
holds; a member's size is believed only as far as its compressed size can produce it (deflate expands at
most ~1032x), so a file allocates at most about a thousand times its own size. Only a regular file is opened:
a device (``/dev/zero``) would be read without end, a FIFO would block. ``written_whole``: the other way, a
file that appears whole or not at all."""

from __future__ import annotations

import contextlib
import os
import stat
import threading
import zipfile
import zlib
from pathlib import Path
from typing import BinaryIO, Iterator

import numpy as np

MAX_EXPANSION = 1100  # deflate's largest ratio is 1032:1; stored members are 1:1
MAX_HEADER = 10_000  # bytes of an array's header (numpy's own default limit)


class ArrayFile:
    """An ``.npz`` opened for checked reads: ``with ArrayFile(path) as f: table = f.array("table", np.int32, (n, None))``."""

    def __init__(self, path: str | Path, what: str) -> None:
        self.path, self.what = Path(path), what
        try:
            self._file = open_regular(self.path)
        except OSError as e:
            raise ValueError(f"{self.path}: not a readable {what} ({type(e).__name__}: {e})") from None
        try:
            self._zip = zipfile.ZipFile(self._file)
        except (OSError, zipfile.BadZipFile, ValueError) as e:
            self._file.close()
            raise ValueError(f"{self.path}: not a readable {what} ({type(e).__name__}: {e})") from None

    def __enter__(self) -> "ArrayFile":
        return self

    def __exit__(self, *exc) -> None:
        self._zip.close()
        self._file.close()

    def fail(self, field: str, problem: str) -> ValueError:
        return ValueError(f"{self.path}: {self.what}: {field}: {problem}")

    def array(self, name: str, dtype: type, shape: tuple[int | None, ...]) -> np.ndarray:
        """The array ``name``, C-ordered, of exactly ``dtype`` and ``shape`` (None: any length on that axis)."""
        try:
            info = self._zip.getinfo(f"{name}.npy")
        except KeyError:
            raise self.fail(name, "missing") from None
        if info.file_size > MAX_EXPANSION * info.compress_size + 1024:
            raise self.fail(name, f"claims {info.file_size} bytes from {info.compress_size} compressed")
        try:
            with self._zip.open(info) as member:
                version = np.lib.format.read_magic(member)
                read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
                found, fortran, found_dtype = read_header(member, max_header_size=MAX_HEADER)
                header_bytes = member.tell()
                if found_dtype != np.dtype(dtype) or fortran:
                    raise self.fail(name, f"dtype {found_dtype}{' (Fortran order)' if fortran else ''}, expected {np.dtype(dtype)}")
                if len(found) != len(shape) or any(want is not None and got != want for got, want in zip(found, shape)):
                    raise self.fail(name, f"shape {found}, expected {tuple('any' if s is None else s for s in shape)}")
                nbytes = int(np.prod(found, dtype=object)) * found_dtype.itemsize
                if header_bytes + nbytes != info.file_size:
                    raise self.fail(name, f"shape {found} needs {nbytes} bytes, the file holds {info.file_size - header_bytes}")
                data = member.read(nbytes)
        except ValueError as e:
            raise e if str(e).startswith(f"{self.path}:") else self.fail(name, str(e)) from None
        except (OSError, EOFError, zipfile.BadZipFile, zlib.error) as e:
            raise self.fail(name, f"unreadable ({type(e).__name__}: {e})") from None
        if len(data) != nbytes:
            raise self.fail(name, f"truncated ({len(data)} of {nbytes} bytes)")
        return np.frombuffer(data, found_dtype).reshape(found)  # read-only: callers copy what they keep

    def scalar(self, name: str) -> int:
        """A 0-d int64 array as an int."""
        return int(self.array(name, np.int64, ()))

    def check(self, field: str, ok: bool, problem: str) -> None:
        if not ok:
            raise self.fail(field, problem)


def open_regular(path: Path) -> BinaryIO:
    """``path`` opened for reading, or a one-line ``ValueError`` naming it unless it is a regular file (after
    symlinks). Opened without blocking (a FIFO would block the open itself), then checked before a byte is read."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = {stat.S_IFIFO: "a FIFO", stat.S_IFDIR: "a directory"}.get(stat.S_IFMT(mode), "a device")
            raise ValueError(f"{path}: not a regular file but {kind}")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


@contextlib.contextmanager
def written_whole(path: str | Path) -> Iterator[BinaryIO]:
    """A file to write that becomes ``path`` only when the block ends: written beside it under a temporary name,
    flushed to disk, then renamed over it, so a reader (or the next run, after a kill or a full disk mid-write)
    finds the old file or the new one, never a torn one. On an exception the temporary file is removed."""
    path = Path(path)
    partial = path.with_name(f".{path.name}.{os.getpid()}-{threading.get_ident()}.partial")  # no two writers share one
    try:
        with open(partial, "wb") as out:
            yield out
            out.flush()
            os.fsync(out.fileno())
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
