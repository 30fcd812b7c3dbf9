from __future__ import annotations

import itertools
import json
import math
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

from shardwise import Block, Layout, LayoutError
from shardwise.layout import coverage

from .strategies import layouts

SPEC_EXAMPLE = Layout(
    global_shape=(1024, 256),
    blocks={
        0: [Block((0, 0), (1024, 64)), Block((0, 128), (1024, 64))],
        1: [Block((0, 64), (1024, 64)), Block((0, 192), (1024, 64))],
        2: [],
    },
)


def test_spec_example():
    assert SPEC_EXAMPLE.world_size == 3
    assert SPEC_EXAMPLE.blocks_of(2) == ()
    assert SPEC_EXAMPLE.blocks_of(0)[1] == Block((0, 128), (1024, 64))
    assert SPEC_EXAMPLE.ndim == 2 and SPEC_EXAMPLE.is_fully_covered
    assert SPEC_EXAMPLE.ranks_holding(Block((0, 64), (1024, 64))) == (1,)
    assert SPEC_EXAMPLE.replica_groups == {}


def test_value_semantics():
    again = Layout((1024, 256), SPEC_EXAMPLE.blocks)
    assert again == SPEC_EXAMPLE and hash(again) == hash(SPEC_EXAMPLE)
    assert eval(repr(SPEC_EXAMPLE)) == SPEC_EXAMPLE
    assert str(SPEC_EXAMPLE) == "Layout(1024x256, 4 blocks on 3 ranks)"
    assert Layout.chunked((8,), 0, 2) != Layout.chunked((8,), 0, 4)
    assert len({SPEC_EXAMPLE, again}) == 1


def test_replicas_and_world_size():
    rep = Layout.replicated((4, 4), 3)
    whole = Block((0, 0), (4, 4))
    assert rep.ranks_holding(whole) == (0, 1, 2)
    assert rep.replica_groups == {whole: (0, 1, 2)}
    assert Layout((4,), {0: [Block((0,), (4,))]}, world_size=4).blocks_of(3) == ()


# -- validation: each rule, and the message names rank, offsets and rule ----------

BAD_LAYOUTS = {
    "partial-overlap": (
        lambda: Layout((8, 8), {1: [Block((0, 0), (4, 8))], 2: [Block((2, 0), (6, 8))]}),
        ["rank 1", "rank 2", "(0, 0)", "(2, 0)", "partly overlap"],
    ),
    "strictly-inside": (
        lambda: Layout((8, 8), {0: [Block((0, 0), (8, 8))], 1: [Block((2, 2), (1, 1))]}),
        ["rank 0", "rank 1", "(2, 2)", "partly overlap"],
    ),
    "out-of-bounds": (
        lambda: Layout((8, 8), {0: [Block((0, 0), (8, 8))], 3: [Block((4, 4), (5, 1))]}),
        ["rank 3", "(4, 4)", "out of bounds"],
    ),
    "ndim": (
        lambda: Layout((8,), {0: [Block((0,), (8,))], 1: [Block((0, 0), (8, 1))]}),
        ["rank 1", "ndim"],
    ),
    "hole": (
        lambda: Layout((8, 8), {0: [Block((0, 0), (8, 4))], 1: []}),
        ["hole", "(0, 4)", "allow_holes"],
    ),
    "empty-layout-hole": (lambda: Layout((2,), {}), ["hole"]),
    "rank-beyond-world": (lambda: Layout((2,), {3: [Block((0,), (2,))]}, world_size=2), ["rank 3"]),
    "scalar-hole": (lambda: Layout((), {0: []}), ["hole"]),
}


@pytest.mark.parametrize("case", BAD_LAYOUTS, ids=list(BAD_LAYOUTS))
def test_bad_layouts_name_the_problem(case):
    build, words = BAD_LAYOUTS[case]
    with pytest.raises(LayoutError) as info:
        build()
    for word in words:
        assert word in str(info.value), (word, str(info.value))
    assert isinstance(info.value, ValueError)


