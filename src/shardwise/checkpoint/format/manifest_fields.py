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
import functools
import json
import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from ...errors import ShardwiseError

FORMAT = "shardwise.checkpoint"
VERSION = 3  # the version written
# the versions read; 2 added transforms, planner data, storage_meta, requires_grad;
# 3 replaced pages of `page_size` with tiles (a chunk's `tile` and `tiles`)
READS = (1, 2, 3)


class FieldError(ShardwiseError, ValueError):
    """A manifest field that is missing, unexpected or malformed; the message names it.
    Internal: `Manifest.from_json` catches it (as a `ValueError`) and raises
    `CorruptCheckpointError` naming the file."""

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
    # crc32c of each tile of the payload (`tile` set, v3), or of each page (v1, v2);
    # when transformed, one crc32c of the whole record
    crcs: list[int]
    frame: int = 0  # crc32c of the record's bytes before and after the payload
    transform: list[str] | None = None  # DCP stream-transform descriptors (e.g. zstd)
    tile: tuple[int, ...] | None = None  # the tile shape (v3); None: pages, or transformed


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
    entry's value or raises `FieldError`; `dump(value, version)` turns the entry's
    value back into JSON (None: as it is; json writes tuples as lists). A leaf kind
    also gives `ok` and `convert`, which `decode` calls directly (the same checks as
    `parse`, without building the field's path unless it fails)."""

    doc: str  # as docs/format.md describes it
    parse: Callable[[Any, int, str], Any]
    dump: Callable[[Any, int], Any] | None = None
    ok: Callable[[Any], bool] | None = None
    convert: Callable[[Any], Any] | None = None


_UNSET: Any = object()


@dataclass(frozen=True)
class Field:
    name: str
    kind: Kind
    doc: str
    default: Any = _UNSET  # set: optional, this value when absent, and then never written
    since: int = 1  # the first format version that has it (older files must not)
    until: int | None = None  # the last format version that has it (newer files must not)
    fixed: Any = _UNSET  # set: always written as this (format, checksum)
    stored: bool = True  # False: checked on read, not kept on the entry
    attr: str = ""  # the entry's attribute that holds it, when not `name`

    @property
    def required(self) -> bool:
        return self.default is _UNSET

    @property
    def attribute(self) -> str:
        return self.attr or self.name

    def in_version(self, version: int) -> bool:
        return self.since <= version and (self.until is None or version <= self.until)


class _Step(NamedTuple):
    """One field of a table as encode and decode use it, its lookups done once."""

    name: str
    attribute: str
    required: bool
    default: Any
    fixed: Any
    stored: bool
    ok: Callable[[Any], bool] | None
    convert: Callable[[Any], Any] | None
    parse: Callable[[Any, int, str], Any]
    dump: Callable[[Any, int], Any] | None
    doc: str


_PLANS: dict[tuple[int, int], tuple[tuple[Field, ...], frozenset[str], tuple[_Step, ...]]] = {}


def _plan(fields: tuple[Field, ...], version: int) -> tuple[frozenset[str], tuple[_Step, ...]]:
    """The names and steps of the fields a file of `version` has, in table order.
    Cached by the table's identity: a manifest of 100,000 chunks encodes and decodes
    the chunk table 100,000 times, so per-field lookups are what it costs."""
    plan = _PLANS.get((id(fields), version))
    if plan is None or plan[0] is not fields:
        steps = tuple(
            _Step(
                f.name,
                f.attribute,
                f.required,
                f.default,
                f.fixed,
                f.stored,
                f.kind.ok,
                f.kind.convert,
                f.kind.parse,
                f.kind.dump,
                f.kind.doc,
            )
            for f in fields
            if f.in_version(version)
        )
        plan = _PLANS[(id(fields), version)] = (fields, frozenset(s.name for s in steps), steps)
    return plan[1], plan[2]


def encode(fields: tuple[Field, ...], entry: Any, version: int) -> dict[str, Any]:
    """The JSON object of `entry` (a dataclass, or a dict for storage_meta) in format `version`."""
    _, steps = _plan(fields, version)
    as_dict = isinstance(entry, dict)
    if as_dict:
        unknown = set(entry) - {f.name for f in fields}
        if unknown:  # a writer's bug: what it means to keep would be lost
            raise ValueError(f"no manifest field for {sorted(unknown)}")
    doc: dict[str, Any] = {}
    for s in steps:
        if s.fixed is not _UNSET:
            doc[s.name] = s.fixed
            continue
        value = entry.get(s.name, s.default) if as_dict else getattr(entry, s.attribute)
        if s.required or value != s.default:
            doc[s.name] = value if s.dump is None else s.dump(value, version)
    return doc


def decode(fields: tuple[Field, ...], doc: Any, version: int, path: str) -> dict[str, Any]:
    """The entry's values, by attribute, from a JSON object of format `version`, every
    field checked."""
    if type(doc) is not dict:
        raise FieldError(path, f"expected an object, got {_show(doc)}")
    names, steps = _plan(fields, version)
    if not names.issuperset(doc):
        name = next(n for n in doc if n not in names)
        raise FieldError(
            _at(path, name), f"unexpected (format version {version} has no such field)"
        )
    values: dict[str, Any] = {}
    for s in steps:
        value = doc.get(s.name, _UNSET)
        if value is _UNSET:
            if s.required:
                raise FieldError(
                    _at(path, s.name), f"missing (required in format version {version})"
                )
            value = copy.copy(s.default) if isinstance(s.default, (list, dict)) else s.default
        elif s.ok is not None:
            if not s.ok(value):
                raise FieldError(_at(path, s.name), f"expected {s.doc}, got {_show(value)}")
            if s.convert is not None:
                value = s.convert(value)
        else:
            value = s.parse(value, version, _at(path, s.name))
        if s.stored:
            values[s.attribute] = value
    return values


def _at(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _leaf(doc: str, ok: Callable[[Any], bool], convert: Callable[[Any], Any] | None = None) -> Kind:
    def parse(value: Any, version: int, path: str) -> Any:
        if not ok(value):
            raise FieldError(path, f"expected {doc}, got {_show(value)}")
        return value if convert is None else convert(value)

    return Kind(doc, parse, ok=ok, convert=convert)


def _int(v: Any) -> bool:
    return type(v) is int  # not bool, not float: JSON `true` or `1.5` is no size


def _nonneg(v: Any) -> bool:
    return type(v) is int and v >= 0


def _crc(v: Any) -> bool:
    return type(v) is int and 0 <= v < 4294967296


def _list_of(ok: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, list) and all(ok(x) for x in v)


# The lists every chunk has, checked inline: a manifest of 100,000 chunks checks 10^6 integers.
def _nonneg_list(v: Any) -> bool:
    return type(v) is list and all(type(x) is int and x >= 0 for x in v)


def _crc_list(v: Any) -> bool:
    return type(v) is list and all(type(x) is int and 0 <= x < 4294967296 for x in v)


def _str(v: Any) -> bool:
    return isinstance(v, str)


def _range(v: Any) -> bool:
    return type(v) is list and len(v) == 2 and _nonneg(v[0]) and _nonneg(v[1])


def _file_name(v: Any) -> bool:
    """A plain name inside the checkpoint folder, never a path out of it."""
    return (
        isinstance(v, str)
        and v not in ("", ".", "..")
        and "/" not in v
        and "\\" not in v
        and "\0" not in v
    )


def _dtype_name(v: Any) -> bool:
    return isinstance(v, str) and _is_dtype_name(v)


@functools.lru_cache(maxsize=256)
def _is_dtype_name(v: str) -> bool:
    return isinstance(getattr(torch, v, None), torch.dtype)


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
        lambda entry, version: encode(fields, entry, version),
    )


# A record kind's fast path: `parse(value, version)` returns the entry, or None to
# leave the value to the table (which also names what is wrong); `dump(entry, version)`
# returns the JSON object, or None likewise.
FastParse = Callable[[Any, int], Any]
FastDump = Callable[[Any, int], Any]


def _record_map(
    doc: str,
    fields: tuple[Field, ...],
    make: Callable[..., Any],
    fast: tuple[FastParse, FastDump] | None = None,
    fast_all: FastParse | None = None,
) -> Kind:
    """`fast_all(value, version)`: all entries at once, or None to take them one by one."""
    fast_parse, fast_dump = fast or (lambda v, version: None, lambda e, version: None)

    def parse(value: Any, version: int, path: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise FieldError(path, f"expected an object, got {_show(value)}")
        if fast_all is not None:
            entries = fast_all(value, version)
            if entries is not None:
                return entries
        out = {}
        for k, v in value.items():
            entry = fast_parse(v, version)
            out[k] = (
                make(**decode(fields, v, version, f"{path}[{k!r}]")) if entry is None else entry
            )
        return out

    def dump(entries: dict[str, Any], version: int) -> dict[str, Any]:
        out = {}
        for k, e in entries.items():
            d = fast_dump(e, version)
            out[k] = encode(fields, e, version) if d is None else d
        return out

    return Kind(doc, parse, dump)


def _record_list(
    doc: str,
    fields: tuple[Field, ...],
    make: Callable[..., Any],
    fast: tuple[FastParse, FastDump] | None = None,
) -> Kind:
    fast_parse, fast_dump = fast or (lambda v, version: None, lambda e, version: None)

    def parse(value: Any, version: int, path: str) -> list[Any]:
        if not isinstance(value, list):
            raise FieldError(path, f"expected a list, got {_show(value)}")
        out = []
        for i, v in enumerate(value):
            entry = fast_parse(v, version)
            if entry is None:
                entry = make(**decode(fields, v, version, f"{path}[{i}]"))
            out.append(entry)
        return out

    def dump(entries: list[Any], version: int) -> list[Any]:
        out = []
        for e in entries:
            d = fast_dump(e, version)
            out.append(encode(fields, e, version) if d is None else d)
        return out

    return Kind(doc, parse, dump)


NONNEG = _leaf("a non-negative integer", _nonneg)
POSITIVE = _leaf("a positive integer", lambda v: _int(v) and v > 0)
CRC = _leaf("a crc32c: an integer in [0, 2**32)", _crc)
INDEX = _leaf("a list of non-negative integers", _nonneg_list, tuple)
CRCS = _leaf("a list of crc32c", _crc_list)
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
        CRCS,
        "crc32c of each `page_size` slice of the payload (the last may be shorter); "
        "when transformed, one crc32c of the whole record",
        until=2,
        attr="crcs",
    ),
    Field(
        "tile",
        _leaf(
            "a list of non-negative integers or null",
            lambda v: v is None or _nonneg_list(v),
            lambda v: None if v is None else tuple(v),
        ),
        "the tile shape: the payload's checksum grid (see Tiles); `null` when transformed",
        since=3,
    ),
    Field(
        "tiles",
        CRCS,
        "crc32c of each tile of the payload, in the tile grid's C order; when transformed, "
        "one crc32c of the whole record",
        since=3,
        attr="crcs",
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

# -- the common chunk and tensor, fast -------------------------------------------------
# A checkpoint of 100,000 small tensors has 100,000 chunks like these: the newest
# version, no transform, every integer checked by a few C-level calls instead of one
# Python call each. They accept exactly what the tables accept (a test holds them to
# it); anything else goes through the tables, which name what is wrong.
FAST_CHUNK = ("offsets", "sizes", "file", "record", "payload", "tile", "tiles", "frame")
_FAST_CHUNK_KEYS = frozenset(FAST_CHUNK)
_chunk_values = operator.itemgetter(*FAST_CHUNK)
_INT = {int}  # not bool: JSON `true` is no size


def _counts(values: list[Any]) -> bool:
    """Non-negative integers, all of them (`values` is not empty)."""
    return set(map(type, values)) == _INT and min(values) >= 0


def _parse_chunk(doc: Any, version: int) -> ChunkEntry | None:
    """One common chunk, checked by `_parse_tensors` (wrapped as the chunk of a tensor)."""
    out = _parse_tensors({"": {"dtype": "uint8", "shape": [], "chunks": [doc]}}, version)
    return None if out is None else out[""].chunks[0]


def _dump_chunk(c: ChunkEntry, version: int) -> dict[str, Any] | None:
    if version != VERSION or c.transform is not None:
        return None
    if c.tile is None and c.payload is not None:  # a writer's bug: no reader would take it
        raise ValueError(f"chunk at {c.offsets} in {c.file} has a payload but no tiles")
    return {
        "offsets": c.offsets,
        "sizes": c.sizes,
        "file": c.file,
        "record": c.record,
        "payload": c.payload,
        "tile": c.tile,
        "tiles": c.crcs,
        "frame": c.frame,
    }


def _parse_tensors(value: Any, version: int) -> dict[str, TensorEntry] | None:
    """Every tensor of a manifest at once, when all are common: the integers, crc32cs,
    file and dtype names of all chunks are gathered and each kind checked in one pass."""
    if version != VERSION or type(value) is not dict:
        return None
    counts: list[Any] = []  # every value that must be a non-negative integer
    crcs: list[Any] = []  # every value that must be a crc32c
    names: set[str] = set()  # file names and dtype names, checked once each
    dtypes: set[str] = set()
    out = {}
    for key, t in value.items():
        if type(t) is not dict:
            return None
        dtype, shape, chunks = t.get("dtype"), t.get("shape"), t.get("chunks")
        requires_grad = t.get("requires_grad", False)
        if not (
            len(t) == 3 + ("requires_grad" in t)
            and type(dtype) is str
            and type(shape) is list
            and type(chunks) is list
            and type(requires_grad) is bool
        ):
            return None
        counts += shape
        dtypes.add(dtype)
        entries = []
        for c in chunks:
            if type(c) is not dict or c.keys() != _FAST_CHUNK_KEYS:
                return None
            offsets, sizes, file, record, payload, tile, tiles, frame = _chunk_values(c)
            if not (
                type(offsets) is list
                and type(sizes) is list
                and type(file) is str
                and type(record) is list
                and len(record) == 2
                and type(payload) is list
                and len(payload) == 2
                and type(tile) is list
                and type(tiles) is list
            ):
                return None
            counts += offsets
            counts += sizes
            counts += record
            counts += payload
            counts += tile
            crcs += tiles
            crcs.append(frame)
            names.add(file)
            entries.append(
                ChunkEntry(
                    tuple(offsets),
                    tuple(sizes),
                    file,
                    tuple(record),
                    tuple(payload),
                    tiles,
                    frame,
                    None,
                    tuple(tile),
                )
            )
        out[key] = TensorEntry(dtype, tuple(shape), entries, requires_grad)
    if counts and not _counts(counts):
        return None
    if crcs and not (_counts(crcs) and max(crcs) < 4294967296):
        return None
    if not (all(map(_file_name, names)) and all(map(_dtype_name, dtypes))):
        return None
    return out


def _parse_tensor(doc: Any, version: int) -> TensorEntry | None:
    out = _parse_tensors({"": doc}, version)
    return None if out is None else out[""]


def _dump_tensor(t: TensorEntry, version: int) -> dict[str, Any] | None:
    if version != VERSION:
        return None
    chunks = []
    for c in t.chunks:
        d = _dump_chunk(c, version)
        if d is None:
            return None
        chunks.append(d)
    if t.requires_grad:
        return {"dtype": t.dtype, "shape": t.shape, "requires_grad": True, "chunks": chunks}
    return {"dtype": t.dtype, "shape": t.shape, "chunks": chunks}


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
    Field(
        "chunks",
        _record_list("a list of chunks", CHUNK, ChunkEntry, (_parse_chunk, _dump_chunk)),
        "the stored blocks",
    ),
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
    ),
    Field("world_size", POSITIVE, "ranks that saved"),
    Field(
        "checksum", _const("crc32c"), "the checksum used throughout", fixed="crc32c", stored=False
    ),
    Field("page_size", POSITIVE, "bytes of payload per checksum page", until=2),
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
        _record_map(
            "an object: key to tensor",
            TENSOR,
            TensorEntry,
            (_parse_tensor, _dump_tensor),
            _parse_tensors,
        ),
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
