"""The machinery of the field tables of `shardwise.json`: declare a field once.

A table is a tuple of `Field`s, each with a `Kind` (what its JSON value may be).
`encode` writes exactly a table's fields and `decode` reads them back, checking
presence, type and range, so the writer, the reader and the field tables of
docs/format.md (held to the tables by a test) cannot drift apart. The tables
themselves are in `manifest_fields`.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from ...errors import ShardwiseError

__all__ = ["Field", "FieldError", "Kind", "decode", "encode"]


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


def record(fields: tuple[Field, ...], make: Callable[..., Any]) -> Kind:
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


def record_map(
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


def record_list(
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
