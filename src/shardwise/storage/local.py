"""`LocalFolder`: a directory on a local (or POSIX network) filesystem, through the OS directly.

Atomic means `rename(2)`: a record is written under a temporary name,
fsynced, then renamed over its final name, and the directory fsynced, so a
reader sees the old file or the new one and a power loss keeps one of them.
Reads are `preadv` straight into the caller's buffers; writes `writev`
straight from them. No fsspec in between: local paths keep their speed.
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .folder import Folder, RandomAccess, Sink, temporary_name

__all__ = ["LocalFile", "LocalFolder", "LocalSink", "write_all"]

_IOV_MAX = 1024


def write_all(fd: int, buffers: Sequence[Any]) -> None:
    """`writev` until every byte is written (one call may write less)."""
    pending = [memoryview(b).cast("B") for b in buffers if len(memoryview(b).cast("B"))]
    while pending:
        n = os.writev(fd, pending[:_IOV_MAX])
        while n:
            if n >= len(pending[0]):
                n -= len(pending.pop(0))
            else:
                pending[0] = pending[0][n:]
                n = 0


class LocalFile(RandomAccess):
    """An open file descriptor, read with `preadv`."""

    def __init__(self, path: Path) -> None:
        self.where = str(path)
        self.fd = os.open(path, os.O_RDONLY)
        self._owned = True

    @classmethod
    def wrap(cls, fd: int, where: str = "") -> LocalFile:
        """A descriptor opened elsewhere, read in place (and left open by `close`)."""
        f = cls.__new__(cls)
        f.where, f.fd, f._owned = where or f"<fd {fd}>", fd, False
        return f

    def readinto(self, buffers: Sequence[memoryview], offset: int) -> int:
        views = [b for b in buffers if len(b)]
        return os.preadv(self.fd, views, offset) if views else 0

    def pread(self, n: int, offset: int) -> bytes:
        return os.pread(self.fd, n, offset)

    def size(self) -> int:
        return os.fstat(self.fd).st_size

    def close(self) -> None:
        if self.fd >= 0 and self._owned:
            os.close(self.fd)
        self.fd = -1


class LocalSink(Sink):
    """A new file created exclusively (`O_EXCL`) and filled with `writev`."""

    def __init__(self, path: Path) -> None:
        self.name = path.name
        self.path = path
        self.file = open(path, "xb", buffering=0)  # noqa: SIM115 - closed by close/abort
        self._buffered: io.BufferedWriter | None = None

    def write(self, buffers: Sequence[Any]) -> None:
        """One `writev` for the lot when the kernel takes it all (the common case)."""
        if self._buffered is not None:
            self._buffered.flush()
        views = [memoryview(b).cast("B") for b in buffers]
        views = [v for v in views if len(v)]
        if not views:
            return
        fd = self.file.fileno()
        for k in range(0, len(views), _IOV_MAX):
            part = views[k : k + _IOV_MAX]
            n = os.writev(fd, part)
            total = sum(len(v) for v in part)
            if n < total:  # a short write: finish from where it stopped
                rest, skip = [], n
                for v in part:
                    if skip >= len(v):
                        skip -= len(v)
                        continue
                    rest.append(v[skip:])
                    skip = 0
                write_all(fd, rest)

    def stream(self) -> io.BufferedWriter:
        if self._buffered is None:
            self._buffered = io.BufferedWriter(self.file)
        return self._buffered

    def close(self, *, sync: bool = True) -> None:
        if self.file.closed:
            return
        try:
            if self._buffered is not None:
                self._buffered.flush()
            if sync:
                os.fsync(self.file.fileno())
        finally:
            self.file.close()

    def abort(self) -> None:
        if not self.file.closed:
            self.file.close()
        self.path.unlink(missing_ok=True)


class LocalFolder(Folder):
    """A local directory. See the module docstring for what atomic means here."""

    is_local = True

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.location = str(self.path)

    @property
    def identity(self) -> str:
        return str(self.path.resolve())

    @property
    def checkpoint_id(self) -> Path:
        return self.path

    def where(self, name: str) -> str:
        return str(self.path / name)

    def is_file(self) -> bool:
        return self.path.is_file()

    def sizes(self) -> dict[str, int]:
        try:
            entries = list(os.scandir(self.path))
        except OSError:
            return {}
        out = {}
        for entry in entries:
            try:
                if entry.is_file():
                    out[entry.name] = entry.stat().st_size
            except OSError:
                continue
        return out

    def names(self) -> list[str]:
        try:
            return sorted(os.listdir(self.path))
        except OSError:
            return []

    def has(self, name: str) -> bool:
        return (self.path / name).exists()

    def removable(self, name: str) -> bool:
        p = self.path / name
        return p.is_file() and not p.is_symlink()

    def read(self, name: str) -> bytes:
        return (self.path / name).read_bytes()

    def open(self, name: str) -> LocalFile:
        return LocalFile(self.path / name)

    def make(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True)

    def create(self, name: str) -> LocalSink:
        return LocalSink(self.path / name)

    def write_atomically(self, name: str, write: Callable[[Sink], object], *, sync: bool) -> None:
        """`write(sink)` fills a temporary name, fsynced, then renamed over `name`."""
        sink = self.create(temporary_name(name))
        try:
            write(sink)
            sink.close(sync=sync)
        except BaseException:
            sink.abort()  # a failed write leaves nothing behind to collect
            raise
        os.replace(sink.path, self.path / name)

    def replace(self, source: str, target: str) -> None:
        os.replace(self.path / source, self.path / target)

    def remove(self, name: str) -> None:
        os.unlink(self.path / name)

    def sync(self) -> None:
        fd = os.open(self.path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
