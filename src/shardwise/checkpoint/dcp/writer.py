"""`Writer`: the DCP `StorageWriter` of shardwise checkpoints, kept apart from reading.

Stock `FileSystemWriter` planning, constructor and `.metadata`, and data
files in its format, so stock `dcp.load` reads the result. Every rank writes
its items under fresh token-named files (`__0_0.sw<token>.distcp`) through
`chunk_io`, then fsyncs them; the coordinator then commits (`commit.py`):
`.metadata`, `shardwise.json`, the marker, each renamed into place, and
collects the files of the checkpoint it replaced. Other files in the folder
are never touched. The coordinator (every rank, without collectives) holds the
path's lease (`lease.py`) from the global plan, before any data is written, to
the end of the commit.

Call order (DCP's): reset -> set_up_storage_writer -> prepare plans
(collective) -> write_data on every rank -> finish on the coordinator.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import weakref
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, cast

import crc32c
import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import (
    CURRENT_DCP_VERSION,
    SerializationFormat,
    _split_by_size_and_type,
    _StorageInfo,
    _StoragePrefix,
    _write_item,
)
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from ...errors import InvalidArgumentError, ShardMismatchError
from ...storage import Folder, open_folder
from ..engine.planning import holes_in_plans
from ..format.manifest import Manifest, TensorEntry, dtype_name
from ..io.chunk_writer import DataFile, Written
from ..io.commit import RecordNames, commit, data_file_name, in_the_way, new_token
from ..io.faults import failpoint
from ..io.lease import Lease
from .folder_backed import FolderBacked

__all__ = ["Writer"]


@dataclass
class _Result:
    """A stock `_StorageInfo` plus what the manifest needs; unwrapped in `finish`."""

    stock: _StorageInfo
    written: Written


class Writer(FolderBacked, FileSystemWriter):
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
    `path` may be an fsspec URL (as with stock `FsspecWriter`); `storage_options`
    go to its backend. Another save of the same path in flight (it holds the
    path's lease) fails this one with `CheckpointBusyError`, unless `wait` (True,
    or seconds) says to wait for it.
    """

    def __init__(
        self,
        path: str | os.PathLike | Folder,
        single_file_per_rank: bool = True,
        sync_files: bool = True,
        thread_count: int = 1,
        per_thread_copy_ahead: int = 10_000_000,
        cache_staged_state_dict: bool = False,
        overwrite: bool = True,
        _extensions: Sequence[Any] | None = None,
        serialization_format: SerializationFormat = SerializationFormat.TORCH_SAVE,
        *,
        storage_options: dict[str, Any] | None = None,
        wait: bool | float = False,
    ) -> None:
        if serialization_format != SerializationFormat.TORCH_SAVE:
            raise InvalidArgumentError(
                f"serialization_format={serialization_format} is not supported by "
                "shardwise.checkpoint.Writer: stock FileSystemReader reads only TORCH_SAVE "
                "records; for safetensors files use "
                "torch.distributed.checkpoint.HuggingFaceStorageWriter or "
                "shardwise.checkpoint.convert"
            )
        folder = open_folder(path, storage_options)
        super().__init__(
            folder.checkpoint_id,
            single_file_per_rank=single_file_per_rank,
            sync_files=sync_files,
            thread_count=thread_count,
            per_thread_copy_ahead=per_thread_copy_ahead,
            cache_staged_state_dict=cache_staged_state_dict,
            overwrite=overwrite,
            _extensions=_extensions,
            serialization_format=serialization_format,
        )
        self.storage_options = storage_options
        self._use(folder)
        self._token = new_token()
        self.wait = wait
        # the lease this writer holds, released by `finish`, by the next save's set-up
        # (a save that failed on another rank never reaches `finish`) or when the
        # writer is freed
        self._lease: list[Lease] = []
        weakref.finalize(self, _release, self._lease)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        _release(self._lease)  # an earlier save that failed before `finish`
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)
        # A fresh token on every rank for every save, whatever DCP resets or caches:
        # data files never reuse a name, so no committed file is ever reopened.
        self._token = new_token()

    def _records(self) -> RecordNames:
        return RecordNames(
            self.rank if not self.use_collectives and self.rank is not None else None
        )

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        # Holes would read back as memory no chunk filled: refused even in one process,
        # where stock DCP's own check (across ranks only) lets them through.
        # Per-rank records (use_collectives=False) each hold only their rank's part.
        holes = holes_in_plans(plans) if self.use_collectives else []
        if holes:
            raise ShardMismatchError(f"cannot save to {self.folder}: " + "; ".join(holes))
        plans = super().prepare_global_plan(plans)
        self._take_lease()
        return plans

    def release_lease(self) -> None:
        """Give back the path's lease if this writer still holds it: `finish` does, but
        a save that failed on another rank never gets there (the next save's set-up,
        or freeing the writer, would release it too)."""
        _release(self._lease)

    def _take_lease(self) -> None:
        """The lease of this writer's record scope, before any rank writes data (DCP
        scatters the plan after this): a busy path fails every rank."""
        _release(self._lease)
        lease = Lease(self.folder, self._records().rank, save_id=self.save_id)
        lease.acquire(self.wait)
        self._lease.append(lease)
        existing = in_the_way(self.folder, self._records())  # committed while this one waited
        if not self.overwrite and existing:
            _release(self._lease)
            raise RuntimeError(f"Checkpoint already exists and self.overwrite=False: {existing}")

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        # The folder is created in write_data: a save refused in planning leaves no folder.
        existing = in_the_way(self.folder, self._records())
        if not self.overwrite and existing:
            raise RuntimeError(f"Checkpoint already exists and self.overwrite=False: {existing}")
        if self.rank is not None and not self.use_collectives:
            plan = dataclasses.replace(plan, storage_data=_StoragePrefix(f"__{self.rank}_"))
        return plan

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Write this rank's items into fresh token-named files (one per bucket of
        `thread_count`, or one per item), in parallel threads when there are several."""
        failpoint("before-write")
        self.folder.make()
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
        """Objects as pickled bytes, tensors as torch.save records (`chunk_io`); then fsync."""
        serialization_id = self.save_id.replace("-", "")[:40].ljust(40, "0")  # torch.save's field
        results = []
        with DataFile(self.folder, name) as out:
            for item in items:
                data = planner.resolve_data(item)
                if item.type == WriteItemType.BYTE_IO:
                    written = out.write_object(cast(io.BytesIO, data).getbuffer())
                else:
                    tensor = cast(torch.Tensor, data).detach().cpu().contiguous()
                    written = out.write_tensor(tensor, serialization_id)
                stock = _StorageInfo(name, written.offset, written.length)
                results.append(WriteResult(item.index, written.length, _Result(stock, written)))
                failpoint("mid-data")
            if self.sync_files:
                out.sync()
            failpoint("after-data")
        return results

    def _write_transformed(
        self, name: str, items: list[WriteItem], planner: SavePlanner
    ) -> list[WriteResult]:
        """Items through the writer's stream transforms (stock's own item writer);
        each stored range gets one checksum, computed from the written bytes."""
        stock = []
        with self.folder.create(name) as sink:  # never an existing file
            stream = sink.stream()
            for item in items:
                data = planner.resolve_data(item)
                if item.type != WriteItemType.BYTE_IO:
                    data = cast(torch.Tensor, data).detach().cpu()
                stock.append(
                    _write_item(
                        self.transforms, stream, data, item, name, SerializationFormat.TORCH_SAVE
                    )
                )
                failpoint("mid-data")
            sink.close(sync=self.sync_files)
        failpoint("after-data")
        results = []
        f = self.folder.open(name)
        try:
            for r in stock:
                info: _StorageInfo = r.storage_data
                crc = crc32c.crc32c(f.pread(info.length, info.offset))
                written = Written(info.relative_path, info.offset, info.length, [crc])
                results.append(WriteResult(r.index, r.size_in_bytes, _Result(info, written)))
        finally:
            f.close()
        return results

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Build `.metadata` and the manifest, then commit them (coordinator, or
        every rank on its own without collectives)."""
        stored: dict[MetadataIndex, _Result] = {}
        for rank_results in results:
            stored.update({r.index: r.storage_data for r in rank_results})
        metadata.version = CURRENT_DCP_VERSION
        metadata.storage_data = {index: r.stock for index, r in stored.items()}
        metadata.storage_meta = self.storage_meta()
        metadata_bytes = pickle.dumps(metadata)
        manifest = _manifest(metadata, stored, len(results))
        manifest.metadata_crc32c = crc32c.crc32c(metadata_bytes)
        keep = {r.stock.relative_path for r in stored.values()}
        try:
            commit(
                self.folder,
                metadata_bytes,
                manifest.to_json().encode(),
                keep,
                self._records(),
                sync=self.sync_files,
                lease=self._lease[0] if self._lease else None,
            )
        finally:
            _release(self._lease)


def _release(held: list[Lease]) -> None:
    """Give back the lease a writer holds, if any."""
    while held:
        held.pop().release()


def _manifest(
    metadata: Metadata, stored: dict[MetadataIndex, _Result], world_size: int
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
        if isinstance(md, TensorStorageMetadata):
            entry = manifest.tensors[fqn] = TensorEntry(
                dtype_name(md.properties.dtype),
                tuple(md.size),
                requires_grad=bool(md.properties.requires_grad),
            )
            for chunk in md.chunks:
                r = stored[MetadataIndex(fqn, chunk.offsets)]
                entry.chunks.append(
                    r.written.chunk_entry(
                        tuple(chunk.offsets), tuple(chunk.sizes), _descriptors(r.stock)
                    )
                )
        else:
            r = stored[MetadataIndex(fqn)]
            manifest.objects[fqn] = r.written.object_entry(_descriptors(r.stock))
    return manifest


def _descriptors(info: _StorageInfo) -> list[str] | None:
    return list(info.transform_descriptors) if info.transform_descriptors else None
