"""`Reader`: the DCP `StorageReader` for shardwise and stock checkpoints, with ranged reads.

It reads `shardwise.json` (never unpickling `.metadata`), or a stock
`.metadata` through an unpickler that admits only DCP's classes. Every byte
range it reads comes from the `Metadata` it was set up with
(`set_up_storage_reader`): a reset reader keeps nothing of the previous
checkpoint. It reads only the byte ranges of each stored chunk that the load
targets need (`byte_runs`), widened to the checksum tiles (or, in older
checkpoints, pages) that cover them, and verifies those.

Call order (DCP's): reset -> read_metadata -> set_up_storage_reader ->
prepare plans (collective) -> read_data on every rank. On an object store
`read_data` first fetches every byte range its plan needs, concurrently
(`Folder.prefetch`), then reads as it would locally. How much of a chunk a
ranged read reads, and how it is verified, is `chunk_read`'s.
"""

from __future__ import annotations

import io
import math
import os
from collections import defaultdict
from typing import Any

import crc32c
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.futures import Future

from ...errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    UnsupportedStorageError,
)
from ...storage import Folder, RandomAccess, open_folder
from ..format.manifest import MARKER, Manifest, StoredChunk, StoredObject, dtype_from_name
from ..format.objects import vetted_stream
from ..format.record_check import check_metadata, check_name, follow_replaced, read_stock
from ..format.record_read import HEAD_BYTES, RecordLayout, read_record_layout
from ..io.box_read import box_ranges, check_record, read_box
from ..io.commit import RecordNames, leftover_data, per_rank_records
from .folder_backed import FolderBacked

# What a `torch.save` container adds around a tensor's bytes, at most (its pickle, zip
# headers and alignment take a few KiB): the bound on undoing a chunk's stream extensions.
_CONTAINER_ROOM = 1 << 20

__all__ = ["Reader"]


