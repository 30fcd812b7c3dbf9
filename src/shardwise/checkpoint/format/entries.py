"""The entries of `shardwise.json`: what each tensor, chunk and object entry holds.

One concept, whole: the entries as Python values and the format versions; the
field tables that declare each field once (its key, its kind, its check); the
kinds a leaf field may hold; and the fast path that parses and writes the
common chunk and tensor entries without building a dict per field. Adding a
field to an entry is one line in its table here (see docs/format.md).
"""

from __future__ import annotations

import base64
import binascii
import copy
import functools
import io
import itertools
import json
import operator
import pickle
import re
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import crc32c
import torch

from ...errors import CorruptCheckpointError, ShardwiseError
from .pickles import load_metadata

__all__ = [
    "CHUNK",
    "ChunkEntry",
    "Compact",
    "FAST_CHUNK",
    "FORMAT",
    "Field",
    "FieldError",
    "Head",
    "INDEX_REF",
    "IndexRef",
    "Kind",
    "OBJECT",
    "ObjectEntry",
    "READS",
    "ENTRY_TABLES",
    "STORAGE_META",
    "TENSOR",
    "TOP",
    "TensorEntry",
    "VERSION",
    "checksum",
    "decode",
    "encode",
    "encode_planner_data",
    "parse",
    "pickled",
    "unpickled",
    "untag",
]


# -----------------------------------------------------------------------------
# The entries of `shardwise.json` as Python values, and the format versions.
#
# What the field tables (`format.entries`) decode a manifest into and encode from;
# kept apart from the tables so the fast path (`format.entries`) and the readers can
# build them without the table machinery.
# -----------------------------------------------------------------------------

FORMAT = "shardwise.checkpoint"

VERSION = 5  # the version written

# the versions read; 2 added transforms, planner data, storage_meta, requires_grad;
# 3 replaced pages of `page_size` with tiles (a chunk's `tile` and `format.checksums`);
# 4 moved the chunks into binary sections of an index file (`format.table`);
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


# -----------------------------------------------------------------------------
# The machinery of the field tables of `shardwise.json`: declare a field once.
#
# A table is a tuple of `Field`s, each with a `Kind` (what its JSON value may be).
# `encode` writes exactly a table's fields and `decode` reads them back, checking
# presence, type and range, so the writer, the reader and the field tables of
# docs/format.md (held to the tables by a test) cannot drift apart. The tables
# themselves are in `format.entries`.
# -----------------------------------------------------------------------------


