"""Interop with DTensor (plain and LocalShardsWrapper inside) and the legacy ShardedTensor."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper

import shardwise as sw
from shardwise import Layout
from shardwise.testing import run_ranks

pytestmark = pytest.mark.spawned

SHAPE = (7, 6)


def full() -> torch.Tensor:
    return torch.arange(42, dtype=torch.float32).reshape(SHAPE)


def _check(st, what):
    for shard, block in zip(st.local_shards(), st.local_blocks):
        if not torch.equal(shard, full()[block.slices()]):
            return [f"rank {st.rank} {what} {block}"]
    return []


PLACEMENTS = {
    1: [(Shard(0),), (Shard(1),), (Replicate(),)],
    2: [(Shard(0), Shard(1)), (Replicate(), Shard(0)), (Shard(1), Shard(1))],
}


def _dtensor_round_trip(rank: int, world: int) -> list[str]:
    bad = []
    meshes = {1: init_device_mesh("cpu", (world,))}
    if world == 4:
        meshes[2] = init_device_mesh("cpu", (2, 2))
    for ndim, mesh in meshes.items():
        for placements in PLACEMENTS[ndim]:
            dt = distribute_tensor(full(), mesh, placements)
            st = sw.from_dtensor(dt)
            bad += _check(st, f"from_dtensor {placements}")
            if st.local_shards() and st.local_shards()[0].data_ptr() != dt._local_tensor.data_ptr():
                bad.append(f"rank {rank} copied the shard")
            back = st.to_dtensor(mesh, placements)
            if not torch.equal(back.full_tensor(), full()) or back.placements != placements:
                bad.append(f"rank {rank} to_dtensor {placements}")
    # a layout DTensor cannot express
    uneven = sw.ShardedTensor.zeros(Layout.row_wise(SHAPE, [1] * (world - 1) + [8 - world]))
    try:
        uneven.to_dtensor(meshes[1], (Shard(0),))
        bad.append("expressed the inexpressible")
    except sw.LayoutError as e:
        if "redistribute" not in str(e):
            bad.append(str(e))
    return bad


@pytest.mark.parametrize("world", [2, 4])
def test_dtensor_both_ways(world):
    assert run_ranks(_dtensor_round_trip, world, timeout=60) == [[]] * world


def _torchrec_state(rank: int, world: int) -> list[str]:
    """Column-wise with two blocks per rank and a table-wise table with empty ranks,
    as TorchRec puts them in state dicts: DTensor around LocalShardsWrapper."""
    mesh = init_device_mesh("cpu", (world,))
    bad = []
    cases = {
        "column-wise": Layout.column_wise(
            SHAPE, [1, 2, 1, 2], ranks=[0, 1, 0, 1], world_size=world
        ),
        "table-wise": Layout.table_wise(SHAPE, world - 1, world),
    }
    for name, layout in cases.items():
        blocks = layout.blocks_of(rank)
        shards = [full()[b.slices()].clone() for b in blocks]
        lsw = LocalShardsWrapper(shards, [b.offsets for b in blocks])
        dt = DTensor.from_local(
            lsw, mesh, (Shard(1),), run_check=False, shape=torch.Size(SHAPE), stride=(6, 1)
        )
        st = sw.from_dtensor(dt)
        if st.layout_spec != layout:
            bad.append(f"rank {rank} {name}: {st.layout_spec!r}")
        bad += _check(st, name)
        # DTensor.from_local may re-view the wrapper; the memory must be the same
        if [s.data_ptr() for s in st.local_shards()] != [s.data_ptr() for s in shards]:
            bad.append(f"rank {rank} {name}: copied")
    return bad


def test_local_shards_wrapper_state_dicts():
    assert run_ranks(_torchrec_state, 3, timeout=60) == [[]] * 3


def _legacy(rank: int, world: int) -> list[str]:
    from torch.distributed._shard.sharded_tensor import Shard as LegacyShard
    from torch.distributed._shard.sharded_tensor import init_from_local_shards

    layout = Layout.column_wise(SHAPE, [1, 2, 3], ranks=[0, 1, 0], world_size=world)
    local = [
        LegacyShard.from_tensor_and_offsets(full()[b.slices()].clone(), list(b.offsets), rank)
        for b in layout.blocks_of(rank)
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        legacy = init_from_local_shards(local, *SHAPE)
    st = sw.from_torch_sharded_tensor(legacy)
    bad = [] if st.layout_spec == layout else [f"rank {rank} {st.layout_spec!r}"]
    if local and st.local_shards()[0] is not local[0].tensor:
        bad.append("copied")
    return bad + _check(st, "legacy")


def test_legacy_sharded_tensor():
    assert run_ranks(_legacy, 3, timeout=60) == [[]] * 3


def _functional(rank: int, world: int) -> list:
    import torch.distributed._functional_collectives as funcol

    # all_gather needs equal sizes per rank: two row blocks of 2 rows each
    whole = torch.arange(48.0).reshape(8, 6)
    layout = Layout.row_wise((8, 6), [2, 2, 2, 2], ranks=[0, 0, 1, 1])
    st = sw.ShardedTensor.from_layout(
        layout, [whole[b.slices()].clone() for b in layout.blocks_of(rank)]
    )
    out = funcol.wait_tensor(funcol.all_gather_tensor(st, 0, dist.group.WORLD))
    return [torch.equal(out, whole)]


def test_functional_all_gather():
    assert run_ranks(_functional, 2, timeout=60) == [[True], [True]]


def _refusal(rank: int, world: int, case: str) -> tuple[str, str]:
    """What `from_dtensor` raised on this rank for `case`; the group must still work after."""
    mesh = init_device_mesh("cpu", (world,))
    good = distribute_tensor(full(), mesh, (Shard(0),))  # rows 3, 3, 1
    value: object = good
    if case == "uneven" and rank == 2:  # built unevenly: 2 rows where torch.chunk gives 1
        value = DTensor.from_local(
            full()[5:].clone(), mesh, (Shard(0),), run_check=False, shape=SHAPE, stride=(6, 1)
        )
    elif case == "not a dtensor" and rank == 1:
        value = full()
    elif case == "other placements" and rank == 0:  # built locally: distribute_tensor is collective
        value = DTensor.from_local(
            full()[:, :2].clone(), mesh, (Shard(1),), run_check=False, shape=SHAPE, stride=(6, 1)
        )
    elif case == "other dtype" and rank == 1:
        value = DTensor.from_local(
            good.to_local().double(), mesh, (Shard(0),), run_check=False, shape=SHAPE, stride=(6, 1)
        )
    try:
        sw.from_dtensor(value)
        outcome = ("returned", "")
    except Exception as e:  # noqa: BLE001 - compared across ranks below
        outcome = (type(e).__name__, str(e))
    ok = torch.ones(1)
    dist.all_reduce(ok)  # no rank was left behind in a collective
    return outcome if ok.item() == world else ("group broken", "")


@pytest.mark.parametrize(
    "case, kind, start",
    [
        (
            "uneven",
            "LayoutError",
            "rank 2: its DTensor's local tensor has shape (2, 6) but its placements",
        ),
        ("not a dtensor", "InvalidTypeError", "rank 1: from_dtensor takes a DTensor"),
        ("other placements", "LayoutError", "rank 0: it passed placements (Shard(dim=1),)"),
        (
            "other dtype",
            "InvalidTypeError",
            "rank 1: it passed a torch.float64 value but rank 0 passed a torch.float32",
        ),
    ],
)
def test_from_dtensor_one_bad_rank_raises_everywhere(case, kind, start):
    results = run_ranks(_refusal, 3, case, timeout=60)
    assert results[0][0] == kind and results[0][1].startswith(start), results[0]
    assert results == [results[0]] * 3  # the same error on every rank, no hang
