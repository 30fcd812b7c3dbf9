"""Whole stored chunks of one file read by one `preadv` each span, straight into their targets.

The fast path of every load: a target piece that is exactly a stored chunk takes
the chunk's payload bytes in its own memory (when it is contiguous, on the CPU
and of the stored dtype; else scratch it is copied from: a pinned stand-in for
a device target, `device_landing`). Chunks closer than
`GAP` in a file share one read, the small frames between them landing in
scratch. Each payload is then verified against its checksums by the same
functions a ranged read uses (`box_read.check_whole`).
"""

from __future__ import annotations

from collections.abc import Callable

import crc32c
import torch

from ...errors import CorruptCheckpointError
from ...storage import RandomAccess
from ..format.checksums import byte_view
from ..format.manifest import StoredChunk
from ..format.record_read import RecordLayout
from .box_read import check_whole
from .read_requests import ChunkRead

__all__ = ["GAP", "Placed", "Whole", "read_span", "whole_spans"]

GAP = 64 << 10  # chunks closer than this in a file are read by one preadv, gap and all
_SPAN_IOVECS = 1024

Whole = tuple[ChunkRead, RecordLayout]
Placed = tuple[ChunkRead, torch.Tensor, torch.Tensor]  # read, its target, what took the bytes


def whole_spans(batch: list[Whole], limit: int) -> list[tuple[int, int, list[Whole]]]:
    """Whole chunks of one file as `(start, end, chunks)` spans, by offset: neighbours
    within `GAP` share one while it stays within `limit` bytes (what one staging slab
    holds, for device targets), a chunk far from (or overlapping: damaged) the last
    starts the next."""
    batch = sorted(batch, key=lambda b: b[1].payload_offset)
    out = []
    start = 0
    while start < len(batch):
        end = start
        lo = pos = batch[start][1].payload_offset
        while end < len(batch) and end - start < (_SPAN_IOVECS - 1) // 2:
            at, n = batch[end][1].payload_offset, batch[end][1].payload_length
            if end > start and (at < pos or at - pos > GAP or at + n - lo > limit):
                break
            pos = at + n
            end += 1
        out.append((lo, pos, batch[start:end]))
        start = end
    return out


def read_span(
    file: RandomAccess,
    where: str,
    span: list[Whole],
    lo: int,
    resolve: Callable[[ChunkRead], torch.Tensor],
    verify: bool,
    scratch: Callable[[torch.Tensor, RecordLayout], torch.Tensor],
) -> tuple[int, list[Placed]]:
    """Read one span (`resolve` gives each chunk's target), verify each payload; the
    bytes read, and where each chunk's bytes went (its target, or `scratch` — a
    stand-in for a device target — to copy from)."""
    buffers: list[memoryview] = []
    placed: list[tuple[ChunkRead, torch.Tensor, torch.Tensor, memoryview]] = []
    pos = lo
    for read, layout in span:
        at = layout.payload_offset
        if at > pos:
            buffers.append(memoryview(bytearray(at - pos)))
        target = resolve(read)
        direct = (
            target.device.type == "cpu" and target.is_contiguous() and target.dtype == layout.dtype
        )
        dest = target if direct else scratch(target, layout)
        view = byte_view(dest) if dest.numel() else memoryview(b"")
        if layout.payload_length < len(view):  # `record_read` refuses it: never trusted here
            raise CorruptCheckpointError(
                f"'{read.name}' in {where}: its payload holds {layout.payload_length} bytes, "
                f"its chunk needs {len(view)}"
            )
        buffers.append(view)
        placed.append((read, target, dest, view))
        pos = at + len(view)  # exactly the chunk's bytes: the target's size, not the record's
    got = file.readinto(buffers, lo) if pos > lo else 0
    if got != pos - lo:
        raise CorruptCheckpointError(f"{where}: short read of bytes {lo}..{pos}: truncated")
    for read, _target, _dest, view in placed:
        if verify and isinstance(read.info, StoredChunk):
            _check(read.name, read.info, view, where)
    return got, [(read, target, dest) for read, target, dest, _view in placed]


def _check(name: str, chunk: StoredChunk, view: memoryview, where: str) -> None:
    crcs = chunk.crcs
    if crcs is not None and len(crcs) == 1 and chunk.tile in (None, chunk.sizes):
        if crc32c.crc32c(view) == crcs[0]:  # one tile or page: the whole payload
            return
    check_whole(view, chunk, where, name)
