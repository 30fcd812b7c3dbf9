"""`shardwise.json`: the plain-JSON description of a checkpoint (see docs/format.md).

It lists every tensor's dtype, global shape and chunks (file, byte ranges,
checksums) and every stored object, so that loading a shardwise checkpoint
never unpickles DCP's `.metadata`, and tools can inspect or verify it with a
JSON parser. It is written last: its presence marks a committed checkpoint.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import crc32c
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from ..errors import CorruptCheckpointError

__all__ = ["MANIFEST", "MARKER", "ChunkEntry", "Manifest", "ObjectEntry", "PAGE_SIZE"]

MANIFEST = "shardwise.json"
MARKER = ".shardwise"  # written first: a folder with it but no manifest is incomplete
FORMAT = "shardwise.checkpoint"
VERSION = 1
PAGE_SIZE = 1 << 20  # payload bytes per checksum page


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CorruptCheckpointError(f"unknown dtype {name!r} in {MANIFEST}")
    return dtype


@dataclass
class ChunkEntry:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    record: tuple[int, int]  # the torch.save record: offset, length (what stock reads)
    payload: tuple[int, int]  # the raw C-order bytes inside it: offset, length
    pages: list[int]  # crc32c of each PAGE_SIZE slice of the payload
    frame: int = 0  # crc32c of the record's bytes before and after the payload


@dataclass
class ObjectEntry:
    file: str
    offset: int
    length: int
    crc32c: int


@dataclass
class TensorEntry:
    dtype: str
    shape: tuple[int, ...]
    chunks: list[ChunkEntry] = field(default_factory=list)


@dataclass
class Manifest:
    world_size: int
    tensors: dict[str, TensorEntry] = field(default_factory=dict)
    objects: dict[str, ObjectEntry] = field(default_factory=dict)
    page_size: int = PAGE_SIZE
    metadata_crc32c: int = 0  # of DCP's .metadata, for `verify`

    def to_json(self) -> str:
        """Canonical JSON whose "crc32c" field checksums the document itself."""
        doc = self._to_dict()
        doc["crc32c"] = crc32c.crc32c(json.dumps(doc, separators=(",", ":")).encode())
        return json.dumps(doc, separators=(",", ":"))

    def _to_dict(self) -> dict[str, Any]:
        return {
                "format": FORMAT,
                "version": VERSION,
                "world_size": self.world_size,
                "checksum": "crc32c",
                "page_size": self.page_size,
                "metadata_crc32c": self.metadata_crc32c,
                "tensors": {
                    k: {
                        "dtype": t.dtype,
                        "shape": list(t.shape),
                        "chunks": [
                            {
                                "offsets": list(c.offsets),
                                "sizes": list(c.sizes),
                                "file": c.file,
                                "record": list(c.record),
                                "payload": list(c.payload),
                                "pages": c.pages,
                                "frame": c.frame,
                            }
                            for c in t.chunks
                        ],
                    }
                    for k, t in self.tensors.items()
                },
                "objects": {
                    k: {"file": o.file, "offset": o.offset, "length": o.length, "crc32c": o.crc32c}
                    for k, o in self.objects.items()
                },
                "crc32c": 0,
        }

    @classmethod
    def read(cls, folder: Path) -> Manifest:
        path = folder / MANIFEST
        try:
            data = json.loads(path.read_bytes())
            if not isinstance(data, dict):
                raise ValueError("not a JSON object")
            stored = data.get("crc32c")
            data["crc32c"] = 0
            # no indent: keeps json's C encoder (10x faster); canonical, so re-encoding is exact
            if crc32c.crc32c(json.dumps(data, separators=(",", ":")).encode()) != stored:
                raise ValueError("its checksum does not match its contents (damaged)")
            if data.get("format") != FORMAT:
                raise ValueError(f"format is {data.get('format')!r}, not {FORMAT!r}")
            if data.get("version") != VERSION:
                raise ValueError(f"version {data.get('version')!r} is not supported (reads {VERSION})")
            out = cls(
                world_size=int(data["world_size"]), page_size=int(data["page_size"]),
                metadata_crc32c=int(data["metadata_crc32c"]),
            )
            if out.page_size <= 0:
                raise ValueError(f"page size {out.page_size}")
            for k, t in data["tensors"].items():
                entry = TensorEntry(t["dtype"], tuple(int(s) for s in t["shape"]))
                dtype_from_name(entry.dtype)
                for c in t["chunks"]:
                    entry.chunks.append(
                        ChunkEntry(
                            tuple(int(o) for o in c["offsets"]),
                            tuple(int(s) for s in c["sizes"]),
                            _safe_name(c["file"]),
                            _pair(c["record"]),
                            _pair(c["payload"]),
                            [int(p) for p in c["pages"]],
                            int(c["frame"]),
                        )
                    )
                out.tensors[k] = entry
            for k, o in data["objects"].items():
                out.objects[k] = ObjectEntry(
                    _safe_name(o["file"]), _nonneg(o["offset"]), _nonneg(o["length"]), int(o["crc32c"])
                )
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise CorruptCheckpointError(f"{path}: unreadable manifest: {e}") from e
        out._check_geometry(path)
        out._check_files(folder)
        return out

    def _check_files(self, folder: Path) -> None:
        """Every byte range lies inside its file: nothing past the end is read, and
        no size taken from the manifest is trusted beyond what is on disk."""
        sizes: dict[str, int] = {}
        ranges = [(k, c.file, c.record) for k, t in self.tensors.items() for c in t.chunks]
        ranges += [(k, o.file, (o.offset, o.length)) for k, o in self.objects.items()]
        for key, name, (offset, length) in ranges:
            if name not in sizes:
                try:
                    sizes[name] = (folder / name).stat().st_size
                except OSError as e:
                    raise CorruptCheckpointError(f"'{key}': data file {folder / name} is missing") from e
            if offset + length > sizes[name]:
                raise CorruptCheckpointError(
                    f"'{key}': bytes {offset}..{offset + length} lie past the end of {folder / name} "
                    f"({sizes[name]} bytes): truncated or damaged"
                )

    def _check_geometry(self, path: Path) -> None:
        for k, t in self.tensors.items():
            itemsize = torch.empty((), dtype=dtype_from_name(t.dtype)).element_size()
            for c in t.chunks:
                nbytes = math.prod(c.sizes) * itemsize
                if (
                    len(c.offsets) != len(t.shape)
                    or len(c.sizes) != len(t.shape)
                    or any(o + s > n for o, s, n in zip(c.offsets, c.sizes, t.shape))
                    or c.payload[1] != nbytes
                    or not c.record[0] <= c.payload[0] <= c.payload[0] + c.payload[1] <= sum(c.record)
                    or len(c.pages) != max(1, -(-nbytes // self.page_size))
                ):
                    raise CorruptCheckpointError(
                        f"{path}: chunk at offsets {c.offsets} of '{k}' has inconsistent sizes or "
                        f"byte ranges (file {c.file}, payload {c.payload})"
                    )

    def to_metadata(self) -> Metadata:
        """The DCP `Metadata` this manifest describes, built without unpickling."""
        state: dict[str, Any] = {}
        storage: dict[MetadataIndex, _StorageInfo] = {}
        for k, t in self.tensors.items():
            state[k] = TensorStorageMetadata(
                properties=TensorProperties(dtype=dtype_from_name(t.dtype)),
                size=torch.Size(t.shape),
                chunks=[ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(c.sizes)) for c in t.chunks],
            )
            for c in t.chunks:
                storage[MetadataIndex(k, c.offsets)] = _StorageInfo(c.file, c.record[0], c.record[1])
        for k, o in self.objects.items():
            state[k] = BytesStorageMetadata()
            storage[MetadataIndex(k)] = _StorageInfo(o.file, o.offset, o.length)
        return Metadata(state_dict_metadata=state, storage_data=storage)


def _safe_name(name: Any) -> str:
    """A data file name: a plain name inside the checkpoint folder, never a path out of it."""
    if not isinstance(name, str) or not name or os.sep in name or "/" in name or name in (".", "..") or "\0" in name:
        raise ValueError(f"data file name {name!r} is not a plain file name inside the checkpoint")
    return name


def _nonneg(value: Any) -> int:
    v = int(value)
    if v < 0:
        raise ValueError(f"negative byte offset or length {v}")
    return v


def _pair(value: Any) -> tuple[int, int]:
    a, b = value
    return _nonneg(a), _nonneg(b)