def test_allowed_shapes_of_blocks():
    # touching blocks, zero-size blocks anywhere, empty ranks, replicas
    Layout((8,), {0: [Block((0,), (4,)), Block((3,), (0,))], 1: [], 2: [Block((4,), (4,))]})
    Layout((0, 5), {0: [Block((0, 0), (0, 5))]})
    holes = Layout((8, 8), {0: [Block((0, 0), (4, 8))]}, allow_holes=True)
    assert not holes.is_fully_covered
    assert Layout.from_json(holes.to_json()).allow_holes


@pytest.mark.parametrize("fallback", [False, True], ids=["raster", "sweep"])
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_validation_methods_agree(fallback, data):
    """Raster and sweep find the same problems; perturbing a valid layout is caught."""
    layout = data.draw(layouts())
    blocks = [b for b in layout.distinct_blocks if not b.is_empty()]
    if layout.ndim == 0 or not blocks:
        return
    victim = data.draw(st.sampled_from(blocks))
    d = data.draw(st.integers(0, layout.ndim - 1))
    grown = Block(victim.offsets, tuple(s + 1 if i == d else s for i, s in enumerate(victim.sizes)))
    shrunk = Block(
        victim.offsets, tuple(s - 1 if i == d else s for i, s in enumerate(victim.sizes))
    )
    old = coverage._MAX_RASTER_CELLS
    coverage._MAX_RASTER_CELLS = 0 if fallback else old
    try:
        Layout(layout.global_shape, layout.blocks)
        for replacement, must_fail in ((grown, True), (shrunk, True)):
            swapped = [[replacement if b == victim else b for b in bs] for bs in layout.blocks]
            found = coverage.analyze(
                list(dict.fromkeys(b for bs in swapped for b in bs if not b.is_empty())),
                layout.global_shape,
            )
            problem = found.out_of_bounds or found.overlap or found.hole
            assert (problem is not None) == must_fail
            with pytest.raises(LayoutError):
                Layout(layout.global_shape, swapped)
    finally:
        coverage._MAX_RASTER_CELLS = old


@settings(max_examples=100, deadline=None)
@given(layouts())
def test_json_round_trip(layout):
    text = layout.to_json()
    assert json.loads(text)["global_shape"] == list(layout.global_shape)
    assert Layout.from_json(text) == layout


@pytest.mark.parametrize(
    "text",
    [
        "{",
        '{"format": "other"}',
        '{"format": "shardwise.layout", "version": 99}',
        '{"format": "shardwise.layout", "version": 1, "blocks": 3}',
    ],
)
def test_bad_json(text):
    with pytest.raises(LayoutError):
        Layout.from_json(text)


# -- builders ----------------------------------------------------------------------


@pytest.mark.parametrize("n, world", [(10, 4), (5, 4), (3, 5), (0, 2), (8, 8), (7, 1)])
def test_chunked_matches_torch_chunk(n, world):
    layout = Layout.chunked((n, 3), 0, world)
    expected = [c.shape[0] for c in torch.arange(n).chunk(world)] if n else []
    got = [b.sizes[0] for bs in layout.blocks for b in bs]
    assert got == expected
    assert layout.world_size == world


def test_row_and_column_wise():
    rows = Layout.row_wise((10, 4), [3, 0, 7])
    assert rows.blocks == ((Block((0, 0), (3, 4)),), (), (Block((3, 0), (7, 4)),))
    cols = Layout.column_wise((1024, 256), [64] * 4, ranks=[0, 1, 0, 1], world_size=3)
    assert cols == SPEC_EXAMPLE
    with pytest.raises(ValueError, match="add up"):
        Layout.row_wise((10, 4), [3, 3])
    with pytest.raises(ValueError, match="add up"):
        Layout.column_wise((10, 4), [3, 3])


