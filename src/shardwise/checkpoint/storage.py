"""`Writer` / `Reader`: DCP storage for shardwise checkpoints.

Writer (stock `FileSystemWriter` planning and `.metadata`, and data files in
its format, so stock `dcp.load` reads the result): every rank writes one
`.distcp` file into a hidden staging folder beside the target, each tensor a
torch.save-format record written straight from the tensor's memory and
checksummed while its bytes are in cache, then fsyncs it; the coordinator then writes `.metadata`, then
`shardwise.json` (fsynced), and only then renames the staging folder onto the
target. A crash at any point leaves earlier checkpoints intact and no folder
at the target that loads as complete.

Reader: reads `shardwise.json` (never unpickling `.metadata`), or a stock
`.metadata` through an unpickler that admits only DCP's classes. It reads
only the byte ranges of each stored chunk that the load targets need, and
verifies the checksum pages it reads.

Call order (DCP's): reset -> set_up_storage_writer/reader -> prepare plans
(collective) -> write_data/read_data on every rank -> finish on the coordinator.
"""

from __future__ import annotations

import io
import math
import os
import shutil
from torch.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import crc32c
import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult

from ..errors import CorruptCheckpointError, IncompleteCheckpointError
from .faults import failpoint
from .manifest import (
    MANIFEST,
    MARKER,
    PAGE_SIZE,
    ChunkEntry,
    Manifest,
    ObjectEntry,
    TensorEntry,
    dtype_from_name,
    dtype_name,
)
from .records import RecordLayout, read_record_layout, tensor_record
from .safe_pickle import load_metadata

__all__ = ["Reader", "Writer", "fresh_staging_dir", "fsync_dir", "pages_of", "partial_dirs", "publish", "recover", "write_all", "write_durably"]


# -- folder protocol ------------------------------------------------------------------


def _staging_dir(final: Path) -> Path:
    return final.parent / f".{final.name}.shardwise-partial"


def _backup_dir(final: Path) -> Path:
    return final.parent / f".{final.name}.shardwise-old"


def partial_dirs(final: Path) -> list[Path]:
    """Staging folders of saves to `final` that never committed."""
    return [p for p in (_staging_dir(final),) if p.exists()]


def recover(final: Path) -> None:
    """Finish an interrupted overwrite: if only the backup of `final` exists, put it back."""
    backup = _backup_dir(final)
    if not final.exists() and (backup / MANIFEST).exists():
        os.rename(backup, final)
        fsync_dir(final.parent)


def publish(staging: Path, final: Path, overwrite: bool) -> None:
    """Rename a complete staging folder onto `final` (replacing it when `overwrite`)."""
    backup = _backup_dir(final)
    if final.exists():
        if not overwrite:
            raise FileExistsError(f"checkpoint {final} already exists; pass overwrite=True to replace it")
        shutil.rmtree(backup, ignore_errors=True)
        os.rename(final, backup)  # recover() undoes this if we die before the next rename
        failpoint("mid-overwrite")
    os.rename(staging, final)
    fsync_dir(final.parent)
    shutil.rmtree(backup, ignore_errors=True)


def fresh_staging_dir(final: Path) -> Path:
    """Where a save to `final` writes before it commits (cleared of leftovers)."""
    staging = _staging_dir(final)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    (staging / MARKER).touch()
    return staging


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, path)


def pages_of(payload: memoryview, page_size: int = PAGE_SIZE) -> list[int]:
    if len(payload) == 0:
        return [crc32c.crc32c(b"")]
    return [crc32c.crc32c(payload[i : i + page_size]) for i in range(0, len(payload), page_size)]


def write_all(fd: int, buffers: list[Any]) -> None:
    """`writev` until every byte is written (one call may write less)."""
    pending = [memoryview(b).cast("B") for b in buffers if len(b)]
    while pending:
        n = os.writev(fd, pending[:1024])
        while n:
            if n >= len(pending[0]):
                n -= len(pending.pop(0))
            else:
                pending[0] = pending[0][n:]
                n = 0


# -- writer -----------------------------------------------------------------------------


@dataclass
class _Written:
    """A stock `_StorageInfo` plus what the manifest needs; unwrapped in `finish`."""

    stock: _StorageInfo
    pages: list[int]
    payload: tuple[int, int] | None = None
    frame: int = 0


