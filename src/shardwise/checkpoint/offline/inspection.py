"""`inspect`: what a checkpoint holds, from its metadata alone, for people and scripts.

No data is read: dtypes, shapes, sizes and how each tensor is cut into chunks,
for shardwise and stock DCP checkpoints alike.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...layout import Block
from ..format import dtype_name
from .opening import open_checkpoint

__all__ = ["CheckpointInfo", "TensorInfo", "describe_sharding", "inspect"]


@dataclass
class TensorInfo:
    """One stored tensor as `inspect` reports it: dtype, global shape, chunks, bytes."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    chunks: int
    nbytes: int
    sharding: str


@dataclass
class CheckpointInfo:
    """What `inspect` returns: the checkpoint's kind, format and tensors."""

    path: Path | str
    kind: str  # "shardwise" or "stock DCP"
    format_version: int | None
    world_size: int | None
    tensors: list[TensorInfo] = field(default_factory=list)
    objects: list[str] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def to_json(self) -> dict[str, Any]:
        return {
            "path": str(self.path),
            "kind": self.kind,
            "format_version": self.format_version,
            "world_size": self.world_size,
            "bytes": self.nbytes,
            "tensors": {
                t.key: {
                    "dtype": t.dtype,
                    "shape": list(t.shape),
                    "chunks": t.chunks,
                    "bytes": t.nbytes,
                    "sharding": t.sharding,
                }
                for t in self.tensors
            },
            "objects": self.objects,
        }


def describe_sharding(shape: tuple[int, ...], chunks: list[Block]) -> str:
    """How a tensor's chunks cut it, in words: whole, row-wise, column-wise, grid, blocks."""
    if len(chunks) == 1 and chunks[0].sizes == shape:
        return "whole"
    cut = sorted({d for c in chunks for d in range(len(shape)) if c.sizes[d] != shape[d]})
    if len(cut) == 1:
        d = cut[0]
        sizes = {c.sizes[d] for c in chunks}
        name = {0: "row-wise", 1: "column-wise"}.get(d, f"along dim {d}")
        return f"{name}, {len(chunks)} parts" + (" (uneven)" if len(sizes) > 1 else "")
    parts = [len({c.offsets[d] for c in chunks}) for d in cut]
    if math.prod(parts) == len(chunks):
        return "grid " + "x".join(map(str, parts)) + f" over dims {cut}"
    return f"{len(chunks)} blocks"


def inspect(
    path: str | os.PathLike, *, storage_options: dict[str, Any] | None = None
) -> CheckpointInfo:
    """What a checkpoint holds, from its metadata alone (no data read); `path` may be
    an fsspec URL, `storage_options` its backend's options."""
    ckpt = open_checkpoint(path, storage_options=storage_options)
    m = ckpt.manifest
    info = CheckpointInfo(
        ckpt.path,
        "shardwise" if m else "stock DCP",
        m.version if m else None,
        m.world_size if m else None,
    )
    for key in ckpt.tensor_keys():
        md = ckpt.tensor_metadata(key)
        shape = tuple(md.size)
        blocks = [Block(tuple(c.offsets), tuple(c.sizes)) for c in md.chunks]
        info.tensors.append(
            TensorInfo(
                key,
                dtype_name(md.properties.dtype),
                shape,
                len(blocks),
                ckpt.tensor_nbytes(key),
                describe_sharding(shape, blocks),
            )
        )
    info.tensors.sort(key=lambda t: t.key)
    info.objects = sorted(ckpt.object_keys())
    return info
