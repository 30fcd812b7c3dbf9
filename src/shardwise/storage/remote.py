"""`FsspecFolder`: a checkpoint folder under any fsspec URL (`s3://`, `gs://`, `memory://`, ...).

Reads are ranged GETs: `prefetch` takes every byte range a load will need,
merges neighbours only while the bytes between them stay under a tenth of
the bytes wanted (so at most 1.1x the needed bytes cross the network), cuts
long ranges into parts, and fetches all of them concurrently
(`fs.cat_ranges`, which fsspec's async backends run as one gather; the
planning is `ranges`, the file handles `remote_files`). The
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
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..errors import CorruptCheckpointError
from .folder import Folder, Sink, plain_name, temporary_name, too_large
from .ranges import MAX_GAP, PART, WASTE, coalesce, parts
from .remote_files import RemoteFile, RemoteSink

__all__ = [
    "ATOMIC_PUT",
    "MAX_GAP",
    "PART",
    "WASTE",
    "FsspecFolder",
    "RemoteFile",
    "SharedReads",
    "RemoteSink",
    "coalesce",
]

_parts = parts  # tests/storage/test_remote.py imports it under this name

# Protocols where a completed upload replaces the object whole, in one step.
ATOMIC_PUT = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss"})


@dataclass
class SharedReads:
    """What one rank listed and read of a folder's records, for the other ranks of a
    load to read from instead of the store (`FsspecFolder.record`, `know`): on an
    object store each listing and read is a request, by every rank. `wholes`: each
    file read whole, as that read returned it (never cut to what the listing said:
    a record replaced between the two is served as the reader parsed it); `spans`:
    by file, (start, bytes) of each range read. `encode`/`decode`: the bytes sent
    between the ranks of one job (no pickle)."""

    listing: dict[str, int] | None = None
    wholes: dict[str, bytes] = field(default_factory=dict)
    spans: dict[str, list[tuple[int, bytes]]] = field(default_factory=dict)

    def served(self, name: str, start: int, end: int) -> bytes | None:
        """`[start, end)` of `name` if one span read holds all of it."""
        for at, data in self.spans.get(name, ()):
            if at <= start and end <= at + len(data):
                return data[start - at : end - at]
        return None

    @property
    def nbytes(self) -> int:
        spans = sum(len(d) for s in self.spans.values() for _at, d in s)
        return spans + sum(len(d) for d in self.wholes.values())

    def encode(self) -> bytearray:
        heads = [(n, at, len(d)) for n, spans in self.spans.items() for at, d in spans]
        heads += [(n, -1, len(d)) for n, d in self.wholes.items()]  # -1: read whole
        head = json.dumps({"listing": self.listing, "spans": heads}).encode()
        body = [d for spans in self.spans.values() for _at, d in spans]
        body += list(self.wholes.values())
        return bytearray().join([len(head).to_bytes(8, "little"), head, *body])

    @classmethod
    def decode(cls, data: bytes | memoryview) -> SharedReads:
        n = int.from_bytes(data[:8], "little")
        head = json.loads(bytes(data[8 : 8 + n]))
        out = cls(head["listing"])
        at = 8 + n
        for name, start, length in head["spans"]:
            part = bytes(data[at : at + length])
            if start < 0:
                out.wholes[name] = part
            else:
                out.spans.setdefault(name, []).append((start, part))
            at += length
        return out


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
        self._recording: SharedReads | None = None  # what this rank lists and reads
        self._known: SharedReads | None = None  # what another rank listed and read

    # -- one rank's reads of the records, served to the others ---------------------------------

    def record(self) -> None:
        """Keep the listing and every read from now until `recorded`."""
        self._recording = SharedReads()

    @property
    def recording(self) -> SharedReads | None:
        """What was listed and read since `record` so far; None when not recording."""
        return self._recording

    def recorded(self) -> SharedReads:
        """What was listed and read since `record`; recording stops."""
        out, self._recording = self._recording or SharedReads(), None
        return out

    def know(self, reads: SharedReads | None) -> None:
        """List and read from `reads` (another rank's, or this one's `recorded`) where
        they hold what is asked, the store otherwise; None: the store again."""
        self._known = reads

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
        if self._known is not None and self._known.listing is not None:
            self._listed = dict(self._known.listing)
            return dict(self._listed)
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
        if self._recording is not None:
            self._recording.listing = dict(out)
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

    def read(self, name: str, limit: int | None = None) -> bytes:
        path = self._plain(name)
        known = self._whole(name)
        if known is not None:
            if limit is not None and len(known) > limit:
                raise too_large(self.where(name), len(known), limit)
            return known
        if limit is None:
            data = bytes(self.fs.cat_file(path))
        else:  # its size first (listed, or one HEAD), then never more than `limit` + 1 bytes
            size = self.size_of(name)
            if size > limit:
                raise too_large(self.where(name), size, limit)
            # ranged, so that one replaced since it was listed costs at most `limit` + 1
            # bytes too (an empty one whole: S3 refuses a range of it, InvalidRange)
            ranged = {"start": 0, "end": limit + 1} if size else {}
            data = bytes(self.fs.cat_file(path, **ranged))
            if len(data) > limit:
                raise too_large(self.where(name), len(data), limit)
        self.whole_bytes += len(data)
        if self._recording is not None:
            self._recording.wholes[name] = data
        return data

    def _whole(self, name: str) -> bytes | None:
        """`name` as another rank's `read` of it returned it, if it made one."""
        return None if self._known is None else self._known.wholes.get(name)

    def open(self, name: str) -> RemoteFile:
        self._plain(name)
        return RemoteFile(self, name)

    def get(self, name: str, start: int, end: int) -> bytes:
        """One ranged GET of `[start, end)` (none where `know` holds it)."""
        known = None if self._known is None else self._known.served(name, start, end)
        if known is not None:
            return known
        data = bytes(self.fs.cat_file(self.path_of(name), start=start, end=end))
        self.range_requests += 1
        self.range_bytes += len(data)
        if self._recording is not None:
            self._recording.spans.setdefault(name, []).append((start, data))
        return data

    def prefetch(self, ranges: dict[str, list[tuple[int, int]]]) -> None:
        paths, starts, ends, names = [], [], [], []
        for name, wanted in ranges.items():
            for s, e in parts(coalesce(wanted)):
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

    def folders(self) -> list[str]:
        self.fresh()
        try:
            entries = self.fs.ls(self.root, detail=True)
        except (FileNotFoundError, NotADirectoryError):
            return []
        prefix = self.root + "/"
        out = []
        for e in entries:
            name = str(e["name"]).rstrip("/")
            if e.get("type") == "directory" and not e.get("islink") and name.startswith(prefix):
                out.append(name[len(prefix) :])
        return sorted(out)

    def child(self, name: str) -> FsspecFolder:
        return FsspecFolder(self.fs, self.path_of(name), self.where(name))

    def remove_if_empty(self) -> None:
        if self.atomic_put:  # object stores have no folders (and rmdir of a bucket deletes it)
            return
        try:
            if not self.fs.ls(self.root, detail=False):
                self.fs.rmdir(self.root)
        except (OSError, NotImplementedError):
            pass  # a store without folders, or something is there now
