"""`shardwise.json`: the plain-JSON description of a checkpoint (see docs/format.md).

It lists every tensor's dtype, global shape and chunks (file, byte ranges,
checksums) and every stored object, so that loading a shardwise checkpoint
never unpickles DCP's `.metadata`, and tools can inspect or verify it with a
JSON parser. It is written last: its presence marks a committed checkpoint.
"""

from __future__ import annotations

import base64
import io
import json
import math
import os
import pickle
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
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from ..errors import CorruptCheckpointError
from .safe_pickle import load_metadata

__all__ = [
    "MANIFEST",
    "MARKER",
    "ChunkEntry",
    "Manifest",
    "ObjectEntry",
    "PAGE_SIZE",
    "StoredChunk",
    "StoredObject",
]

MANIFEST = "shardwise.json"
MARKER = ".shardwise"  # written first: a folder with it but no manifest is incomplete
FORMAT = "shardwise.checkpoint"
VERSION = 2
READS = (1, 2)  # version 2 added transforms, planner_data and storage_meta
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
    payload: tuple[int, int] | None  # the raw C-order bytes inside it; None when transformed
    pages: list[
        int
    ]  # crc32c of each PAGE_SIZE slice of the payload (of the record, when transformed)
    frame: int = 0  # crc32c of the record's bytes before and after the payload
    transform: list[str] | None = None  # DCP stream-transform descriptors (e.g. zstd)


@dataclass
class ObjectEntry:
    file: str
    offset: int
    length: int
    crc32c: int
    transform: list[str] | None = None


@dataclass
class StoredChunk(_StorageInfo):
    """DCP's per-chunk storage info plus what ranged, verified reads need.

    It is what `Manifest.to_metadata` puts in `Metadata.storage_data`, so a
    reader's byte ranges always come from the metadata it was set up with."""

    dtype: str = ""
    sizes: tuple[int, ...] = ()
    payload: tuple[int, int] | None = None
    pages: list[int] | None = None
    page_size: int = PAGE_SIZE


@dataclass
class StoredObject(_StorageInfo):
    """DCP's storage info of a pickled object plus its checksum."""

    crc32c: int | None = None


@dataclass
class TensorEntry:
    dtype: str
    shape: tuple[int, ...]
    chunks: list[ChunkEntry] = field(default_factory=list)
    requires_grad: bool = False  # DCP's TensorProperties field, kept for stock parity


