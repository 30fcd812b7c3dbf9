"""The fields of `shardwise.json`, each declared once.

One table per record of the file (the top level, a tensor, a chunk, an object,
DCP's storage meta). `encode` writes exactly a table's fields and `decode` reads
them back, checking presence, type and range, so the writer, the reader and the
field tables of docs/format.md (held to these by a test) cannot drift apart.
Checks that relate several fields (byte ranges inside files, geometry) stay in
`manifest.py`, which runs them on the decoded entries.
"""

from __future__ import annotations

import base64
import binascii
import copy
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

FORMAT = "shardwise.checkpoint"
VERSION = 2  # the version written
READS = (1, 2)  # the versions read; 2 added transforms, planner data, storage_meta, requires_grad


class FieldError(ValueError):
    """A manifest field that is missing, unexpected or malformed; the message names it."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"field {path}: {reason}")
        self.path = path


@dataclass
class ChunkEntry:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    record: tuple[int, int]  # the torch.save record: offset, length (what stock reads)
    payload: tuple[int, int] | None  # the raw C-order bytes inside it; None when transformed
    pages: list[int]  # crc32c of each page of the payload (of the record, when transformed)
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
class TensorEntry:
    dtype: str
    shape: tuple[int, ...]
    chunks: list[ChunkEntry] = field(default_factory=list)
    requires_grad: bool = False  # DCP's TensorProperties field, kept for stock parity


@dataclass(frozen=True)
class Kind:
    """What a field's JSON value may be: `parse(value, version, path)` returns the
    entry's value or raises `FieldError`; `dump` turns the entry's value back into JSON."""

    doc: str  # as docs/format.md describes it
    parse: Callable[[Any, int, str], Any]
    dump: Callable[[Any], Any] = lambda value: value  # tuples need nothing: json writes lists


_UNSET: Any = object()


@dataclass(frozen=True)
class Field:
    name: str
    kind: Kind
    doc: str
    default: Any = _UNSET  # set: optional, this value when absent, and then never written
    since: int = 1  # the first format version that has it (older files must not)
    fixed: Any = _UNSET  # set: always written as this (format, version, checksum)
    stored: bool = True  # False: checked on read, not kept on the entry

    @property
    def required(self) -> bool:
        return self.default is _UNSET


def encode(fields: tuple[Field, ...], entry: Any) -> dict[str, Any]:
    """The JSON object of `entry` (a dataclass, or a dict for storage_meta)."""
    unknown = set(entry) - {f.name for f in fields} if isinstance(entry, dict) else set()
    if unknown:  # a writer's bug: what it means to keep would be lost
        raise ValueError(f"no manifest field for {sorted(unknown)}")
    doc: dict[str, Any] = {}
    for f in fields:
        if f.fixed is not _UNSET:
            doc[f.name] = f.fixed
            continue
        value = entry.get(f.name, f.default) if isinstance(entry, dict) else getattr(entry, f.name)
        if f.required or value != f.default:
            doc[f.name] = f.kind.dump(value)
    return doc


def decode(fields: tuple[Field, ...], doc: Any, version: int, path: str) -> dict[str, Any]:
    """The entry's values from a JSON object of format `version`, every field checked."""
    if not isinstance(doc, dict):
        raise FieldError(path, f"expected an object, got {_show(doc)}")
    known = {f.name: f for f in fields if f.since <= version}
    for name in doc:
        if name not in known:
            raise FieldError(
                _at(path, name), f"unexpected (format version {version} has no such field)"
            )
    values: dict[str, Any] = {}
    for f in known.values():
        at = _at(path, f.name)
        if f.name in doc:
            value = f.kind.parse(doc[f.name], version, at)
        elif f.required:
            raise FieldError(at, f"missing (required in format version {version})")
        else:
            value = copy.copy(f.default)  # never share a mutable default between entries
        if f.stored:
            values[f.name] = value
    return values


