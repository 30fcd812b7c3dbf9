"""`Reader`: the DCP `StorageReader` for shardwise and stock checkpoints, with ranged reads.

It reads `shardwise.json` (never unpickling `.metadata`), or a stock
`.metadata` through an unpickler that admits only DCP's classes. Every byte
range it reads comes from the `Metadata` it was set up with
(`set_up_storage_reader`): a reset reader keeps nothing of the previous
checkpoint. It reads only the byte ranges of each stored chunk that the load
targets need (`byte_runs`), widened to the checksum tiles (or, in older
checkpoints, pages) that cover them, and verifies those.

Call order (DCP's): reset -> read_metadata -> set_up_storage_reader ->
prepare plans (collective) -> read_data on every rank. The records are found
and checked by `stored_view.read_records`, as for `swc.load`; `read_data` only
translates DCP's `ReadItem`s into the one read executor's requests
(`item_reads`): what is read, prefetched and verified is `io.read_executor`'s.
"""

from __future__ import annotations

import os
from typing import Any

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.futures import Future

from ...errors import UsageError
from ...storage import Folder, open_folder
from ..engine.item_reads import item_reads
from ..engine.stored_view import read_records
from ..format.manifest import Manifest
from ..format.record_check import check_metadata, check_name
from ..io.read_executor import ReadExecutor
from .folder_backed import FolderBacked

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
        self.manifest, self.storage_data, self._set_up_for = None, {}, None
        self.manifest, metadata = read_records(self.folder, kwargs.get("rank"), whole=True)
        if self.manifest is not None:
            metadata = self.manifest.to_metadata()
        assert metadata is not None
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
        """DCP's plan, as the read executor's requests (`item_reads`), run at once."""
        if self._set_up_for is None or self._set_up_for != self.path or self._checked is None:
            raise UsageError(  # a RuntimeError, as stock's would be
                f"Reader for {self.path}: read_data before set_up_storage_reader with this "
                "checkpoint's metadata (DCP calls reset -> read_metadata -> "
                "set_up_storage_reader first)"
            )
        for name, req in {
            self.storage_data[req.storage_index].relative_path: req for req in plan.items
        }.items():  # checked with the records; again here, where it is opened
            check_name(
                self.folder,
                req.storage_index.fqn,
                name,
                str(self.folder),
                shardwise=self.manifest is not None,
            )
        reads = item_reads(
            plan.items,
            self._checked,
            self.storage_data,
            planner,
            self.folder,
            trust_objects=self.trust_objects,
        )
        executor = ReadExecutor(
            self.folder, verify=self.verify, registry=self.transforms.extension_registry
        )
        try:
            executor.run(reads)
        finally:
            self.bytes_read += executor.bytes_read
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut
