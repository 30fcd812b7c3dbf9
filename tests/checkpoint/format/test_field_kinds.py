"""What a leaf field of shardwise.json may hold (`format.entries`): the predicates the tables
and the fast path share, and the kinds built on them naming what they expected."""

from __future__ import annotations

import pytest

from shardwise.checkpoint.format.entries import (
    CRC,
    FILE,
    INDEX,
    POSITIVE,
    RANGE_OR_NULL,
    TRANSFORM,
    FieldError,
    is_base64,
    is_crc,
    is_crc_list,
    is_dtype_name,
    is_file_name,
    is_nonneg,
    is_nonneg_list,
    is_range,
    list_of,
)


@pytest.mark.parametrize(
    "check, yes, no",
    [
        (is_nonneg, [0, 5, 1 << 40], [-1, True, 1.0, "1", None]),
        (is_crc, [0, (1 << 32) - 1], [1 << 32, -1, True, 1.5]),
        (is_nonneg_list, [[], [0, 3]], [(0, 3), [-1], [True], [1.0], None]),
        (is_crc_list, [[], [0, (1 << 32) - 1]], [[1 << 32], [False], (1,)]),
        (is_range, [[0, 0], [3, 9]], [[1], [1, 2, 3], (1, 2), [-1, 2], [1, True]]),
        (
            is_file_name,
            ["a", "__0_0.sw0123456789ab.distcp", "..."],
            ["", ".", "..", "a/b", "a\\b", "a\0", 3],
        ),
        (is_dtype_name, ["float32", "bfloat16"], ["float33", "Tensor", 3, ""]),
        (is_base64, ["YQ==", "AAEC"], ["", "not base64!", "YQ=", 3]),
    ],
    ids=["nonneg", "crc", "nonneg_list", "crc_list", "range", "file_name", "dtype_name", "base64"],
)
def test_predicates(check, yes, no):
    assert [check(v) for v in yes] == [True] * len(yes)
    assert [check(v) for v in no] == [False] * len(no)


def test_list_of_checks_every_element():
    strings = list_of(lambda v: isinstance(v, str))
    assert strings([]) and strings(["a", "b"])
    assert not strings(["a", 1]) and not strings("ab") and not strings(("a",))


@pytest.mark.parametrize(
    "kind, value, expected",
    [
        (POSITIVE, 0, "expected a positive integer, got 0"),
        (CRC, 1 << 32, "expected a crc32c: an integer in [0, 2**32), got 4294967296"),
        (INDEX, [1, -1], "expected a list of non-negative integers, got [1, -1]"),
        (FILE, "../x", "expected a file name (no `/`, no `..`), got '../x'"),
        (TRANSFORM, [], "expected a non-empty list of strings, got []"),
        (RANGE_OR_NULL, [1], "expected [offset, length] or null, got [1]"),
    ],
    ids=["positive", "crc", "index", "file", "transform", "range-or-null"],
)
def test_a_kind_names_what_it_expected_and_the_field(kind, value, expected):
    with pytest.raises(FieldError) as info:
        kind.parse(value, 3, "tensors['w'].x")
    assert str(info.value) == f"field tensors['w'].x: {expected}"
    assert info.value.path == "tensors['w'].x"


def test_kinds_convert_lists_to_tuples():
    assert INDEX.parse([2, 3], 3, "p") == (2, 3)
    assert RANGE_OR_NULL.parse([0, 9], 3, "p") == (0, 9)
    assert RANGE_OR_NULL.parse(None, 3, "p") is None
    assert TRANSFORM.parse(["stream.zstd/1"], 3, "p") == ["stream.zstd/1"]