class Writer(FileSystemWriter):
    """A DCP `StorageWriter` producing a shardwise checkpoint at `path`.

    Usable directly with `torch.distributed.checkpoint.save(..., storage_writer=Writer(path))`.
    `overwrite=False` refuses an existing checkpoint at `path`; `True` replaces it.
    """

    def __init__(self, path: str | os.PathLike, *, overwrite: bool = False) -> None:
        self.final_path = Path(path)
        self.replace = overwrite
        super().__init__(_staging_dir(self.final_path), overwrite=True)

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id:
            self.final_path = Path(checkpoint_id)
        super().reset(_staging_dir(self.final_path))

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)
        if is_coordinator:
            recover(self.final_path)
            if self.final_path.exists() and not self.replace:
                raise FileExistsError(
                    f"checkpoint {self.final_path} already exists; pass overwrite=True to replace it"
                )
            # A stale staging folder from a crashed save: no rank writes before the
            # global plan, which follows this call, so removing it here is safe.
            shutil.rmtree(_staging_dir(self.final_path), ignore_errors=True)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan  # the folder is made in write_data, after the coordinator's cleanup

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Write this rank's items into one file: objects as pickled bytes, tensors
        as torch.save-format records whose payload is written straight from the
        tensor's memory (`writev`, no copy), checksummed while in cache; fsync."""
        failpoint("before-write")
        folder = Path(self.path)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / MARKER).touch()
        name = f"{plan.storage_data.prefix}0{DEFAULT_SUFFIX}"
        serialization_id = self.save_id.replace("-", "")[:40].ljust(40, "0")  # torch.save's field
        results = []
        fd = os.open(folder / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            pos = 0
            for item in plan.items:
                data = planner.resolve_data(item)
                if item.type == WriteItemType.BYTE_IO:
                    buf = data.getbuffer()
                    write_all(fd, [buf])
                    written = _Written(_StorageInfo(name, pos, len(buf)), [crc32c.crc32c(buf)])
                    pos += len(buf)
                else:
                    tensor = data.detach().cpu().contiguous()
                    head, payload, tail = tensor_record(tensor, serialization_id)
                    write_all(fd, [head, payload, tail])
                    length = len(head) + len(payload) + len(tail)
                    written = _Written(
                        _StorageInfo(name, pos, length), pages_of(payload),
                        (pos + len(head), len(payload)), crc32c.crc32c(tail, crc32c.crc32c(head)),
                    )
                    pos += length
                results.append(WriteResult(item.index, written.stock.length, written))
                failpoint("mid-data")
            os.fsync(fd)
            failpoint("after-data")
        finally:
            os.close(fd)
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        manifest = Manifest(world_size=len(results))
        stock = []
        written: dict[MetadataIndex, _Written] = {}
        for rank_results in results:
            stock.append([WriteResult(r.index, r.size_in_bytes, r.storage_data.stock) for r in rank_results])
            written.update({r.index: r.storage_data for r in rank_results})
        super().finish(metadata, stock)  # .metadata for stock readers, fsynced
        for fqn, md in metadata.state_dict_metadata.items():
            if hasattr(md, "chunks"):
                entry = manifest.tensors[fqn] = TensorEntry(dtype_name(md.properties.dtype), tuple(md.size))
                for chunk in md.chunks:
                    w = written[MetadataIndex(fqn, chunk.offsets)]
                    entry.chunks.append(
                        ChunkEntry(
                            tuple(chunk.offsets), tuple(chunk.sizes), w.stock.relative_path,
                            (w.stock.offset, w.stock.length), w.payload, w.pages, w.frame,
                        )
                    )
            else:
                w = written[MetadataIndex(fqn)]
                manifest.objects[fqn] = ObjectEntry(w.stock.relative_path, w.stock.offset, w.stock.length, w.pages[0])
        staging = Path(self.path)
        manifest.metadata_crc32c = crc32c.crc32c((staging / ".metadata").read_bytes())
        failpoint("before-manifest")
        write_durably(staging / MANIFEST, manifest.to_json().encode())
        failpoint("before-publish")
        fsync_dir(staging)
        self._publish(staging)

    def _publish(self, staging: Path) -> None:
        publish(staging, self.final_path, self.replace)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=str(self.final_path), save_id=self.save_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return FileSystemWriter.validate_checkpoint_id(checkpoint_id)


# -- reader -----------------------------------------------------------------------------


class Reader(FileSystemReader):
    """A DCP `StorageReader` for shardwise and stock checkpoints with ranged reads.

    `bytes_read` counts every byte this reader read from data files.
    `verify=False` skips checksum verification (and the page-widening it needs).
    """

    def __init__(self, path: str | os.PathLike, *, verify: bool = True) -> None:
        super().__init__(path)
        self.verify = verify
        self.bytes_read = 0
        self.manifest: Manifest | None = None
        self._chunks: dict[MetadataIndex, ChunkEntry] = {}
        self._objects: dict[str, ObjectEntry] = {}

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        folder = Path(self.path)
        if (folder / MANIFEST).exists():
            self.manifest = Manifest.read(folder)
            self._index_manifest()
            return self.manifest.to_metadata()
        if (folder / MARKER).exists():
            raise IncompleteCheckpointError(
                f"{folder} is a shardwise checkpoint without its {MANIFEST}: the save did not commit"
            )
        if not (folder / ".metadata").exists():
            if partial_dirs(folder):
                raise IncompleteCheckpointError(
                    f"a save to {folder} started but never committed ({partial_dirs(folder)[0].name} is left)"
                )
            raise FileNotFoundError(f"no checkpoint at {folder}")
        with open(folder / ".metadata", "rb") as f:
            return load_metadata(f)

    def _index_manifest(self) -> None:
        assert self.manifest is not None
        for fqn, t in self.manifest.tensors.items():
            for c in t.chunks:
                self._chunks[MetadataIndex(fqn, c.offsets)] = c
        self._objects = dict(self.manifest.objects)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        if self.manifest is None and (Path(self.path) / MANIFEST).exists():
            self.manifest = Manifest.read(Path(self.path))  # non-coordinators got metadata by broadcast
            self._index_manifest()

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        by_file: dict[str, list[Any]] = {}
        for req in plan.items:
            by_file.setdefault(self.storage_data[req.storage_index].relative_path, []).append(req)
        for name, reqs in by_file.items():
            path = Path(self.path) / name
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError as e:
                raise CorruptCheckpointError(f"data file {path} is missing") from e
            try:
                size = os.fstat(fd).st_size
                for req in reqs:
                    info = self.storage_data[req.storage_index]
                    if info.offset + info.length > size:
                        raise CorruptCheckpointError(
                            f"'{req.storage_index.fqn}': bytes {info.offset}..{info.offset + info.length} of "
                            f"{path} lie past its end ({size} bytes): the file is truncated"
                        )
                    if req.type == LoadItemType.BYTE_IO:
                        self._read_object(fd, path, req, info, planner)
                    else:
                        self._read_tensor(fd, path, req, info, planner)
            finally:
                os.close(fd)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _pread(self, fd: int, n: int, offset: int, path: Path) -> bytes:
        data = os.pread(fd, n, offset)
        self.bytes_read += len(data)
        if len(data) != n:
            raise CorruptCheckpointError(f"{path}: short read of {n} bytes at {offset}: truncated")
        return data

    def _read_object(self, fd: int, path: Path, req: Any, info: _StorageInfo, planner: LoadPlanner) -> None:
        data = self._pread(fd, info.length, info.offset, path)
        entry = self._objects.get(req.storage_index.fqn)
        if entry is not None and self.verify and crc32c.crc32c(data) != entry.crc32c:
            raise CorruptCheckpointError(
                f"object '{req.storage_index.fqn}' in {path} bytes {info.offset}..{info.offset + info.length} "
                f"fails its checksum"
            )
        planner.load_bytes(req, io.BytesIO(data))

    def _read_tensor(self, fd: int, path: Path, req: Any, info: _StorageInfo, planner: LoadPlanner) -> None:
        entry = self._chunks.get(req.storage_index)
        if entry is not None:
            layout = RecordLayout(entry.payload[0], entry.payload[1], _dtype(self, req), entry.sizes, True)
            pages = entry.pages if self.verify else None
        else:
            try:
                layout = read_record_layout(fd, info.offset, info.length)
            except ValueError as e:
                raise CorruptCheckpointError(f"'{req.storage_index.fqn}' in {path}: {e}") from e
            pages = None  # stock checkpoints carry no checksums
        target = planner.resolve_tensor(req).detach()
        if tuple(target.shape) != tuple(req.lengths):
            raise CorruptCheckpointError(f"'{req.storage_index.fqn}' in {path}: stored chunk has the wrong size")
        if layout.c_contiguous:
            piece = self._read_box(fd, path, req, layout, pages, target)
        else:  # a strided record: load it whole, as stock DCP does
            record = self._pread(fd, info.length, info.offset, path)
            whole = torch.load(io.BytesIO(record), map_location="cpu", weights_only=True)
            piece = whole[tuple(slice(o, o + n) for o, n in zip(req.storage_offsets, req.lengths))]
        if piece is not target:
            target.copy_(piece)
        planner.commit_tensor(req, target)

    def _read_box(
        self, fd: int, path: Path, req: Any, layout: RecordLayout, pages: list[int] | None,
        target: torch.Tensor,
    ) -> torch.Tensor:
        """Read the sub-box `req.storage_offsets/lengths` of a C-order payload.

        The box is a set of equal runs along its last partial dimension. Runs
        closer than one OS page are read as one span (a smaller gap saves no
        I/O); with verification each span is widened to whole checksum pages.
        A whole chunk, or a span that is exactly one run, is read straight into
        `target`; a span of several runs is read once and the runs gathered
        from it with one copy.
        """
        direct = target.is_contiguous() and target.device.type == "cpu" and target.dtype == layout.dtype
        dest = target if direct else torch.empty(tuple(req.lengths), dtype=layout.dtype)
        page = self.manifest.page_size if self.manifest else PAGE_SIZE
        name = req.storage_index.fqn
        if tuple(req.lengths) == layout.shape:  # the whole chunk, the common case: one read
            if dest.numel():
                out = memoryview(dest.reshape(-1).view(torch.uint8).numpy())
                got = os.preadv(fd, [out], layout.payload_offset)
                self.bytes_read += got
                if got != len(out):
                    raise CorruptCheckpointError(f"{path}: short read in '{name}': truncated")
                if pages is not None:
                    self._check_pages(out, 0, page, pages, layout, name, path)
            return dest
        itemsize = torch.empty((), dtype=layout.dtype).element_size()
        starts, run = _runs(layout.shape, tuple(req.storage_offsets), tuple(req.lengths), itemsize)
        if not len(starts):
            return dest
        spans = _spans(starts, run, _MERGE_GAP, page if pages is not None else None, layout.payload_length)
        rows = dest.reshape(-1).view(torch.uint8).view(len(starts), run)
        out = memoryview(rows.numpy()).cast("B")
        for span_start, span_len, first, last in spans:
            in_place = last - first == 1 and span_len == run  # one run: straight into its place
            buf = None if in_place else torch.empty(span_len, dtype=torch.uint8)
            view = out[first * run : last * run] if in_place else memoryview(buf.numpy())
            got = os.preadv(fd, [view], layout.payload_offset + span_start)
            self.bytes_read += got
            if got != span_len:
                raise CorruptCheckpointError(f"{path}: short read in '{name}': truncated")
            if pages is not None:
                self._check_pages(view, span_start, page, pages, layout, name, path)
            if buf is not None:  # several runs read as one span: gather them with one copy
                torch.index_select(buf.unfold(0, run, 1), 0, starts[first:last] - span_start, out=rows[first:last])
        return dest

    @staticmethod
    def _check_pages(
        data: memoryview, start: int, page: int, pages: list[int], layout: RecordLayout, name: str, path: Path
    ) -> None:
        """Verify the whole pages in `data`, which begins at payload offset `start` (page-aligned)."""
        for k in range(0, len(data), page):
            if crc32c.crc32c(data[k : k + page]) != pages[(start + k) // page]:
                lo = layout.payload_offset + start + k
                raise CorruptCheckpointError(
                    f"'{name}': bytes {lo}..{lo + min(page, len(data) - k)} of {path} fail their checksum"
                )


def _dtype(reader: Reader, req: Any) -> torch.dtype:
    assert reader.manifest is not None
    return dtype_from_name(reader.manifest.tensors[req.storage_index.fqn].dtype)


_MERGE_GAP = 4096  # runs closer than one OS page are read together


def _runs(
    shape: tuple[int, ...], offsets: tuple[int, ...], lengths: tuple[int, ...], itemsize: int
) -> tuple[torch.Tensor, int]:
    """`(starts, run_bytes)`: the byte offsets, in C order, of the equal runs that make
    up a sub-box of a C-order array."""
    ndim = len(shape)
    if ndim == 0:
        return torch.zeros(1, dtype=torch.int64), itemsize
    if math.prod(lengths) == 0:
        return torch.zeros(0, dtype=torch.int64), 0
    k = ndim - 1  # the trailing dimensions the box spans whole fold into one run
    while k > 0 and lengths[k] == shape[k] and offsets[k] == 0:
        k -= 1
    strides = [math.prod(shape[d + 1 :]) for d in range(ndim)]
    starts = torch.tensor([offsets[k] * strides[k]], dtype=torch.int64)
    for d in reversed(range(k)):  # outer dimensions vary slowest
        steps = torch.arange(offsets[d], offsets[d] + lengths[d], dtype=torch.int64) * strides[d]
        starts = (steps.view(-1, 1) + starts.view(1, -1)).reshape(-1)
    return starts * itemsize, lengths[k] * strides[k] * itemsize


def _spans(
    starts: torch.Tensor, run: int, gap: int, page: int | None, limit: int
) -> list[tuple[int, int, int, int]]:
    """Byte spans `(start, length, first run, end run)` to read: runs merged across
    gaps under `gap`, widened to whole `page`s (not past `limit`) when verifying."""
    lo = starts
    hi = starts + run
    if page is not None:
        lo = lo // page * page
        hi = torch.clamp((hi + page - 1) // page * page, max=limit)
    breaks = (lo[1:] - hi[:-1] >= gap).nonzero().flatten() + 1
    bounds = [0, *breaks.tolist(), len(starts)]
    lo_list, hi_list = lo.tolist(), hi.tolist()
    return [(lo_list[a], hi_list[b - 1] - lo_list[a], a, b) for a, b in zip(bounds, bounds[1:])]
