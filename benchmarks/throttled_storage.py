"""Storage of a fixed aggregate bandwidth shared by every rank process on this machine,
for `shardwise bench read-once`: the same local folder (on `/dev/shm`), but every read
of a data file (`*.distcp`) by either loader passes through one `Link`.

A `Link` is a FIFO link of `rate` bytes per second, standing in for a shared file
system: its state is a small file (8 bytes: the `CLOCK_MONOTONIC` time the link is
next free, which every process on the machine reads alike) under an `fcntl.flock`.
A read of n bytes is made, then reserves the link for [max(now, free), + n / rate)
and sleeps until the end of that slot, when its bytes have "arrived". Reads of all
ranks and threads queue in one line, so W ranks share `rate`, whatever their count.
With no state file (`rate` None) a link only counts.

Every link counts what passes through it in its process (`bytes`, `reads`): the bytes
read from storage, counted the same way for both loaders.

- shardwise: `register(scheme, link)` registers a storage backend
  (`shardwise.storage.register_backend`) that opens `scheme:///path` as a
  `LinkedFolder`, a `LocalFolder` whose data files are read through the link
  (`LinkedFile`, around the `LocalFile` whose `preadv`s `swc.load` makes).
- stock DCP: `stock_reader(path, link)` is a `FileSystemReader` whose file system
  opens data files as stock's does (`path.open("rb")`: a `BufferedReader` over a
  `FileIO`, of the same buffer size) with the link between the two, so what is
  counted is what stock's buffered stream asks the OS for (its read-ahead too).
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import os
import struct
import tempfile
import threading
import time
from collections.abc import Generator, Sequence
from pathlib import Path
from typing import Any

DATA_SUFFIX = ".distcp"
_STAMP = struct.Struct("d")


def is_data(name: str | os.PathLike) -> bool:
    return str(name).endswith(DATA_SUFFIX)


class Link:
    """What data reads pass through in one process: counted, and throttled when the
    link has a state file (`create`) and a rate."""

    def __init__(self, state: str | None = None, rate: float | None = None) -> None:
        self.state, self.rate = state, rate
        self.bytes = 0
        self.reads = 0
        self._lock = threading.Lock()
        self._fd = -1

    @staticmethod
    def create(folder: str = "/dev/shm") -> str:
        """A fresh state file (the link free from now on); remove it with `os.unlink`."""
        fd, path = tempfile.mkstemp(prefix="shardwise-link-", dir=folder)
        try:
            os.write(fd, _STAMP.pack(0.0))
        finally:
            os.close(fd)
        return path

    def reset(self) -> None:
        with self._lock:
            self.bytes = self.reads = 0

    def counts(self) -> tuple[int, int]:
        return self.bytes, self.reads

    def passed(self, n: int) -> None:
        """`n` bytes were just read: count them and, throttled, wait for their slot."""
        with self._lock:
            self.bytes += n
            self.reads += 1
            if not self.rate or not self.state or n <= 0:
                return
            if self._fd < 0:
                self._fd = os.open(self.state, os.O_RDWR)
            end = self._reserve(n)
        delay = end - time.monotonic()
        if delay > 0:
            time.sleep(delay)

    def _reserve(self, n: int) -> float:
        """The end of the slot of `n` bytes, taken in the one line of every process."""
        assert self.rate
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            (free,) = _STAMP.unpack(os.pread(self._fd, _STAMP.size, 0))
            end = max(time.monotonic(), free) + n / self.rate
            os.pwrite(self._fd, _STAMP.pack(end), 0)
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        return end


# -- shardwise: a storage backend --------------------------------------------------------------


def _local_classes() -> tuple[Any, Any, Any]:
    from shardwise.storage import LocalFolder, RandomAccess
    from shardwise.storage.local import LocalFile

    return LocalFolder, RandomAccess, LocalFile


def register(scheme: str, link: Link) -> None:
    """Serve `scheme:///path` (this process) as the local folder `/path` read through `link`."""
    from shardwise.storage import register_backend

    folder_class = linked_folder_class()
    prefix = f"{scheme}://"

    def factory(location: str, options: dict[str, Any]) -> Any:
        if options:
            raise ValueError(f"{scheme}:// takes no storage options, not {sorted(options)}")
        return folder_class(location[len(prefix) :], link)

    register_backend(scheme, factory)


_CLASSES: dict[str, Any] = {}


def linked_folder_class() -> Any:
    """`LinkedFolder` (made on first use, so that importing this module imports no shardwise)."""
    if "folder" in _CLASSES:
        return _CLASSES["folder"]
    LocalFolder, RandomAccess, _ = _local_classes()

    class LinkedFile(RandomAccess):
        """A data file whose every read passes through the link."""

        def __init__(self, inner: Any, link: Link) -> None:
            self.inner, self.link, self.where = inner, link, inner.where

        def readinto(self, buffers: Sequence[memoryview], offset: int) -> int:
            got = self.inner.readinto(buffers, offset)
            self.link.passed(got)
            return got

        def pread(self, n: int, offset: int) -> bytes:
            data = self.inner.pread(n, offset)
            self.link.passed(len(data))
            return data

        def size(self) -> int:
            return self.inner.size()

        def close(self) -> None:
            self.inner.close()

    class LinkedFolder(LocalFolder):
        """A local folder whose data files are read through a `Link`. A throttled link is
        a medium every rank shares, as a network file system is
        (`Folder.shared_medium`); a link that only counts is the local disk it reads."""

        @property
        def shared_medium(self) -> bool:
            return bool(self.link.rate and self.link.state)

        def __init__(self, path: str | os.PathLike, link: Link) -> None:
            super().__init__(path)
            self.link = link

        def open(self, name: str) -> Any:
            f = super().open(name)
            return LinkedFile(f, self.link) if is_data(name) else f

        def child(self, name: str) -> Any:
            return LinkedFolder(super().child(name).path, self.link)

    _CLASSES["folder"] = LinkedFolder
    return LinkedFolder


# -- stock DCP: a FileSystemReader --------------------------------------------------------------


class LinkedRaw(io.RawIOBase):
    """A `FileIO` whose reads pass through the link (below stock's buffer)."""

    def __init__(self, path: str | os.PathLike, link: Link) -> None:
        super().__init__()
        self._file = io.FileIO(path, "r")
        self.link = link

    def readinto(self, b: Any) -> int | None:
        got = self._file.readinto(b)
        if got:
            self.link.passed(got)
        return got

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        return self._file.seek(offset, whence)

    def tell(self) -> int:
        return self._file.tell()

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._file.fileno()

    def close(self) -> None:
        self._file.close()
        super().close()


def stock_reader(path: str | os.PathLike, link: Link) -> Any:
    """Stock's `FileSystemReader` of `path`, its data files read through `link`."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.filesystem import FileSystem

    class LinkedFileSystem(FileSystem):
        @contextlib.contextmanager
        def create_stream(
            self, path: str | os.PathLike, mode: str
        ) -> Generator[io.IOBase, None, None]:
            if mode != "rb" or not is_data(path):
                with super().create_stream(path, mode) as stream:
                    yield stream
                return
            raw = LinkedRaw(Path(path), link)
            # what `open(path, "rb")` picks: the file's block size, else the default
            size = os.fstat(raw.fileno()).st_blksize
            with io.BufferedReader(raw, size if size > 1 else io.DEFAULT_BUFFER_SIZE) as stream:
                yield stream

    reader = FileSystemReader(path)
    reader.fs = LinkedFileSystem()
    return reader