@dataclass
class Manifest:
    world_size: int
    tensors: dict[str, TensorEntry] = field(default_factory=dict)
    objects: dict[str, ObjectEntry] = field(default_factory=dict)
    page_size: int = PAGE_SIZE
    metadata_crc32c: int = 0  # of DCP's .metadata, for `verify`
    planner_data: Any = None  # DCP's, when plain JSON (see encode_planner_data)
    planner_data_pickle: str | None = None  # otherwise: base64 pickle, read with the safe unpickler
    storage_meta: dict[str, Any] = field(default_factory=dict)  # checkpoint_id, save_id, modules
    dcp_version: str | None = None
    version: int = VERSION  # of the file read; writing always writes VERSION

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
            "dcp_version": self.dcp_version,
            "storage_meta": self.storage_meta,
            "planner_data": self.planner_data,
            **(
                {"planner_data_pickle": self.planner_data_pickle}
                if self.planner_data_pickle
                else {}
            ),
            "tensors": {
                k: {
                    "dtype": t.dtype,
                    "shape": list(t.shape),
                    **({"requires_grad": True} if t.requires_grad else {}),
                    "chunks": [
                        {
                            "offsets": list(c.offsets),
                            "sizes": list(c.sizes),
                            "file": c.file,
                            "record": list(c.record),
                            "payload": None if c.payload is None else list(c.payload),
                            "pages": c.pages,
                            "frame": c.frame,
                            **({"transform": c.transform} if c.transform else {}),
                        }
                        for c in t.chunks
                    ],
                }
                for k, t in self.tensors.items()
            },
            "objects": {
                k: {
                    "file": o.file,
                    "offset": o.offset,
                    "length": o.length,
                    "crc32c": o.crc32c,
                    **({"transform": o.transform} if o.transform else {}),
                }
                for k, o in self.objects.items()
            },
            "crc32c": 0,
        }

    @classmethod
    def read(cls, folder: Path, name: str = MANIFEST) -> Manifest:
        path = folder / name
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
            if data.get("version") not in READS:
                raise ValueError(
                    f"version {data.get('version')!r} is not supported (reads {READS})"
                )
            out = cls(
                world_size=int(data["world_size"]),
                page_size=int(data["page_size"]),
                metadata_crc32c=int(data["metadata_crc32c"]),
                planner_data=data.get("planner_data"),
                planner_data_pickle=data.get("planner_data_pickle"),
                storage_meta=dict(data.get("storage_meta") or {}),
                dcp_version=data.get("dcp_version"),
                version=int(data["version"]),
            )
            if out.page_size <= 0:
                raise ValueError(f"page size {out.page_size}")
            for k, t in data["tensors"].items():
                entry = TensorEntry(
                    t["dtype"],
                    tuple(int(s) for s in t["shape"]),
                    requires_grad=bool(t.get("requires_grad", False)),
                )
                dtype_from_name(entry.dtype)
                for c in t["chunks"]:
                    entry.chunks.append(
                        ChunkEntry(
                            tuple(int(o) for o in c["offsets"]),
                            tuple(int(s) for s in c["sizes"]),
                            _safe_name(c["file"]),
                            _pair(c["record"]),
                            None if c["payload"] is None else _pair(c["payload"]),
                            [int(p) for p in c["pages"]],
                            int(c["frame"]),
                            _transform(c.get("transform")),
                        )
                    )
                out.tensors[k] = entry
            for k, o in data["objects"].items():
                out.objects[k] = ObjectEntry(
                    _safe_name(o["file"]),
                    _nonneg(o["offset"]),
                    _nonneg(o["length"]),
                    int(o["crc32c"]),
                    _transform(o.get("transform")),
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
                    raise CorruptCheckpointError(
                        f"'{key}': data file {folder / name} is missing"
                    ) from e
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
                    or not _consistent(c, nbytes, self.page_size)
                ):
                    raise CorruptCheckpointError(
                        f"{path}: chunk at offsets {c.offsets} of '{k}' has inconsistent sizes or "
                        f"byte ranges (file {c.file}, payload {c.payload})"
                    )

    def set_planner_data(self, value: Any) -> None:
        """Keep DCP's `planner_data`: as JSON when it is plain, else pickled (in
        this manifest, not in `.metadata`, so the two records never depend on
        each other)."""
        try:
            self.planner_data, self.planner_data_pickle = encode_planner_data(value), None
        except ValueError:
            self.planner_data = None
            self.planner_data_pickle = base64.b64encode(pickle.dumps(value)).decode()

    def decoded_planner_data(self) -> Any:
        if self.planner_data_pickle is None:
            return decode_planner_data(self.planner_data)
        try:
            return load_metadata(io.BytesIO(base64.b64decode(self.planner_data_pickle)))
        except (ValueError, pickle.UnpicklingError) as e:
            raise CorruptCheckpointError(f"{MANIFEST}: unreadable planner data: {e}") from e

    def to_metadata(self) -> Metadata:
        """The DCP `Metadata` this manifest describes, built without unpickling."""
        state: dict[str, Any] = {}
        storage: dict[MetadataIndex, _StorageInfo] = {}
        for k, t in self.tensors.items():
            state[k] = TensorStorageMetadata(
                properties=TensorProperties(
                    dtype=dtype_from_name(t.dtype), requires_grad=t.requires_grad
                ),
                size=torch.Size(t.shape),
                chunks=[
                    ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(c.sizes))
                    for c in t.chunks
                ],
            )
            for c in t.chunks:
                storage[MetadataIndex(k, c.offsets)] = StoredChunk(
                    c.file,
                    c.record[0],
                    c.record[1],
                    c.transform,
                    t.dtype,
                    c.sizes,
                    c.payload,
                    c.pages,
                    self.page_size,
                )
        for k, o in self.objects.items():
            state[k] = BytesStorageMetadata()
            storage[MetadataIndex(k)] = StoredObject(
                o.file, o.offset, o.length, o.transform, o.crc32c
            )
        meta = self.storage_meta
        return Metadata(
            state_dict_metadata=state,
            planner_data=self.decoded_planner_data(),
            storage_data=storage,
            storage_meta=StorageMeta(
                # a Path, as FileSystemWriter pickles it (its init_path makes one)
                checkpoint_id=None
                if meta.get("checkpoint_id") is None
                else Path(meta["checkpoint_id"]),
                save_id=meta.get("save_id"),
                modules=list(meta.get("modules") or []),
            ),
            version=self.dcp_version,
        )


def encode_planner_data(value: Any) -> Any:
    """DCP's `planner_data` as JSON, tuples tagged so they come back as tuples
    (the default planner maps keys to tuple paths); `ValueError` when it holds
    anything else than plain containers, strings and numbers."""
    kind = type(
        value
    )  # exact types: an Enum, namedtuple or OrderedDict would come back as its base
    if value is None or kind in (bool, int, float, str):
        return value
    if kind is tuple:
        return {"__tuple__": [encode_planner_data(v) for v in value]}
    if kind is list:
        return [encode_planner_data(v) for v in value]
    if kind is dict and all(type(k) is str for k in value) and "__tuple__" not in value:
        return {k: encode_planner_data(v) for k, v in value.items()}
    raise ValueError(f"planner data of type {type(value).__name__} is not plain JSON")


def decode_planner_data(value: Any) -> Any:
    if isinstance(value, list):
        return [decode_planner_data(v) for v in value]
    if isinstance(value, dict):
        if set(value) == {"__tuple__"}:
            return tuple(decode_planner_data(v) for v in value["__tuple__"])
        return {k: decode_planner_data(v) for k, v in value.items()}
    return value


def _consistent(c: ChunkEntry, nbytes: int, page_size: int) -> bool:
    """The byte ranges of a chunk fit each other and its size."""
    if c.payload is None:  # transformed: one checksum over the stored record
        return bool(c.transform) and len(c.pages) == 1
    return (
        c.payload[1] == nbytes
        and c.record[0] <= c.payload[0] <= c.payload[0] + c.payload[1] <= sum(c.record)
        and len(c.pages) == max(1, -(-nbytes // page_size))
    )


def _transform(value: Any) -> list[str] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"transform descriptors {value!r} are not a list of strings")
    return value or None


def _safe_name(name: Any) -> str:
    """A data file name: a plain name inside the checkpoint folder, never a path out of it."""
    if (
        not isinstance(name, str)
        or not name
        or os.sep in name
        or "/" in name
        or name in (".", "..")
        or "\0" in name
    ):
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
