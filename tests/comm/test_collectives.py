"""Collectives on real ranks (gloo), each result checked bit for bit against the full tensor."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import shardwise as sw
from shardwise import Block, InvalidTypeError, Layout, ShardedTensor
from shardwise.testing import run_ranks, shard_of
from tests.comm.refusal import refuse

pytestmark = pytest.mark.spawned

SHAPE = (9, 8)


def full_tensor() -> torch.Tensor:
    return torch.arange(SHAPE[0] * SHAPE[1], dtype=torch.float32).reshape(SHAPE)


def chain(world: int) -> list[Layout]:
    """row-wise uneven -> column-wise multi-block -> grid -> replicated -> table-wise."""
    rows = [0] * world
    rows[0], rows[-1] = 4, 5  # uneven; middle ranks empty when world > 2
    return [
        Layout.row_wise(SHAPE, rows),
        Layout.column_wise(
            SHAPE, [1, 3, 2, 2], ranks=[i % world for i in range(4)], world_size=world
        ),
        Layout.grid(SHAPE, (world, 1)) if world != 4 else Layout.grid(SHAPE, (2, 2)),
        Layout.replicated(SHAPE, world),
        Layout.table_wise(SHAPE, world - 1, world),
        Layout.chunked(SHAPE, 1, world),
    ]


def _check(st: ShardedTensor, full: torch.Tensor, what: str) -> list[str]:
    bad = []
    for shard, block in zip(st.local_shards(), st.local_blocks):
        if not torch.equal(shard, full[block.slices()]):
            bad.append(f"rank {st.rank} {what} {block}")
    return bad


def _redistribute_chain(rank: int, world: int) -> list[str]:
    full = full_tensor()
    layouts = chain(world)
    bad = []
    st = ShardedTensor.from_layout(layouts[0], shard_of(full, layouts[0], rank))
    for step, layout in enumerate(layouts[1:] + layouts[:1]):
        stats: dict[str, int] = {}
        prev = st.layout_spec
        st = st.redistribute(layout, stats=stats)
        bad += _check(st, full, f"step {step}")
        planned = sum(
            t.region.numel * 4
            for t in sw.plan_transfers(prev, layout)
            if t.src_rank == rank and not t.is_local
        )
        if stats["bytes_sent"] != planned:
            bad.append(
                f"rank {rank} step {step}: sent {stats['bytes_sent']} bytes, planned {planned}"
            )
    return bad


@pytest.mark.parametrize("world", [2, 3, 4])
def test_redistribute_between_any_layouts(world):
    assert run_ranks(_redistribute_chain, world, timeout=60) == [[]] * world


def _async_redistribute(rank: int, world: int, flag: str) -> list[str]:
    """`redistribute(..., async_op=True)` returns before the peers' messages are posted:
    rank 1 posts its all-to-all only once rank 0 has returned from its own call (a flag
    file; a synchronous move would wait for rank 1, which waits for the flag, and rank
    1 reports that). Moves in flight together, and a synchronous one among them, each
    get their own buffers: every result equals the full tensor's blocks."""
    import os
    import time

    from shardwise.comm.communicator import ProcessGroupCommunicator

    full = full_tensor()
    layouts = chain(world)
    bad = []
    st = ShardedTensor.from_layout(layouts[1], shard_of(full, layouts[1], rank))
    if rank == 1:
        posted = ProcessGroupCommunicator.all_to_all_single

        def after_rank_0(self, *args):  # type: ignore[no-untyped-def]
            deadline = time.monotonic() + 30
            while not os.path.exists(flag):
                if time.monotonic() > deadline:
                    bad.append("rank 0 did not return from redistribute(async_op=True)")
                    break
                time.sleep(0.01)
            ProcessGroupCommunicator.all_to_all_single = posted  # once
            return posted(self, *args)

        ProcessGroupCommunicator.all_to_all_single = after_rank_0
    first = st.redistribute(layouts[2], async_op=True)
    if rank == 0:
        if first._arriving is None:
            bad.append("rank 0: the result had landed before rank 1 posted")
        open(flag, "w").close()
    second = st.redistribute(layouts[0], async_op=True)  # several blocks: packed buffers
    middle = st.redistribute(layouts[5])  # synchronous, on the shared staging buffer
    third = second.redistribute(layouts[3], async_op=True)  # reads `second`: waits first
    bad += _check(middle, full, "synchronous between")
    bad += _check(third, full, "async of async")
    bad += _check(second, full, "second")
    bad += _check(first, full, "first")
    if any(t._arriving is not None for t in (first, second, third)):
        bad.append(f"rank {rank}: read but still arriving")
    # differentiable: the gradient moves back to the source's layout
    x = ShardedTensor.from_layout(layouts[0], shard_of(full, layouts[0], rank))
    x.requires_grad_(True)
    y = x.redistribute(layouts[1], async_op=True)
    (y * 2).sum().backward()
    bad += _check(x.grad, torch.full(SHAPE, 2.0), "gradient")
    return bad


@pytest.mark.parametrize("world", [2, 3])
def test_async_redistribute_returns_before_the_messages_land(world, tmp_path):
    flag = str(tmp_path / "rank 0 returned")
    assert run_ranks(_async_redistribute, world, flag, timeout=90) == [[]] * world


def _gather_family(rank: int, world: int) -> list[str]:
    full = full_tensor()
    bad = []
    for i, layout in enumerate(chain(world)):
        st = ShardedTensor.from_layout(layout, shard_of(full, layout, rank))
        if not torch.equal(st.full_tensor(), full):
            bad.append(f"rank {rank} full_tensor of layout {i}")
        g = st.gather(dst=world - 1)
        if (g is None) != (rank != world - 1) or (g is not None and not torch.equal(g, full)):
            bad.append(f"rank {rank} gather of layout {i}")
        back = sw.distribute(full if rank == 1 else None, layout, src=1)
        bad += _check(back, full, f"distribute {i}")
        if not sw.equal(st, back) or not sw.equal(st, back.redistribute(chain(world)[0])):
            bad.append(f"rank {rank} equal {i}")
    # zero-element shards and an empty tensor: no deadlock
    zero = Layout((0, 4), {0: [Block((0, 0), (0, 4))]}, world)
    z = ShardedTensor.from_layout(
        zero, [torch.empty(0, 4)] if rank == 0 else [], dtype=torch.float32
    )
    if z.full_tensor().shape != (0, 4) or (rank == 0 and z.gather(0).shape != (0, 4)):
        bad.append(f"rank {rank} zero-size")
    if rank != 0:
        z.gather(0)
    # 0-d and a different value on one rank
    scalar = sw.distribute(torch.tensor(3.5) if rank == 0 else None, Layout.replicated((), world))
    if scalar.full_tensor().item() != 3.5:
        bad.append(f"rank {rank} scalar")
    other = ShardedTensor.from_layout(chain(world)[3], [full + (1 if rank == 0 else 0)])
    if sw.equal(other, ShardedTensor.from_layout(chain(world)[3], [full.clone()])):
        bad.append(f"rank {rank} equal missed a difference on rank 0")
    return bad


@pytest.mark.parametrize("world", [2, 3])
def test_full_tensor_gather_distribute_equal(world):
    assert run_ranks(_gather_family, world, timeout=60) == [[]] * world


def _from_local_shards_ok(rank: int, world: int) -> list[str]:
    full = full_tensor()
    layout = chain(world)[1]  # several blocks per rank, maybe none
    shards = shard_of(full, layout, rank)
    offsets = [b.offsets for b in layout.blocks_of(rank)]
    st = ShardedTensor.from_local_shards(shards, offsets)
    bad = [] if st.layout_spec == layout else [f"rank {rank} layout {st.layout_spec!r}"]
    if st.local_shards()[0] is not shards[0] if shards else False:
        bad.append("copied the shards")
    # global shape given, and a rank with nothing at all
    only = Layout.table_wise(SHAPE, 0, world)
    st2 = ShardedTensor.from_local_shards(
        [full] if rank == 0 else [], [(0, 0)] if rank == 0 else [], global_shape=SHAPE
    )
    if st2.layout_spec != only or st2.dtype != torch.float32:
        bad.append(f"rank {rank} table-wise")
    return bad + _check(st, full, "from_local_shards")


def test_from_local_shards_learns_the_layout():
    assert run_ranks(_from_local_shards_ok, 3, timeout=60) == [[]] * 3


BAD_INPUT = {
    "overlap": lambda r: (
        ([torch.zeros(5, 8)], [(0, 0)])
        if r == 0
        else ([torch.zeros(6, 8)], [(3, 0)])
        if r == 1
        else ([], [])
    ),
    "out-of-bounds": lambda r: (
        ([torch.zeros(9, 8)], [(0, 0)])
        if r == 0
        else ([torch.zeros(1, 8)], [(9, 0)])
        if r == 1
        else ([], [])
    ),
    "hole": lambda r: ([torch.zeros(3, 8)], [(3 * r, 0)]) if r != 1 else ([], []),
    "dtype": lambda r: (
        [torch.zeros(3, 8, dtype=torch.float64 if r == 1 else torch.float32)],
        [(3 * r, 0)],
    ),
    "non-contiguous": lambda r: (
        [torch.zeros(8, 3).t() if r == 2 else torch.zeros(3, 8)],
        [(3 * r, 0)],
    ),
    "lengths": lambda r: ([torch.zeros(3, 8)], [(3 * r, 0), (0, 0)] if r == 1 else [(3 * r, 0)]),
    "ndim": lambda r: (
        [torch.zeros(3, 8, 1) if r == 2 else torch.zeros(3, 8)],
        [(3 * r, 0, 0) if r == 2 else (3 * r, 0)],
    ),
}
EXPECTED = {
    "overlap": (sw.LayoutError, "overlap"),
    "out-of-bounds": (sw.LayoutError, "out of bounds"),
    "hole": (sw.LayoutError, "hole"),
    "dtype": (InvalidTypeError, "rank 1"),
    "non-contiguous": (sw.ShardMismatchError, "rank 2"),
    "lengths": (sw.ShardMismatchError, "rank 1"),
    "ndim": (sw.LayoutError, "ndim"),
}


