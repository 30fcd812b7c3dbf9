"""The field-table machinery (`format.entries`): its error is in the tree, and `encode` /
`decode` write and check exactly a table's fields."""

from __future__ import annotations

import pytest

import shardwise
from shardwise.checkpoint.format.archive import ArchiveError
from shardwise.checkpoint.format.entries import (
    STORAGE_META,
    VERSION,
    Field,
    FieldError,
    Kind,
    const,
    decode,
    encode,
    leaf,
    show,
)


@pytest.mark.parametrize("cls", [FieldError, ArchiveError])
def test_internal_errors_are_shardwise_value_errors(cls):
    assert issubclass(cls, shardwise.ShardwiseError) and issubclass(cls, ValueError)


def test_a_field_no_table_has_is_a_field_error():
    with pytest.raises(FieldError, match=r"field bogus: no manifest field has this name"):
        encode(STORAGE_META, {"bogus": 1}, VERSION)


def _plain(name: str) -> Kind:
    return leaf(f"a {name}", lambda v: type(v) is str)


TABLE = (
    Field("format", const("demo"), "fixed", fixed="demo", stored=False),
    Field("n", leaf("a count", lambda v: type(v) is int), "required"),
    Field("label", _plain("label"), "optional", default="x"),
    Field("old", _plain("string"), "until version 1", default="", until=1),
    Field("new", _plain("string"), "since version 2", default="", since=2),
    Field("seen", _plain("string"), "checked, not kept", default="", stored=False),
    Field("size", leaf("a size", lambda v: type(v) is int), "kept as `length`", attr="length"),
)


def test_encode_writes_fixed_required_and_non_default_fields_in_table_order():
    entry = {"n": 3, "label": "x", "size": 9}  # `label` at its default: not written
    assert list(encode(TABLE, {"size": 9, "n": 3}, 2)) == ["format", "n", "size"]
    assert encode(TABLE, entry, 2) == {"format": "demo", "n": 3, "size": 9}
    assert encode(TABLE, dict(entry, label="y", new="z"), 2) == {
        "format": "demo",
        "n": 3,
        "label": "y",
        "new": "z",
        "size": 9,
    }


def test_decode_gives_the_entrys_attributes_with_defaults():
    doc = {"format": "demo", "n": 3, "seen": "s", "size": 9}
    assert decode(TABLE, doc, 2, "rec") == {"n": 3, "label": "x", "new": "", "length": 9}
    assert decode(TABLE, {"format": "demo", "n": 3, "old": "o", "size": 9}, 1, "") == {
        "n": 3,
        "label": "x",
        "old": "o",
        "length": 9,
    }


@pytest.mark.parametrize(
    "doc, version, message",
    [
        ([1], 2, "field rec: expected an object, got [1]"),
        ({"format": "demo", "size": 9}, 2, "field rec.n: missing (required in format version 2)"),
        (
            {"format": "demo", "n": 3, "size": 9, "old": "o"},
            2,
            "field rec.old: unexpected (format version 2 has no such field)",
        ),
        (
            {"format": "demo", "n": 3, "size": 9, "new": "n"},
            1,
            "field rec.new: unexpected (format version 1 has no such field)",
        ),
        (
            {"format": "other", "n": 3, "size": 9},
            2,
            "field rec.format: expected \"demo\", got 'other'",
        ),
        ({"format": "demo", "n": "3", "size": 9}, 2, "field rec.n: expected a count, got '3'"),
        (
            {"format": "demo", "n": 3, "size": 9, "seen": 1},
            2,
            "field rec.seen: expected a string, got 1",
        ),
    ],
    ids=["not-an-object", "missing", "removed-field", "newer-field", "fixed", "type", "unstored"],
)
def test_decode_names_the_field_and_why(doc, version, message):
    with pytest.raises(FieldError) as info:
        decode(TABLE, doc, version, "rec")
    assert str(info.value) == message


def test_a_long_value_is_shown_cut_to_sixty_characters():
    assert show("x" * 10) == repr("x" * 10)
    assert show("x" * 100) == repr("x" * 100)[:57] + "..." and len(show("x" * 100)) == 60


def test_fields_say_which_versions_have_them():
    old, new = TABLE[3], TABLE[4]
    assert [old.in_version(v) for v in (1, 2, 3)] == [True, False, False]
    assert [new.in_version(v) for v in (1, 2, 3)] == [False, True, True]
    assert TABLE[1].required and not TABLE[2].required
    assert (TABLE[6].attribute, TABLE[1].attribute) == ("length", "n")