class FieldError(ShardwiseError, ValueError):
    """A manifest field that is missing, unexpected or malformed; the message names it.
    Internal: `Manifest.from_json` catches it (as a `ValueError`) and raises
    `CorruptCheckpointError` naming the file."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"field {path}: {reason}")
        self.path = path


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
            raise FieldError(", ".join(sorted(unknown)), "no manifest field has this name")
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
        raise FieldError(path, f"expected an object, got {show(doc)}")
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
                raise FieldError(_at(path, s.name), f"expected {s.doc}, got {show(value)}")
            if s.convert is not None:
                value = s.convert(value)
        else:
            value = s.parse(value, version, _at(path, s.name))
        if s.stored:
            values[s.attribute] = value
    return values


def _at(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def leaf(doc: str, ok: Callable[[Any], bool], convert: Callable[[Any], Any] | None = None) -> Kind:
    def parse(value: Any, version: int, path: str) -> Any:
        if not ok(value):
            raise FieldError(path, f"expected {doc}, got {show(value)}")
        return value if convert is None else convert(value)

    return Kind(doc, parse, ok=ok, convert=convert)


def const(value: Any) -> Kind:
    return leaf(json.dumps(value), lambda v: type(v) is type(value) and v == value)


def entry_kind(fields: tuple[Field, ...], make: Callable[..., Any]) -> Kind:
    return Kind(
        "an object (fields below)",
        lambda doc, version, path: make(**decode(fields, doc, version, path)),
        lambda entry, version: encode(fields, entry, version),
    )


# An entry kind's fast path: `parse(value, version)` returns the entry, or None to
# leave the value to the table (which also names what is wrong); `dump(entry, version)`
# returns the JSON object, or None likewise.
FastParse = Callable[[Any, int], Any]

FastDump = Callable[[Any, int], Any]


def entry_map(
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
            raise FieldError(path, f"expected an object, got {show(value)}")
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


def entry_list(
    doc: str,
    fields: tuple[Field, ...],
    make: Callable[..., Any],
    fast: tuple[FastParse, FastDump] | None = None,
) -> Kind:
    fast_parse, fast_dump = fast or (lambda v, version: None, lambda e, version: None)

    def parse(value: Any, version: int, path: str) -> list[Any]:
        if not isinstance(value, list):
            raise FieldError(path, f"expected a list, got {show(value)}")
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


# -----------------------------------------------------------------------------
# What a leaf field of `shardwise.json` may hold: the checks and the kinds built on them.
#
# Each check is a plain predicate, so the fast path (`format.entries`) applies the
# same rules as the tables without building a field path.
# -----------------------------------------------------------------------------


def is_int(v: Any) -> bool:
    return type(v) is int  # not bool, not float: JSON `true` or `1.5` is no size


def is_nonneg(v: Any) -> bool:
    return type(v) is int and v >= 0


def is_crc(v: Any) -> bool:
    return type(v) is int and 0 <= v < 4294967296


def list_of(ok: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, list) and all(ok(x) for x in v)


# The lists every chunk has, checked inline: a manifest of 100,000 chunks checks 10^6 integers.
def is_nonneg_list(v: Any) -> bool:
    return type(v) is list and all(type(x) is int and x >= 0 for x in v)


def is_crc_list(v: Any) -> bool:
    return type(v) is list and all(type(x) is int and 0 <= x < 4294967296 for x in v)


def is_str(v: Any) -> bool:
    return isinstance(v, str)


def is_range(v: Any) -> bool:
    return type(v) is list and len(v) == 2 and is_nonneg(v[0]) and is_nonneg(v[1])


def is_file_name(v: Any) -> bool:
    """A plain name inside the checkpoint folder, never a path out of it."""
    return (
        isinstance(v, str)
        and v not in ("", ".", "..")
        and "/" not in v
        and "\\" not in v
        and "\0" not in v
    )


def is_dtype_name(v: Any) -> bool:
    return isinstance(v, str) and _known_dtype(v)


@functools.lru_cache(maxsize=256)
def _known_dtype(v: str) -> bool:
    return isinstance(getattr(torch, v, None), torch.dtype)


def is_base64(v: Any) -> bool:
    try:
        return isinstance(v, str) and bool(base64.b64decode(v, validate=True))
    except binascii.Error:
        return False


NONNEG = leaf("a non-negative integer", is_nonneg)

POSITIVE = leaf("a positive integer", lambda v: is_int(v) and v > 0)

CRC = leaf("a crc32c: an integer in [0, 2**32)", is_crc)

INDEX = leaf("a list of non-negative integers", is_nonneg_list, tuple)

CRCS = leaf("a list of crc32c", is_crc_list)

RANGE = leaf("[offset, length]: non-negative integers", is_range, tuple)

RANGE_OR_NULL = leaf(
    "[offset, length] or null",
    lambda v: v is None or is_range(v),
    lambda v: None if v is None else tuple(v),
)

FILE = leaf("a file name (no `/`, no `..`)", is_file_name)

TRANSFORM = leaf("a non-empty list of strings", lambda v: list_of(is_str)(v) and bool(v))

STR_OR_NULL = leaf("a string or null", lambda v: v is None or is_str(v))


# -----------------------------------------------------------------------------
# DCP's `format.entries` in a manifest: plain JSON where it is, else a pickle.
#
# The manifest keeps its own copy (never `.metadata`'s), so the two records never
# depend on each other; a pickle is read back with the unpickler of stock
# `.metadata` (`format.pickles`).
# -----------------------------------------------------------------------------


def encode_planner_data(value: Any) -> Any:
    """DCP's `format.entries` as JSON, tuples tagged so they come back as tuples
    (the default planner maps keys to tuple paths); `FieldError` (a `ValueError`) when it holds
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
    raise FieldError(
        "planner_data", f"planner data of type {type(value).__name__} is not plain JSON"
    )


