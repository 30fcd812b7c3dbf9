"""The chunks a record claims for a tensor (`format.checks`): in bounds, each element in
exactly one distinct chunk, and every refusal naming what is wrong."""

from __future__ import annotations

import pytest

from shardwise.checkpoint.format.checks import check_coverage, checked_ints
from shardwise.errors import CorruptCheckpointError

_REFUSED = ": damaged or crafted; refused (nothing a chunk does not hold is ever returned)"


def _problem(shape, chunks, **kw) -> str | None:
    """What `check_coverage` says of `chunks`, or None when it takes them."""
    try:
        check_coverage("w", shape, chunks, "rec", **kw)
    except CorruptCheckpointError as e:
        return str(e)
    return None


@pytest.mark.parametrize(
    "shape, chunks",
    [
        ((4,), [((0,), (4,))]),  # one whole chunk
        ((4,), [((2,), (2,)), ((0,), (2,))]),  # a cut along one dimension, in any order
        ((4, 4), [((0, 0), (2, 4)), ((2, 0), (2, 2)), ((2, 2), (2, 2))]),
        ((4,), [((0,), (4,)), ((0,), (4,))]),  # an exact replica
        ((), [((), ())]),  # 0-d
        ((0, 3), [((0, 0), (0, 3))]),  # empty: nothing to cover
        ((4,), [((0,), (4,)), ((1,), (0,))]),  # an empty chunk covers nothing, in bounds
    ],
    ids=["whole", "cut", "2d", "replica", "0-d", "empty", "empty-chunk"],
)
def test_exact_coverings_pass(shape, chunks):
    assert _problem(shape, chunks) is None


@pytest.mark.parametrize(
    "shape, chunks, why",
    [
        ((4,), [((0,), (2,)), ((3,), (1,))], "leave elements 2..3 of dimension 0 in no chunk"),
        ((4,), [((0,), (2,))], "leave elements 2.. of dimension 0 in no chunk"),
        ((4,), [((0,), (3,)), ((2,), (2,))], "overlap in part at 2 along dimension 0"),
        (
            (4, 4),
            [((0, 0), (2, 2)), ((0, 2), (2, 2)), ((2, 0), (2, 2))],
            "leave element (2, 2) in no chunk",
        ),
        (
            (4, 4),
            [((0, 0), (2, 2)), ((0, 2), (2, 2)), ((2, 0), (2, 4)), ((1, 1), (2, 2))],
            "overlap in part: [0:2, 0:2] and [1:3, 1:3]",
        ),
    ],
    ids=["hole-1d", "tail-1d", "overlap-1d", "hole-2d", "overlap-2d"],
)
def test_holes_and_overlaps_are_named_exactly(shape, chunks, why):
    assert _problem(shape, chunks) == f"rec: the chunks of 'w' (shape {shape}) {why}{_REFUSED}"


def test_a_per_rank_record_may_have_holes_but_never_overlaps():
    assert _problem((4,), [((0,), (2,))], holes=True) is None
    assert _problem((4, 4), [((0, 0), (2, 2)), ((2, 2), (2, 2))], holes=True) is None
    overlap = _problem((4,), [((0,), (3,)), ((2,), (2,))], holes=True)
    assert overlap is not None and "overlap in part at 2 along dimension 0" in overlap


def test_two_chunks_at_one_offset():
    twice = [((0,), (4,)), ((0,), (4,))]
    assert _problem((4,), twice, replicas=False) == (
        "rec: 'w' has two chunks at offsets (0,) (sizes (4,) and (4,)): damaged or crafted"
    )
    assert _problem((4,), [((0,), (4,)), ((0,), (2,))]) == (
        "rec: 'w' has two chunks at offsets (0,) (sizes (4,) and (2,)): damaged or crafted"
    )


def test_dimensions_and_bounds():
    assert _problem((4,), [((0, 0), (4, 1))]) == (
        "rec: chunk at offsets (0, 0) of 'w' has 2 dimensions, the tensor 1 (shape (4,))"
    )
    assert _problem((4,), [((2,), (3,))]) == (
        "rec: chunk at offsets (2,) sizes (3,) of 'w' lies outside its shape (4,)"
    )


@pytest.mark.parametrize(
    "value",
    [(True,), (-1,), (1.0,), (1 << 62,), ("1",)],
    ids=["bool", "neg", "float", "huge", "str"],
)
def test_only_plain_non_negative_ints_are_numbers(value):
    with pytest.raises(CorruptCheckpointError) as info:
        checked_ints(value, "chunk size", "w", "rec")
    assert str(info.value) == f"rec: 'w' has an invalid chunk size {value!r}"
    assert _problem((4,), [((0,), value)]) == f"rec: 'w' has an invalid chunk size {value!r}"


def test_checked_ints_takes_a_single_number_as_one():
    assert checked_ints(3, "shape", "w", "rec") == (3,)
    assert checked_ints([0, (1 << 62) - 1], "shape", "w", "rec") == (0, (1 << 62) - 1)
