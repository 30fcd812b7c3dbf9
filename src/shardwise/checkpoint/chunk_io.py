"""Writing a data file item by item: the one path by which `Writer` and `reshard` store chunks.

Both frame each tensor as a `torch.save` record, write it straight from the
tensor's memory, checksum its pages while they are in cache, and record where
it went; doing that in one place keeps their files and manifests identical.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import crc32c
import torch

from .file_io import frame_crc, pages_of, write_all
from .manifest import ChunkEntry, ObjectEntry
from .record_write import tensor_record

__all__ = ["DataFile", "Written"]


@dataclass(frozen=True)
class Written:
    """Where one item went in a data file, and its checksums: what the manifest records."""

    file: str
    offset: int
    length: int
    pages: list[int]  # of the payload; one, of the whole range, for an object
    payload: tuple[int, int] | None = None  # a tensor record's raw C-order bytes
    frame: int = 0  # crc32c of a tensor record's bytes around its payload

    def chunk_entry(
        self, offsets: tuple[int, ...], sizes: tuple[int, ...], transform: list[str] | None = None
    ) -> ChunkEntry:
        return ChunkEntry(
            offsets,
            sizes,
            self.file,
            (self.offset, self.length),
            self.payload,
            self.pages,
            self.frame,
            transform,
        )

    def object_entry(self, transform: list[str] | None = None) -> ObjectEntry:
        return ObjectEntry(self.file, self.offset, self.length, self.pages[0], transform)


class DataFile:
    """A new data file in `folder`, filled with items in order, then synced and closed.

    It is created exclusively: a save never changes a file it did not write."""

    def __init__(self, folder: Path, name: str) -> None:
        self.name = name
        self.pos = 0
        self._fd = os.open(folder / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)

    def __enter__(self) -> DataFile:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        os.close(self._fd)

    def sync(self) -> None:
        os.fsync(self._fd)

    def write_object(self, data: Any) -> Written:
        """Bytes stored as they are (a pickled object), with one checksum."""
        write_all(self._fd, [data])
        return self._advance(len(data), [crc32c.crc32c(data)])

    def write_tensor(self, tensor: torch.Tensor, serialization_id: str = "0" * 40) -> Written:
        """A contiguous CPU tensor as the `torch.save` record stock DCP reads, its
        payload written from the tensor's memory (`writev`, no copy)."""
        head, payload, tail = tensor_record(tensor, serialization_id)
        write_all(self._fd, [head, payload, tail])
        payload_at = (self.pos + len(head), len(payload))
        length = len(head) + len(payload) + len(tail)
        return self._advance(length, pages_of(payload), payload_at, frame_crc(head, tail))

    def _advance(
        self, length: int, pages: list[int], payload: tuple[int, int] | None = None, frame: int = 0
    ) -> Written:
        written = Written(self.name, self.pos, length, pages, payload, frame)
        self.pos += length
        return written