def pickled(value: Any) -> tuple[Any, str | None]:
    """(planner_data, planner_data_pickle) of `value`: itself when it is plain JSON (a
    manifest keeps it decoded and encodes it as it writes: tags are a third of a
    large manifest's planner data), else pickled."""
    try:
        encode_planner_data(value)
    except FieldError:
        return None, base64.b64encode(pickle.dumps(value)).decode()
    return value, None


def untag(pairs: list[tuple[str, Any]]) -> Any:
    """`json.loads`'s `object_pairs_hook` for a manifest: a tagged tuple
    `{"__tuple__": [...]}` read as the tuple it stands for, object by object as
    they are parsed (the tags are never built), any other object
    as a dict. Only planner data holds such an object; anywhere else a tuple is no
    JSON object, and the manifest's tables refuse it as they refuse a list there."""
    if len(pairs) == 1 and pairs[0][0] == "__tuple__" and type(pairs[0][1]) is list:
        return tuple(pairs[0][1])
    return dict(pairs)


def unpickled(planner_data: Any, planner_data_pickle: str | None) -> Any:
    """The value `pickled` stored."""
    if planner_data_pickle is None:
        return planner_data
    try:
        return load_metadata(
            io.BytesIO(base64.b64decode(planner_data_pickle)), f"{MANIFEST}: planner data"
        )
    except (ValueError, pickle.UnpicklingError) as e:
        raise CorruptCheckpointError(f"{MANIFEST}: unreadable planner data: {e}") from e


# -----------------------------------------------------------------------------
# A manifest's text parsed: compactly, its format, version and checksum checked.
#
# From format version 4 a tensor is its head: dtype, shape and section. Parsed as
# JSON objects, 100,000 heads are 100,000 dicts and lists (50 MiB) that live beside
# the entries made from them; `json.loads` calls `Compact` with each object's
# pairs as it completes, so a head is a small tuple from the start (equal dtypes
# and shapes one object) and planner data's tags are tuples (`untag`). A head is
# only made of an object whose fields and types are a head's; `format.entries`
# checks its values as it checks an object's, and gives it back as the object it
# was (`Head.as_object`) wherever a table must name what is wrong. An object shaped
# like a head outside "tensors" (planner data may hold any JSON) is found by count
# and the text parsed again as plain objects.
# -----------------------------------------------------------------------------

# The end of a document as the writer writes it: its checksum is the last field.
_TAIL = re.compile(rb',"crc32c":(0|[1-9][0-9]{0,9})\}$')


def parse(data: bytes) -> tuple[dict[str, Any], int] | None:
    """The document in `data` and its format version, parsed compactly (`Compact`),
    its checksum checked; None when it is no JSON object (`ValueError` when it is no
    JSON, `FieldError` when its format, version or checksum is wrong)."""
    compact = Compact()
    doc = json.loads(data, object_pairs_hook=compact)
    if not isinstance(doc, dict):
        return None
    if not compact.all_in(doc):  # a head-shaped object elsewhere: plain objects
        doc = json.loads(data, object_pairs_hook=untag)
    version = _check_version(doc)
    if not _checksum_matches(data, doc):
        raise FieldError("crc32c", "does not match the contents (damaged)")
    return doc, version


