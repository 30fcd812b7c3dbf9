"""`FsspecFolder`: a checkpoint folder under any fsspec URL (`s3://`, `gs://`, `memory://`, ...).

Reads are ranged GETs: `prefetch` takes every byte range a load will need,
merges neighbours only while the bytes between them stay under a tenth of
the bytes wanted (so at most 1.1x the needed bytes cross the network), cuts
long ranges into parts, and fetches all of them concurrently
(`fs.cat_ranges`, which fsspec's async backends run as one gather). The
reads that follow are served from those bytes; a read nothing prefetched
costs one GET of exactly its range.

What atomic means depends on the backend (`ATOMIC_PUT`):

- object stores (S3, GCS, Azure): an object becomes visible whole when its
  upload completes, and a PUT replaces the previous object in one step.
  Records are written in place; `replace` is a server-side copy (itself
  atomic at the target), then the source removed. Nothing needs an fsync: a
  completed upload is durable.
- any other fsspec filesystem (fsspec's in-memory one included, whose files
  are visible while being written): records go to a temporary name, then
  `fs.mv` over the target (a rename where the filesystem has one; a copy
  then a delete in memory, the copy one dictionary assignment).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import CorruptCheckpointError
from .folder import Folder, RandomAccess, Sink, plain_name, temporary_name

__all__ = ["ATOMIC_PUT", "FsspecFolder", "RemoteFile", "RemoteSink", "coalesce"]

# Protocols where a completed upload replaces the object whole, in one step.
ATOMIC_PUT = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss"})
WASTE = 0.1  # bytes fetched between two wanted ranges, at most this share of the bytes wanted
MAX_GAP = 4 << 20  # never merge across more than this, whatever the ranges around it
PART = 8 << 20  # ranges longer than this are fetched as concurrent parts


def coalesce(
    ranges: Sequence[tuple[int, int]], waste: float = WASTE, max_gap: int = MAX_GAP
) -> list[tuple[int, int]]:
    """`(start, end)` ranges merged into fewer GETs: neighbours join while the gap
    bytes of the merged range stay within `waste` of its wanted bytes (so the
    whole costs at most `1 + waste` times the bytes wanted); overlaps always join."""
    out: list[list[int]] = []  # start, end, wanted bytes
    for start, end in sorted(r for r in ranges if r[1] > r[0]):
        if out:
            last = out[-1]
            gap = start - last[1]
            if gap <= 0:
                last[2] += max(0, end - last[1])
                last[1] = max(last[1], end)
                continue
            wanted = last[2] + end - start
            spent = (last[1] - last[0]) - last[2] + gap
            if gap <= max_gap and spent <= waste * wanted:
                last[1], last[2] = end, wanted
                continue
        out.append([start, end, end - start])
    return [(s, e) for s, e, _ in out]


def _parts(ranges: list[tuple[int, int]], part: int = PART) -> list[tuple[int, int]]:
    return [(s, min(s + part, e)) for start, e in ranges for s in range(start, e, part)]


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
        return _scatter(source, buffers)


def _scatter(source: list[memoryview], buffers: Sequence[memoryview]) -> int:
    """Copy the concatenation of `source` into `buffers` in order; the bytes copied."""
    copied, k, at = 0, 0, 0
    for piece in source:
        while len(piece) and k < len(buffers):
            dest = buffers[k]
            n = min(len(piece), len(dest) - at)
            dest[at : at + n] = piece[:n]
            piece, at, copied = piece[n:], at + n, copied + n
            if at == len(dest):
                k, at = k + 1, 0
    return copied


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


class FsspecFolder(Folder):
    """A folder under an fsspec URL. See the module docstring for what atomic means."""

    wants_prefetch = True  # one coalesced, concurrent batch of ranged GETs beats many

    def __init__(self, fs: Any, root: str, url: str) -> None:
        self.fs = fs
        self.root = root.rstrip("/")
        self.location = url.rstrip("/")
        protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
        self.atomic_put = protocol in ATOMIC_PUT
        self._cache: dict[str, tuple[list[int], list[bytes]]] = {}
        self._listed: dict[str, int] = {}
        self.range_requests = 0  # ranged GETs issued (prefetch parts and direct reads)
        self.range_bytes = 0  # bytes those returned
        self.whole_bytes = 0  # bytes of whole-file reads (records, manifests)

    @property
    def identity(self) -> str:
        return str(self.fs.unstrip_protocol(self.root))

    def path_of(self, name: str) -> str:
        """The key of `name`: always directly under the folder's prefix."""
        return f"{self.root}/{plain_name(name)}"

    def _plain(self, name: str) -> str:
        """`path_of(name)`, refused when it is a link (filesystems that have them, such
        as a `file://` URL with storage options): nothing is read through one."""
        path = self.path_of(name)
        islink = getattr(self.fs, "islink", None)
        if islink is not None and islink(path):
            raise CorruptCheckpointError(
                f"{self.where(name)} is a symbolic link: files of a checkpoint must be "
                "plain files inside its folder (refused, nothing read through it)"
            )
        return path

    def fresh(self) -> None:
        """Forget fsspec's listing cache: other processes write here too."""
        self.fs.invalidate_cache(self.root)

    # -- looking ---------------------------------------------------------------------------------

    def is_file(self) -> bool:
        self.fresh()
        return bool(self.fs.isfile(self.root))

    def sizes(self) -> dict[str, int]:
        self.fresh()
        try:
            entries = self.fs.ls(self.root, detail=True)
        except (FileNotFoundError, NotADirectoryError):
            return {}
        prefix = self.root + "/"
        out = {}
        for e in entries:
            name = str(e["name"]).rstrip("/")
            if e.get("type") == "file" and not e.get("islink") and name.startswith(prefix):
                out[name[len(prefix) :]] = int(e.get("size") or 0)
        self._listed = out
        return out

    def size_of(self, name: str) -> int:
        """The size of `name`: from the last listing (data files never change once
        written: fresh names), else asked for (one HEAD); `FileNotFoundError` if absent."""
        if name in self._listed:
            return self._listed[name]
        self.fresh()  # another process may have written it since this one listed
        return int(self.fs.size(self.path_of(name)))

    def has(self, name: str) -> bool:
        return name in self.sizes()  # one LIST (a HEAD of a missing object costs a LIST too)

    def removable(self, name: str) -> bool:
        return True  # `sizes` lists plain objects only

    # -- reading ---------------------------------------------------------------------------------

    def read(self, name: str) -> bytes:
        data = bytes(self.fs.cat_file(self._plain(name)))
        self.whole_bytes += len(data)
        return data

    def open(self, name: str) -> RemoteFile:
        self._plain(name)
        return RemoteFile(self, name)

    def get(self, name: str, start: int, end: int) -> bytes:
        """One ranged GET of `[start, end)`."""
        data = bytes(self.fs.cat_file(self.path_of(name), start=start, end=end))
        self.range_requests += 1
        self.range_bytes += len(data)
        return data

    def prefetch(self, ranges: dict[str, list[tuple[int, int]]]) -> None:
        paths, starts, ends, names = [], [], [], []
        for name, wanted in ranges.items():
            for s, e in _parts(coalesce(wanted)):
                paths.append(self.path_of(name))
                starts.append(s)
                ends.append(e)
                names.append(name)
        if not paths:
            return
        got = self.fs.cat_ranges(paths, starts, ends, on_error="return")
        for name, s, data in zip(names, starts, got):
            if isinstance(data, BaseException):
                continue  # the read that needs it fetches it again and reports the failure
            self.range_requests += 1
            self.range_bytes += len(data)
            at, blocks = self._cache.setdefault(name, ([], []))
            k = bisect.bisect(at, s)
            at.insert(k, s)
            blocks.insert(k, bytes(data))

    def cached(self, name: str, start: int, end: int) -> list[memoryview] | None:
        """`[start, end)` of `name` as slices of prefetched blocks, if they hold all of it."""
        found = self._cache.get(name)
        if found is None:
            return None
        at, blocks = found
        k = bisect.bisect(at, start) - 1
        out: list[memoryview] = []
        pos = start
        while pos < end:
            if k < 0 or k >= len(at) or not at[k] <= pos < at[k] + len(blocks[k]):
                return None
            lo = pos - at[k]
            hi = min(len(blocks[k]), end - at[k])
            out.append(memoryview(blocks[k])[lo:hi])
            pos = at[k] + hi
            k += 1
        return out

    def release(self) -> None:
        self._cache.clear()

    # -- writing ---------------------------------------------------------------------------------

    def make(self) -> None:
        self.fs.makedirs(self.root, exist_ok=True)

    def create(self, name: str) -> RemoteSink:
        return RemoteSink(self, name)

    def write_atomically(self, name: str, write: Callable[[Sink], object], *, sync: bool) -> None:
        target = name if self.atomic_put else temporary_name(name)
        sink = self.create(target)
        try:
            write(sink)
            sink.close(sync=sync)
        except BaseException:
            sink.abort()
            raise
        if target != name:
            self.fs.mv(self.path_of(target), self.path_of(name))

    def replace(self, source: str, target: str) -> None:
        if self.atomic_put:  # a server-side copy lands whole; then the source goes
            self.fs.copy(self.path_of(source), self.path_of(target))
            self.fs.rm_file(self.path_of(source))
        else:
            self.fs.mv(self.path_of(source), self.path_of(target))

    def remove(self, name: str) -> None:
        self.fs.rm_file(self.path_of(name))

    def sync(self) -> None:
        pass  # a completed upload is durable; object stores have no directory to sync

    def create_exclusive(self, name: str, data: bytes, *, sync: bool = True) -> None:
        """A conditional create where the backend offers one (fsspec's
        `pipe_file(mode="create")`: `If-None-Match: *` on S3, `xb` elsewhere);
        `FileExistsError` when the object exists. A backend that refuses the mode
        gets the best-effort default (look, then write); a store that silently
        ignores the condition is caught by the lease re-reading what it wrote."""
        try:
            self.fs.pipe_file(self.path_of(name), data, mode="create")
        except FileExistsError:
            raise
        except (NotImplementedError, TypeError, ValueError):
            super().create_exclusive(name, data, sync=sync)
        finally:
            self.fresh()

    def is_folder(self) -> bool:
        self.fresh()
        return bool(self.fs.isdir(self.root))

    def remove_if_empty(self) -> None:
        if self.atomic_put:  # object stores have no folders (and rmdir of a bucket deletes it)
            return
        try:
            if not self.fs.ls(self.root, detail=False):
                self.fs.rmdir(self.root)
        except (OSError, NotImplementedError):
            pass  # a store without folders, or something is there now
