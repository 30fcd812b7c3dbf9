"""Parity with torch 2.13's `LocalShardsWrapper` (LSW), as TorchRec and FSDP use it.

Side by side with the real LSW on the same shards: `ShardedTensor.from_local_blocks`
(built like `LocalShardsWrapper(shards, offsets)`, no process group, views kept),
its accessors and DCP hooks, `requires_grad_`, `_get_tensor_size_bytes`; the layout
learned later, once per family of tensors, with an error on every rank; and the way
back for several blocks per rank, `to_dtensor` over an LSW sharing storage, saved by
stock `dcp.save` and loaded into shardwise tensors, on 2 and 3 gloo ranks.
"""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper

import shardwise as sw
from shardwise import Layout, ShardedTensor
from shardwise.testing import run_ranks

pytestmark = pytest.mark.spawned

SHAPE = (5, 6)


def whole() -> torch.Tensor:
    return torch.arange(30, dtype=torch.float32).reshape(SHAPE)


def column_views() -> tuple[torch.Tensor, list[torch.Tensor], list[tuple[int, int]]]:
    """Columns [0:2] and [4:6] of a copy of `whole()`: strided views, as TorchRec holds."""
    base = whole().clone()
    return base, [base[:, 0:2], base[:, 4:6]], [(0, 0), (0, 4)]


# -- one process, no process group ----------------------------------------------------------


def test_built_with_no_process_group_answers_like_the_wrapper():
    assert not dist.is_initialized()
    base, shards, offsets = column_views()
    assert not shards[0].is_contiguous()
    st = ShardedTensor.from_local_blocks(shards, offsets, SHAPE)
    lsw = LocalShardsWrapper(shards, offsets)

    assert st.shape == torch.Size(SHAPE) and st.rank == 0 and not st.is_layout_learned
    assert all(a is b for a, b in zip(st.local_shards(), lsw.local_shards()))
    assert st.local_shards()[1].data_ptr() == base.data_ptr() + 4 * 4
    assert st.local_offsets() == lsw.local_offsets() == [torch.Size([0, 0]), torch.Size([0, 4])]
    assert st.local_sizes() == lsw.local_sizes() == [torch.Size([5, 2])] * 2
    assert st.local_chunks == lsw.local_chunks
    assert st.__create_chunk_list__() == lsw.__create_chunk_list__()
    assert st.storage_metadata().chunks == lsw.storage_metadata().chunks
    assert st.storage_metadata().size == torch.Size(SHAPE)  # LSW's is its local (5, 4)
    assert st.is_empty_shard() is lsw.is_empty_shard() is False
    ours = st.__create_write_items__("w", st)
    theirs = lsw.__create_write_items__("w", lsw)
    assert [i.index.offset for i in ours] == [i.index.offset for i in theirs]
    assert [i.tensor_data.chunk for i in ours] == [i.tensor_data.chunk for i in theirs]
    for index in (
        MetadataIndex("w", (0, 4), 1),
        MetadataIndex("w", (0, 4)),
        MetadataIndex("w", (0, 0), 1),
    ):
        assert st.__get_tensor_shard__(index) is lsw.__get_tensor_shard__(index)
    assert st._get_tensor_size_bytes() == lsw._get_tensor_size_bytes() == 2 * 10 * 4
    assert "2 blocks; others not learned" in repr(st)
    assert not st.is_layout_learned
    # the global layout needs a process group: asked for here, it says so
    with pytest.raises(sw.UsageError, match="init_process_group"):
        _ = st.layout_spec
    assert not st.is_layout_learned


def test_an_empty_rank_and_a_scalar():
    empty = ShardedTensor.from_local_blocks([], [], SHAPE)
    assert empty.local_shards() == [] and empty.local_offsets() == []
    assert empty.is_empty_shard() and empty._get_tensor_size_bytes() == 0
    assert empty.__create_write_items__("w", empty) == [] and empty.__create_chunk_list__() == []
    scalar = ShardedTensor.from_local_blocks([torch.tensor(3.0)], [()], ())
    assert scalar.shape == torch.Size([]) and scalar.local_sizes() == [torch.Size([])]


@pytest.mark.parametrize(
    "args, error, match",
    [
        pytest.param(([torch.ones(2, 2)], [(4, 0)], SHAPE), sw.LayoutError, "inside", id="outside"),
        pytest.param(
            ([torch.ones(2, 2)], [(0, 0), (2, 0)], SHAPE),
            sw.ShardMismatchError,
            "1 shards but 2 offsets",
            id="count",
        ),
        pytest.param(
            ([torch.ones(2, 2)], [(0,)], SHAPE), sw.ShardMismatchError, "offsets", id="ndim"
        ),
        pytest.param(
            ([torch.ones(2, 2)], [(0, 0)], None), sw.UsageError, "global_shape", id="no-shape"
        ),
        pytest.param(
            ([torch.ones(2, 2), torch.ones(2, 2, dtype=torch.int64)], [(0, 0), (2, 0)], SHAPE),
            sw.InvalidTypeError,
            "dtype",
            id="dtypes",
        ),
    ],
)
def test_local_problems_raise_at_construction(args, error, match):
    with pytest.raises(error, match=match):
        ShardedTensor.from_local_blocks(*args)


