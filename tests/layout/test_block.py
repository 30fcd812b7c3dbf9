from __future__ import annotations

import pickle

import pytest

from shardwise import Block, LayoutError
from shardwise.layout import overlap


def test_value_semantics():
    b = Block((0, 64), (128, 32))
    assert b == Block([0, 64], [128, 32])
    assert hash(b) == hash(Block((0, 64), (128, 32)))
    assert eval(repr(b)) == b
    assert str(b) == "[0:128, 64:96]"
    assert pickle.loads(pickle.dumps(b)) == b
    assert (b.ndim, b.numel, b.ends) == (2, 128 * 32, (128, 96))
    with pytest.raises(AttributeError):
        b.offsets = (1, 1)  # type: ignore[misc]


@pytest.mark.parametrize(
    "a, b, expected",
    [
        pytest.param(
            Block((0, 0), (4, 4)), Block((2, 2), (4, 4)), Block((2, 2), (2, 2)), id="corner"
        ),
        pytest.param(Block((0, 0), (4, 4)), Block((4, 0), (4, 4)), None, id="touching"),
        pytest.param(Block((0, 0), (4, 4)), Block((1, 1), (0, 2)), None, id="zero-size"),
        pytest.param(
            Block((0, 0), (8, 8)), Block((2, 2), (1, 1)), Block((2, 2), (1, 1)), id="inside"
        ),
        pytest.param(Block((), ()), Block((), ()), Block((), ()), id="0-d"),
        pytest.param(Block((3,), (2,)), Block((0,), (10,)), Block((3,), (2,)), id="1-d"),
    ],
)
def test_intersect(a, b, expected):
    assert a.intersect(b) == expected
    assert b.intersect(a) == expected
    # the same arithmetic on plain tuples, as the checkpoint engine calls it
    boxes = None if expected is None else (expected.offsets, expected.sizes)
    assert overlap(a.offsets, a.sizes, b.offsets, b.sizes) == boxes
    assert overlap(b.offsets, b.sizes, a.offsets, a.sizes) == boxes


def test_contains_and_relative():
    outer = Block((2, 2), (4, 4))
    assert outer.contains(Block((3, 3), (1, 3)))
    assert not outer.contains(Block((3, 3), (1, 4)))
    assert Block((3, 4), (1, 2)).relative_to(outer) == Block((1, 2), (1, 2))
    assert Block((1, 2), (2, 3)).slices() == (slice(1, 3), slice(2, 5))


@pytest.mark.parametrize(
    "offsets, sizes, error",
    [
        ((0,), (1, 2), ValueError),
        ((-1,), (2,), ValueError),
        ((0,), (-2,), ValueError),
        ((0.5,), (2,), TypeError),
        ((True,), (2,), TypeError),
    ],
)
def test_bad_blocks(offsets, sizes, error):
    with pytest.raises(error):
        Block(offsets, sizes)


@pytest.mark.parametrize(
    "offsets, sizes, words",
    [
        pytest.param((0,), (1, 2), ["(0,)", "(1, 2)", "ndim"], id="lengths differ"),
        pytest.param((-1, 0), (2, 2), ["(-1, 0)", "offsets must be non-negative"], id="offset<0"),
        pytest.param((0, 0), (2, -2), ["(2, -2)", "sizes must be non-negative"], id="size<0"),
    ],
)
def test_bad_blocks_raise_layout_error_saying_why(offsets, sizes, words):
    with pytest.raises(LayoutError) as info:
        Block(offsets, sizes)
    assert all(w in str(info.value) for w in words), str(info.value)


def test_mismatched_block_geometry_is_a_layout_error():
    with pytest.raises(LayoutError, match="2-d block.*1-d block.*ndim"):
        Block((0, 0), (2, 2)).intersect(Block((0,), (2,)))
    with pytest.raises(LayoutError, match="not inside"):
        Block((0, 0), (4, 4)).relative_to(Block((1, 1), (2, 2)))
