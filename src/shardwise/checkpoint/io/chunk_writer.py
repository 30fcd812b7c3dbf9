"""Writing a data file item by item: the one path by which `Writer` and `reshard` store chunks.

Both frame each tensor as a `torch.save` record, write it straight from the
tensor's memory, checksum its tiles while they are in cache, and record where
it went; doing that in one place keeps their files and manifests identical.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import crc32c
import torch

from ...storage import Folder, open_folder
from ..format.checksums import byte_view, frame_crc
from ..format.manifest import ChunkEntry, ObjectEntry
from ..format.record_write import tensor_record
from ..format.tiles import checksum_payload

__all__ = ["DataFile", "Written", "payload_checksums"]


@dataclass(frozen=True)
class Written:
    """Where one item went in a data file, and its checksums: what the manifest records."""

    file: str
    offset: int
    length: int
    crcs: list[int]  # of the payload's tiles (pages when `tile` is None); one, of the whole range,
    # for an object or a transformed record
    payload: tuple[int, int] | None = None  # a tensor record's raw C-order bytes
    frame: int = 0  # crc32c of a tensor record's bytes around its payload
    tile: tuple[int, ...] | None = None  # the tile shape of `crcs`; None: pages, or one crc

    def chunk_entry(
        self, offsets: tuple[int, ...], sizes: tuple[int, ...], transform: list[str] | None = None
    ) -> ChunkEntry:
        return ChunkEntry(
            offsets,
            sizes,
            self.file,
            (self.offset, self.length),
            self.payload,
            self.crcs,
            self.frame,
            transform,
            self.tile,
        )

    def object_entry(self, transform: list[str] | None = None) -> ObjectEntry:
        return ObjectEntry(self.file, self.offset, self.length, self.crcs[0], transform)


def payload_checksums(tensor: torch.Tensor) -> tuple[tuple[int, ...], list[int]]:
    """(tile shape, crc32c of each tile) of a contiguous CPU tensor's payload, read in
    place: what the manifest records for the chunk it is stored as."""
    if not tensor.is_contiguous() or tensor.device.type != "cpu":
        raise ValueError("payload_checksums needs a contiguous CPU tensor")
    plain = tensor.resolve_conj().resolve_neg()  # the values, as `tensor_record` stores them
    payload = byte_view(plain) if plain.numel() else memoryview(b"")
    return checksum_payload(payload, tuple(plain.shape), plain.element_size())


class DataFile:
    """A new data file in `folder`, filled with items in order, then synced and closed.

    It is created exclusively: a save never changes a file it did not write. On an
    object store it becomes visible only when closed without an error."""

    def __init__(self, folder: Folder | str | os.PathLike, name: str) -> None:
        self.name = name
        self.pos = 0
        self._sink = open_folder(folder).create(name)

    def __enter__(self) -> DataFile:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if kind is None:
            self._sink.close(sync=False)  # a no-op after `sync`
        else:
            self._sink.abort()

    def sync(self) -> None:
        """Make the file durable (fsync; on an object store, complete the upload)."""
        self._sink.close(sync=True)

    def write_object(self, data: Any) -> Written:
        """Bytes stored as they are (a pickled object), with one checksum."""
        self._sink.write([data])
        return self._advance(len(data), [crc32c.crc32c(data)])

    def write_tensor(self, tensor: torch.Tensor, serialization_id: str = "0" * 40) -> Written:
        """A contiguous CPU tensor as the `torch.save` record stock DCP reads, its
        payload written from the tensor's memory (`writev`, no copy) and checksummed
        tile by tile (`tiles`)."""
        head, payload, tail = tensor_record(tensor, serialization_id)
        self._sink.write([head, payload, tail])
        tile, crcs = checksum_payload(payload, tuple(tensor.shape), tensor.element_size())
        payload_at = (self.pos + len(head), len(payload))
        length = len(head) + len(payload) + len(tail)
        return self._advance(length, crcs, payload_at, frame_crc(head, tail), tile)

    def _advance(
        self,
        length: int,
        crcs: list[int],
        payload: tuple[int, int] | None = None,
        frame: int = 0,
        tile: tuple[int, ...] | None = None,
    ) -> Written:
        written = Written(self.name, self.pos, length, crcs, payload, frame, tile)
        self.pos += length
        return written