def checksum(doc: dict[str, Any]) -> int:
    """The crc32c of `doc`'s compact text with "crc32c" 0 (what the writer seals)."""
    # compact, no indent: json's C encoder (10x faster), and canonical, so re-encoding is exact
    return crc32c.crc32c(json.dumps(dict(doc, crc32c=0), separators=(",", ":")).encode())


def _checksum_matches(text: bytes, doc: dict[str, Any]) -> bool:
    """Whether `doc`'s "crc32c" checksums its compact form: the writer's text as it is
    (its bytes are that form), anything else (indented, reordered) encoded again."""
    found = _TAIL.search(text, max(0, len(text) - 32))
    if found is not None and int(found.group(1)) == doc.get("crc32c"):
        if crc32c.crc32c(b"0}", crc32c.crc32c(memoryview(text)[: found.start(1)])) == doc["crc32c"]:
            return True
    # parsed again as plain JSON: `doc` holds heads and planner data's tuples (`Compact`)
    return checksum(json.loads(text)) == doc.get("crc32c")


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


class Head(tuple):
    """A tensor head as parsed: (dtype, shape, section, requires_grad, whether the object
    named requires_grad), shape and section as tuples of what the JSON lists held."""

    __slots__ = ()

    def as_object(self) -> dict[str, Any]:
        """The JSON object it was parsed from."""
        dtype, shape, section, grad, named = self
        out: dict[str, Any] = {"dtype": dtype, "shape": list(shape)}
        if named:
            out["requires_grad"] = grad
        out["section"] = list(section)
        return out


class Compact:
    """`json.loads`'s `object_pairs_hook` for one manifest: heads as `Head` (`heads`:
    how many), planner data's tags as tuples, any other object as a dict."""

    def __init__(self) -> None:
        self.heads = 0
        self._same: dict[Any, Any] = {}

    def __call__(self, pairs: list[tuple[str, Any]]) -> Any:
        n = len(pairs)
        if n == 1:
            return untag(pairs)
        if (
            (n == 3 or (n == 4 and pairs[2][0] == "requires_grad"))
            and pairs[0][0] == "dtype"
            and pairs[1][0] == "shape"
            and pairs[-1][0] == "section"
        ):
            dtype, shape, section = pairs[0][1], pairs[1][1], pairs[-1][1]
            grad = pairs[2][1] if n == 4 else False
            if (
                type(dtype) is str
                and type(shape) is list
                and type(section) is list
                and len(section) == 5
                and type(grad) is bool
            ):
                try:  # an element no tuple can be hashed by (a list): an object, refused later
                    shape = self._same.setdefault(tuple(shape), tuple(shape))
                except TypeError:
                    return dict(pairs)
                self.heads += 1
                dtype = self._same.setdefault(dtype, dtype)
                return Head((dtype, shape, tuple(section), grad, n == 4))
        return dict(pairs)

    def all_in(self, doc: dict[str, Any]) -> bool:
        """Whether every head made is a tensor of `doc` (none elsewhere)."""
        tensors = doc.get("tensors")
        if not self.heads:
            return True
        return type(tensors) is dict and self.heads == sum(
            type(t) is Head for t in tensors.values()
        )


# -----------------------------------------------------------------------------
# The common chunk and tensor of `shardwise.json`, parsed and written fast.
#
# A checkpoint of 100,000 small tensors has 100,000 chunks like these: version 3
# (the last listing chunks in the manifest), no transform, every integer checked by
# a few C-level calls instead of one Python call each; from version 4 a tensor is
# its dtype, shape and section (`_heads`). They accept exactly what the tables
# accept (a test holds them to it); anything else goes through the tables, which
# name what is wrong.
# -----------------------------------------------------------------------------

FAST_CHUNK = ("offsets", "sizes", "file", "record", "payload", "tile", "tiles", "frame")

_FAST_CHUNK_KEYS = frozenset(FAST_CHUNK)

_chunk_values = operator.itemgetter(*FAST_CHUNK)

_INT = {int}  # not bool: JSON `true` is no size

