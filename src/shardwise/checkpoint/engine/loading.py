"""The collective load engine behind `swc.load`, for checkpoints with a manifest.

Two exchanges here per load, whatever the number of tensors: one to agree that
the targets fit the checkpoint (every problem listed, on every rank, before
any target is touched; it also settles the route, this engine or `dcp.load`),
one after reading so that corruption found by one rank is raised on all.
`swc.load` makes three small `all_gather_object` before them (the folder opens
on every rank, `megatron_route`, the adapters' `_agree_on`) and, when the state
holds a `Stateful`, one after its `load_state_dict()`: five per rank, six with a
`Stateful`. Pinned by tests/checkpoint/test_collective_counts.py.
In between each rank plans and reads alone — there is
nothing to coordinate: it matches its targets' pieces against the stored
chunks of `shardwise.json` and reads

* a chunk its piece matches exactly straight into the target's memory,
  neighbouring chunks of a file in one `preadv` (the small frames between
  them land in scratch), each payload verified against its checksums;
* a part of a chunk through `chunk_read.read_box`: only the byte runs (with
  verification, the checksum tiles) the part needs.

On an object store every read above is planned first and its byte ranges
fetched concurrently (`Folder.prefetch`), a window of `_WINDOW` bytes at a
time; locally the reads simply run.

Stock checkpoints, per-rank records and transformed chunks go through DCP's
own `dcp.load` with `Reader` instead (`load_state` returns None for them after
its first exchange): then `api._load_through_dcp` agrees once more on the
mismatches and `dcp.load` adds its own three (plan: `gather_object` +
`scatter_object_list`; read: `all_gather_object`).
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import crc32c
import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint._traverse import set_element

from ...comm.agreement import exchange, require_same
from ...comm.communicator import Communicator
from ...errors import CheckpointMismatchError, CorruptCheckpointError
from ...storage import Folder, RandomAccess, open_folder
from ..format.checksums import byte_view
from ..format.manifest import (
    MANIFEST,
    ChunkEntry,
    Manifest,
    StoredChunk,
    TensorEntry,
    dtype_from_name,
    dtype_name,
)
from ..format.objects import load_object
from ..format.record_read import RecordLayout
from ..io.box_read import box_ranges, check_whole, read_box
from .inventory import Piece, pieces_of

__all__ = ["load_state"]

_GAP = 64 << 10  # chunks closer than this in a file are read by one preadv, gap and all
_IOVECS = 1024
_WINDOW = 64 << 20  # bytes fetched ahead at once from an object store (8 parts in flight)

# One read of a load: the byte ranges it needs (by file) and the call that does it.
_Job = tuple[dict[str, list[tuple[int, int]]], Callable[[], None]]


@dataclass
class _Whole:
    """A stored chunk read whole into `dest` (the target itself, or scratch to copy from)."""

    key: str
    chunk: ChunkEntry
    dest: torch.Tensor
    target: torch.Tensor | None  # copied from `dest` after the read, when `dest` is scratch

    @property
    def view(self) -> memoryview:
        return byte_view(self.dest) if self.dest.numel() else memoryview(b"")


def load_state(
    state_dict: dict[str, Any],
    path: Folder | str | os.PathLike,
    comm: Communicator,
    arguments: Any,
    *,
    strict: bool,
    verify: bool,
    cast_dtype: bool,
    trust_objects: bool = False,
) -> tuple[int, Manifest] | None:
    """Fill `state_dict` (values already adapted) from the checkpoint at `path`.
    Collective. Returns the bytes this rank read and the manifest it followed,
    or None (having read no data) when the checkpoint or a target needs DCP's
    own load path. Objects unpickle by `objects.load_object`'s rules (`trust_objects`)."""
    path = open_folder(path)
    flat, mappings = flatten_state_dict(state_dict)
    problem: BaseException | None = None
    manifest: Manifest | None = None
    pieces: dict[str, list[Piece]] = {}
    fast = path.has(MANIFEST)
    if fast:
        try:
            manifest = Manifest.read(path)
            if manifest.stale(path) is not None:  # stock replaced it: `Reader` follows .metadata
                fast, manifest = False, None
            elif found := _mismatches(flat, manifest, strict, cast_dtype):
                problem = CheckpointMismatchError(f"{path}: " + "; ".join(found))
        except (OSError, ValueError) as e:
            problem = e
    if fast and manifest is not None and problem is None:
        for key, value in flat.items():
            if isinstance(value, torch.Tensor) and key in manifest.tensors:
                held = pieces_of(value)
                stored = manifest.tensors[key]
                if held is None or any(c.transform for c in stored.chunks):
                    fast = False
                    break
                pieces[key] = held
            elif key in manifest.objects and manifest.objects[key].transform:
                fast = False
                break
            elif key in manifest.tensors and not isinstance(value, torch.Tensor):
                fast = False  # a DCP `_Checkpointable` (`_mismatches` refused the rest)
                break
    everyone = exchange(problem if fast else None, (fast, arguments), comm)
    require_same([a for _f, a in everyone], arguments[0], shown=lambda a: repr(a[1]))
    if not all(f for f, _a in everyone):
        return None
    assert manifest is not None
    reader = _Reads(path, manifest, verify, trust_objects)
    problem = None
    try:
        reader.run(flat, pieces)
    except Exception as e:  # noqa: BLE001 - raised on every rank by the exchange below
        problem = e
    exchange(problem, None, comm)
    for key, value in reader.objects.items():
        set_element(state_dict, mappings[key], value)
    return reader.bytes_read, manifest


def _mismatches(flat: dict[str, Any], manifest: Manifest, strict: bool, cast: bool) -> list[str]:
    """Every key, kind, shape and dtype problem, worded as `api` words them for DCP's
    metadata. A tensor against an object (either way) is a problem even when not
    strict, as `dcp.load` refuses it: nothing would be loaded, silently."""
    problems = []
    for key, value in flat.items():
        entry = manifest.tensors.get(key)
        if entry is None:
            if key in manifest.objects:
                if isinstance(value, torch.Tensor):
                    problems.append(
                        f"'{key}' is a tensor here but a Python object in the checkpoint"
                    )
            elif strict:
                problems.append(f"'{key}' is missing from the checkpoint")
            continue
        if not isinstance(value, torch.Tensor):
            if hasattr(type(value), "__create_chunk_list__"):
                continue  # a DCP `_Checkpointable`: DCP's own path fills it
            problems.append(
                f"'{key}' is a Python {type(value).__name__} here but a tensor in the checkpoint"
            )
        else:
            here, there = tuple(value.shape), tuple(entry.shape)
            if here != there:
                problems.append(f"'{key}' shape {here} here, {there} in the checkpoint")
            stored = dtype_from_name(entry.dtype)
            if value.dtype != stored and not cast:
                problems.append(f"'{key}' dtype {value.dtype} here, {stored} in the checkpoint")
    return problems


