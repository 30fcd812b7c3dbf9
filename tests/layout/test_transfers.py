from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardwise import Block, Layout, LayoutError, plan_transfers
from shardwise.layout import BlockIndex

from .strategies import layouts, partitions, shapes


def apply_plan(full: torch.Tensor, src: Layout, dst: Layout, plan) -> dict:
    """Execute a plan in one process: build every destination shard from source shards."""
    src_shards = {
        (r, i): full[b.slices()].clone()
        for r, bs in enumerate(src.blocks)
        for i, b in enumerate(bs)
    }
    out = {
        (r, i): torch.full(b.sizes, -1, dtype=full.dtype)
        for r, bs in enumerate(dst.blocks)
        for i, b in enumerate(bs)
    }
    counts = {k: torch.zeros(v.shape, dtype=torch.int32) for k, v in out.items()}
    for t in plan:
        src_block = src.blocks_of(t.src_rank)[t.src_block_index]
        dst_block = dst.blocks_of(t.dst_rank)[t.dst_block_index]
        assert src_block.contains(t.region) and dst_block.contains(t.region)
        piece = src_shards[t.src_rank, t.src_block_index][t.region.relative_to(src_block).slices()]
        where = t.region.relative_to(dst_block).slices()
        out[t.dst_rank, t.dst_block_index][where] = piece
        counts[t.dst_rank, t.dst_block_index][where] += 1
    return out, counts


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_every_destination_element_exactly_once(data):
    shape = data.draw(shapes())
    src = data.draw(layouts(shape))
    dst = data.draw(layouts(shape))
    plan = plan_transfers(src, dst)
    full = torch.arange(max(1, torch.Size(shape).numel()), dtype=torch.int64)[
        : torch.Size(shape).numel()
    ].reshape(shape)
    out, counts = apply_plan(full, src, dst, plan)
    for (rank, i), shard in out.items():
        block = dst.blocks_of(rank)[i]
        assert bool((counts[rank, i] == 1).all()), (rank, i)
        assert torch.equal(shard, full[block.slices()])
    # local first: nothing a destination rank already holds is fetched remotely
    for t in plan:
        if not t.is_local and t.dst_rank < src.world_size:
            for held in src.blocks_of(t.dst_rank):
                assert held.intersect(t.region) is None, t


def test_reads_spread_over_replicas():
    src = Layout.replicated((8, 8), 4)
    dst = Layout.chunked((8, 8), 0, 8)  # ranks 4..7 hold nothing in src
    wider = Layout(dst.global_shape, dst.blocks, 8)
    src8 = Layout(src.global_shape, src.blocks, 8)
    plan = plan_transfers(src8, wider)
    remote = [t for t in plan if not t.is_local]
    assert sorted(t.src_rank for t in remote) == [0, 1, 2, 3]  # one each, not all from rank 0
    assert all(t.is_local for t in plan if t.dst_rank < 4)


def test_plan_errors():
    with pytest.raises(LayoutError, match="global shapes"):
        plan_transfers(Layout.chunked((4,), 0, 2), Layout.chunked((5,), 0, 2))
    holes = Layout((4,), {0: [Block((0,), (2,))]}, allow_holes=True)
    with pytest.raises(LayoutError, match="rank 1"):
        plan_transfers(holes, Layout.chunked((4,), 0, 2))


def test_zero_d_and_empty():
    plan = plan_transfers(Layout.table_wise((), 0, 2), Layout.replicated((), 2))
    assert [(t.src_rank, t.dst_rank) for t in plan] == [(0, 0), (0, 1)]
    assert plan_transfers(Layout.chunked((0, 3), 0, 2), Layout.chunked((0, 3), 1, 2)) == []


def test_block_index_query():
    blocks = [Block((0, c), (4, 1)) for c in range(8)]
    index = BlockIndex(blocks)
    got = index.query(Block((1, 2), (2, 3)))
    assert [b for b, _ in got] == blocks[2:5]
    assert got[0][1] == Block((1, 2), (2, 1))


def test_planning_1024_ranks_is_output_sensitive():
    """Grid -> grid at 1,024 ranks: few candidates per query, not all pairs."""
    shape = (8192, 8192)
    src = Layout.grid(shape, (32, 32))
    dst = Layout.grid(shape, (16, 64))
    plan = plan_transfers(src, dst)
    assert len(plan) == 2048
    assert sum(t.region.numel for t in plan) == 8192 * 8192


def test_transposed_grid_plans_by_cells_not_bands():
    """Found by the soak: a 1000x100 -> 100x1000 grid plan scanned whole bands (97 s at
    100k blocks). The cell index makes each query touch only its own cells."""
    src = Layout.grid((400, 400), (100, 100))
    dst = Layout.grid((400, 400), (10, 1000))  # 400 one-column parts, 600 empty
    index = BlockIndex(list(src.distinct_blocks))
    assert index._cells is not None
    plan = plan_transfers(src, dst)
    assert len(plan) == 10 * 400 * 10 and sum(t.region.numel for t in plan) == 400 * 400


class _ScanIndex(BlockIndex):
    """A `BlockIndex` that never builds the cell grid: its sorted-scan fallback, which the
    builders' layouts never reach (it serves only more than `_MAX_CELLS` cells)."""

    _MAX_CELLS = -1


@st.composite
def _blocks_and_box(draw) -> tuple[list[Block], Block]:
    """Disjoint blocks (a random partition with random holes, at least one block kept) and
    a query box in bounds."""
    shape = draw(shapes(max_size=9).filter(lambda s: len(s) >= 1 and all(s)))
    parts = draw(partitions(shape))
    kept = draw(st.lists(st.booleans(), min_size=len(parts), max_size=len(parts)))
    blocks = [b for b, keep in zip(parts, kept) if keep] or parts[:1]
    offsets = tuple(draw(st.integers(0, n)) for n in shape)
    sizes = tuple(draw(st.integers(0, n - o)) for n, o in zip(shape, offsets))
    return blocks, Block(offsets, sizes)


@pytest.mark.parametrize("index_type", [BlockIndex, _ScanIndex], ids=["cells", "scan"])
@settings(max_examples=300, deadline=None)
@given(case=_blocks_and_box())
def test_block_index_query_matches_brute_force(index_type, case):
    """Both search paths return every block sharing an element with the box, once each,
    with the exact overlap: a scan window one short along its dimension drops blocks."""
    blocks, box = case
    index = index_type(blocks)
    if index_type is _ScanIndex:
        assert index._cells is None  # the fallback really runs
    got = index.query(box)
    expected = [(b, b.intersect(box)) for b in blocks if b.intersect(box) is not None]
    assert len(got) == len({b for b, _ in got})  # no block twice
    assert sorted(got, key=repr) == sorted(expected, key=repr)


def test_an_index_of_no_blocks_finds_nothing():
    assert BlockIndex([]).query(Block((0,), (2,))) == []
    assert BlockIndex([Block((0, 0), (0, 3))]).query(Block((0, 0), (1, 1))) == []
    with pytest.raises(LayoutError, match="holds only 0"):
        plan_transfers(Layout((4,), {0: []}, allow_holes=True), Layout.chunked((4,), 0, 2))