def test_check_must_be_now_or_later():
    with pytest.raises(sw.InvalidArgumentError, match="'now'"):
        ShardedTensor.from_local_blocks([torch.ones(5, 6)], [(0, 0)], SHAPE, check="never")


def test_local_ops_share_the_pending_layout():
    _, shards, offsets = column_views()
    st = ShardedTensor.from_local_blocks(shards, offsets, SHAPE)
    family = [
        st.clone(),
        st.detach(),
        st.to(torch.float64),
        st.detach().mul_(1),
        torch.neg_(st.clone()),
    ]
    assert all(x._layout is st._layout for x in family)
    assert not any(x.is_layout_learned for x in family)
    assert torch.equal(family[2].local_shards()[1], whole()[:, 4:6].double())
    copy = pickle.loads(pickle.dumps(st))
    assert copy.local_offsets() == st.local_offsets() and not copy.is_layout_learned
    assert torch.equal(copy.local_shards()[0], whole()[:, 0:2])
    with pytest.raises(sw.UsageError, match="unpickled"):
        copy.learn_layout()


def test_requires_grad_reaches_the_shards_as_in_the_wrapper():
    shards = [whole()[:, 0:2].clone(), whole()[:, 4:6].clone()]
    theirs = [s.clone() for s in shards]
    st = ShardedTensor.from_local_blocks(shards, [(0, 0), (0, 4)], SHAPE)
    lsw = LocalShardsWrapper(theirs, [(0, 0), (0, 4)])
    assert st.requires_grad_() is st and lsw.requires_grad_() is lsw
    assert st.requires_grad and [s.requires_grad for s in st.local_shards()] == [True, True]
    assert [s.requires_grad for s in lsw.local_shards()] == [True, True]
    assert st.storage_metadata().properties.requires_grad is True
    assert lsw.storage_metadata().properties.requires_grad is True
    assert st.requires_grad_(False) is st and lsw.requires_grad_(False) is lsw
    assert [s.requires_grad for s in st.local_shards()] == [False, False]
    assert [s.requires_grad for s in lsw.local_shards()] == [False, False]
    # a shard that is a view of a tensor requiring grad keeps its base's flag
    src = torch.ones(5, 6, requires_grad=True)
    views = ShardedTensor.from_local_blocks([src[:, :3]], [(0, 0)], SHAPE)
    views.requires_grad_(False)
    assert views.local_shards()[0].requires_grad and not views.requires_grad


def test_shards_requiring_grad_keep_autograd_and_in_place_paths():
    # one rank holding both column blocks (ops below need the layout: here it is given)
    layout = Layout.column_wise(SHAPE, [2, 2, 2], ranks=[0, 0, 0], world_size=1)
    shards = [whole()[b.slices()].clone() for b in layout.blocks_of(0)]
    st = ShardedTensor.from_layout(layout, shards, rank=0).requires_grad_()
    assert [s.requires_grad for s in st.local_shards()] == [True] * 3
    # the wrapper stays the autograd leaf; shard by shard ops build no graph on the shards
    (st * torch.arange(6.0)).sum().backward()
    grad = st.grad
    assert isinstance(grad, ShardedTensor)
    assert torch.equal(grad.local_shards()[2], torch.tensor([[4.0, 5.0]]).expand(5, 2))
    assert all(s.grad is None for s in st.local_shards())
    torch.optim.SGD([st], lr=1.0).step()  # in place on the shards, under no_grad
    assert torch.equal(st.local_shards()[0], whole()[:, 0:2] - torch.tensor([0.0, 1.0]))
    st.detach().add_(1)  # in place through a detached alias, grad mode on
    assert torch.equal(st.local_shards()[2], whole()[:, 4:6] - torch.tensor([4.0, 5.0]) + 1)
    with torch.no_grad():
        st.zero_()
    assert st.local_shards()[0].abs().sum().item() == 0
    with pytest.raises(RuntimeError, match="leaf Variable"):
        st.add_(1)  # as for any leaf requiring grad
    # to_local() stays differentiable with a shard that requires grad
    one = Layout.row_wise(SHAPE, [5], world_size=1)
    single = ShardedTensor.from_layout(one, [whole().clone()], rank=0).requires_grad_()
    local = single.to_local()
    assert local.grad_fn is not None and single.local_shards()[0].requires_grad
    (local * 3).sum().backward()
    assert torch.equal(single.grad.local_shards()[0], torch.full(SHAPE, 3.0))


