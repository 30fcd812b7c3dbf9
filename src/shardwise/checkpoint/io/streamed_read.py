"""A whole chunk larger than a staging slab, read into a device target slab by slab.

Each slab-sized piece of the payload is read into a pinned stand-in
(`device_landing`), checksummed as it comes (`TileHasher`: the same tiles the
writer took) and sent to its place in the target on the side stream while the
next piece is read. Host memory stays within the slabs however large the
chunk. The target holds the bytes before they are all verified (as a direct
read into a host target does); a failed tile raises `CorruptCheckpointError`
naming the tensor, the file and the bytes.
"""

from __future__ import annotations

import torch

from ...errors import CorruptCheckpointError
from ...storage import RandomAccess
from ..format.checksums import byte_view
from ..format.manifest import StoredChunk
from ..format.record_read import RecordLayout
from ..format.tile_stream import TileHasher, tile_lengths
from .device_landing import DeviceLanding

__all__ = ["can_stream", "read_streamed"]


def can_stream(
    chunk: StoredChunk | None, layout: RecordLayout, target: torch.Tensor, verify: bool
) -> bool:
    """Whether a whole chunk can go to `target` piecewise: a contiguous target of the
    stored dtype, and checksums (if any are checked) in the writer's tiles."""
    if not (target.is_contiguous() and target.dtype == layout.dtype and layout.c_contiguous):
        return False
    if not verify or chunk is None or chunk.crcs is None or chunk.payload is None:
        return True
    tile = TileHasher(layout.shape, layout.dtype.itemsize).tile
    return chunk.tile is not None and tuple(chunk.tile) == tile


def read_streamed(
    file: RandomAccess,
    where: str,
    name: str,
    chunk: StoredChunk | None,
    layout: RecordLayout,
    target: torch.Tensor,
    landing: DeviceLanding,
    verify: bool,
) -> int:
    """Read the chunk's payload into `target` (`can_stream` holds); the bytes read."""
    checked = verify and chunk is not None and chunk.crcs is not None and chunk.payload is not None
    hasher = TileHasher(layout.shape, layout.dtype.itemsize) if checked else None
    flat = target.view(-1).view(torch.uint8) if target.numel() else target
    total, piece, at = flat.numel(), landing.slab_bytes, 0
    while at < total:
        n = min(piece, total - at)
        host = landing.stand_in((n,), torch.uint8)
        staged = host is not None
        if host is None:  # every slab is held by other reads: this piece goes through scratch
            host = torch.empty(n, dtype=torch.uint8)
        view = byte_view(host)
        got = file.readinto([view], layout.payload_offset + at)
        if got != n:
            raise CorruptCheckpointError(
                f"'{name}': short read of bytes {layout.payload_offset + at}.."
                f"{layout.payload_offset + at + n} of {where}: truncated"
            )
        if hasher is not None:
            hasher.update(view)
        if staged:
            landing.send(flat[at : at + n], host)
        else:
            landing.copy(flat[at : at + n], host)
        at += n
    if hasher is not None and chunk is not None and chunk.crcs is not None:
        _check(hasher, chunk, layout, where, name)
    return total


def _check(
    hasher: TileHasher, chunk: StoredChunk, layout: RecordLayout, where: str, name: str
) -> None:
    tile, crcs = hasher.result()
    expected = list(chunk.crcs or [])
    if crcs == expected:
        return
    bad = next((k for k, (a, b) in enumerate(zip(crcs, expected)) if a != b), len(crcs))
    start = length = 0
    for k, length in enumerate(tile_lengths(layout.shape, layout.dtype.itemsize, tile)):
        if k == bad:
            break
        start += length
    lo = layout.payload_offset + start
    raise CorruptCheckpointError(
        f"'{name}': bytes {lo}..{lo + length} of {where} fail their checksum"
    )