_FRESH = 4096  # sections whose integers are made afresh at once


def _counts(values: list[Any]) -> bool:
    """Non-negative integers, all of them (`values` is not empty)."""
    return set(map(type, values)) == _INT and min(values) >= 0


def parse_chunk(doc: Any, version: int) -> ChunkEntry | None:
    """One common chunk, checked by `parse_tensors` (wrapped as the chunk of a tensor)."""
    out = parse_tensors({"": {"dtype": "uint8", "shape": [], "chunks": [doc]}}, version)
    return None if out is None else out[""].chunks[0]


def dump_chunk(c: ChunkEntry, version: int) -> dict[str, Any] | None:
    if version != INLINE or c.transform is not None:
        return None
    if c.tile is None and c.payload is not None:  # a writer's bug: no reader would take it
        raise FieldError("tile", f"chunk at {c.offsets} in {c.file} has a payload but no tiles")
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


def parse_tensors(value: Any, version: int) -> dict[str, TensorEntry] | None:
    """Every tensor of a manifest at once, when all are common: the integers, crc32cs,
    file and dtype names of all chunks are gathered and each kind checked in one pass."""
    if version >= INDEXED:
        return _heads(value)
    if type(value) is dict:
        _objects(value)  # a tensor is no head before version 4: objects again, checked below
    if version != INLINE or type(value) is not dict:
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
    if not (all(map(is_file_name, names)) and all(map(is_dtype_name, dtypes))):
        return None
    return out


def parse_tensor(doc: Any, version: int) -> TensorEntry | None:
    out = parse_tensors({"": doc}, version)
    return None if out is None else out[""]


def _heads(value: Any) -> dict[str, TensorEntry] | None:
    """Every tensor of a version 4 manifest at once: dtype, shape and section each.
    Held for the whole load, 100,000 of them at scale: equal dtype names and shapes are
    one object each (the parsed document's copies die with it), and each section's
    integers are made afresh, together, so that none keeps a piece of the document's
    memory alive after it."""
    if type(value) is not dict:
        return None
    counts: list[Any] = []  # checked a few thousand tensors at a time (`_FRESH`)
    crcs: list[Any] = []
    huge = False  # an integer past int64: sections kept as parsed, refused where used
    dtypes: set[str] = set()
    names: dict[str, str] = {}
    shapes: dict[tuple[int, ...], tuple[int, ...]] = {}
    out = {}
    for key, t in value.items():
        if type(t) is Head:  # checked as parsed (`format.entries`): its values below
            dtype, shape, section, requires_grad, _named = t
        elif type(t) is not dict:
            return _objects(value)
        else:
            dtype, shape, section = t.get("dtype"), t.get("shape"), t.get("section")
            requires_grad = t.get("requires_grad", False)
            if not (
                len(t) == 3 + ("requires_grad" in t)
                and type(dtype) is str
                and type(shape) is list
                and type(section) is list
                and len(section) == 5
                and type(requires_grad) is bool
            ):
                return _objects(value)
        counts += shape
        counts += section
        crcs.append(section[4])
        dtypes.add(dtype)
        shape = tuple(shape)
        dtype, shape = names.setdefault(dtype, dtype), shapes.setdefault(shape, shape)
        # its section a tuple below, of integers of its own
        out[key] = TensorEntry(dtype, shape, [], requires_grad, section)
        if len(crcs) == _FRESH:
            if not _heads_valid(counts, crcs):
                return _objects(value)
            huge |= max(counts) >= 1 << 63
            counts, crcs = [], []
    if not (_heads_valid(counts, crcs) and all(map(is_dtype_name, dtypes))):
        return _objects(value)
    if huge or (counts and max(counts) >= 1 << 63):
        for t in out.values():
            t.section = tuple(t.section)  # type: ignore[arg-type, assignment]
        return out
    del counts, crcs
    heads = list(out.values())
    for lo in range(0, len(heads), _FRESH):
        part = heads[lo : lo + _FRESH]
        fresh = iter(array("q", [v for t in part for v in t.section]).tolist())  # type: ignore[union-attr]
        for t in part:
            t.section = tuple(itertools.islice(fresh, 5))  # type: ignore[assignment]
    return out


