"""The field tables of shardwise.json (`format.entries`): docs/format.md holds them, the
writer emits exactly them, and the reader names each missing, malformed or unexpected field."""

from __future__ import annotations

import json
from dataclasses import MISSING
from dataclasses import fields as dataclass_fields
from typing import Any

import pytest

from shardwise.checkpoint.format.entries import ENTRY_TABLES, INLINE, Field
from shardwise.checkpoint.format.manifest import (
    VERSION,
    ChunkEntry,
    IndexRef,
    Manifest,
    ObjectEntry,
    TensorEntry,
)

from .broken_fields import BAD, BAD_V4, PATH, REMOVE, holds, mutate, refused
from .golden_manifest import DOC, INDEX_FILE, full_manifest, golden_text, minimal_manifest


def _presence(f: Field) -> str:
    since = f", since v{f.since}" if f.since > 1 else ""
    since += f", until v{f.until}" if f.until is not None else ""
    if f.required:
        return f"required{since}"
    return f"optional{since}; absent: `{json.dumps(f.default)}`"


def markdown_table(record: str) -> str:
    """The table docs/format.md must hold for `record`."""
    rows = [f"| {record} field | value | presence | meaning |", "|---|---|---|---|"]
    rows += [
        f"| `{f.name}` | {f.kind.doc} | {_presence(f)} | {f.doc} |" for f in ENTRY_TABLES[record]
    ]
    return "\n".join(rows)


@pytest.mark.parametrize("record", ENTRY_TABLES)
def test_doc_tables_match_the_field_table(record):
    expected = markdown_table(record)
    assert expected in DOC.read_text(), f"docs/format.md should hold:\n\n{expected}\n"


@pytest.mark.parametrize(
    "record, entry",
    [
        ("top level", Manifest),
        ("tensor", TensorEntry),
        ("chunk", ChunkEntry),
        ("object", ObjectEntry),
        ("index", IndexRef),
    ],
)
def test_entries_hold_the_stored_fields_with_the_table_defaults(record, entry):
    table = {f.name: f for f in ENTRY_TABLES[record] if f.stored}
    # what is compared is what is stored: `Manifest.resolved` is state, not a field; a
    # chunk's `crc_at` is a column of its index row only (version 5), never JSON
    attributes = {a.name: a for a in dataclass_fields(entry) if a.compare and a.name != "crc_at"}
    assert {f.attribute for f in table.values()} == set(attributes)
    for f in table.values():
        if not f.required:  # an entry built without it writes nothing for it
            a = attributes[f.attribute]
            default = a.default if a.default_factory is MISSING else a.default_factory()
            assert default == f.default, f.name


def _records(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    tensor = doc["tensors"]["t"]
    inner = {"chunk": tensor["chunks"][0]} if "chunks" in tensor else {"index": doc["index"]}
    return {
        "top level": doc,
        "storage_meta": doc["storage_meta"],
        "tensor": tensor,
        "object": doc["objects"]["o"],
    } | inner


def _held(version: int) -> set[str]:
    """The records a manifest of `version` has: chunks up to 3, the index from 4."""
    return set(ENTRY_TABLES) - {"index" if version <= INLINE else "chunk"}


def _fields(record: str, version: int) -> list[Field]:
    return [f for f in ENTRY_TABLES[record] if f.in_version(version)]


@pytest.mark.parametrize("version", [INLINE, VERSION])
def test_writer_emits_exactly_the_table_fields(version):
    full, minimal = full_manifest(version), minimal_manifest(version)
    if version > INLINE:  # its sections set: what a save writes
        full.indexed(INDEX_FILE, b"")
        minimal.indexed(INDEX_FILE, b"")
    records = _records(json.loads(full.to_json()))
    assert set(records) == _held(version)
    for record, written in records.items():
        assert list(written) == [f.name for f in _fields(record, version)], record
    for record, written in _records(json.loads(minimal.to_json())).items():
        assert list(written) == [f.name for f in _fields(record, version) if f.required], record


REQUIRED = [
    (version, record, f.name)
    for version in (INLINE, 4, VERSION)
    for record, table in ENTRY_TABLES.items()
    for f in table
    if f.required and f.in_version(version) and holds(json.loads(golden_text(version)), record)
]


@pytest.mark.parametrize(
    "version, record, name", REQUIRED, ids=[f"v{v}-{r}.{n}" for v, r, n in REQUIRED]
)
def test_a_missing_required_field_is_named(version, record, name):
    doc = mutate(json.loads(golden_text(version)), record, name, REMOVE)
    message = refused(doc, checksum=(record, name) != ("top level", "crc32c"))
    assert f"field {PATH[record]}{name}: " in message
    if name not in ("format", "version", "crc32c"):  # read first: see test_manifest
        assert f"missing (required in format version {version})" in message


def test_every_record_of_each_version_is_in_its_golden_file():
    for version in (INLINE, 4, VERSION):
        doc = json.loads(golden_text(version))
        assert {r for r in ENTRY_TABLES if holds(doc, r)} == _held(version), version


@pytest.mark.parametrize("record, name, value, reason", BAD.values(), ids=BAD.keys())
def test_a_malformed_field_is_named(record, name, value, reason):
    message = refused(mutate(json.loads(golden_text(INLINE)), record, name, value))
    assert f"field {PATH[record]}{name}: " in message and reason in message


@pytest.mark.parametrize("version", [4, VERSION])
@pytest.mark.parametrize("record, name, value, reason", BAD_V4.values(), ids=BAD_V4.keys())
def test_a_malformed_field_of_version_4_is_named(record, name, value, reason, version):
    message = refused(mutate(json.loads(golden_text(version)), record, name, value))
    reason = reason.replace("format version 4 ", f"format version {version} ")
    assert f"field {PATH[record]}{name}: " in message and reason in message


def test_a_field_newer_than_the_file_version_is_unexpected():
    doc = mutate(json.loads(golden_text(1)), "chunk", "transform", ["stream.zstd/1"])
    message = refused(doc)
    assert f"field {PATH['chunk']}transform: unexpected (format version 1 " in message
    doc = mutate(json.loads(golden_text(2)), "chunk", "tile", [4, 4])
    assert f"field {PATH['chunk']}tile: unexpected (format version 2 " in refused(doc)
    for name, value in [("metadata_tail", [0, 0]), ("index", {"file": "f", "blocks": [0]})]:
        doc = mutate(json.loads(golden_text(3)), "top level", name, value)
        assert f"field {name}: unexpected (format version 3 " in refused(doc)
    doc = mutate(json.loads(golden_text(3)), "tensor", "section", [0, 0, 264, 2, 0])
    assert f"field {PATH['tensor']}section: unexpected (format version 3 " in refused(doc)


BAD_V2 = {
    "page_size-float": ("top level", "page_size", 1048576.0, "expected a positive integer"),
    "pages-too-big": ("chunk", "pages", [1 << 32], "expected a list of crc32c"),
    "pages-missing": ("chunk", "pages", REMOVE, "missing (required in format version 2)"),
    "page_size-missing": ("top level", "page_size", REMOVE, "missing (required in format"),
}


@pytest.mark.parametrize("record, name, value, reason", BAD_V2.values(), ids=BAD_V2.keys())
def test_a_malformed_page_field_of_version_2_is_named(record, name, value, reason):
    message = refused(mutate(json.loads(golden_text(2)), record, name, value))
    assert f"field {PATH[record]}{name}: " in message and reason in message