def _at(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _leaf(doc: str, ok: Callable[[Any], bool], convert: Callable[[Any], Any] = lambda v: v) -> Kind:
    def parse(value: Any, version: int, path: str) -> Any:
        if not ok(value):
            raise FieldError(path, f"expected {doc}, got {_show(value)}")
        return convert(value)

    return Kind(doc, parse)


def _int(v: Any) -> bool:
    return type(v) is int  # not bool, not float: JSON `true` or `1.5` is no size


def _nonneg(v: Any) -> bool:
    return _int(v) and v >= 0


def _crc(v: Any) -> bool:
    return _int(v) and 0 <= v < 1 << 32


def _list_of(ok: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, list) and all(ok(x) for x in v)


def _str(v: Any) -> bool:
    return isinstance(v, str)


def _range(v: Any) -> bool:
    return _list_of(_nonneg)(v) and len(v) == 2


def _file_name(v: Any) -> bool:
    """A plain name inside the checkpoint folder, never a path out of it."""
    return (
        isinstance(v, str)
        and v not in ("", ".", "..")
        and not any(c in v for c in ("/", "\\", "\0"))
    )


def _dtype_name(v: Any) -> bool:
    return isinstance(v, str) and isinstance(getattr(torch, v, None), torch.dtype)


def _base64(v: Any) -> bool:
    try:
        return isinstance(v, str) and bool(base64.b64decode(v, validate=True))
    except binascii.Error:
        return False


def _const(value: Any) -> Kind:
    return _leaf(json.dumps(value), lambda v: type(v) is type(value) and v == value)


def _record(fields: tuple[Field, ...], make: Callable[..., Any]) -> Kind:
    return Kind(
        "an object (fields below)",
        lambda doc, version, path: make(**decode(fields, doc, version, path)),
        lambda entry: encode(fields, entry),
    )


def _record_map(doc: str, fields: tuple[Field, ...], make: Callable[..., Any]) -> Kind:
    def parse(value: Any, version: int, path: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise FieldError(path, f"expected an object, got {_show(value)}")
        return {k: make(**decode(fields, v, version, f"{path}[{k!r}]")) for k, v in value.items()}

    return Kind(doc, parse, lambda entries: {k: encode(fields, e) for k, e in entries.items()})


def _record_list(doc: str, fields: tuple[Field, ...], make: Callable[..., Any]) -> Kind:
    def parse(value: Any, version: int, path: str) -> list[Any]:
        if not isinstance(value, list):
            raise FieldError(path, f"expected a list, got {_show(value)}")
        return [make(**decode(fields, v, version, f"{path}[{i}]")) for i, v in enumerate(value)]

    return Kind(doc, parse, lambda entries: [encode(fields, e) for e in entries])


NONNEG = _leaf("a non-negative integer", _nonneg)
POSITIVE = _leaf("a positive integer", lambda v: _int(v) and v > 0)
CRC = _leaf("a crc32c: an integer in [0, 2**32)", _crc)
INDEX = _leaf("a list of non-negative integers", _list_of(_nonneg), tuple)
RANGE = _leaf("[offset, length]: non-negative integers", _range, tuple)
RANGE_OR_NULL = _leaf(
    "[offset, length] or null",
    lambda v: v is None or _range(v),
    lambda v: None if v is None else tuple(v),
)
FILE = _leaf("a file name (no `/`, no `..`)", _file_name)
TRANSFORM = _leaf("a non-empty list of strings", lambda v: _list_of(_str)(v) and bool(v))
STR_OR_NULL = _leaf("a string or null", lambda v: v is None or _str(v))

STORAGE_META = (
    Field("checkpoint_id", STR_OR_NULL, "where it was saved", default=None),
    Field("save_id", STR_OR_NULL, "the id of the save", default=None),
    Field("modules", _leaf("a list of strings", _list_of(_str)), "DCP's modules", default=[]),
)

CHUNK = (
    Field("offsets", INDEX, "where the stored block starts, in global coordinates"),
    Field("sizes", INDEX, "the stored block's sizes"),
    Field("file", FILE, "its data file"),
    Field("record", RANGE, "the chunk's `torch.save` record in the file: what stock DCP reads"),
    Field(
        "payload",
        RANGE_OR_NULL,
        "the raw element bytes in C order inside the record; `null` when transformed",
    ),
    Field(
        "pages",
        _leaf("a list of crc32c", _list_of(_crc)),
        "crc32c of each `page_size` slice of the payload (the last may be shorter); "
        "when transformed, one crc32c of the whole record",
    ),
    Field("frame", CRC, "crc32c of the record's bytes before the payload, then after it"),
    Field(
        "transform",
        TRANSFORM,
        "DCP stream-transform descriptors (e.g. `stream.zstd/1`): the record is read whole",
        default=None,
        since=2,
    ),
)

TENSOR = (
    Field("dtype", _leaf("a torch dtype name", _dtype_name), "`float32`, `bfloat16`, ..."),
    Field("shape", INDEX, "the global shape (`[]` for a 0-d tensor)"),
    Field(
        "requires_grad",
        _leaf("true or false", lambda v: type(v) is bool),
        "DCP's `TensorProperties.requires_grad`",
        default=False,
        since=2,
    ),
    Field("chunks", _record_list("a list of chunks", CHUNK, ChunkEntry), "the stored blocks"),
)

OBJECT = (
    Field("file", FILE, "its data file"),
    Field("offset", NONNEG, "where its pickle starts in the file"),
    Field("length", NONNEG, "its length in bytes"),
    Field("crc32c", CRC, "crc32c of those bytes"),
    Field("transform", TRANSFORM, "as for chunks", default=None, since=2),
)

TOP = (
    Field("format", _const(FORMAT), "what this file is", fixed=FORMAT, stored=False),
    Field(
        "version",
        _leaf(f"one of {', '.join(map(str, READS))}", lambda v: _int(v) and v in READS),
        "the format version (see Versioning)",
        fixed=VERSION,
    ),
    Field("world_size", POSITIVE, "ranks that saved"),
    Field(
        "checksum", _const("crc32c"), "the checksum used throughout", fixed="crc32c", stored=False
    ),
    Field("page_size", POSITIVE, "bytes of payload per checksum page"),
    Field("metadata_crc32c", CRC, "crc32c of DCP's `.metadata` (checked by `verify`)"),
    Field("dcp_version", STR_OR_NULL, "DCP's `Metadata.version`", since=2),
    Field("storage_meta", _record(STORAGE_META, dict), "DCP's `StorageMeta`", since=2),
    Field(
        "planner_data",
        _leaf("any JSON value", lambda v: True),
        'DCP\'s `Metadata.planner_data`, tuples tagged `{"__tuple__": [...]}`; `null` when '
        "it is not plain JSON",
        since=2,
    ),
    Field(
        "planner_data_pickle",
        _leaf("base64 text", _base64),
        "planner data that is not plain JSON, pickled, read with the unpickler of stock "
        "`.metadata` (kept here: the manifest never depends on `.metadata`)",
        default=None,
        since=2,
    ),
    Field(
        "tensors",
        _record_map("an object: key to tensor", TENSOR, TensorEntry),
        "the tensors, by DCP's flattened key (`model.emb.weight`)",
    ),
    Field(
        "objects",
        _record_map("an object: key to object", OBJECT, ObjectEntry),
        "the stored Python objects (pickled), by key",
    ),
    Field(
        "crc32c",
        CRC,
        "crc32c of this document written compact (no spaces), with this field 0",
        fixed=0,
        stored=False,
    ),
)

# every record type, as docs/format.md titles its table
RECORDS = {
    "top level": TOP,
    "storage_meta": STORAGE_META,
    "tensor": TENSOR,
    "chunk": CHUNK,
    "object": OBJECT,
}