def _objects(value: dict[str, Any]) -> dict[str, TensorEntry] | None:
    """None, for the tables to name what is wrong: every head given back to `value` as
    the JSON object it was parsed from."""
    for key, t in value.items():
        if type(t) is Head:
            value[key] = t.as_object()
    return None


def _heads_valid(counts: list[Any], crcs: list[Any]) -> bool:
    """Non-negative integers all, crc32cs below 2**32 (empty: none to check)."""
    return not counts or (_counts(counts) and max(crcs) < 1 << 32)


def dump_tensor(t: TensorEntry, version: int) -> dict[str, Any] | None:
    if version >= INDEXED and not t.transforms and t.section is not None:
        head: dict[str, Any] = {"dtype": t.dtype, "shape": t.shape}
        if t.requires_grad:
            head["requires_grad"] = True
        head["section"] = t.section
        return head
    if version != INLINE:
        return None
    chunks = []
    for c in t.chunks:
        d = dump_chunk(c, version)
        if d is None:
            return None
        chunks.append(d)
    if t.requires_grad:
        return {"dtype": t.dtype, "shape": t.shape, "requires_grad": True, "chunks": chunks}
    return {"dtype": t.dtype, "shape": t.shape, "chunks": chunks}


# -----------------------------------------------------------------------------
# The fields of `shardwise.json`, each declared once: one table per record of the
# file (the top level, a tensor, a chunk, an object, DCP's storage meta).
#
# `format.entries.encode` / `decode` run these tables; checks that relate several
# fields (byte ranges inside files, geometry) stay in `manifest.py`, which runs
# them on the decoded entries.
# -----------------------------------------------------------------------------

STORAGE_META = (
    Field("checkpoint_id", STR_OR_NULL, "where it was saved", default=None),
    Field("save_id", STR_OR_NULL, "the id of the save", default=None),
    Field("modules", leaf("a list of strings", list_of(is_str)), "DCP's modules", default=[]),
)

CHUNK = (
    Field("offsets", INDEX, "where the stored block starts, in global coordinates"),
    Field("sizes", INDEX, "the stored block's sizes"),
    Field("file", FILE, "its data file"),
    Field("record", RANGE, "the chunk's `torch.save` archive in the file: what stock DCP reads"),
    Field(
        "payload",
        RANGE_OR_NULL,
        "the raw element bytes in C order inside the archive; `null` when transformed",
    ),
    Field(
        "pages",
        CRCS,
        "crc32c of each `page_size` slice of the payload (the last may be shorter); "
        "when transformed, one crc32c of the whole archive",
        until=2,
        attr="crcs",
    ),
    Field(
        "tile",
        leaf(
            "a list of non-negative integers or null",
            lambda v: v is None or is_nonneg_list(v),
            lambda v: None if v is None else tuple(v),
        ),
        "the tile shape: the payload's checksum grid (see Tiles); `null` when transformed",
        since=3,
    ),
    Field(
        "tiles",
        CRCS,
        "crc32c of each tile of the payload, in the tile grid's C order; when transformed, "
        "one crc32c of the whole archive",
        since=3,
        attr="crcs",
    ),
    Field("frame", CRC, "crc32c of the archive's bytes before the payload, then after it"),
    Field(
        "transform",
        TRANSFORM,
        "DCP stream-transform descriptors (e.g. `stream.zstd/1`): the archive is read whole",
        default=None,
        since=2,
    ),
)

