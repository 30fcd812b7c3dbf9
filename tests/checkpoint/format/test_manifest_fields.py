"""The field tables of shardwise.json (`manifest_fields`): docs/format.md holds them, the
writer emits exactly them, and the reader names each missing, malformed or unexpected field."""

from __future__ import annotations

import json
from dataclasses import fields as dataclass_fields
from typing import Any

import pytest

from shardwise.checkpoint.format.manifest import (
    VERSION,
    ChunkEntry,
    Manifest,
    ObjectEntry,
    TensorEntry,
)
from shardwise.checkpoint.format.manifest_fields import RECORDS, Field

from .golden_manifest import (
    BAD,
    DOC,
    PATH,
    REMOVE,
    WHERE,
    full_manifest,
    golden_text,
    minimal_manifest,
    mutate,
    refused,
)


def _presence(f: Field) -> str:
    since = f", since v{f.since}" if f.since > 1 else ""
    since += f", until v{f.until}" if f.until is not None else ""
    if f.required:
        return f"required{since}"
    return f"optional{since}; absent: `{json.dumps(f.default)}`"


def markdown_table(record: str) -> str:
    """The table docs/format.md must hold for `record`."""
    rows = [f"| {record} field | value | presence | meaning |", "|---|---|---|---|"]
    rows += [f"| `{f.name}` | {f.kind.doc} | {_presence(f)} | {f.doc} |" for f in RECORDS[record]]
    return "\n".join(rows)


@pytest.mark.parametrize("record", RECORDS)
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
    ],
)
def test_entries_hold_the_stored_fields_with_the_table_defaults(record, entry):
    table = {f.name: f for f in RECORDS[record] if f.stored}
    attributes = {a.name: a for a in dataclass_fields(entry)}
    assert {f.attribute for f in table.values()} == set(attributes)
    for f in table.values():
        if not f.required:  # an entry built without it writes nothing for it
            assert attributes[f.attribute].default == f.default, f.name


def _records(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {
        "top level": doc,
        "storage_meta": doc["storage_meta"],
        "tensor": doc["tensors"]["t"],
        "chunk": doc["tensors"]["t"]["chunks"][0],
        "object": doc["objects"]["o"],
    }


def _current(record: str) -> list[Field]:
    return [f for f in RECORDS[record] if f.in_version(VERSION)]


def test_writer_emits_exactly_the_table_fields():
    for record, written in _records(json.loads(full_manifest().to_json())).items():
        assert list(written) == [f.name for f in _current(record)], record
    for record, written in _records(json.loads(minimal_manifest().to_json())).items():
        assert list(written) == [f.name for f in _current(record) if f.required], record


REQUIRED = [
    (record, f.name)
    for record, table in RECORDS.items()
    for f in table
    if f.required and record in WHERE and f.in_version(VERSION)
]


@pytest.mark.parametrize("record, name", REQUIRED, ids=[f"{r}.{n}" for r, n in REQUIRED])
def test_a_missing_required_field_is_named(record, name):
    doc = mutate(json.loads(golden_text()), record, name, REMOVE)
    message = refused(doc, checksum=(record, name) != ("top level", "crc32c"))
    assert f"field {PATH[record]}{name}: " in message


@pytest.mark.parametrize("record, name, value, reason", BAD.values(), ids=BAD.keys())
def test_a_malformed_field_is_named(record, name, value, reason):
    message = refused(mutate(json.loads(golden_text()), record, name, value))
    assert f"field {PATH[record]}{name}: " in message and reason in message


def test_a_field_newer_than_the_file_version_is_unexpected():
    doc = mutate(json.loads(golden_text(1)), "chunk", "transform", ["stream.zstd/1"])
    message = refused(doc)
    assert f"field {PATH['chunk']}transform: unexpected (format version 1 " in message
    doc = mutate(json.loads(golden_text(2)), "chunk", "tile", [4, 4])
    assert f"field {PATH['chunk']}tile: unexpected (format version 2 " in refused(doc)


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
