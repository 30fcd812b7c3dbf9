"""The entries of `shardwise.json` as Python values, and the format versions.

What the field tables (`manifest_fields`) decode a manifest into and encode from;
kept apart from the tables so the fast path (`fast_entries`) and the readers can
build them without the table machinery.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ...errors import CorruptCheckpointError

FORMAT = "shardwise.checkpoint"
VERSION = 5  # the version written
# the versions read; 2 added transforms, planner data, storage_meta, requires_grad;
# 3 replaced pages of `page_size` with tiles (a chunk's `tile` and `tiles`);
# 4 moved the chunks into binary sections of an index file (`chunk_table`);
# 5 let a chunk's checksums stay in its data file, with its writer (`crc_at`)
READS = (1, 2, 3, 4, 5)
INLINE = 3  # the newest version listing chunks in the manifest itself (`Manifest.to_json`)
INDEXED = 4  # the first version holding chunks in an index file
MANIFEST = "shardwise.json"
PAGE_SIZE = 1 << 20  # payload bytes per checksum page (format versions 1 and 2)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


_DTYPES: dict[str, torch.dtype] = {}  # one lookup per tensor of a load: 100,000 at scale


def dtype_from_name(name: str) -> torch.dtype:
    dtype = _DTYPES.get(name)
    if dtype is None:
        found = getattr(torch, name, None)
        if not isinstance(found, torch.dtype):
            raise CorruptCheckpointError(f"unknown dtype {name!r} in {MANIFEST}")
        dtype = _DTYPES[name] = found
    return dtype


@dataclass(slots=True)
class ChunkEntry:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    record: tuple[int, int]  # the torch.save record: offset, length (what stock reads)
    payload: tuple[int, int] | None  # the raw C-order bytes inside it; None when transformed
    # crc32c of each tile of the payload (`tile` set, v3), or of each page (v1, v2);
    # when transformed, one crc32c of the whole record
    crcs: list[int]
    frame: int = 0  # crc32c of the record's bytes before and after the payload
    transform: list[str] | None = None  # DCP stream-transform descriptors (e.g. zstd)
    tile: tuple[int, ...] | None = None  # the tile shape (v3); None: pages, or transformed
    # v5: where its frame and `crcs` are in its data file (its writer put them there);
    # -1: in the index, with the chunk's row
    crc_at: int = -1


@dataclass(slots=True)
class ObjectEntry:
    file: str
    offset: int
    length: int
    crc32c: int
    transform: list[str] | None = None


@dataclass(slots=True)
class TensorEntry:
    dtype: str
    shape: tuple[int, ...]
    chunks: list[ChunkEntry] = field(default_factory=list)
    requires_grad: bool = False  # DCP's TensorProperties field, kept for stock parity
    # v4: where its chunks are in the index (block, offset, length, rows, crc32c), and
    # the transforms its rows name by position; `chunks` is filled only when read whole
    section: tuple[int, int, int, int, int] | None = None
    transforms: list[list[str]] = field(default_factory=list)


@dataclass
class IndexRef:
    """v4: the index file holding the tensors' sections, and where each block of it
    (one per writer of sections: an owner of keys) starts."""

    file: str
    blocks: list[int]
