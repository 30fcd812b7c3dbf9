"""The collective load engine behind `swc.load`, for checkpoints with a manifest.

Two exchanges per load, whatever the number of tensors: one to agree that
the targets fit the checkpoint (every problem listed, on every rank, before
any target is touched), one after reading so that corruption found by one
rank is raised on all. In between each rank plans and reads alone — there is
nothing to coordinate: it matches its targets' pieces against the stored
chunks of `shardwise.json` and reads

* a chunk its piece matches exactly straight into the target's memory,
  neighbouring chunks of a file in one `preadv` (the small frames between
  them land in scratch), each payload verified against its checksums;
* a part of a chunk through `chunk_read.read_box`: only the byte runs (with
  verification, the checksum tiles) the part needs.

Stock checkpoints, per-rank records and transformed chunks go through DCP's
own `dcp.load` with `Reader` instead (`load_state` returns None for them).
"""

from __future__ import annotations

import io
import os
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import crc32c
import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint._traverse import set_element

from ..comm.agreement import exchange
from ..comm.communicator import Communicator
from ..errors import CheckpointMismatchError, CorruptCheckpointError
from .chunk_read import check_whole, read_box
from .file_io import byte_view
from .inventory import Piece, pieces_of
from .manifest import (
    MANIFEST,
    ChunkEntry,
    Manifest,
    StoredChunk,
    TensorEntry,
    dtype_from_name,
    dtype_name,
)
from .record_read import RecordLayout

__all__ = ["load_state"]

_GAP = 64 << 10  # chunks closer than this in a file are read by one preadv, gap and all
_IOVECS = 1024


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
    path: Path,
    comm: Communicator,
    arguments: Any,
    *,
    strict: bool,
    verify: bool,
    cast_dtype: bool,
) -> tuple[int, Manifest] | None:
    """Fill `state_dict` (values already adapted) from the checkpoint at `path`.
    Collective. Returns the bytes this rank read and the manifest it followed,
    or None (having read no data) when the checkpoint or a target needs DCP's
    own load path."""
    flat, mappings = flatten_state_dict(state_dict)
    problem: BaseException | None = None
    manifest: Manifest | None = None
    pieces: dict[str, list[Piece]] = {}
    fast = (path / MANIFEST).exists()
    if fast:
        try:
            manifest = Manifest.read(path)
            found = _mismatches(flat, manifest, strict, cast_dtype)
            if found:
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
    everyone = exchange(problem if fast else None, (fast, arguments), comm)
    if len({repr(a) for _f, a in everyone}) > 1:
        odd = [r for r, (_f, a) in enumerate(everyone) if repr(a) != repr(everyone[0][1])]
        raise ValueError(
            f"ranks disagree on {arguments[0]}: ranks {odd} passed {everyone[odd[0]][1][1]!r}, "
            f"rank 0 passed {everyone[0][1][1]!r}; every rank must pass the same"
        )
    if not all(f for f, _a in everyone):
        return None
    assert manifest is not None
    reader = _Reads(path, manifest, verify)
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
    """Every key, shape and dtype problem, worded as `api` words them for DCP's metadata."""
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
        if isinstance(value, torch.Tensor):
            here, there = tuple(value.shape), tuple(entry.shape)
            if here != there:
                problems.append(f"'{key}' shape {here} here, {there} in the checkpoint")
            stored = dtype_from_name(entry.dtype)
            if value.dtype != stored and not cast:
                problems.append(f"'{key}' dtype {value.dtype} here, {stored} in the checkpoint")
    return problems