BAD_BUILDS = {
    "row_wise short": (lambda: Layout.row_wise((10, 4), [3, 3]), "add up to 6"),
    "row_wise negative": (lambda: Layout.row_wise((10, 4), [12, -2]), "non-negative"),
    "row_wise 0-d": (lambda: Layout.row_wise((), []), "at least 1 dimension"),
    "column_wise long": (lambda: Layout.column_wise((10, 4), [3, 3]), "add up to 6"),
    "column_wise negative": (lambda: Layout.column_wise((10, 4), [-1, 5]), "non-negative"),
    "column_wise 1-d": (lambda: Layout.column_wise((10,), [10]), "use row_wise"),
    "ranks per block": (lambda: Layout.row_wise((4,), [2, 2], ranks=[0]), "one rank per block"),
    "chunked no parts": (lambda: Layout.chunked((4,), 0, 0), "must be positive"),
    "chunked bad dim": (lambda: Layout.chunked((4, 4), 2, 2), "dimension 2 is out of range"),
    "grid entries": (lambda: Layout.grid((4, 4), (2,)), "one entry per dimension"),
    "grid size lists": (lambda: Layout.grid((4, 4), (2, 2), sizes=[[2, 2]]), "one list per"),
    "grid part count": (lambda: Layout.grid((4, 4), (2, 2), [[2, 2], [4]]), "one size per part"),
    "grid sizes sum": (lambda: Layout.grid((4, 4), (2, 2), [[2, 2], [1, 2]]), "add up to 3"),
    "table_wise rank": (lambda: Layout.table_wise((4,), rank=2, world_size=2), "range(2)"),
}


@pytest.mark.parametrize("case", BAD_BUILDS, ids=list(BAD_BUILDS))
def test_builders_raise_layout_error_saying_why(case):
    build, words = BAD_BUILDS[case]
    with pytest.raises(LayoutError, match=re.escape(words)):
        build()


def test_grid_is_row_major_with_sizes():
    g = Layout.grid((6, 7), (2, 3), sizes=[[1, 5], [0, 3, 4]])
    assert g.world_size == 6
    assert g.blocks_of(0) == ()  # zero-size part: the rank holds nothing
    assert g.blocks_of(1) == (Block((0, 0), (1, 3)),)
    assert g.blocks_of(5) == (Block((1, 3), (5, 4)),)
    n3 = Layout.grid((4, 4, 4), (2, 2, 2))
    assert n3.blocks_of(3) == (Block((0, 2, 2), (2, 2, 2)),)
    assert Layout.grid((), ()).blocks_of(0) == (Block((), ()),)


def test_table_wise_and_replicated():
    t = Layout.table_wise((5, 3), rank=2, world_size=4)
    assert [len(bs) for bs in t.blocks] == [0, 0, 1, 0]
    assert Layout.replicated((), 2).blocks == ((Block((), ()),), (Block((), ()),))


@pytest.mark.parametrize(
    "mesh, placements",
    [
        ((4,), [Shard(0)]),
        ((3,), [Shard(1)]),
        ((2, 2), [Shard(0), Shard(1)]),
        ((2, 3), [Replicate(), Shard(0)]),
        ((2, 2), [Shard(0), Shard(0)]),
        ((3, 2), [Shard(1), Shard(1)]),
        ((2,), [Replicate()]),
    ],
    ids=str,
)
def test_from_dtensor_spec_matches_dtensor(mesh, placements):
    shape = (7, 5)
    layout = Layout.from_dtensor_spec(mesh, placements, shape)
    for rank, coord in enumerate(itertools.product(*map(range, mesh))):
        sizes, offsets = _compute_local_shape_and_global_offset(
            shape, mesh, list(coord), placements
        )
        expected = () if math.prod(sizes) == 0 else (Block(offsets, sizes),)
        assert layout.blocks_of(rank) == expected, (rank, coord)


def test_from_dtensor_spec_rejects_partial():
    from torch.distributed.tensor import Partial

    with pytest.raises(LayoutError, match="Partial"):
        Layout.from_dtensor_spec((2,), [Partial()], (4,))


def test_layout_imports_no_process_group_code():
    """layout/ is pure math: stdlib, torch tensors, its siblings and shardwise.errors."""
    import ast
    import pathlib

    import shardwise.layout

    for path in pathlib.Path(shardwise.layout.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [("." * node.level) + (node.module or "")]
            else:
                continue
            for name in names:
                assert not name.startswith("torch.distributed"), (path.name, name)
                if name.startswith(".."):
                    assert name == "..errors", (path.name, name)


def test_scale_100k_blocks_validates():
    # Timing claims live in benchmarks/bench_layout.py; here: it works at scale.
    layout = Layout.grid((4000, 400), (1000, 100))
    assert sum(len(b) for b in layout.blocks) == 100_000
    assert Layout.from_json(layout.to_json()) == layout
