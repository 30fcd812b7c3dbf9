"""`Writer`'s translation between DCP's write items and the one chunk writer.

Each item is resolved by DCP's planner and stored by `chunk_writer.DataFile`
(a tensor as its `torch.save` record, an object as its bytes, or, with stream
extensions, the record stock's own item writer encodes); its `WriteResult`
carries stock's `_StorageInfo` and where it went. `records_of` turns DCP's
global metadata and those results into the save's records (`SaveRecords`).
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch.distributed.checkpoint.filesystem import (
    SerializationFormat,
    _StorageInfo,
    _StorageWriterTransforms,
    _write_item,
)
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from ...storage import Folder
from ..engine.save_records import SaveRecords
from ..format.manifest import TensorEntry, dtype_name
from ..io.chunk_writer import DataFile, Written

__all__ = ["ItemResult", "records_of", "write_file"]


@dataclass
class ItemResult:
    """A stock `_StorageInfo` plus what the manifest needs; unwrapped in `finish`."""

    stock: _StorageInfo
    written: Written


def write_file(
    folder: Folder,
    name: str,
    items: list[WriteItem],
    planner: SavePlanner,
    serialization_id: str,
    transforms: _StorageWriterTransforms,
    sync: bool,
) -> list[WriteResult]:
    """`items` into the new file `name` (`DataFile`), then fsync when `sync`."""
    transformed = bool(transforms.extensions)
    results = []
    with DataFile(folder, name) as out:
        for item in items:
            data = planner.resolve_data(item)
            descriptors = None
            if transformed:
                written, descriptors = _write_transformed(out, item, data, transforms)
            elif item.type == WriteItemType.BYTE_IO:
                written = out.write_object(cast(io.BytesIO, data).getbuffer())
            else:
                written = out.write_tensor(cast(torch.Tensor, data), serialization_id)
            stock = _StorageInfo(name, written.offset, written.length, descriptors)
            results.append(WriteResult(item.index, written.length, ItemResult(stock, written)))
        out.finish(sync)
    return results


def _write_transformed(
    out: DataFile, item: WriteItem, data: Any, transforms: _StorageWriterTransforms
) -> tuple[Written, list[str] | None]:
    """One item encoded by stock's item writer through the stream transforms, then
    stored as one record: where it went and its transform descriptors."""
    if item.type != WriteItemType.BYTE_IO:
        data = cast(torch.Tensor, data).detach().cpu()
    encoded = io.BytesIO()
    stock = _write_item(transforms, encoded, data, item, out.name, SerializationFormat.TORCH_SAVE)
    descriptors = cast(_StorageInfo, stock.storage_data).transform_descriptors
    return out.write_record(encoded.getbuffer()), list(descriptors) if descriptors else None


def records_of(
    metadata: Metadata,
    stored: dict[MetadataIndex, ItemResult],
    world_size: int,
    storage_meta: StorageMeta | None,
) -> SaveRecords:
    """The records of DCP's global `metadata`, each item where `write_file` put it."""
    records = SaveRecords(world_size, storage_meta or StorageMeta(), metadata.planner_data)
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            entry = records.tensors[fqn] = TensorEntry(
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
            records.objects[fqn] = r.written.object_entry(_descriptors(r.stock))
    return records


def _descriptors(info: _StorageInfo) -> list[str] | None:
    return list(info.transform_descriptors) if info.transform_descriptors else None
