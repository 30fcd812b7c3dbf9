"""`Reader`: the DCP `StorageReader` for shardwise and stock checkpoints, with ranged reads.

It reads `shardwise.json` (never unpickling `.metadata`), or a stock
`.metadata` through an unpickler that admits only DCP's classes. Every byte
range it reads comes from the `Metadata` it was set up with
(`set_up_storage_reader`): a reset reader keeps nothing of the previous
checkpoint. It reads only the byte ranges of each stored chunk that the load
targets need (`byte_runs`), widened to the checksum tiles (or, in older
checkpoints, pages) that cover them, and verifies those.

Call order (DCP's): reset -> read_metadata -> set_up_storage_reader ->
prepare plans (collective) -> read_data on every rank. How much of a chunk a
ranged read reads, and how it is verified, is `chunk_read`'s.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import crc32c
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.futures import Future

from ..errors import CorruptCheckpointError, IncompleteCheckpointError
from .chunk_read import check_record, read_box
from .commit import RecordNames, leftover_data, per_rank_records
from .manifest import MARKER, Manifest, StoredChunk, StoredObject, dtype_from_name
from .record_read import RecordLayout, read_record_layout
from .safe_pickle import load_metadata

__all__ = ["Reader"]


class Reader(FileSystemReader):
    """A DCP `StorageReader` for shardwise and stock checkpoints with ranged reads.

    A drop-in for `FileSystemReader` (same constructor, `_extension_registry`
    included). `bytes_read` counts every byte this reader read from data
    files. `verify=False` skips checksum verification (and the widening to
    whole tiles or pages it needs). Per-rank checkpoints (saved with `use_collectives=False`) are
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
                f"{folder} is a shardwise checkpoint without its {names.manifest}: "
                "the save did not commit"
            )
        elif (folder / names.metadata).exists():
            metadata = self._stock_metadata(folder, names)
        elif names.rank is None and per_rank_records(folder):
            # what dcp.load expects before it retries with read_metadata(rank=...)
            raise FileNotFoundError(
                f"{folder} holds per-rank checkpoint records only "
                "(saved with use_collectives=False): read them with read_metadata(rank=...)"
            )
        elif names.rank is None and leftover_data(folder):
            raise IncompleteCheckpointError(
                f"a save to {folder} started but never committed "
                f"({leftover_data(folder)[0]} is left)"
            )
        else:
            raise FileNotFoundError(f"no checkpoint at {folder}")
        storage_meta = getattr(metadata, "storage_meta", None)  # absent from old pickles
        if storage_meta is None:
            storage_meta = metadata.storage_meta = StorageMeta()
        storage_meta.load_id = self.load_id
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
                f"Reader for {self.path}: read_data before set_up_storage_reader with this "
                "checkpoint's metadata (DCP calls reset -> read_metadata -> "
                "set_up_storage_reader first)"
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
                            f"'{req.storage_index.fqn}': bytes {info.offset}.."
                            f"{info.offset + info.length} of {path} lie past its end "
                            f"({size} bytes): the file is truncated"
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
                f"object '{req.storage_index.fqn}' in {path} bytes "
                f"{info.offset}..{info.offset + info.length} fails its checksum"
            )
        if info.transform_descriptors:
            data = self._untransform(req, info, data)
        planner.load_bytes(req, io.BytesIO(data))

    def _untransform(self, req: Any, info: _StorageInfo, data: bytes) -> bytes:
        stream = self.transforms.transform_load_stream(
            req, info.transform_descriptors or (), io.BytesIO(data)
        )
        return stream.read(-1)

    def _read_transformed(
        self, fd: int, path: Path, req: Any, info: _StorageInfo, planner: LoadPlanner
    ) -> None:
        """A chunk stored through stream transforms (e.g. zstd): byte ranges inside
        it mean nothing, so read it whole, check it, undo the transforms, load."""
        data = self._pread(fd, info.length, info.offset, path)
        if isinstance(info, StoredChunk) and self.verify:
            check_record(data, info, path, req.storage_index.fqn)
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
        chunk = info if isinstance(info, StoredChunk) and info.payload is not None else None
        if chunk is not None and chunk.payload is not None:
            at, n = chunk.payload
            layout = RecordLayout(at, n, dtype_from_name(chunk.dtype), tuple(chunk.sizes), True)
        else:  # stock checkpoints carry no checksums: find the payload in the record
            try:
                layout = read_record_layout(fd, info.offset, info.length)
            except ValueError as e:
                raise CorruptCheckpointError(f"'{req.storage_index.fqn}' in {path}: {e}") from e
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
        piece, n = read_box(
            fd,
            path,
            req.storage_index.fqn,
            chunk,
            layout,
            tuple(req.storage_offsets),
            tuple(req.lengths),
            target,
            self.verify,
        )
        self.bytes_read += n
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
