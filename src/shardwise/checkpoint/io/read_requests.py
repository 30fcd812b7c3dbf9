"""What a read asks for, as plain data: the requests every reader hands the read executor.

`ChunkRead` is a box of one stored chunk bound for a target tensor; `RecordRead`
a stored record's bytes (an object, a transformed chunk, framing bytes) bound
for a callback; `GatherRead` the parts of many small chunks bound for one
target, as arrays (`format.row_boxes`). Planners (the load engine, `Reader`'s translation of DCP's
`ReadItem`s, the offline tools) make them; `read_executor` runs them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo

from ..format.row_boxes import Boxes

__all__ = ["ChunkRead", "GatherRead", "RecordRead", "end_of"]


@dataclass
class ChunkRead:
    """The box `offsets`/`lengths` of a stored chunk (of `shape` and `dtype`, stored as
    `info` says: a `StoredChunk` adds its payload and checksums) into `target`: a
    detached tensor, or a call that gives one just before the read (DCP's
    `resolve_tensor`); `done` is told once the target holds it."""

    name: str
    info: _StorageInfo
    shape: tuple[int, ...]
    dtype: torch.dtype
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    target: torch.Tensor | Callable[[], torch.Tensor]
    done: Callable[[torch.Tensor], None] | None = None


@dataclass
class RecordRead:
    """A stored record's bytes (an object's; a transformed chunk's, or any byte range, to
    verify), read whole, checked against its checksum, its stream extensions undone
    unless not to `decode`, handed to `use`."""

    name: str
    info: _StorageInfo
    use: Callable[[bytes], None]
    decode: bool = True


@dataclass
class GatherRead:
    """The parts `boxes` of small stored chunks (plain, one checksum tile each) into one
    target, given as its memory: `words`, flat, `factor` words an element, of `shape`
    in elements (`part_gather.words_of`)."""

    name: str
    words: np.ndarray
    factor: int
    shape: tuple[int, ...]
    boxes: Boxes


def end_of(info: _StorageInfo) -> int:
    """Where a stored record ends in its file."""
    return int(info.offset + info.length)
