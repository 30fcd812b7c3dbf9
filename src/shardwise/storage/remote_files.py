"""The file handles of an `FsspecFolder`: ranged reads and uploads."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .folder import RandomAccess, Sink
from .ranges import scatter

if TYPE_CHECKING:
    from .remote import FsspecFolder

__all__ = ["RemoteFile", "RemoteSink"]


class RemoteFile(RandomAccess):
    """A file of an `FsspecFolder`, read by ranged GETs (or from what was prefetched)."""

    def __init__(self, folder: FsspecFolder, name: str) -> None:
        self.folder, self.name = folder, name
        self.where = folder.where(name)
        self._size = folder.size_of(name)

    def size(self) -> int:
        return self._size

    def readinto(self, buffers: Sequence[memoryview], offset: int) -> int:
        total = min(sum(len(b) for b in buffers), max(0, self._size - offset))
        if total <= 0:
            return 0
        source = self.folder.cached(self.name, offset, offset + total)
        if source is None:
            source = [memoryview(self.folder.get(self.name, offset, offset + total))]
        return scatter(source, buffers)


class RemoteSink(Sink):
    """An upload: visible (on object stores) only once `close` completes it."""

    def __init__(self, folder: FsspecFolder, name: str) -> None:
        self.folder, self.name = folder, name
        self.file = folder.fs.open(folder.path_of(name), "wb")

    def write(self, buffers: Sequence[Any]) -> None:
        for b in buffers:
            if len(b):
                self.file.write(b)

    def stream(self) -> Any:
        return self.file

    def close(self, *, sync: bool = True) -> None:
        if not self.file.closed:
            self.file.close()

    def abort(self) -> None:
        if not self.file.closed:
            discard = getattr(self.file, "discard", None)
            if discard is not None:
                discard()  # an unfinished upload never becomes an object
                try:  # s3fs's discarded file would otherwise flush again when freed
                    self.file.closed = True
                except AttributeError:  # a BytesIO (memory://): nothing to flush
                    pass
            else:
                self.file.close()
        if self.folder.has(self.name):  # a backend whose files exist while written: our
            try:  # fresh name, so nobody else's file
                self.folder.remove(self.name)
            except OSError:
                pass
