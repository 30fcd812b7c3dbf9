"""Hypothesis strategies for random N-d layouts (0-d included)."""

from __future__ import annotations

from hypothesis import strategies as st

from shardwise import Block, Layout


@st.composite
def shapes(draw, max_ndim: int = 3, max_size: int = 7) -> tuple[int, ...]:
    ndim = draw(st.integers(0, max_ndim))
    return tuple(draw(st.integers(0, max_size)) for _ in range(ndim))


@st.composite
def partitions(draw, shape: tuple[int, ...], max_depth: int = 4) -> list[Block]:
    """Disjoint blocks covering `shape`, by random recursive cuts (not just grids)."""

    def split(offsets: tuple[int, ...], sizes: tuple[int, ...], depth: int) -> list[Block]:
        cuttable = [d for d, s in enumerate(sizes) if s > 1]
        if depth == 0 or not cuttable or not draw(st.booleans()):
            return [Block(offsets, sizes)]
        d = draw(st.sampled_from(cuttable))
        at = draw(st.integers(1, sizes[d] - 1))
        left = split(offsets, sizes[:d] + (at,) + sizes[d + 1 :], depth - 1)
        right_off = offsets[:d] + (offsets[d] + at,) + offsets[d + 1 :]
        right = split(right_off, sizes[:d] + (sizes[d] - at,) + sizes[d + 1 :], depth - 1)
        return left + right

    return split((0,) * len(shape), shape, max_depth)


@st.composite
def layouts(draw, shape: tuple[int, ...] | None = None, max_world: int = 5) -> Layout:
    """A valid layout: a random partition, each block on 1+ random ranks, some ranks empty."""
    if shape is None:
        shape = draw(shapes())
    world = draw(st.integers(1, max_world))
    blocks: dict[int, list[Block]] = {r: [] for r in range(world)}
    for block in draw(partitions(shape)):
        holders = draw(st.sets(st.integers(0, world - 1), min_size=1, max_size=world))
        for r in sorted(holders):
            blocks[r].append(block)
    for r in blocks:
        blocks[r] = draw(st.permutations(blocks[r]))
    return Layout(shape, blocks, world)