# -- several ranks: learning, the way back over LocalShardsWrapper, DCP -------------------

# case -> (world size, this rank's blocks as (offsets, sizes), placements' Shard dim)
CASES = {
    # rank 0 holds columns [0:2] and [4:6] (views of one buffer), rank 1 columns [2:4]
    "column-2-blocks": (2, {0: [((0, 0), (5, 2)), ((0, 4), (5, 2))], 1: [((0, 2), (5, 2))]}, 1),
    # rank 1 holds nothing; rank 0 two column blocks, rank 2 the rest
    "empty-rank": (
        3,
        {0: [((0, 0), (5, 1)), ((0, 3), (5, 2))], 1: [], 2: [((0, 1), (5, 2)), ((0, 5), (5, 1))]},
        1,
    ),
    # uneven rows, one block per rank: 3, 0 (an empty block) and 2 rows
    "row-uneven": (3, {0: [((0, 0), (3, 6))], 1: [((3, 0), (0, 6))], 2: [((3, 0), (2, 6))]}, 0),
}


def _layout(case: str, *, held: bool = False) -> Layout:
    """The case's layout; `held`: without its empty blocks (what a wrapper holds)."""
    world, blocks, _ = CASES[case]
    by_rank = {
        r: [sw.Block(o, s) for o, s in b if not held or 0 not in s] for r, b in blocks.items()
    }
    return Layout(SHAPE, by_rank, world)


def _views(rank: int, case: str) -> tuple[torch.Tensor, list[torch.Tensor], list[tuple[int, ...]]]:
    """This rank's blocks as views into one copy of the whole tensor (strided, no copy)."""
    base = whole().clone()
    blocks = _layout(case).blocks_of(rank)
    return base, [base[b.slices()] for b in blocks], [b.offsets for b in blocks]


