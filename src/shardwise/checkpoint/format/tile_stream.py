"""Tile checksums of a payload that arrives in pieces: a chunk staged through bounded
host buffers is checksummed as each buffer lands, never whole in memory at once.

`TileHasher` gives exactly what `tiles.checksum_payload` gives for the whole
payload (the same tile shape, the same crc32c per tile), whatever the piece
boundaries: the writer's tiles (`tiles.tile_shape`) are contiguous and back to
back in memory order, so their byte lengths are a fixed sequence and a tile cut
by a piece boundary continues its crc32c in the next piece.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import crc32c

from ...errors import InvalidArgumentError
from .tiles import TILE_BYTES, Shape, tile_shape

__all__ = ["TileHasher", "tile_lengths"]


def tile_lengths(shape: Sequence[int], itemsize: int, tile: Sequence[int]) -> Iterator[int]:
    """The byte length of each tile of a writer-tiled payload, in memory order."""
    shape, tile = tuple(shape), tuple(tile)
    total = math.prod(shape) * itemsize
    if tile == shape:
        yield total
        return
    # `tile_shape`'s form: 1 before dimension k, whole after it (so each tile is contiguous)
    k = next((d for d, t in enumerate(tile) if t != 1), len(tile) - 1)
    inner = math.prod(shape[k + 1 :]) * itemsize
    row, step = shape[k] * inner, tile[k] * inner
    cuts = [min(step, row - a) for a in range(0, row, step)]
    for _ in range(total // row if row else 0):
        yield from cuts


class TileHasher:
    """crc32c per tile of a C-order payload of `shape` fed in consecutive pieces."""

    __slots__ = ("tile", "crcs", "_lengths", "_left", "_crc", "_fed", "_total")

    def __init__(self, shape: Sequence[int], itemsize: int) -> None:
        shape = tuple(shape)
        self._total = math.prod(shape) * itemsize
        self.tile: Shape = (
            shape if self._total <= TILE_BYTES else tile_shape(shape, itemsize)
        )  # as `checksum_payload` picks it
        self.crcs: list[int] = []
        self._lengths = tile_lengths(shape, itemsize, self.tile)
        self._left = next(self._lengths, 0)
        self._crc = 0
        self._fed = 0

    def update(self, data: memoryview | bytes) -> None:
        """Feed the next `len(data)` bytes of the payload."""
        view = memoryview(data).cast("B")
        self._fed += len(view)
        if self._fed > self._total:
            raise InvalidArgumentError(
                f"fed {self._fed} bytes to the checksums of a {self._total}-byte payload"
            )
        at, n = 0, len(view)
        crc = crc32c.crc32c
        while at < n:
            take = min(self._left, n - at)
            self._crc = crc(view[at : at + take], self._crc)
            at += take
            self._left -= take
            if self._left == 0:
                self.crcs.append(self._crc)
                self._crc = 0
                self._left = next(self._lengths, 0)

    def result(self) -> tuple[Shape, list[int]]:
        """(tile shape, crc32c of each tile), once the whole payload was fed."""
        if self._fed != self._total:
            raise InvalidArgumentError(
                f"checksums asked after {self._fed} of a {self._total}-byte payload"
            )
        if self._total == 0:  # an empty payload is one empty tile, as `checksum_payload` says
            return self.tile, [0]
        return self.tile, self.crcs
