"""Reading a checkpoint in one process, with no process group: what every offline tool builds on.

`open_checkpoint` reads the records once (`engine.stored`, as `swc.load`
does); `read` fetches a tensor or a region of it and `object_bytes` a stored
object's bytes, verified and never unpickled, both through the one read executor
(only the bytes of the region, widened to whole checksum tiles when verifying;
`bytes_read` counts them). Works on shardwise and stock DCP checkpoints alike.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ...errors import CorruptCheckpointError, LayoutError
from ...layout import Block
from ...storage import Folder, open_folder
from ..engine import StoredView, read_records
from ..format import Manifest, nbytes
from ..io import ArchiveRead, ChunkRead, ReadExecutor

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
        self._view = StoredView(self.folder, *read_records(self.folder, whole=True))
        self.metadata = self._view.metadata()
        self._executor = ReadExecutor(self.folder, verify=verify, registry=extension_registry)
        # called with the bytes of each tensor or region `read` returns: the offline
        # tools' progress, whatever reads through this checkpoint
        self.on_read: Callable[[int], None] | None = None

    @property
    def manifest(self) -> Manifest | None:
        return self._view.manifest

    @property
    def bytes_read(self) -> int:
        """Bytes read from data files so far: of each region, its byte runs, widened
        (when verifying) to the checksum tiles that cover them."""
        return self._executor.bytes_read

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
            raise KeyError(
                f"no tensor '{fqn}' in {self.path}; "
                + stored_keys_hint(fqn, self.tensor_keys(), "tensors")
            )
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
        out = torch.empty(region.sizes, dtype=md.properties.dtype)
        reads: list[ChunkRead | ArchiveRead] = []
        filled = 0
        boxes = {(offsets, sizes): info for offsets, sizes, info in self._view.chunks(fqn)}
        for (offsets, sizes), info in boxes.items():  # exact replicas read once
            overlap = Block(offsets, sizes).intersect(region)
            if overlap is None:
                continue
            filled += overlap.numel
            reads.append(
                ChunkRead(
                    fqn,
                    self._view.storage(fqn, info),
                    sizes,
                    md.properties.dtype,
                    overlap.relative_to(Block(offsets, sizes)).offsets,
                    overlap.sizes,
                    out[overlap.relative_to(region).slices()],
                )
            )
        if filled != region.numel:  # the records were checked: never, but never a hole either
            raise CorruptCheckpointError(
                f"'{fqn}' in {self.path}: the stored chunks fill {filled} of the "
                f"{region.numel} elements of {region}; refused (a hole is never returned)"
            )
        self._executor.run(reads)
        if self.on_read:
            self.on_read(out.nbytes)
        return out

    def object_bytes(self, fqn: str) -> bytes:
        """The stored bytes of object `fqn`, verified, not unpickled."""
        if not self._view.is_object(fqn):
            raise KeyError(
                f"no object '{fqn}' in {self.path}; "
                + stored_keys_hint(fqn, self.object_keys(), "objects")
            )
        got: list[bytes] = []
        self._executor.run([ArchiveRead(fqn, self._view.object_info(fqn), got.append)])
        return got[0]


KEYS_SHOWN = 10  # a message lists this many of a checkpoint's keys, not 100,000


def stored_keys_hint(key: str, stored: Sequence[str], what: str = "keys") -> str:
    """What to say when `key` is not among `stored`: the likeliest typos' targets
    (`difflib`), then the first `KEYS_SHOWN` stored keys and how many more there are."""
    near = difflib.get_close_matches(str(key), list(stored), n=3)
    hint = f"did you mean {' or '.join(repr(k) for k in near)}? " if near else ""
    return hint + (f"its {what}: {listed(stored)}" if stored else f"it stores no {what}")


def listed(keys: Sequence[str]) -> str:
    """The first `KEYS_SHOWN` of `keys`, quoted, then how many more there are."""
    shown = ", ".join(repr(k) for k in keys[:KEYS_SHOWN])
    return shown + (f", ... and {len(keys) - KEYS_SHOWN} more" if len(keys) > KEYS_SHOWN else "")


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
