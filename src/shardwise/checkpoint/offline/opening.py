"""Reading a checkpoint in one process, with no process group: what every offline tool builds on.

`open_checkpoint` reads the metadata once; `read` fetches a tensor or a
region of it through `Reader` (only the bytes of the region, widened to whole
checksum tiles when verifying; `bytes_read` counts them), and
`object_bytes` a stored object, verified and never unpickled. Works on
shardwise and stock DCP checkpoints alike.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, cast

import crc32c
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

from ...errors import CorruptCheckpointError, LayoutError
from ...layout import Block
from ...storage import Folder, open_folder
from ..dcp.reader import Reader
from ..format.byte_runs import nbytes
from ..format.manifest import Manifest

__all__ = ["OpenCheckpoint", "open_checkpoint"]


class OpenCheckpoint:
    """A checkpoint opened for reading in this process: metadata read once."""

    def __init__(
        self,
        path: str | os.PathLike | Folder,
        *,
        verify: bool = True,
        storage_options: dict[str, Any] | None = None,
        extension_registry: Any = None,
    ) -> None:
        self.folder = open_folder(path, storage_options)
        self.path: Path | str = self.folder.checkpoint_id
        self.reader = Reader(self.folder, extension_registry, verify=verify)
        self.metadata = self.reader.read_metadata()
        self.reader.set_up_storage_reader(self.metadata, True)

    @property
    def manifest(self) -> Manifest | None:
        return self.reader.manifest

    @property
    def bytes_read(self) -> int:
        """Bytes read from data files so far: of each region, its byte runs, widened
        (when verifying) to the checksum tiles that cover them."""
        return self.reader.bytes_read

    def tensor_keys(self) -> list[str]:
        return [
            k
            for k, md in self.metadata.state_dict_metadata.items()
            if isinstance(md, TensorStorageMetadata)
        ]

    def object_keys(self) -> list[str]:
        return [
            k
            for k, md in self.metadata.state_dict_metadata.items()
            if not isinstance(md, TensorStorageMetadata)
        ]

    def tensor_metadata(self, fqn: str) -> TensorStorageMetadata:
        md = self.metadata.state_dict_metadata.get(fqn)
        if md is None:
            raise KeyError(f"no tensor '{fqn}' in {self.path}")
        if not isinstance(md, TensorStorageMetadata):
            raise KeyError(f"'{fqn}' in {self.path} is a Python object, not a tensor")
        return md

    def tensor_nbytes(self, fqn: str) -> int:
        """Bytes of tensor `fqn` whole, from its metadata."""
        md = self.tensor_metadata(fqn)
        return nbytes(tuple(md.size), md.properties.dtype)

    def read(self, fqn: str, region: Block | None = None) -> torch.Tensor:
        """Tensor `fqn`, or only `region` of it (global coordinates): only those bytes are
        read (with verification, each chunk's tile-aligned box enclosing the region)."""
        md = self.tensor_metadata(fqn)
        shape = tuple(md.size)
        if region is None:
            region = Block((0,) * len(shape), shape)
        if region.ndim != len(shape) or any(e > s for e, s in zip(region.ends, shape)):
            raise LayoutError(f"region {region} is out of bounds of '{fqn}' with shape {shape}")
        items = []
        filled = 0
        for chunk in dict.fromkeys(  # exact replicas read once
            Block(tuple(c.offsets), tuple(c.sizes)) for c in md.chunks
        ):
            overlap = chunk.intersect(region)
            if overlap is None:
                continue
            filled += overlap.numel
            items.append(
                ReadItem(
                    type=LoadItemType.TENSOR,
                    dest_index=MetadataIndex(fqn, region.offsets),
                    dest_offsets=torch.Size(overlap.relative_to(region).offsets),
                    storage_index=MetadataIndex(fqn, torch.Size(chunk.offsets)),
                    storage_offsets=torch.Size(overlap.relative_to(chunk).offsets),
                    lengths=torch.Size(overlap.sizes),
                )
            )
        if filled != region.numel:  # the records were checked: never, but never a hole either
            raise CorruptCheckpointError(
                f"'{fqn}' in {self.path}: the stored chunks fill {filled} of the "
                f"{region.numel} elements of {region}; refused (a hole is never returned)"
            )
        out = torch.empty(region.sizes, dtype=md.properties.dtype)
        # Tensor items only: the planner calls made are the two `_IntoTensor` has.
        self.reader.read_data(LoadPlan(items), cast(LoadPlanner, _IntoTensor(out))).wait()
        return out

    def object_bytes(self, fqn: str) -> bytes:
        """The stored bytes of object `fqn`, verified, not unpickled."""
        info = self.reader.storage_data[MetadataIndex(fqn)]
        f = self.folder.open(info.relative_path)
        try:
            data = f.pread(info.length, info.offset)
        finally:
            f.close()
        self.reader.bytes_read += len(data)
        entry = self.manifest.objects.get(fqn) if self.manifest else None
        if len(data) != info.length or (entry is not None and crc32c.crc32c(data) != entry.crc32c):
            raise CorruptCheckpointError(
                f"object '{fqn}' in {self.folder.where(info.relative_path)} is damaged"
            )
        return data


def open_checkpoint(
    path: str | os.PathLike | Folder,
    *,
    verify: bool = True,
    storage_options: dict[str, Any] | None = None,
    extension_registry: Any = None,
) -> OpenCheckpoint:
    """A checkpoint opened for reading in one process (no process group); `path` may
    be an fsspec URL, `storage_options` its backend's options; `extension_registry`
    (DCP's `ExtensionRegistry`) decodes records written through custom stream extensions."""
    return OpenCheckpoint(
        path,
        verify=verify,
        storage_options=storage_options,
        extension_registry=extension_registry,
    )


class _IntoTensor:
    """The two LoadPlanner calls `Reader.read_data` makes, aimed at one tensor."""

    def __init__(self, out: torch.Tensor) -> None:
        self.out = out

    def resolve_tensor(self, req: ReadItem) -> torch.Tensor:
        return self.out[tuple(slice(o, o + n) for o, n in zip(req.dest_offsets, req.lengths))]

    def commit_tensor(self, req: ReadItem, tensor: torch.Tensor) -> None:
        pass
