"""The interface every storage backend implements: a flat folder of named files.

A checkpoint is a handful of files side by side (data files, `.metadata`,
`shardwise.json`, a marker), so a folder is a set of names, never a tree.
What differs between backends is what "atomic" and "durable" mean, which
each implementation states in its docstring.
"""

from __future__ import annotations

import io
import re
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..errors import CorruptCheckpointError, UnsupportedStorageError

__all__ = [
    "TEMPORARY",
    "Folder",
    "RandomAccess",
    "Sink",
    "plain_name",
    "temporary_name",
    "too_large",
]

# `{name}.sw{12 hex}.tmp`: what a record looks like before it replaces `name`.
TEMPORARY = re.compile(r"(.+)\.sw([0-9a-f]{12})\.tmp")


def plain_name(name: str) -> str:
    """`name` if it names a file directly in a folder: never a path out of it (`..`,
    an absolute path, a separator), whatever a record says. The last line of
    defence: readers check every name a record holds before opening anything."""
    if (
        not isinstance(name, str)
        or name in ("", ".", "..")
        or "/" in name
        or "\\" in name
        or "\0" in name
    ):
        raise CorruptCheckpointError(
            f"{name!r} is not the name of a file inside the folder (a path out of it?): refused"
        )
    return name


def too_large(where: str, size: int, limit: int) -> CorruptCheckpointError:
    """The refusal of a record of `size` bytes where at most `limit` may be read whole."""
    return CorruptCheckpointError(
        f"{where} holds {size} bytes, more than the {limit} bytes a record there may hold "
        "(damaged or crafted: refused, nothing read)"
    )


def temporary_name(name: str) -> str:
    """A fresh name beside `name` that `TEMPORARY` matches: a leftover of ours if found."""
    return f"{name}.sw{uuid.uuid4().hex[:12]}.tmp"


class RandomAccess(ABC):
    """A file open for positional reads (`pread`): nothing is read that is not asked for."""

    where: str  # the file's full path or URL, for messages

    @abstractmethod
    def readinto(self, buffers: Sequence[memoryview], offset: int) -> int:
        """Fill `buffers` in order from `offset` (as `preadv`); the bytes read, fewer at
        the end of the file."""

    def pread(self, n: int, offset: int) -> bytes:
        """Up to `n` bytes at `offset` (fewer at the end of the file)."""
        buffer = bytearray(n)
        got = self.readinto([memoryview(buffer)], offset) if n else 0
        return bytes(buffer[:got])

    @abstractmethod
    def size(self) -> int:
        """The file's length in bytes."""

    def close(self) -> None:  # noqa: B027 - most files hold nothing to release
        """Release what the file holds (a descriptor)."""


class Sink(ABC):
    """A new file being written front to back; visible under its name only once
    `close` returns (object stores), or as written (local files, which are
    never read before a commit record names them)."""

    name: str
    #: whether `write_at` works here, from several threads at once (local files)
    positional: bool = False

    @abstractmethod
    def write(self, buffers: Sequence[Any]) -> None:
        """Append every byte of `buffers` (bytes-like), in order."""

    def write_at(self, buffers: Sequence[Any], offset: int) -> None:
        """Write every byte of `buffers` from byte `offset` on (only where `positional`;
        a file written this way is written only this way)."""
        raise UnsupportedStorageError(f"{type(self).__name__} writes front to back only")

    @abstractmethod
    def stream(self) -> io.RawIOBase | io.BufferedIOBase | Any:
        """A writable, `tell`-able stream onto the same file, for writers that want one
        (DCP's stream transforms); bytes written there count as appended."""

    @abstractmethod
    def close(self, *, sync: bool = True) -> None:
        """Finish the file: durable (fsynced, or the upload completed) when `sync`."""

    @abstractmethod
    def abort(self) -> None:
        """Give up: the partial file is removed (or never becomes visible)."""

    def __enter__(self) -> Sink:
        return self

    def __exit__(self, kind: Any, value: Any, traceback: Any) -> None:
        if kind is None:
            self.close(sync=False)
        else:
            self.abort()