class Reader(FolderBacked, FileSystemReader):
    """A DCP `StorageReader` for shardwise and stock checkpoints with ranged reads.

    A drop-in for `FileSystemReader` (same constructor, `_extension_registry`
    included). `bytes_read` counts every byte this reader read from data
    files. `verify=False` skips checksum verification (and the widening to
    whole tiles or pages it needs). Stored objects are vetted with PyTorch's
    `weights_only` unpickler before DCP's planner (which unpickles with
    `weights_only=False`) sees them: a refused global raises `UnsafeMetadataError`
    unless `trust_objects=True` (`shardwise.checkpoint.format.objects`). Per-rank
    checkpoints (saved with `use_collectives=False`) are read through
    `read_metadata(rank=...)`, as stock. `path` may be an fsspec URL (as with
    stock `FsspecReader`); `storage_options` go to its backend.
    """

    def __init__(
        self,
        path: str | os.PathLike | Folder,
        _extension_registry: Any = None,
        *,
        verify: bool = True,
        storage_options: dict[str, Any] | None = None,
        trust_objects: bool = False,
    ) -> None:
        folder = open_folder(path, storage_options)
        super().__init__(folder.checkpoint_id, _extension_registry)
        self.storage_options = storage_options
        self._use(folder)
        self.verify = verify
        self.trust_objects = trust_objects
        self.bytes_read = 0
        self.manifest: Manifest | None = None
        self._set_up_for: str | os.PathLike | None = None
        self._checked: Metadata | None = None  # the metadata whose records were checked

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        super().reset(checkpoint_id)
        self.manifest = None
        self._set_up_for = None
        self._checked = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        names = RecordNames(kwargs.get("rank"))
        folder = self.folder
        self.manifest, self.storage_data, self._set_up_for = None, {}, None
        present = set(folder.names())
        if names.manifest in present:
            manifest = Manifest.read(folder, names.manifest)
            replaced = manifest.stale(folder, names.metadata)
            if replaced is None:
                metadata = manifest.to_metadata()
                self.manifest = manifest
            else:  # what stock readers see now: never the data it replaced
                metadata = follow_replaced(
                    folder, names.metadata, replaced, manifest.files(), holes=names.rank is not None
                )
        elif names.rank is None and MARKER in present:
            raise IncompleteCheckpointError(
                f"{folder} is a shardwise checkpoint without its {names.manifest}: "
                "the save did not commit"
            )
        elif names.metadata in present:
            metadata = read_stock(folder, names.metadata, holes=names.rank is not None)
        elif names.rank is None and per_rank_records(folder):
            # what dcp.load expects before it retries with read_metadata(rank=...)
            raise CheckpointNotFoundError(
                f"{folder} holds per-rank checkpoint records only "
                "(saved with use_collectives=False): read them with read_metadata(rank=...)"
            )
        elif names.rank is None and leftover_data(folder):
            raise IncompleteCheckpointError(
                f"a save to {folder} started but never committed "
                f"({leftover_data(folder)[0]} is left)"
            )
        else:
            raise CheckpointNotFoundError(f"no checkpoint at {folder}")
        storage_meta = getattr(metadata, "storage_meta", None)  # absent from old pickles
        if storage_meta is None:
            storage_meta = metadata.storage_meta = StorageMeta()
        storage_meta.load_id = self.load_id
        self._checked = metadata
        return metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        if metadata is not self._checked:  # not what read_metadata read and checked
            check_metadata(metadata, self.folder, f"metadata given for {self.folder}", holes=True)
            self._checked = metadata
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._set_up_for = self.path

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        if self._set_up_for is None or self._set_up_for != self.path:
            raise RuntimeError(
                f"Reader for {self.path}: read_data before set_up_storage_reader with this "
                "checkpoint's metadata (DCP calls reset -> read_metadata -> "
                "set_up_storage_reader first)"
            )
        by_file: dict[str, list[Any]] = defaultdict(list)
        for req in plan.items:
            by_file[self.storage_data[req.storage_index].relative_path].append(req)
        files: dict[str, RandomAccess] = {}
        try:
            for name in by_file:
                check_name(  # checked with the records; again here, where it is opened
                    self.folder,
                    by_file[name][0].storage_index.fqn,
                    name,
                    str(self.folder),
                    shardwise=self.manifest is not None,
                )
                try:
                    files[name] = self.folder.open(name)
                except FileNotFoundError as e:
                    raise CorruptCheckpointError(
                        f"data file {self.folder.where(name)} is missing"
                    ) from e
            layouts = self._prefetch(by_file, files) if self.folder.wants_prefetch else {}
            for name, reqs in by_file.items():
                f, path = files[name], self.folder.where(name)
                size = f.size()
                for req in reqs:
                    info = self.storage_data[req.storage_index]
                    if info.offset + info.length > size:
                        raise CorruptCheckpointError(
                            f"'{req.storage_index.fqn}': bytes {info.offset}.."
                            f"{info.offset + info.length} of {path} lie past its end "
                            f"({size} bytes): the file is truncated"
                        )
                    if req.type == LoadItemType.BYTE_IO:
                        self._read_object(f, path, req, info, planner)
                    elif info.transform_descriptors:
                        self._read_transformed(f, path, req, info, planner)
                    else:
                        self._read_tensor(f, path, req, info, planner, layouts.get(id(req)))
        finally:
            self.folder.release()
            for f in files.values():
                f.close()
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _prefetch(
        self, by_file: dict[str, list[Any]], files: dict[str, RandomAccess]
    ) -> dict[int, RecordLayout]:
        """Fetch every byte range the plan reads, concurrently (an object store): first
        the heads of stock records (where their payload starts), then the rest. Returns
        the stock records' layouts so parsed, by request."""
        heads: dict[str, list[tuple[int, int]]] = defaultdict(list)
        for name, reqs in by_file.items():
            for req in reqs:
                info = self.storage_data[req.storage_index]
                if req.type != LoadItemType.BYTE_IO and not info.transform_descriptors:
                    if self._layout_of(info) is None:
                        heads[name].append(
                            (info.offset, info.offset + min(info.length, HEAD_BYTES))
                        )
        layouts: dict[int, RecordLayout] = {}
        if heads:
            self.folder.prefetch(heads)
            for name, reqs in by_file.items():
                for req in reqs:
                    info = self.storage_data[req.storage_index]
                    if name in heads and req.type != LoadItemType.BYTE_IO:
                        if not info.transform_descriptors and self._layout_of(info) is None:
                            try:
                                layouts[id(req)] = read_record_layout(
                                    files[name], info.offset, info.length
                                )
                            except ValueError:
                                pass  # reported by the read itself
            self.folder.release()
        wanted: dict[str, list[tuple[int, int]]] = defaultdict(list)
        for name, reqs in by_file.items():
            for req in reqs:
                info = self.storage_data[req.storage_index]
                layout = self._layout_of(info) or layouts.get(id(req))
                if req.type == LoadItemType.BYTE_IO or info.transform_descriptors:
                    wanted[name].append((info.offset, info.offset + info.length))
                elif layout is not None and layout.c_contiguous:
                    chunk = info if isinstance(info, StoredChunk) else None
                    wanted[name] += box_ranges(
                        chunk,
                        layout,
                        tuple(req.storage_offsets),
                        tuple(req.lengths),
                        self.verify,
                    )
                else:
                    wanted[name].append((info.offset, info.offset + info.length))
        self.folder.prefetch(wanted)
        return layouts

    @staticmethod
    def _layout_of(info: _StorageInfo) -> RecordLayout | None:
        """A chunk's payload layout as its manifest records it (None for stock chunks)."""
        if isinstance(info, StoredChunk) and info.payload is not None:
            at, n = info.payload
            return RecordLayout(at, n, dtype_from_name(info.dtype), tuple(info.sizes), True)
        return None

    def _pread(self, f: RandomAccess, n: int, offset: int, path: str) -> bytes:
        data = f.pread(n, offset)
        self.bytes_read += len(data)
        if len(data) != n:
            raise CorruptCheckpointError(f"{path}: short read of {n} bytes at {offset}: truncated")
        return data

    def _read_object(
        self, f: RandomAccess, path: str, req: Any, info: _StorageInfo, planner: LoadPlanner
    ) -> None:
        data = self._pread(f, info.length, info.offset, path)
        crc = info.crc32c if isinstance(info, StoredObject) else None
        if crc is not None and self.verify and crc32c.crc32c(data) != crc:
            raise CorruptCheckpointError(
                f"object '{req.storage_index.fqn}' in {path} bytes "
                f"{info.offset}..{info.offset + info.length} fails its checksum"
            )
        if info.transform_descriptors:
            data = self._untransform(req, info, data)
        fqn = req.storage_index.fqn
        planner.load_bytes(req, vetted_stream(data, fqn, path, trust=self.trust_objects))

    def _untransform(self, req: Any, info: _StorageInfo, data: bytes) -> bytes:
        try:
            stream = self.transforms.transform_load_stream(
                req, info.transform_descriptors or (), io.BytesIO(data)
            )
        except ValueError as e:  # DCP's "Unknown extension": not damage, a missing registry
            raise UnsupportedStorageError(
                f"'{req.storage_index.fqn}' in {self.folder} was written through stream "
                f"extensions {list(info.transform_descriptors or ())} this reader does not "
                f"know ({e}); pass a registry that does: Reader(path, _extension_registry=...), "
                "swc.load(..., extension_registry=...) or read_tensor(..., extension_registry=...)"
            ) from e
        limit = self._untransformed_limit(req)
        data = stream.read(-1 if limit is None else limit + 1)
        if limit is not None and len(data) > limit:
            raise CorruptCheckpointError(
                f"'{req.storage_index.fqn}' in {self.folder}: undoing its stream extensions "
                f"yields over {limit} bytes, more than its chunk's elements and a torch.save "
                "container need: a decompression bomb, or damaged; refused"
            )
        return data

    def _untransformed_limit(self, req: Any) -> int | None:
        """The most bytes a tensor chunk's record may expand to: its elements' bytes plus
        room for `torch.save`'s container (DCP clones a view before saving it, so no
        record holds more storage than its chunk). None for objects (no size recorded)."""
        md = (self._checked.state_dict_metadata if self._checked else {}).get(req.storage_index.fqn)
        if req.type == LoadItemType.BYTE_IO or not isinstance(md, TensorStorageMetadata):
            return None
        at = tuple(req.storage_index.offset or ())
        for c in md.chunks:
            if tuple(c.offsets) == at:
                return math.prod(c.sizes) * md.properties.dtype.itemsize + _CONTAINER_ROOM
        return None
        at = tuple(req.storage_index.offset or ())
        for c in md.chunks:
            if tuple(c.offsets) == at:
                return math.prod(c.sizes) * md.properties.dtype.itemsize + _CONTAINER_ROOM
        return None

    def _read_transformed(
        self, f: RandomAccess, path: str, req: Any, info: _StorageInfo, planner: LoadPlanner
    ) -> None:
        """A chunk stored through stream transforms (e.g. zstd): byte ranges inside
        it mean nothing, so read it whole, check it, undo the transforms, load."""
        data = self._pread(f, info.length, info.offset, path)
        if isinstance(info, StoredChunk) and self.verify:
            check_record(data, info, path, req.storage_index.fqn)
        plain = self._untransform(req, info, data)
        try:
            whole = torch.load(io.BytesIO(plain), map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - any decoding failure means damaged bytes
            raise CorruptCheckpointError(
                f"'{req.storage_index.fqn}' in {path}: cannot decode ({e})"
            ) from e
        self._commit(req, planner, path, whole)

    def _read_tensor(
        self,
        f: RandomAccess,
        path: str,
        req: Any,
        info: _StorageInfo,
        planner: LoadPlanner,
        parsed: RecordLayout | None = None,
    ) -> None:
        chunk = info if isinstance(info, StoredChunk) and info.payload is not None else None
        layout = self._layout_of(info) or parsed
        if layout is None:  # stock checkpoints carry no checksums: find the payload in the record
            try:
                layout = read_record_layout(f, info.offset, info.length)
            except ValueError as e:
                raise CorruptCheckpointError(f"'{req.storage_index.fqn}' in {path}: {e}") from e
        if not layout.c_contiguous:  # a strided record: load it whole, as stock DCP does
            record = self._pread(f, info.length, info.offset, path)
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
            f,
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
    def _commit(req: Any, planner: LoadPlanner, path: str, whole: torch.Tensor) -> None:
        """Copy the requested box of a wholly loaded chunk into its target."""
        piece = whole[tuple(slice(o, o + n) for o, n in zip(req.storage_offsets, req.lengths))]
        target = planner.resolve_tensor(req).detach()
        if tuple(target.shape) != tuple(piece.shape):
            raise CorruptCheckpointError(
                f"'{req.storage_index.fqn}' in {path}: stored chunk has the wrong size"
            )
        target.copy_(piece)
        planner.commit_tensor(req, target)
