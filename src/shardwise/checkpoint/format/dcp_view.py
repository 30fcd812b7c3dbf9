"""DCP's view of a manifest: the `Metadata` stock readers and `Reader` plan from.

`metadata_of` builds it from the manifest alone (nothing unpickled), with a
`StoredChunk` per chunk carrying what ranged, verified reads need, so a
reader's byte ranges always come from the metadata it was set up with.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from .manifest_entries import PAGE_SIZE, ChunkEntry, dtype_from_name

if TYPE_CHECKING:
    from .manifest import Manifest

__all__ = ["StoredChunk", "StoredObject", "metadata_of"]


@dataclass
class StoredChunk(_StorageInfo):
    """DCP's per-chunk storage info plus what ranged, verified reads need.

    It is what `Manifest.to_metadata` puts in `Metadata.storage_data`, so a
    reader's byte ranges always come from the metadata it was set up with.
    `crcs` are those of the tiles of shape `tile` (format version 3), else of
    pages of `page_size` (versions 1 and 2), else (no payload) one of the record."""

    dtype: str = ""
    sizes: tuple[int, ...] = ()
    payload: tuple[int, int] | None = None
    crcs: list[int] | None = None
    page_size: int = PAGE_SIZE
    tile: tuple[int, ...] | None = None

    @classmethod
    def of(cls, chunk: ChunkEntry, dtype: str, page_size: int = PAGE_SIZE) -> StoredChunk:
        """The storage info of a manifest chunk of a tensor of `dtype` (its name)."""
        return cls(
            chunk.file,
            chunk.record[0],
            chunk.record[1],
            chunk.transform,
            dtype,
            chunk.sizes,
            chunk.payload,
            chunk.crcs,
            page_size,
            chunk.tile,
        )


@dataclass
class StoredObject(_StorageInfo):
    """DCP's storage info of a pickled object plus its checksum."""

    crc32c: int | None = None


def metadata_of(manifest: Manifest) -> Metadata:
    """The DCP `Metadata` `manifest` describes, built without unpickling."""
    state: dict[str, Any] = {}
    storage: dict[MetadataIndex, _StorageInfo] = {}
    for k, t in manifest.tensors.items():
        state[k] = TensorStorageMetadata(
            properties=TensorProperties(
                dtype=dtype_from_name(t.dtype), requires_grad=t.requires_grad
            ),
            size=torch.Size(t.shape),
            chunks=[
                ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(c.sizes)) for c in t.chunks
            ],
        )
        for c in t.chunks:
            storage[MetadataIndex(k, c.offsets)] = StoredChunk.of(c, t.dtype, manifest.page_size)
    for k, o in manifest.objects.items():
        state[k] = BytesStorageMetadata()
        storage[MetadataIndex(k)] = StoredObject(o.file, o.offset, o.length, o.transform, o.crc32c)
    meta = manifest.storage_meta
    return Metadata(
        state_dict_metadata=state,
        planner_data=manifest.decoded_planner_data(),
        storage_data=storage,
        storage_meta=StorageMeta(
            # a Path, as FileSystemWriter pickles it (its init_path makes one)
            checkpoint_id=None
            if meta.get("checkpoint_id") is None
            else Path(meta["checkpoint_id"]),
            save_id=meta.get("save_id"),
            modules=list(meta.get("modules") or []),
        ),
        version=manifest.dcp_version,
    )
