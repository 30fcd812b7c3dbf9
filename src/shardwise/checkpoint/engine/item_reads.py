"""DCP's `ReadItem`s as the read executor's requests: where DCP's planner decides what to read.

`Reader.read_data` (under stock `dcp.load`) and the load engine's one DCP branch
(targets only DCP's planner understands: a `_Checkpointable`, an unknown tensor
subclass) both turn a `LoadPlan` into `ChunkRead`/`RecordRead` here, with the
planner's `resolve_tensor`/`commit_tensor`/`load_bytes` as the callbacks, and run
them through the one `ReadExecutor`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlanner, ReadItem

from ...errors import CorruptCheckpointError
from ...storage import Folder
from ..format.objects import vetted_stream
from ..io.read_requests import ChunkRead, RecordRead

__all__ = ["item_reads", "planned_reads"]


def item_reads(
    items: Iterable[ReadItem],
    metadata: Metadata,
    storage: dict[MetadataIndex, _StorageInfo],
    planner: LoadPlanner,
    folder: Folder,
    *,
    trust_objects: bool,
) -> list[ChunkRead | RecordRead]:
    """The executor's requests for DCP's `items`; stored objects reach `planner.load_bytes`
    only once vetted by `objects.vetted_stream` (`trust_objects`)."""
    out: list[ChunkRead | RecordRead] = []
    shapes: dict[str, dict[tuple[int, ...], tuple[int, ...]]] = {}
    for req in items:
        fqn = req.storage_index.fqn
        info = storage[req.storage_index]
        if req.type == LoadItemType.BYTE_IO:
            where = folder.where(info.relative_path)
            out.append(RecordRead(fqn, info, _load_bytes(planner, req, where, trust_objects)))
            continue
        md = metadata.state_dict_metadata.get(fqn)
        if not isinstance(md, TensorStorageMetadata):
            raise CorruptCheckpointError(f"'{fqn}' in {folder}: no tensor metadata for a chunk")
        boxes = shapes.get(fqn)
        if boxes is None:
            boxes = shapes[fqn] = {tuple(c.offsets): tuple(c.sizes) for c in md.chunks}
        shape = boxes.get(tuple(req.storage_index.offset or ()))
        if shape is None:
            raise CorruptCheckpointError(
                f"'{fqn}' in {folder}: no stored chunk at {req.storage_index.offset}"
            )
        out.append(
            ChunkRead(
                fqn,
                info,
                shape,
                md.properties.dtype,
                tuple(req.storage_offsets),
                tuple(req.lengths),
                _resolve(planner, req),
                _commit(planner, req),
            )
        )
    return out


def planned_reads(
    targets: dict[str, Any], metadata: Metadata, folder: Folder, *, trust_objects: bool
) -> list[ChunkRead | RecordRead]:
    """Reads for `targets` (flat keys) planned by DCP's own `DefaultLoadPlanner`, locally:
    the one branch for values only DCP's per-item machinery knows how to fill."""
    planner = DefaultLoadPlanner(allow_partial_load=True)
    planner.set_up_planner(targets, metadata, True)
    plan = planner.create_local_plan()
    storage = metadata.storage_data or {}
    return item_reads(plan.items, metadata, storage, planner, folder, trust_objects=trust_objects)


def _resolve(planner: LoadPlanner, req: ReadItem) -> Any:
    return lambda: planner.resolve_tensor(req)


def _commit(planner: LoadPlanner, req: ReadItem) -> Any:
    return lambda tensor: planner.commit_tensor(req, tensor)


def _load_bytes(planner: LoadPlanner, req: ReadItem, where: str, trust: bool) -> Any:
    fqn = req.storage_index.fqn
    return lambda data: planner.load_bytes(req, vetted_stream(data, fqn, where, trust=trust))