class _Reads:
    """One rank's reads of one load: planned per key, executed per file."""

    def __init__(self, folder: Path, manifest: Manifest, verify: bool) -> None:
        self.folder = folder
        self.manifest = manifest
        self.verify = verify
        self.bytes_read = 0
        self.objects: dict[str, Any] = {}
        self._fds: dict[str, int] = {}

    def run(self, flat: dict[str, Any], pieces: dict[str, list[Piece]]) -> None:
        try:
            wholes: dict[str, list[_Whole]] = defaultdict(list)
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
                        self._read_parts(key, entry, piece, dtype)
            for name, batch in wholes.items():
                self._read_wholes(name, batch)
            for key, value in flat.items():
                if key in self.manifest.objects and not isinstance(value, torch.Tensor):
                    self.objects[key] = self._read_object(key)
        finally:
            for fd in self._fds.values():
                os.close(fd)

    def _fd(self, name: str) -> int:
        fd = self._fds.get(name)
        if fd is None:
            try:
                fd = self._fds[name] = os.open(self.folder / name, os.O_RDONLY)
            except FileNotFoundError as e:
                raise CorruptCheckpointError(f"data file {self.folder / name} is missing") from e
        return fd

    @staticmethod
    def _whole(key: str, chunk: ChunkEntry, target: torch.Tensor, dtype: torch.dtype) -> _Whole:
        target = target.detach()
        if target.device.type == "cpu" and target.is_contiguous() and target.dtype == dtype:
            return _Whole(key, chunk, target, None)
        return _Whole(key, chunk, torch.empty(chunk.sizes, dtype=dtype), target)

    def _read_wholes(self, name: str, batch: list[_Whole]) -> None:
        """Chunks of one file, by offset; neighbours within `_GAP` share one preadv."""
        fd = self._fd(name)
        batch.sort(key=lambda w: _payload(w.chunk)[0])
        start = 0
        while start < len(batch):
            end = start
            buffers: list[memoryview] = []
            views: list[memoryview] = []
            lo = pos = _payload(batch[start].chunk)[0]
            while end < len(batch) and len(buffers) < _IOVECS - 1:
                at, n = _payload(batch[end].chunk)
                if end > start and (at < pos or at - pos > _GAP):  # far (or damaged): new span
                    break
                if at > pos:
                    buffers.append(memoryview(bytearray(at - pos)))
                views.append(batch[end].view)
                buffers.append(views[-1])
                pos = at + n
                end += 1
            got = os.preadv(fd, [b for b in buffers if len(b)], lo) if pos > lo else 0
            self.bytes_read += got
            if got != pos - lo:
                raise CorruptCheckpointError(
                    f"{self.folder / name}: short read of bytes {lo}..{pos}: truncated"
                )
            for whole, view in zip(batch[start:end], views):
                if self.verify:
                    self._check(whole, view)
                if whole.target is not None:
                    whole.target.copy_(whole.dest)
            start = end

    def _check(self, whole: _Whole, view: memoryview) -> None:
        chunk = whole.chunk
        if len(chunk.crcs) == 1 and chunk.tile in (None, chunk.sizes) and chunk.transform is None:
            if crc32c.crc32c(view) == chunk.crcs[0]:  # one tile or page: the whole payload
                return
        stored = _stored(chunk, self.manifest, whole.dest.dtype)
        check_whole(view, stored, self.folder / chunk.file, whole.key)

    def _read_parts(self, key: str, entry: TensorEntry, piece: Piece, dtype: torch.dtype) -> None:
        """The parts of stored chunks that overlap `piece`, each read as byte runs."""
        target = piece.tensor.detach()
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
            got, nbytes = read_box(
                self._fd(chunk.file),
                self.folder / chunk.file,
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

    def _read_object(self, key: str) -> Any:
        entry = self.manifest.objects[key]
        data = os.pread(self._fd(entry.file), entry.length, entry.offset)
        self.bytes_read += len(data)
        path = self.folder / entry.file
        if len(data) != entry.length:
            raise CorruptCheckpointError(f"{path}: short read of object '{key}': truncated")
        if self.verify and crc32c.crc32c(data) != entry.crc32c:
            raise CorruptCheckpointError(
                f"object '{key}' in {path} bytes {entry.offset}..{entry.offset + entry.length} "
                "fails its checksum"
            )
        return torch.load(io.BytesIO(data), weights_only=False)


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