class Folder(ABC):
    """One checkpoint's folder: local, or under an fsspec URL.

    `location` is what messages show (the path or the URL); `identity` is what
    ranks compare to agree they all name the same folder.
    """

    location: str
    # Capabilities callers ask for instead of checking the backend's type:
    wants_prefetch: bool = False  # reads go faster when planned ranges are fetched up front

    @property
    def shared_medium(self) -> bool:
        """Whether reads cross a link other readers share (an object store, a network
        file system): there a byte read once and sent to the ranks needing it beats each
        reading it. By default, where reads are prefetched (a remote store)."""
        return self.wants_prefetch

    @property
    def local_path(self) -> Path | None:
        """The folder's path on the local filesystem, for tools that need one (Megatron's
        loader, safetensors' `safe_open`); None where there is none (an object store)."""
        return None

    def __str__(self) -> str:
        return self.location

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.location!r})"

    @property
    def identity(self) -> str:
        return self.location

    @property
    def checkpoint_id(self) -> Any:
        """What DCP's `StorageMeta.checkpoint_id` holds for this folder (a `Path`, or the URL)."""
        return self.location

    def where(self, name: str) -> str:
        """The full path or URL of the file `name`, for messages."""
        return f"{self.location.rstrip('/')}/{name}"

    # -- looking ---------------------------------------------------------------------------------

    @abstractmethod
    def is_file(self) -> bool:
        """Whether the location is itself a file (not a folder)."""

    @abstractmethod
    def sizes(self) -> dict[str, int]:
        """Every plain file directly in the folder, with its size (one listing)."""

    def names(self) -> list[str]:
        return sorted(self.sizes())

    @abstractmethod
    def has(self, name: str) -> bool:
        """Whether the file `name` exists."""

    @abstractmethod
    def removable(self, name: str) -> bool:
        """Whether `name` is a plain file `remove` may delete (never a link or folder)."""

    # -- reading ---------------------------------------------------------------------------------

    @abstractmethod
    def read(self, name: str, limit: int | None = None) -> bytes:
        """The whole file `name`. With `limit`, a file of more bytes is refused
        (`CorruptCheckpointError` naming it, `too_large`) before anything is allocated
        for it: a record's size is untrusted (an 8 GiB sparse file costs no disk)."""

    @abstractmethod
    def open(self, name: str) -> RandomAccess:
        """`name` open for positional reads; `FileNotFoundError` when it is missing."""

    def prefetch(self, ranges: dict[str, list[tuple[int, int]]]) -> None:  # noqa: B027
        """Fetch `(start, end)` byte ranges of several files ahead of the reads that need
        them, all at once (object stores); local reads need no help."""

    def release(self) -> None:  # noqa: B027
        """Forget what `prefetch` fetched."""

    # -- writing ---------------------------------------------------------------------------------

    @abstractmethod
    def make(self) -> None:
        """Create the folder (and its parents) if missing."""

    @abstractmethod
    def create(self, name: str) -> Sink:
        """A new file `name` to fill; never an existing file's name."""

    @abstractmethod
    def write_atomically(self, name: str, write: Callable[[Sink], object], *, sync: bool) -> None:
        """Write `name` whole or not at all: a reader sees the old file or the new one."""

    def write_durably(self, name: str, data: bytes, *, sync: bool = True) -> None:
        """`write_atomically` of bytes in hand."""
        self.write_atomically(name, lambda sink: sink.write([data]), sync=sync)

    def write_temporary(self, name: str, data: bytes, *, sync: bool = True) -> str:
        """`data` under a fresh temporary name beside `name` (one `commit` recognises
        as a leftover of ours), durable; returns that name, for `replace`."""
        return self.write_new(temporary_name(name), data, sync=sync)

    def write_new(self, name: str, data: bytes | list[bytes], *, sync: bool = True) -> str:
        """A new file `name` (`create`: never an existing file's) holding `data` (bytes,
        or buffers written one after the other), or nothing if writing fails; returns
        its name."""
        sink = self.create(name)
        try:
            sink.write(data if isinstance(data, list) else [data])
            sink.close(sync=sync)
        except BaseException:
            sink.abort()
            raise
        return sink.name

    @abstractmethod
    def replace(self, source: str, target: str) -> None:
        """Make `source`'s content visible as `target` in one step (rename locally; on an
        object store a server-side copy, then the source removed)."""

    @abstractmethod
    def remove(self, name: str) -> None:
        """Delete the file `name`."""

    @abstractmethod
    def sync(self) -> None:
        """Make the folder's names durable (fsync the directory; a no-op where a
        completed write is durable by itself)."""

    # -- leases ----------------------------------------------------------------------------------

    def create_exclusive(self, name: str, data: bytes, *, sync: bool = True) -> None:
        """Create `name` holding all of `data`, or raise `FileExistsError` if it exists.

        The lease primitive (`checkpoint.lease`). This default is best effort (look,
        then write whole): two racing creators may both succeed, so callers re-read
        the file to learn which one won; backends that can, override it atomically."""
        if self.has(name):
            raise FileExistsError(f"{self.where(name)} exists")
        self.write_durably(name, data, sync=sync)

    def is_folder(self) -> bool:
        """Whether the folder itself exists (a lease creates it; `remove_if_empty` undoes that)."""
        return True

    def remove_if_empty(self) -> None:  # noqa: B027 - a store without folders has none to remove
        """Remove the folder itself if it holds nothing (a save that made it, then failed)."""

    # -- nesting: a root of many checkpoints (`checkpoint.manager`) -------------------------------

    def folders(self) -> list[str]:
        """The names of the folders directly inside this one (never a link), sorted, in
        one listing; [] where it does not exist. Not every backend can: one that cannot
        refuses (`UnsupportedStorageError`)."""
        raise UnsupportedStorageError(
            f"{type(self).__name__} cannot list the folders inside {self.location}"
        )

    def child(self, name: str) -> Folder:
        """The folder `name` directly inside this one (a plain name: never a path out)."""
        raise UnsupportedStorageError(
            f"{type(self).__name__} cannot open a folder inside {self.location}"
        )
