"""`shardwise.json`: the plain-JSON description of a checkpoint (see docs/format.md).

It lists every tensor's dtype, global shape and chunks (file, byte ranges,
checksums) and every stored object, so that loading a shardwise checkpoint
never unpickles DCP's `.metadata`, and tools can inspect or verify it with a
JSON parser. It is written last: its presence marks a committed checkpoint.
Its fields are declared once, in `manifest_fields`; this module adds what
relates several of them (byte ranges inside files, geometry) and DCP's view.
"""

from __future__ import annotations

import base64
import io
import json
import math
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
from .manifest_fields import (
    FORMAT,
    READS,
    TOP,
    VERSION,
    ChunkEntry,
    FieldError,
    ObjectEntry,
    TensorEntry,
    decode,
    encode,
)
from .safe_pickle import load_metadata

__all__ = [
    "FORMAT",
    "MANIFEST",
    "MARKER",
    "PAGE_SIZE",
    "READS",
    "VERSION",
    "ChunkEntry",
    "Manifest",
    "ObjectEntry",
    "StoredChunk",
    "StoredObject",
    "TensorEntry",
]

MANIFEST = "shardwise.json"
MARKER = ".shardwise"  # written first: a folder with it but no manifest is incomplete
PAGE_SIZE = 1 << 20  # payload bytes per checksum page


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CorruptCheckpointError(f"unknown dtype {name!r} in {MANIFEST}")
    return dtype


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


def _checksum(doc: dict[str, Any]) -> int:
    # compact, no indent: json's C encoder (10x faster), and canonical, so re-encoding is exact
    return crc32c.crc32c(json.dumps(dict(doc, crc32c=0), separators=(",", ":")).encode())


def _check_version(doc: dict[str, Any]) -> int:
    """Format and version first: they keep their meaning in every version, and
    which other fields exist depends on them."""
    if doc.get("format") != FORMAT:
        raise FieldError("format", f"is {doc.get('format')!r}, not {FORMAT!r}")
    version = doc.get("version")
    if type(version) is not int or version not in READS:
        newer = type(version) is int and version > VERSION
        raise FieldError(
            "version",
            f"format version {version!r} is not supported: this shardwise reads versions "
            f"{', '.join(map(str, READS))}"
            + (" (a newer shardwise wrote it: upgrade to read it)" if newer else ""),
        )
    return version


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
        doc = encode(TOP, self)
        doc["crc32c"] = _checksum(doc)
        return json.dumps(doc, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes, source: str | Path = MANIFEST) -> Manifest:
        """The manifest in `text`, every field and the geometry checked (not the data
        files: see `read`). `source` names the file in errors."""
        try:
            doc = json.loads(text)
            if not isinstance(doc, dict):
                raise ValueError("not a JSON object")
            version = _check_version(doc)
            if _checksum(doc) != doc.get("crc32c"):
                raise FieldError("crc32c", "does not match the contents (damaged)")
            out = cls(**decode(TOP, doc, version, ""))
        except ValueError as e:  # FieldError, and JSON's and UTF-8's errors
            raise CorruptCheckpointError(f"{source}: unreadable manifest: {e}") from e
        out._check_geometry(source)
        return out

    @classmethod
    def read(cls, folder: Path, name: str = MANIFEST) -> Manifest:
        """The manifest `name` in `folder`, checked, its byte ranges inside its files."""
        path = folder / name
        try:
            text = path.read_bytes()
        except OSError as e:
            raise CorruptCheckpointError(f"{path}: unreadable manifest: {e}") from e
        out = cls.from_json(text, path)
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
                    f"'{key}': bytes {offset}..{offset + length} lie past the end of "
                    f"{folder / name} ({sizes[name]} bytes): truncated or damaged"
                )

    def _check_geometry(self, path: str | Path) -> None:
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