def _round_trip(rank: int, world: int, case: str, path: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    _, _, dim = CASES[case]
    placements = (Shard(dim),)
    base, views, offsets = _views(rank, case)
    st = ShardedTensor.from_local_blocks(views, offsets, SHAPE)
    out: dict = {}
    if rank == 0:  # paths one rank may take alone: any learning here would hang the test
        repr(st), st.local_offsets(), st.local_chunks, st.is_empty_shard()
        st.__create_write_items__("w", st), st.__create_chunk_list__()
        st.to_dtensor(mesh, placements)
    dt = st.to_dtensor(mesh, placements)
    local = dt._local_tensor
    out["wrapper"] = isinstance(local, LocalShardsWrapper) and isinstance(dt, DTensor)
    held_views = [v for v in views if v.numel()]
    out["shared"] = [a.data_ptr() == b.data_ptr() for a, b in zip(local.local_shards(), held_views)]
    out["wrapper offsets"] = [tuple(o) for o in local.local_offsets()] if held_views else []
    out["dt shape"] = tuple(dt.shape)

    # stock DCP on the DTensor over our wrapper, on the pending tensor itself, and on the
    # DTensor over torch's own wrapper as TorchRec builds it
    held = [(v, o) for v, o in zip(views, offsets) if v.numel()]  # as TorchRec: no empty shard
    theirs = DTensor.from_local(
        LocalShardsWrapper([v for v, _ in held], [o for _, o in held]),
        mesh,
        placements,
        run_check=False,
        shape=torch.Size(SHAPE),
        stride=(6, 1),
    )
    dcp.save({"w": dt}, checkpoint_id=f"{path}/ours")
    dcp.save({"w": st}, checkpoint_id=f"{path}/pending")
    dcp.save({"w": theirs}, checkpoint_id=f"{path}/theirs")
    out["learned after save"] = st.is_layout_learned
    meta = [
        dcp.FileSystemReader(f"{path}/{name}").read_metadata().state_dict_metadata["w"]
        for name in ("ours", "pending", "theirs")
    ]
    out["same metadata"] = [
        (m.size, sorted((tuple(c.offsets), tuple(c.sizes)) for c in m.chunks)) for m in meta
    ]

    # the way back: from_dtensor reads the wrapper (collective), sharing storage
    back = sw.from_dtensor(dt)
    out["back shared"] = [a.data_ptr() == b.data_ptr() for a, b in zip(back._shards, held_views)]
    out["back layout"] = back.layout_spec
    out["back full"] = back.full_tensor()

    # learning: a collective op learns once, for the whole family
    family = st.clone()
    out["family before"] = family.is_layout_learned
    out["full"] = st.full_tensor()
    out["family after"] = (family.is_layout_learned, family.layout_spec == st.layout_spec)
    out["layout"] = st.layout_spec
    out["gather"] = (family * 2).gather(dst=1)

    # shardwise's own checkpoint of the tensor holding views, loaded back into views
    import shardwise.checkpoint as swc

    swc.save({"w": st}, f"{path}/swc")
    _, into, _ = _views(rank, case)
    for v in into:
        v.zero_()
    target = ShardedTensor.from_local_blocks(into, offsets, SHAPE)
    swc.load({"w": target}, f"{path}/swc")
    out["swc"] = (target.full_tensor(), [v.clone() for v in into])

    # load each checkpoint into shardwise tensors: the same layout and another one
    loaded = {}
    for name in ("ours", "pending", "theirs"):
        same = ShardedTensor.zeros(_layout(case))
        other = ShardedTensor.zeros(Layout.chunked(SHAPE, 1 - dim, world))
        dcp.load({"w": same}, checkpoint_id=f"{path}/{name}")
        dcp.load({"w": other}, checkpoint_id=f"{path}/{name}")
        loaded[name] = (same.full_tensor(), other.full_tensor())
    out["loaded"] = loaded

    # stock dcp.load into a tensor built from local blocks: filled, nothing learned
    _, into, _ = _views(rank, case)
    for v in into:
        v.zero_()
    pending = ShardedTensor.from_local_blocks(into, offsets, SHAPE)
    dcp.load({"w": pending}, checkpoint_id=f"{path}/theirs")
    out["dcp into pending"] = (pending.is_layout_learned, [v.clone() for v in into])
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_round_trip_over_local_shards_wrapper(case, tmp_path):
    world = CASES[case][0]
    results = run_ranks(_round_trip, world, case, str(tmp_path), timeout=180)
    full = whole()
    for rank, out in enumerate(results):
        held = _layout(case, held=True).blocks_of(rank)
        assert out["wrapper"]
        assert out["shared"] == [True] * len(held)
        assert out["wrapper offsets"] == [b.offsets for b in held]
        assert out["dt shape"] == SHAPE
        assert out["learned after save"] is False
        assert out["same metadata"][0] == out["same metadata"][1] == out["same metadata"][2]
        assert out["same metadata"][0][0] == torch.Size(SHAPE)
        assert out["back shared"] == [True] * len(held)
        assert out["back layout"] == _layout(case, held=True)  # empty blocks left out
        assert out["layout"] == _layout(case)
        assert torch.equal(out["back full"], full) and torch.equal(out["full"], full)
        assert out["family before"] is False and out["family after"] == (True, True)
        if rank == 1:
            assert torch.equal(out["gather"], 2 * full)
        else:
            assert out["gather"] is None
        blocks = _layout(case).blocks_of(rank)
        swc_full, swc_views = out["swc"]
        assert torch.equal(swc_full, full)
        assert [torch.equal(v, full[b.slices()]) for v, b in zip(swc_views, blocks)] == [
            True
        ] * len(blocks)
        learned, filled = out["dcp into pending"]
        assert learned is False
        assert [torch.equal(v, full[b.slices()]) for v, b in zip(filled, blocks)] == [True] * len(
            blocks
        )
        for name, (same, other) in out["loaded"].items():
            assert torch.equal(same, full), name
            assert torch.equal(other, full), name


def _bad_layout(rank: int, world: int, check: str) -> None:
    # rank 1's block overlaps rank 0's: each rank's own input is fine, the layout is not
    blocks = {0: [((0, 0), (3, 6))], 1: [((2, 0), (3, 6))]}[rank]
    shards = [whole()[o[0] : o[0] + s[0]] for o, s in blocks]
    st = ShardedTensor.from_local_blocks(shards, [o for o, _ in blocks], SHAPE, check=check)
    st.full_tensor()


@pytest.mark.parametrize("check", ["now", "later"])
def test_a_bad_layout_raises_on_every_rank_when_learned(check):
    errors = run_ranks(_bad_layout, 2, check, timeout=120, return_exceptions=True)
    assert all(isinstance(e, sw.LayoutError) for e in errors), errors
    assert len({str(e) for e in errors}) == 1
    assert "overlap" in str(errors[0])


def _learned_now(rank: int, world: int) -> tuple:
    _, views, offsets = _views(rank, "column-2-blocks")
    st = ShardedTensor.from_local_blocks(views, offsets, SHAPE, check="now")
    learned = st.is_layout_learned
    dt = st.to_dtensor(_mesh(world), (_shard(1),))  # learned, several blocks: still the wrapper
    return learned, st.layout_spec, isinstance(dt._local_tensor, LocalShardsWrapper)


def _mesh(world: int):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world,))


def _shard(dim: int):
    from torch.distributed.tensor import Shard

    return Shard(dim)


def test_check_now_learns_at_construction():
    for learned, layout, wrapped in run_ranks(_learned_now, 2, timeout=120):
        assert learned and wrapped
        assert layout == _layout("column-2-blocks")