def _bad_from_local_shards(rank: int, world: int, case: str) -> tuple[str, str]:
    shards, offsets = BAD_INPUT[case](rank)
    global_shape = (9, 8) if case == "out-of-bounds" else None
    try:
        ShardedTensor.from_local_shards(shards, offsets, global_shape=global_shape)
    except Exception as e:
        # the group must still work afterwards
        t = torch.ones(1)
        dist.all_reduce(t)
        return type(e).__name__, str(e)
    return "no error", ""


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_on_one_rank_raises_the_same_error_everywhere(case):
    results = run_ranks(_bad_from_local_shards, 3, case, timeout=30)
    kind, word = EXPECTED[case]
    assert len(set(results)) == 1, results  # same type and message on every rank
    name, message = results[0]
    assert name == kind.__name__ and word in message, results[0]


def _redistribute_bad(rank: int, world: int) -> str:
    st = ShardedTensor.zeros(Layout.chunked(SHAPE, 0, world))
    try:
        st.redistribute(Layout.chunked((9, 9), 0, world))
    except sw.LayoutError as e:
        return str(e)
    return "no error"


def test_redistribute_to_another_shape_is_refused():
    assert all("(9, 9)" in r for r in run_ranks(_redistribute_bad, 2, timeout=30))


def _rows3(rank: int) -> ShardedTensor:
    layout = Layout.chunked(SHAPE, 0, 3)
    return ShardedTensor.from_layout(layout, shard_of(full_tensor(), layout, rank))


def _on(rank: int, good, bad):
    return bad if rank == 1 else good


# Entry points whose argument checks used to raise on the faulty rank before the
# first exchange, leaving the others waiting there: rank 1 is the faulty rank.
REFUSE_TOGETHER = {
    "from_local_shards-offsets-not-ints": (
        lambda r: ShardedTensor.from_local_shards(
            [torch.zeros(3, 8)], [_on(r, (3 * r, 0), ("3", "0"))]
        ),
        InvalidTypeError,
    ),
    "from_local_shards-shards-not-a-list": (
        lambda r: ShardedTensor.from_local_shards(_on(r, [torch.zeros(3, 8)], None), [(3 * r, 0)]),
        InvalidTypeError,
    ),
    "from_local_shards-global-shape-garbage": (
        lambda r: ShardedTensor.from_local_shards(
            [torch.zeros(3, 8)], [(3 * r, 0)], global_shape=_on(r, SHAPE, "9x8")
        ),
        InvalidTypeError,
    ),
    "from_local_shards-global-shape-differs": (
        lambda r: ShardedTensor.from_local_shards(
            [torch.zeros(3, 8)], [(3 * r, 0)], global_shape=_on(r, SHAPE, (10, 8))
        ),
        sw.ShardMismatchError,
    ),
    "from_local_shards-ndim": (
        lambda r: ShardedTensor.from_local_shards(
            [_on(r, torch.zeros(3, 8), torch.zeros(3, 8, 1))], [_on(r, (3 * r, 0), (3, 0, 0))]
        ),
        sw.LayoutError,
    ),
    "distribute-source-not-a-layout": (
        lambda r: sw.distribute(
            full_tensor() if r == 1 else None, _on(r, Layout.chunked(SHAPE, 0, 3), "rows"), src=1
        ),
        InvalidTypeError,
    ),
    "distribute-src-out-of-range": (
        lambda r: sw.distribute(
            full_tensor() if r == 0 else None, Layout.chunked(SHAPE, 0, 3), src=_on(r, 0, 7)
        ),
        sw.InvalidArgumentError,
    ),
    "distribute-source-wrong-shape": (
        lambda r: sw.distribute(
            torch.zeros(8, 8) if r == 1 else None, Layout.chunked(SHAPE, 0, 3), src=1
        ),
        sw.LayoutError,
    ),
    "equal-plain-tensor": (
        lambda r: sw.equal(_rows3(r), _on(r, _rows3(r), full_tensor())),
        InvalidTypeError,
    ),
    "gather-dst-out-of-range": (
        lambda r: _rows3(r).gather(_on(r, 0, 3)),
        sw.InvalidArgumentError,
    ),
    "redistribute-not-a-layout": (
        lambda r: _rows3(r).redistribute(_on(r, Layout.chunked(SHAPE, 1, 3), None)),
        InvalidTypeError,
    ),
}


def _refuse_together(rank: int, world: int, case: str) -> tuple[str, str, float]:
    return refuse(REFUSE_TOGETHER[case][0], rank)


@pytest.mark.parametrize("case", list(REFUSE_TOGETHER))
def test_every_entry_point_refuses_together_naming_the_rank(case):
    results = run_ranks(_refuse_together, 3, case, timeout=30)  # a hang fails in 30 s
    assert len(set(results)) == 1, results
    name, message, total = results[0]
    assert name == REFUSE_TOGETHER[case][1].__name__, results[0]
    assert message.startswith("rank 1: ") and total == 3, results[0]
