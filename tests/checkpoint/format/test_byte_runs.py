"""`format.checksums`: the byte ranges of a sub-box, checked against torch's own slicing.

A stored chunk is C-contiguous; gathering the bytes of the runs `runs` computes
for a sub-box must give exactly the bytes of `chunk[box].contiguous()`.
"""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardwise.checkpoint.format.checksums import SMALL, few_runs, list_spans, runs, spans

DTYPES = [torch.uint8, torch.int16, torch.float32, torch.float64]  # itemsizes 1, 2, 4, 8


@st.composite
def _box_within(draw: st.DrawFn, shape: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """(offsets, lengths) of a box inside `shape`; zero lengths included, and whole
    dimensions often, since trailing whole dimensions are what runs fold."""
    offsets, lengths = [], []
    for size in shape:
        if draw(st.booleans()):
            offsets.append(0)
            lengths.append(size)
        else:
            offsets.append(draw(st.integers(0, size)))
            lengths.append(draw(st.integers(0, size - offsets[-1])))
    return tuple(offsets), tuple(lengths)


@st.composite
def cases(draw: st.DrawFn) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """A stored chunk of random bytes (a box of a random global shape), and a sub-box of it."""
    ndim = draw(st.integers(0, 4))
    global_shape = tuple(draw(st.lists(st.integers(0, 6), min_size=ndim, max_size=ndim)))
    _, chunk_shape = draw(_box_within(global_shape))
    offsets, lengths = draw(_box_within(chunk_shape))
    dtype = draw(st.sampled_from(DTYPES))
    seed = draw(st.integers(0, 2**31 - 1))
    nbytes = math.prod(chunk_shape) * dtype.itemsize
    raw = torch.randint(
        0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)
    )
    return raw.view(dtype).reshape(chunk_shape), offsets, lengths


def _bytes(t: torch.Tensor) -> bytes:
    return bytes(t.contiguous().reshape(-1).view(torch.uint8).tolist())


@settings(max_examples=400, deadline=None)
@given(cases())
def test_runs_gather_exactly_the_sub_box(case) -> None:
    chunk, offsets, lengths = case
    raw = _bytes(chunk)
    starts, run = runs(tuple(chunk.shape), offsets, lengths, chunk.dtype.itemsize)
    starts_list = starts.tolist()

    gathered = b"".join(raw[s : s + run] for s in starts_list)
    box = chunk[tuple(slice(o, o + n) for o, n in zip(offsets, lengths))]
    assert gathered == _bytes(box)

    if starts_list:
        assert run > 0
        assert 0 <= starts_list[0] and starts_list[-1] + run <= len(raw)
    # disjoint, increasing, merged: a run that touched the next would be one run
    assert all(a + run < b for a, b in zip(starts_list, starts_list[1:]))


@settings(max_examples=400, deadline=None)
@given(cases(), st.one_of(st.none(), st.integers(1, 48)), st.data())
def test_spans_cover_every_run_in_order(case, page, data) -> None:
    chunk, offsets, lengths = case
    limit = chunk.numel() * chunk.dtype.itemsize
    starts, run = runs(tuple(chunk.shape), offsets, lengths, chunk.dtype.itemsize)
    if not len(starts):
        return  # nothing to read: the reader makes no spans
    starts_list = starts.tolist()
    # how far apart consecutive runs are once widened to whole pages
    distances = [
        _widened(b, page) - _widened(a + run, page, limit)
        for a, b in zip(starts_list, starts_list[1:])
    ]
    # a gap equal to one of those distances is the boundary case: that pair must split
    gap = data.draw(st.one_of(st.integers(0, 64), st.sampled_from(distances or [0])))
    found = spans(starts, run, gap, page, limit)

    assert [first for _, _, first, _ in found] == [0] + [end for _, _, _, end in found[:-1]]
    assert found[-1][3] == len(starts_list)
    for (start, length, first, end), nxt in zip(found, [*found[1:], None]):
        assert first < end
        assert start <= starts_list[first] and starts_list[end - 1] + run <= start + length
        assert 0 <= start and start + length <= limit
        if page is not None:
            assert start % page == 0 and ((start + length) % page == 0 or start + length == limit)
        else:
            assert start == starts_list[first] and start + length == starts_list[end - 1] + run
        if nxt is not None:
            assert nxt[0] - (start + length) >= gap  # closer spans would have been merged
        assert all(d < gap for d in distances[first : end - 1])  # ...and farther runs split


def _widened(at: int, page: int | None, limit: int | None = None) -> int:
    """`at` moved to its page boundary: down for a start, up (within `limit`) for an end."""
    if page is None:
        return at
    if limit is None:
        return at // page * page
    return min(-(-at // page) * page, limit)


@settings(max_examples=400, deadline=None)
@given(cases(), st.one_of(st.none(), st.integers(1, 48)), st.integers(0, 64))
def test_the_list_path_is_the_tensor_path_for_few_runs(case, page, gap) -> None:
    """`few_runs` / `list_spans` (the reader's path for at most `SMALL` runs) give
    exactly what `runs` / `spans` give, and decline only above `SMALL` runs."""
    chunk, offsets, lengths = case
    shape, itemsize = tuple(chunk.shape), chunk.dtype.itemsize
    limit = chunk.numel() * itemsize
    starts, run = runs(shape, offsets, lengths, itemsize)
    few = few_runs(shape, offsets, lengths, itemsize)
    if few is None:
        assert len(starts) > SMALL
        return
    assert few == (starts.tolist(), run)
    if len(starts):
        assert list_spans(few[0], run, gap, page, limit) == spans(starts, run, gap, page, limit)


def test_few_runs_declines_above_small() -> None:
    shape = (SMALL + 1, 4)
    assert few_runs(shape, (0, 1), (SMALL, 2), 4) == ([4 * (4 * i + 1) for i in range(SMALL)], 8)
    assert few_runs(shape, (0, 1), (SMALL + 1, 2), 4) is None
    assert few_runs(shape, (0, 0), (SMALL + 1, 4), 4) == ([0], 4 * 4 * (SMALL + 1))  # one run