TENSOR = (
    Field("dtype", leaf("a torch dtype name", is_dtype_name), "`float32`, `bfloat16`, ..."),
    Field("shape", INDEX, "the global shape (`[]` for a 0-d tensor)"),
    Field(
        "requires_grad",
        leaf("true or false", lambda v: type(v) is bool),
        "DCP's `TensorProperties.requires_grad`",
        default=False,
        since=2,
    ),
    Field(
        "chunks",
        entry_list("a list of chunks", CHUNK, ChunkEntry, (parse_chunk, dump_chunk)),
        "the stored blocks",
        until=3,
    ),
    Field(
        "section",
        leaf(
            "[block, offset, length, rows, crc32c]: non-negative integers",
            lambda v: is_nonneg_list(v) and len(v) == 5 and v[4] < 1 << 32,
            tuple,
        ),
        "where its chunks are in the index: the block (`index.blocks`), the offset in it, "
        "the length, the number of chunk rows and the section's crc32c (see Index)",
        since=4,
    ),
    Field(
        "transforms",
        leaf("a list of transforms", list_of(TRANSFORM.ok)),  # type: ignore[arg-type]
        "the transforms its chunk rows name by position",
        default=[],
        since=4,
    ),
)

INDEX_REF = (
    Field("file", FILE, "the index file: a data file of the save"),
    Field(
        "blocks",
        leaf("a list of non-negative integers", is_nonneg_list),
        "where each block of sections starts in the file (one per writer of sections)",
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
    Field("format", const(FORMAT), "what this file is", fixed=FORMAT, stored=False),
    Field(
        "version",
        leaf(f"one of {', '.join(map(str, READS))}", lambda v: is_int(v) and v in READS),
        "the format version (see Versioning)",
    ),
    Field("world_size", POSITIVE, "ranks that saved"),
    Field(
        "checksum", const("crc32c"), "the checksum used throughout", fixed="crc32c", stored=False
    ),
    Field("page_size", POSITIVE, "bytes of payload per checksum page", until=2),
    Field("metadata_crc32c", CRC, "crc32c of DCP's `.metadata` (checked by `verify`)"),
    Field(
        "metadata_tail",
        leaf("[size, crc32c]", lambda v: is_range(v) and v[1] < 1 << 32, tuple),
        "`.metadata`'s size and the crc32c of its last 4 KiB, where its save id is: what a "
        "load checks (`metadata_crc32c` would make every rank read all of it)",
        since=4,
    ),
    Field(
        "index",
        entry_kind(INDEX_REF, IndexRef),
        "the index file holding the tensors' chunk sections",
        since=4,
    ),
    Field("dcp_version", STR_OR_NULL, "DCP's `Metadata.version`", since=2),
    Field("storage_meta", entry_kind(STORAGE_META, dict), "DCP's `StorageMeta`", since=2),
    Field(
        "planner_data",
        Kind(
            "any JSON value",
            lambda value, _version, _path: value,  # tags read as tuples (`untag`)
            lambda value, _version: encode_planner_data(value),
        ),
        'DCP\'s `Metadata.planner_data`, tuples tagged `{"__tuple__": [...]}`; `null` when '
        "it is not plain JSON",
        since=2,
    ),
    Field(
        "planner_data_pickle",
        leaf("base64 text", is_base64),
        "planner data that is not plain JSON, pickled, read with the unpickler of stock "
        "`.metadata` (kept here: the manifest never depends on `.metadata`)",
        default=None,
        since=2,
    ),
    Field(
        "tensors",
        entry_map(
            "an object: key to tensor",
            TENSOR,
            TensorEntry,
            (parse_tensor, dump_tensor),
            parse_tensors,
        ),
        "the tensors, by DCP's flattened key (`model.emb.weight`)",
    ),
    Field(
        "objects",
        entry_map("an object: key to object", OBJECT, ObjectEntry),
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
ENTRY_TABLES = {
    "top level": TOP,
    "storage_meta": STORAGE_META,
    "tensor": TENSOR,
    "chunk": CHUNK,
    "object": OBJECT,
    "index": INDEX_REF,
}
