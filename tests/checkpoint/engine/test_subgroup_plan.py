"""The plan of a save holding tensors of process subgroups (`engine.plan`), ranks in one
process: the DP copies of a TP-sharded tensor are one box held by several ranks, written
once, the writes spread over the DP rows; copies that disagree are named once per key,
with their ranks; and what a rank receives to plan does not grow with the world."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shardwise import Block, Layout, ShardedTensor
from shardwise.checkpoint.engine import plan as plan_cache
from shardwise.checkpoint.engine.inventory import describe
from shardwise.checkpoint.engine.plan import plan_save, ranks_text
from shardwise.checkpoint.engine.save import save_state
from shardwise.comm.agreement import Agreement
from shardwise.testing import shard_of

from ...comm.threaded_world import ThreadedWorld

TP = 2


@pytest.fixture(autouse=True)
def _fresh() -> None:
    plan_cache.forget()


def _tp_tensor(world_rank: int, shape: tuple[int, ...], rows: list[int], value: float = 1.0):
    """World rank `world_rank`'s copy of a TP-sharded tensor: TP rank = world rank mod TP
    (its layout's ranks are the TP group's)."""
    layout = Layout.row_wise(shape, rows)
    full = torch.full(shape, value)
    return ShardedTensor.from_layout(
        layout, shard_of(full, layout, world_rank % TP), rank=world_rank % TP
    )


def _inventories(world: int, state_of) -> list[list]:
    return [describe(s, {k: (k,) for k in s}, {})[0] for s in map(state_of, range(world))]


def test_dp_copies_are_written_once_spread_over_the_dp_rows() -> None:
    """DP 4 x TP 2, eight TP-sharded tensors of 4 x 8 float32 (two 64 B boxes each): 16
    distinct boxes, each held by 4 ranks, each written by one; every rank writes two."""
    keys = [f"layer{i}.w" for i in range(8)]
    plan = plan_save(_inventories(8, lambda r: {k: _tp_tensor(r, (4, 8), [2, 2]) for k in keys}))
    assert plan.problems == []
    for key in keys:
        chunks = sorted((c[0], c[1]) for c in plan.tensors[key].chunks)
        assert chunks == [((0, 0), (2, 8)), ((2, 0), (2, 8))], key
    assert [len(w) for w in plan.writes] == [2] * 8
    for rank, writes in enumerate(plan.writes):  # a rank writes only boxes it holds
        for key, index in writes:
            assert index == 0 and any(
                c[2] == rank and c[0] == ((rank % TP) * 2, 0) for c in plan.tensors[key].chunks
            )


def test_a_rank_holding_nothing_of_a_subgroup_tensor_writes_nothing_of_it() -> None:
    """TP rank 1 holds no block of "v" (TP rank 0 holds both): only ranks 0 and 2 hold
    it, and one of them writes each of its two blocks."""

    def state(r: int) -> dict:
        lay = Layout((4, 4), {0: [Block((0, 0), (4, 2)), Block((0, 2), (4, 2))], 1: []})
        shards = shard_of(torch.ones(4, 4), lay, r % TP)
        return {"v": ShardedTensor.from_layout(lay, shards, rank=r % TP, dtype=torch.float32)}

    plan = plan_save(_inventories(4, state))
    assert plan.problems == []
    writers = sorted((c[0], c[2]) for c in plan.tensors["v"].chunks)
    assert [w[0] for w in writers] == [(0, 0), (0, 2)]
    assert {w[1] for w in writers} == {0, 2}  # spread over the two DP rows' rank 0


def test_copies_that_disagree_are_named_once_per_key_with_their_ranks() -> None:
    """DP 4 x TP 2: rows 2 and 3 (ranks 4-7) hold "w" in another shape, rank 7 "u" in
    another dtype, and row 1 (ranks 2, 3) cuts "x" elsewhere."""

    def state(r: int) -> dict:
        w_shape = (8, 9) if r >= 4 else (8, 8)
        u = _tp_tensor(r, (4, 2), [2, 2])
        return {
            "w": _tp_tensor(r, w_shape, [4, 4]),
            "u": u.to(torch.float64) if r == 7 else u,
            "x": _tp_tensor(r, (6, 2), [3, 3] if r // TP != 1 else [4, 2]),
        }

    problems = plan_save(_inventories(8, state)).problems
    assert problems == [
        "'w': rank 0 holds a tensor of dtype float32, shape (8, 8) but ranks 4-7 hold a tensor "
        "of dtype float32, shape (8, 9)",
        "'u': rank 0 holds a tensor of dtype float32, shape (4, 2) but rank 7 holds a tensor "
        "of dtype float64, shape (4, 2)",
        "'x': the block [0:3, 0:2] held by ranks 0, 4, 6 and the block [0:4, 0:2] held by rank "
        "2 partly overlap; ranks holding copies of a part (replicas, such as the data-parallel "
        "copies of a tensor-parallel weight) must hold identical blocks: give every copy the "
        "same layout",
    ]


@pytest.mark.parametrize(
    ("ranks", "text"),
    [
        ([3], "rank 3"),
        ([2, 3], "ranks 2, 3"),
        ([0, 1, 2, 3, 9], "ranks 0-3, 9"),
        (list(range(0, 40, 2)), "ranks 0, 2, 4, 6, 8, 10, 12, 14, ... (20 ranks)"),
        (list(range(512, 1024)), "ranks 512-1023"),
    ],
    ids=["one", "two", "a run", "many", "half of 1024"],
)
def test_ranks_are_named_briefly_at_any_world_size(ranks: list[int], text: str) -> None:
    assert ranks_text(ranks) == text


def _planning_bytes(world_size: int, tensors: int, folder: Path) -> int:
    """The bytes a rank received on average (rank 0, which also gets the records, left
    out) while saving `tensors` TP-sharded tensors on a DP (world / 2) x TP 2 grid."""
    world = ThreadedWorld(world_size)

    def save(comm) -> None:
        state = {f"layer{i}.w": _tp_tensor(comm.rank, (8, 8), [4, 4], i) for i in range(tensors)}
        save_state(state, folder, Agreement(comm))

    assert world.run(save) == [None] * world_size
    return sum(world.received[1:]) // (world_size - 1)


def test_what_a_rank_receives_to_plan_subgroup_tensors_does_not_grow_with_the_world(
    tmp_path: Path,
) -> None:
    """Each key's owner receives every rank's entry of it (W entries of one box) for its
    N / W keys, and each rank one decision per box it holds: about N entries per rank
    whatever W. All inventories to every rank would be 4x more at 16 ranks than at 4."""
    small = _planning_bytes(4, 256, tmp_path / "4")
    large = _planning_bytes(16, 256, tmp_path / "16")
    assert large < 1.5 * small, (small, large)


def _writers(folder: Path, names: str, world_size: int, tp: int) -> list[int]:
    """Chunks written per rank when DP (world / tp) x TP `tp` ranks save eight tensors,
    each row-sharded over its TP group, named `names.format(i)` (each key planned by
    its own owner: `crc32c(key) % world`)."""
    from shardwise.checkpoint.format.manifest import Manifest

    world = ThreadedWorld(world_size)

    def save(comm) -> None:
        layout = Layout.chunked((64, 64), 0, tp)
        state = {
            names.format(i): ShardedTensor.from_layout(
                layout,
                shard_of(torch.full((64, 64), i), layout, comm.rank % tp),
                rank=comm.rank % tp,
            )
            for i in range(8)
        }
        save_state(state, folder, Agreement(comm))

    assert world.run(save) == [None] * world_size
    counts = [0] * world_size
    for entry in Manifest.read(folder).tensors.values():
        for chunk in entry.chunks:
            counts[int(chunk.file.split("_")[2])] += 1
    return counts


@pytest.mark.parametrize("names", ["layer{:03d}.weight", "t{}"])
def test_each_dp_copy_writes_its_share_of_its_tp_groups_chunks(tmp_path: Path, names: str) -> None:
    """DP 4 x TP 4, eight tensors: each TP quarter is 8 chunks held by 4 DP copies. Their
    owners decide alone, but the copies number their boxes alike, so each writes 2, not
    1 to 3 as the owners' ranks fell (one data file each of the same size: a load reads
    each whole, `read_once._readers`)."""
    assert _writers(tmp_path / "ck", names, 16, 4) == [2] * 16