class _Reads:
    """One rank's reads of one load: planned per key, executed per file."""

    def __init__(self, folder: Folder, manifest: Manifest, verify: bool, trust: bool) -> None:
        self.folder = folder
        self.manifest = manifest
        self.verify = verify
        self.trust = trust
        self.bytes_read = 0
        self.objects: dict[str, Any] = {}
        self._files: dict[str, RandomAccess] = {}

    def run(self, flat: dict[str, Any], pieces: dict[str, list[Piece]]) -> None:
        try:
            wholes: dict[str, list[_Whole]] = defaultdict(list)
            # objects first: one refused (untrusted pickle) stops this rank before it
            # writes into any target
            jobs: list[_Job] = [
                self._object_job(key)
                for key, value in flat.items()
                if key in self.manifest.objects and not isinstance(value, torch.Tensor)
            ]
            for key, held in pieces.items():
                entry = self.manifest.tensors[key]
                dtype = dtype_from_name(entry.dtype)
                chunks = entry.chunks
                exact = {(c.offsets, c.sizes): c for c in chunks} if len(chunks) > 8 else None
                for piece in held:
                    if not piece.tensor.numel():
                        continue
                    if exact is not None:
                        chunk = exact.get((piece.offsets, piece.sizes))
                    else:
                        chunk = _same_box(chunks, piece)
                    if chunk is not None:
                        wholes[chunk.file].append(self._whole(key, chunk, piece.tensor, dtype))
                    else:
                        jobs += self._part_jobs(key, entry, piece, dtype)
            for name, batch in wholes.items():
                jobs += self._whole_jobs(name, batch)
            self._execute(jobs)
        finally:
            for f in self._files.values():
                f.close()

    def _execute(self, jobs: list[_Job]) -> None:
        """Run the reads; on an object store, fetch each window's ranges at once first."""
        if not self.folder.wants_prefetch:
            for _ranges, read in jobs:
                read()
            return
        start = 0
        while start < len(jobs):
            end, size = start, 0
            window: dict[str, list[tuple[int, int]]] = defaultdict(list)
            while end < len(jobs) and (end == start or size < _WINDOW):
                for name, ranges in jobs[end][0].items():
                    window[name] += ranges
                    size += sum(e - s for s, e in ranges)
                end += 1
            self.folder.prefetch(window)
            try:
                for _ranges, read in jobs[start:end]:
                    read()
            finally:
                self.folder.release()
            start = end

    def _file(self, name: str) -> RandomAccess:
        f = self._files.get(name)
        if f is None:
            try:
                f = self._files[name] = self.folder.open(name)
            except FileNotFoundError as e:
                raise CorruptCheckpointError(
                    f"data file {self.folder.where(name)} is missing"
                ) from e
        return f

    @staticmethod
    def _whole(key: str, chunk: ChunkEntry, target: torch.Tensor, dtype: torch.dtype) -> _Whole:
        target = target.detach()
        if target.device.type == "cpu" and target.is_contiguous() and target.dtype == dtype:
            return _Whole(key, chunk, target, None)
        return _Whole(key, chunk, torch.empty(chunk.sizes, dtype=dtype), target)

    def _whole_jobs(self, name: str, batch: list[_Whole]) -> list[_Job]:
        """Chunks of one file, by offset; neighbours within `_GAP` share one preadv."""
        batch.sort(key=lambda w: _payload(w.chunk)[0])
        jobs: list[_Job] = []
        start = 0
        while start < len(batch):
            end = start
            lo = pos = _payload(batch[start].chunk)[0]
            while end < len(batch) and end - start < (_IOVECS - 1) // 2:
                at, n = _payload(batch[end].chunk)
                if end > start and (at < pos or at - pos > _GAP):  # far (or damaged): new span
                    break
                pos = at + n
                end += 1
            span = batch[start:end]
            jobs.append(({name: [(lo, pos)]}, _bind(self._read_span, name, span, lo)))
            start = end
        return jobs

    def _read_span(self, name: str, span: list[_Whole], lo: int) -> None:
        """Neighbouring chunks in one read, straight into their targets (gaps to scratch)."""
        buffers: list[memoryview] = []
        views: list[memoryview] = []
        pos = lo
        for whole in span:
            at, n = _payload(whole.chunk)
            if at > pos:
                buffers.append(memoryview(bytearray(at - pos)))
            views.append(whole.view)
            buffers.append(views[-1])
            pos = at + n
        got = self._file(name).readinto(buffers, lo) if pos > lo else 0
        self.bytes_read += got
        if got != pos - lo:
            raise CorruptCheckpointError(
                f"{self.folder.where(name)}: short read of bytes {lo}..{pos}: truncated"
            )
        for whole, view in zip(span, views):
            if self.verify:
                self._check(whole, view)
            if whole.target is not None:
                whole.target.copy_(whole.dest)

    def _check(self, whole: _Whole, view: memoryview) -> None:
        chunk = whole.chunk
        if len(chunk.crcs) == 1 and chunk.tile in (None, chunk.sizes) and chunk.transform is None:
            if crc32c.crc32c(view) == chunk.crcs[0]:  # one tile or page: the whole payload
                return
        stored = _stored(chunk, self.manifest, whole.dest.dtype)
        check_whole(view, stored, self.folder.where(chunk.file), whole.key)

    def _part_jobs(
        self, key: str, entry: TensorEntry, piece: Piece, dtype: torch.dtype
    ) -> list[_Job]:
        """The parts of stored chunks that overlap `piece`, each read as byte runs."""
        target = piece.tensor.detach()
        jobs: list[_Job] = []
        for chunk in entry.chunks:
            lo = [max(a, b) for a, b in zip(piece.offsets, chunk.offsets)]
            hi = [
                min(a + n, b + m)
                for a, n, b, m in zip(piece.offsets, piece.sizes, chunk.offsets, chunk.sizes)
            ]
            if any(h <= lo_ for lo_, h in zip(lo, hi)):
                continue
            lengths = tuple(h - lo_ for lo_, h in zip(lo, hi))
            in_chunk = tuple(a - o for a, o in zip(lo, chunk.offsets))
            dest = target[
                tuple(slice(a - o, a - o + n) for a, o, n in zip(lo, piece.offsets, lengths))
            ]
            stored = _stored(chunk, self.manifest, dtype)
            at, n = _payload(chunk)
            layout = RecordLayout(at, n, dtype, tuple(chunk.sizes), True)
            ranges = (
                {chunk.file: box_ranges(stored, layout, in_chunk, lengths, self.verify)}
                if self.folder.wants_prefetch
                else {}
            )
            read = _bind(self._read_part, key, chunk, stored, layout, in_chunk, lengths, dest)
            jobs.append((ranges, read))
        return jobs

    def _read_part(
        self,
        key: str,
        chunk: ChunkEntry,
        stored: StoredChunk,
        layout: RecordLayout,
        in_chunk: tuple[int, ...],
        lengths: tuple[int, ...],
        dest: torch.Tensor,
    ) -> None:
        got, nbytes = read_box(
            self._file(chunk.file),
            self.folder.where(chunk.file),
            key,
            stored,
            layout,
            in_chunk,
            lengths,
            dest,
            self.verify,
        )
        self.bytes_read += nbytes
        if got is not dest:
            dest.copy_(got)

    def _object_job(self, key: str) -> _Job:
        entry = self.manifest.objects[key]
        ranges = {entry.file: [(entry.offset, entry.offset + entry.length)]}
        return ranges, _bind(self._read_object, key)

    def _read_object(self, key: str) -> None:
        entry = self.manifest.objects[key]
        data = self._file(entry.file).pread(entry.length, entry.offset)
        self.bytes_read += len(data)
        path = self.folder.where(entry.file)
        if len(data) != entry.length:
            raise CorruptCheckpointError(f"{path}: short read of object '{key}': truncated")
        if self.verify and crc32c.crc32c(data) != entry.crc32c:
            raise CorruptCheckpointError(
                f"object '{key}' in {path} bytes {entry.offset}..{entry.offset + entry.length} "
                "fails its checksum"
            )
        self.objects[key] = load_object(data, key, path, trust=self.trust)


def _bind(fn: Callable[..., None], *args: Any) -> Callable[[], None]:
    return lambda: fn(*args)


def _same_box(chunks: list[ChunkEntry], piece: Piece) -> ChunkEntry | None:
    """The stored chunk that is exactly `piece`'s box, if any: a scan, for the few
    chunks most tensors have (beats building an index)."""
    for c in chunks:
        if c.offsets == piece.offsets and c.sizes == piece.sizes:
            return c
    return None


def _payload(chunk: ChunkEntry) -> tuple[int, int]:
    assert chunk.payload is not None  # transformed chunks never reach this engine
    return chunk.payload


def _stored(chunk: ChunkEntry, manifest: Manifest, dtype: torch.dtype) -> StoredChunk:
    """What `chunk_read` needs of a chunk: DCP's storage info with its checksums."""
    return StoredChunk.of(chunk, dtype_name(dtype), manifest.page_size)
