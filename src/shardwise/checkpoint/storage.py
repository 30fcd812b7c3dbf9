"""`Writer` / `Reader`: DCP storage for shardwise checkpoints.

Writer: stock `FileSystemWriter` planning, constructor and `.metadata`, and
data files in its format, so stock `dcp.load` reads the result. Every rank
writes its items under fresh token-named files (`__0_0.sw<token>.distcp`),
each tensor a torch.save-format record written straight from the tensor's
memory and checksummed while its bytes are in cache, then fsyncs them; the
coordinator then commits (`commit.py`): marker, `.metadata`, `shardwise.json`,
each renamed into place, and collects the files of the checkpoint it replaced.
Other files in the folder are never touched.

Reader: reads `shardwise.json` (never unpickling `.metadata`), or a stock
`.metadata` through an unpickler that admits only DCP's classes. Every byte
range it reads comes from the `Metadata` it was set up with
(`set_up_storage_reader`): a reset reader keeps nothing of the previous
checkpoint. It reads only the byte ranges of each stored chunk that the load
targets need, and verifies the checksum pages it reads.

Call order (DCP's): reset -> set_up_storage_writer/reader -> prepare plans
(collective) -> write_data/read_data on every rank -> finish on the coordinator.
"""

from __future__ import annotations

import dataclasses
import io
import math
import os
import pickle
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import crc32c
import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import (
    CURRENT_DCP_VERSION,
    SerializationFormat,
    _split_by_size_and_type,
    _StorageInfo,
    _StoragePrefix,
    _write_item,
)
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from ..errors import CorruptCheckpointError, IncompleteCheckpointError
from .commit import (
    RecordNames,
    already_exists,
    commit,
    data_file_name,
    holds_checkpoint,
    leftover_data,
    new_token,
    per_rank_records,
)
from .faults import failpoint
from .manifest import (
    MARKER,
    PAGE_SIZE,
    ChunkEntry,
    Manifest,
    ObjectEntry,
    StoredChunk,
    StoredObject,
    TensorEntry,
    dtype_from_name,
    dtype_name,
)
from .records import RecordLayout, read_record_layout, tensor_record
from .safe_pickle import load_metadata

__all__ = ["Reader", "Writer", "pages_of", "write_all"]


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
    """A DCP `StorageWriter` producing a shardwise checkpoint in the folder `path`.

    A drop-in for `FileSystemWriter`, with its constructor: `overwrite=True`
    (the default, as stock) replaces a checkpoint already in the folder;
    `False` raises `RuntimeError("Checkpoint already exists ...")` when the
    folder holds one. Either way, files in the folder that no checkpoint wrote
    are left alone. `thread_count` writes that many files per rank in
    parallel; `single_file_per_rank=False` writes a file per item;
    `sync_files=False` skips fsync (then a crash may lose the new checkpoint,
    as with stock); `_extensions` (e.g. ZStandard) transform each item's
    stream as stock does, and such items are read back whole.
    `serialization_format` must be `TORCH_SAVE` (what stock's own reader reads).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        single_file_per_rank: bool = True,
        sync_files: bool = True,
        thread_count: int = 1,
        per_thread_copy_ahead: int = 10_000_000,
        cache_staged_state_dict: bool = False,
        overwrite: bool = True,
        _extensions: Sequence[Any] | None = None,
        serialization_format: SerializationFormat = SerializationFormat.TORCH_SAVE,
    ) -> None:
        if serialization_format != SerializationFormat.TORCH_SAVE:
            raise ValueError(
                f"serialization_format={serialization_format} is not supported by shardwise.checkpoint.Writer: "
                "stock FileSystemReader reads only TORCH_SAVE records; for safetensors files use "
                "torch.distributed.checkpoint.HuggingFaceStorageWriter or shardwise.checkpoint.convert"
            )
        super().__init__(
            path,
            single_file_per_rank=single_file_per_rank,
            sync_files=sync_files,
            thread_count=thread_count,
            per_thread_copy_ahead=per_thread_copy_ahead,
            cache_staged_state_dict=cache_staged_state_dict,
            overwrite=overwrite,
            _extensions=_extensions,
            serialization_format=serialization_format,
        )
        self._token = new_token()

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)
        # A fresh token on every rank for every save, whatever DCP resets or caches:
        # data files never reuse a name, so no committed file is ever reopened.
        self._token = new_token()

    def _records(self) -> RecordNames:
        return RecordNames(
            self.rank if not self.use_collectives and self.rank is not None else None
        )

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        folder = Path(
            self.path
        )  # created in write_data: a save refused in planning leaves no folder
        if not self.overwrite and holds_checkpoint(folder, self._records()):
            raise RuntimeError(
                f"Checkpoint already exists and self.overwrite=False: {already_exists(folder)}"
            )
        if self.rank is not None and not self.use_collectives:
            plan = dataclasses.replace(plan, storage_data=_StoragePrefix(f"__{self.rank}_"))
        return plan

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Write this rank's items into fresh token-named files (one per bucket of
        `thread_count`, or one per item), in parallel threads when there are several."""
        failpoint("before-write")
        Path(self.path).mkdir(parents=True, exist_ok=True)
        token = self._token
        if self.single_file_per_rank:
            buckets = _split_by_size_and_type(max(1, self.thread_count), list(plan.items))
        else:
            buckets = [[item] for item in plan.items]
        jobs = [
            (data_file_name(plan.storage_data.prefix, k, token), items)
            for k, items in enumerate(buckets)
        ]
        write = self._write_transformed if self.transforms.extensions else self._write_file
        if self.thread_count > 1 and len(jobs) > 1:
            with ThreadPoolExecutor(
                self.thread_count, thread_name_prefix="shardwise-write"
            ) as pool:
                parts = list(pool.map(lambda job: write(job[0], job[1], planner), jobs))
        else:
            parts = [write(name, items, planner) for name, items in jobs]
        fut: Future[list[WriteResult]] = Future()
        fut.set_result([r for part in parts for r in part])
        return fut

    def _write_file(
        self, name: str, items: list[WriteItem], planner: SavePlanner
    ) -> list[WriteResult]:
        """Objects as pickled bytes, tensors as torch.save-format records whose
        payload is written straight from the tensor's memory (`writev`, no copy),
        checksummed while in cache; then fsync."""
        serialization_id = self.save_id.replace("-", "")[:40].ljust(40, "0")  # torch.save's field
        results = []
        fd = os.open(
            Path(self.path) / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644
        )  # never an existing file
        try:
            pos = 0
            for item in items:
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
                        _StorageInfo(name, pos, length),
                        pages_of(payload),
                        (pos + len(head), len(payload)),
                        crc32c.crc32c(tail, crc32c.crc32c(head)),
                    )
                    pos += length
                results.append(WriteResult(item.index, written.stock.length, written))
                failpoint("mid-data")
            if self.sync_files:
                os.fsync(fd)
            failpoint("after-data")
        finally:
            os.close(fd)
        return results

    def _write_transformed(
        self, name: str, items: list[WriteItem], planner: SavePlanner
    ) -> list[WriteResult]:
        """Items through the writer's stream transforms (stock's own item writer);
        each stored range gets one checksum, computed from the written bytes."""
        path = Path(self.path) / name
        stock = []
        with open(path, "xb") as stream:  # never an existing file
            for item in items:
                data = planner.resolve_data(item)
                if item.type != WriteItemType.BYTE_IO:
                    data = data.detach().cpu()
                stock.append(
                    _write_item(
                        self.transforms, stream, data, item, name, SerializationFormat.TORCH_SAVE
                    )
                )
                failpoint("mid-data")
            stream.flush()
            if self.sync_files:
                os.fsync(stream.fileno())
        failpoint("after-data")
        results = []
        with open(path, "rb") as f:
            for r in stock:
                info: _StorageInfo = r.storage_data
                crc = crc32c.crc32c(os.pread(f.fileno(), info.length, info.offset))
                results.append(WriteResult(r.index, r.size_in_bytes, _Written(info, [crc])))
        return results

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Build `.metadata` and the manifest, then commit them (coordinator, or
        every rank on its own without collectives)."""
        written: dict[MetadataIndex, _Written] = {}
        for rank_results in results:
            written.update({r.index: r.storage_data for r in rank_results})
        metadata.version = CURRENT_DCP_VERSION
        metadata.storage_data = {index: w.stock for index, w in written.items()}
        metadata.storage_meta = self.storage_meta()
        metadata_bytes = pickle.dumps(metadata)
        manifest = _manifest(metadata, written, len(results))
        manifest.metadata_crc32c = crc32c.crc32c(metadata_bytes)
        keep = {w.stock.relative_path for w in written.values()}
        commit(
            Path(self.path),
            metadata_bytes,
            manifest.to_json().encode(),
            keep,
            self._records(),
            sync=self.sync_files,
        )


def _manifest(
    metadata: Metadata, written: dict[MetadataIndex, _Written], world_size: int
) -> Manifest:
    meta = metadata.storage_meta or StorageMeta()
    manifest = Manifest(
        world_size=world_size,
        storage_meta={
            "checkpoint_id": None if meta.checkpoint_id is None else str(meta.checkpoint_id),
            "save_id": meta.save_id,
            "modules": list(meta.modules),
        },
        dcp_version=metadata.version,
    )
    manifest.set_planner_data(metadata.planner_data)
    for fqn, md in metadata.state_dict_metadata.items():
        if hasattr(md, "chunks"):
            entry = manifest.tensors[fqn] = TensorEntry(
                dtype_name(md.properties.dtype),
                tuple(md.size),
                requires_grad=bool(md.properties.requires_grad),
            )
            for chunk in md.chunks:
                w = written[MetadataIndex(fqn, chunk.offsets)]
                entry.chunks.append(
                    ChunkEntry(
                        tuple(chunk.offsets),
                        tuple(chunk.sizes),
                        w.stock.relative_path,
                        (w.stock.offset, w.stock.length),
                        w.payload,
                        w.pages,
                        w.frame,
                        _descriptors(w.stock),
                    )
                )
        else:
            w = written[MetadataIndex(fqn)]
            manifest.objects[fqn] = ObjectEntry(
                w.stock.relative_path,
                w.stock.offset,
                w.stock.length,
                w.pages[0],
                _descriptors(w.stock),
            )
    return manifest


def _descriptors(info: _StorageInfo) -> list[str] | None:
    return list(info.transform_descriptors) if info.transform_descriptors else None


# -- reader -----------------------------------------------------------------------------


class Reader(FileSystemReader):
    """A DCP `StorageReader` for shardwise and stock checkpoints with ranged reads.

    A drop-in for `FileSystemReader` (same constructor, `_extension_registry`
    included). `bytes_read` counts every byte this reader read from data
    files. `verify=False` skips checksum verification (and the page-widening
    it needs). Per-rank checkpoints (saved with `use_collectives=False`) are
    read through `read_metadata(rank=...)`, as stock.
    """

    def __init__(
        self, path: str | os.PathLike, _extension_registry: Any = None, *, verify: bool = True
    ) -> None:
        super().__init__(path, _extension_registry)
        self.verify = verify
        self.bytes_read = 0
        self.manifest: Manifest | None = None
        self._set_up_for: str | os.PathLike | None = None

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        super().reset(checkpoint_id)
        self.manifest = None
        self._set_up_for = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        names = RecordNames(kwargs.get("rank"))
        folder = Path(self.path)
        self.manifest, self.storage_data, self._set_up_for = None, {}, None
        if (folder / names.manifest).exists():
            manifest = Manifest.read(folder, names.manifest)
            metadata = manifest.to_metadata()
            self.manifest = manifest
        elif names.rank is None and (folder / MARKER).exists():
            raise IncompleteCheckpointError(
                f"{folder} is a shardwise checkpoint without its {names.manifest}: the save did not commit"
            )
        elif (folder / names.metadata).exists():
            metadata = self._stock_metadata(folder, names)
        elif names.rank is None and per_rank_records(folder):
            # what dcp.load expects before it retries with read_metadata(rank=...)
            raise FileNotFoundError(
                f"{folder} holds per-rank checkpoint records only (saved with use_collectives=False): "
                f"read them with read_metadata(rank=...)"
            )
        elif names.rank is None and leftover_data(folder):
            raise IncompleteCheckpointError(
                f"a save to {folder} started but never committed ({leftover_data(folder)[0]} is left)"
            )
        else:
            raise FileNotFoundError(f"no checkpoint at {folder}")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    @staticmethod
    def _stock_metadata(folder: Path, names: RecordNames) -> Metadata:
        with open(folder / names.metadata, "rb") as f:
            return load_metadata(f)

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._set_up_for = self.path

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        if self._set_up_for is None or self._set_up_for != self.path:
            raise RuntimeError(
                f"Reader for {self.path}: read_data before set_up_storage_reader with this checkpoint's "
                f"metadata (DCP calls reset -> read_metadata -> set_up_storage_reader first)"
            )
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
                    elif info.transform_descriptors:
                        self._read_transformed(fd, path, req, info, planner)
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

    def _read_object(
        self, fd: int, path: Path, req: Any, info: _StorageInfo, planner: LoadPlanner
    ) -> None:
        data = self._pread(fd, info.length, info.offset, path)
        crc = info.crc32c if isinstance(info, StoredObject) else None
        if crc is not None and self.verify and crc32c.crc32c(data) != crc:
            raise CorruptCheckpointError(
                f"object '{req.storage_index.fqn}' in {path} bytes {info.offset}..{info.offset + info.length} "
                f"fails its checksum"
            )
        if info.transform_descriptors:
            data = self._untransform(req, info, data)
        planner.load_bytes(req, io.BytesIO(data))

    def _untransform(self, req: Any, info: _StorageInfo, data: bytes) -> bytes:
        stream = self.transforms.transform_load_stream(
            req, info.transform_descriptors, io.BytesIO(data)
        )
        return stream.read(-1)

    def _read_transformed(
        self, fd: int, path: Path, req: Any, info: _StorageInfo, planner: LoadPlanner
    ) -> None:
        """A chunk stored through stream transforms (e.g. zstd): byte ranges inside
        it mean nothing, so read it whole, check it, undo the transforms, load."""
        data = self._pread(fd, info.length, info.offset, path)
        pages = info.pages if isinstance(info, StoredChunk) else None
        if pages and self.verify and crc32c.crc32c(data) != pages[0]:
            raise CorruptCheckpointError(
                f"'{req.storage_index.fqn}': bytes {info.offset}..{info.offset + info.length} of {path} "
                f"fail their checksum"
            )
        try:
            whole = torch.load(
                io.BytesIO(self._untransform(req, info, data)),
                map_location="cpu",
                weights_only=True,
            )
        except Exception as e:  # noqa: BLE001 - any decoding failure means damaged bytes
            raise CorruptCheckpointError(
                f"'{req.storage_index.fqn}' in {path}: cannot decode ({e})"
            ) from e
        self._commit(req, planner, path, whole)

    def _read_tensor(
        self, fd: int, path: Path, req: Any, info: _StorageInfo, planner: LoadPlanner
    ) -> None:
        if isinstance(info, StoredChunk) and info.payload is not None:
            dtype = dtype_from_name(info.dtype)
            layout = RecordLayout(info.payload[0], info.payload[1], dtype, tuple(info.sizes), True)
            pages = info.pages if self.verify else None
            page = info.page_size
        else:
            try:
                layout = read_record_layout(fd, info.offset, info.length)
            except ValueError as e:
                raise CorruptCheckpointError(f"'{req.storage_index.fqn}' in {path}: {e}") from e
            pages, page = None, PAGE_SIZE  # stock checkpoints carry no checksums
        if not layout.c_contiguous:  # a strided record: load it whole, as stock DCP does
            record = self._pread(fd, info.length, info.offset, path)
            self._commit(
                req,
                planner,
                path,
                torch.load(io.BytesIO(record), map_location="cpu", weights_only=True),
            )
            return
        target = planner.resolve_tensor(req).detach()
        if tuple(target.shape) != tuple(req.lengths):
            raise CorruptCheckpointError(
                f"'{req.storage_index.fqn}' in {path}: stored chunk has the wrong size"
            )
        piece = self._read_box(fd, path, req, layout, pages, page, target)
        if piece is not target:
            target.copy_(piece)
        planner.commit_tensor(req, target)

    @staticmethod
    def _commit(req: Any, planner: LoadPlanner, path: Path, whole: torch.Tensor) -> None:
        """Copy the requested box of a wholly loaded chunk into its target."""
        piece = whole[tuple(slice(o, o + n) for o, n in zip(req.storage_offsets, req.lengths))]
        target = planner.resolve_tensor(req).detach()
        if tuple(target.shape) != tuple(piece.shape):
            raise CorruptCheckpointError(
                f"'{req.storage_index.fqn}' in {path}: stored chunk has the wrong size"
            )
        target.copy_(piece)
        planner.commit_tensor(req, target)

    def _read_box(
        self,
        fd: int,
        path: Path,
        req: Any,
        layout: RecordLayout,
        pages: list[int] | None,
        page: int,
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
        direct = (
            target.is_contiguous() and target.device.type == "cpu" and target.dtype == layout.dtype
        )
        dest = target if direct else torch.empty(tuple(req.lengths), dtype=layout.dtype)
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
        spans = _spans(
            starts, run, _MERGE_GAP, page if pages is not None else None, layout.payload_length
        )
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
                torch.index_select(
                    buf.unfold(0, run, 1), 0, starts[first:last] - span_start, out=rows[first:last]
                )
        return dest

    @staticmethod
    def _check_pages(
        data: memoryview,
        start: int,
        page: int,
        pages: list[int],
        layout: RecordLayout,
        name: str,
        path: Path,
    ) -> None:
        """Verify the whole pages in `data`, which begins at payload offset `start` (page-aligned)."""
        for k in range(0, len(data), page):
            if crc32c.crc32c(data[k : k + page]) != pages[(start + k) // page]:
                lo = layout.payload_offset + start + k
                raise CorruptCheckpointError(
                    f"'{name}': bytes {lo}..{lo + min(page, len(data) - k)} of {path} fail their checksum"
                )


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
