"""`Writer`: the DCP `StorageWriter` of shardwise checkpoints, kept apart from reading.

Stock `FileSystemWriter` planning, constructor and `.metadata`, and data
files in its format, so stock `dcp.load` reads the result. Every rank writes
its items under fresh token-named files (`__0_0.sw<token>.distcp`) through
`chunk_writer`, then fsyncs them; the coordinator then commits (`commit.py`):
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
import os
import weakref
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import (
    SerializationFormat,
    _split_by_size_and_type,
    _StoragePrefix,
)
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
)
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from ...errors import InvalidArgumentError, ShardMismatchError, UsageError
from ...storage import Folder, open_folder
from ..engine.holes import holes_in_plans
from ..io.commit import RecordNames, commit, data_file_name, in_the_way, new_token
from ..io.faults import failpoint
from ..io.lease import Lease
from .folder_backed import FolderBacked
from .write_items import ItemResult, records_of, write_file

__all__ = ["Writer"]


class Writer(FolderBacked, FileSystemWriter):
    """A DCP `StorageWriter` producing a shardwise checkpoint in the folder `path`.

    A drop-in for `FileSystemWriter`, with its constructor: `overwrite=True`
    (the default, as stock) replaces a checkpoint already in the folder;
    `False` raises `UsageError("Checkpoint already exists ...")` (a
    `RuntimeError`, as stock's) when the folder holds one. Either way, files
    in the folder that no checkpoint wrote are left alone. `thread_count`
    writes that many files per rank in parallel; `single_file_per_rank=False`
    writes a file per item;
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
        self._index_name = ""  # set by `write_data`
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
            raise UsageError(f"Checkpoint already exists and self.overwrite=False: {existing}")

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        # The folder is created in write_data: a save refused in planning leaves no folder.
        existing = in_the_way(self.folder, self._records())
        if not self.overwrite and existing:
            raise UsageError(f"Checkpoint already exists and self.overwrite=False: {existing}")
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
        # past this rank's data files: where its index goes if it is the one to commit
        self._index_name = data_file_name(plan.storage_data.prefix, len(jobs), token)
        serialization_id = self.save_id.replace("-", "")[:40].ljust(40, "0")  # torch.save's field

        def write(name: str, items: list[WriteItem]) -> list[WriteResult]:
            return write_file(
                self.folder,
                name,
                items,
                planner,
                serialization_id,
                self.transforms,
                self.sync_files,
            )

        if self.thread_count > 1 and len(jobs) > 1:
            with ThreadPoolExecutor(
                self.thread_count, thread_name_prefix="shardwise-write"
            ) as pool:
                parts = list(pool.map(lambda job: write(*job), jobs))
        else:
            parts = [write(name, items) for name, items in jobs]
        fut: Future[list[WriteResult]] = Future()
        fut.set_result([r for part in parts for r in part])
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Build `.metadata` and the manifest (`SaveRecords`), then commit them
        (coordinator, or every rank on its own without collectives)."""
        stored: dict[MetadataIndex, ItemResult] = {}
        for rank_results in results:
            stored.update({r.index: r.storage_data for r in rank_results})
        records = records_of(metadata, stored, len(results), self.storage_meta())
        keep = {r.stock.relative_path for r in stored.values()}
        index_name = self._index_name
        metadata_bytes, manifest, index = records.records(index_name)
        try:
            self.folder.write_new(index_name, index, sync=self.sync_files)
            commit(
                self.folder,
                metadata_bytes,
                manifest,
                keep | {index_name},
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
