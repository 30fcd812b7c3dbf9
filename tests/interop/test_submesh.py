"""A ShardedTensor on a sub-mesh: every collective runs over the sub-mesh's ranks.

4 spawned gloo ranks on a real 2-d mesh `("dp", "domain")` of shape (2, 2): both DP
rows hold their own tensor (different data per row) on `mesh["domain"]`, built by
`scatter_tensor`, `from_local_shards`, `from_dtensor`, `from_shard_tensor` (the real
PhysicsNeMo) and the legacy API on a subgroup, with uneven pieces. Row 0 runs
collectives row 1 does not: any of them on the world would hang the test.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import shardwise as sw
import shardwise.legacy
from shardwise import Layout
from shardwise.testing import run_ranks

pytestmark = pytest.mark.spawned

SHAPE = (7, 6)


def value(row: int) -> torch.Tensor:
    """The global tensor of DP row `row` (distinct per row)."""
    return torch.arange(42, dtype=torch.float32).reshape(SHAPE) + 100 * row


def _on_submesh(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "domain"))
    dom = mesh["domain"]
    row, pos = divmod(rank, 2)
    full, src = value(row), 2 * row
    out: dict = {"row": row}

    # scatter_tensor over the sub-mesh, uneven pieces, the source a global rank of the row
    st = sw.scatter_tensor(
        full if rank == src else None, src, dom, (Shard(0),), sharding_shapes={0: [5, 2]}
    )
    out["scatter"] = (
        st.layout_spec,
        st.local_shards()[0].clone(),
        st.offsets(),
        st.placements,
        st.device_mesh is dom,
        dist.get_process_group_ranks(st.group),
        st.rank,
    )
    if row == 0:  # only row 0: a world collective here would never complete
        out["row0 only"] = st.full_tensor()
    out["full"] = st.full_tensor()
    out["gather"] = st.gather(dst=1)
    cols = st.redistribute(dom, (Shard(1),))
    out["cols"] = (cols.layout_spec, cols.local_shards()[0].clone(), cols.placements)
    back = cols.redistribute(st.layout_spec)  # the Layout form on the same group
    out["back"] = torch.equal(back.local_shards()[0], st.local_shards()[0])
    out["equal"] = sw.equal(st, cols)

    # from_local_shards with a sub-mesh as the group: two blocks on position 0, none on 1
    blocks = Layout.row_wise(SHAPE, [3, 4], ranks=[0, 0], world_size=2).blocks_of(pos)
    built = sw.ShardedTensor.from_local_shards(
        [full[b.slices()].clone() for b in blocks], [b.offsets for b in blocks], SHAPE, group=dom
    )
    out["from_local_shards"] = (built.layout_spec, built.full_tensor(), built.rank)

    # from_dtensor / to_dtensor on the sub-mesh
    dt = distribute_tensor(full, dom, (Shard(1),))
    conv = sw.from_dtensor(dt)
    again = conv.to_dtensor(dom, (Shard(1),))
    out["dtensor"] = (
        conv.local_shards()[0].data_ptr() == dt._local_tensor.data_ptr(),
        conv.full_tensor(),
        again.full_tensor(),
        conv.placements,
        conv.offsets(),
    )

    # a DTensor on the whole 2-d mesh: its group is the default one
    whole = sw.from_dtensor(distribute_tensor(value(0), mesh, (Replicate(), Shard(0))))
    out["whole mesh"] = (whole.group, whole.full_tensor(), whole.placements, whole.offsets())

    # the legacy API on a subgroup: placements name global ranks
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec

    subgroups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank makes both
    spec = ChunkShardingSpec(0, [f"rank:{2 * row}/cpu", f"rank:{2 * row + 1}/cpu"])
    legacy = sw.legacy.full(spec, SHAPE, float(row + 1), process_group=subgroups[row])
    out["legacy"] = (legacy.layout_spec, legacy.rank, legacy.full_tensor())
    resharded = legacy.reshard(ChunkShardingSpec(1, spec.placements))
    out["legacy reshard"] = resharded.layout_spec

    # an n-d sub-mesh that is not the world: ("a", "domain") of a (2, 1, 2) mesh
    mesh3 = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("dp3", "a", "domain3"))
    sub = mesh3["a", "domain3"]
    st2 = sw.scatter_tensor(
        full if rank == src else None,
        src,
        sub,
        (Replicate(), Shard(1)),
        sharding_shapes={1: [4, 2]},
    )
    out["2-d sub-mesh"] = (
        dist.get_process_group_ranks(st2.group),
        st2.layout_spec,
        st2.full_tensor(),
        st2.placements,
        st2.offsets(),
    )
    st3 = sw.scatter_tensor(
        full if rank == src else None, src, sub, (Replicate(), Shard(0)), sharding_shapes="chunk"
    )
    out["2-d sub-mesh again"] = (st3.group is st2.group, st3.full_tensor())
    return out


def _shard_tensor_on_submesh(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    from tests.clients.physicsnemo_harness import shard_tensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "domain"))
    dom = mesh["domain"]
    row = rank // 2
    full = value(row)
    pn = shard_tensor(full, dom, (Shard(0),), {0: [5, 2]})
    st = sw.from_shard_tensor(pn)
    back = st.to_shard_tensor(dom, (Shard(0),))
    return {
        "layout": st.layout_spec,
        "shared": st.local_shards()[0].data_ptr() == pn._local_tensor.data_ptr(),
        "full": st.full_tensor(),
        "pn full": pn.full_tensor(),
        "offsets": (st.offsets(), tuple(pn.offsets())),
        "placements": st.placements,
        "back": back.full_tensor(),
        "group": dist.get_process_group_ranks(st.group),
    }


def test_every_collective_runs_on_the_submesh():
    from torch.distributed.tensor import Replicate, Shard

    results = run_ranks(_on_submesh, 4, timeout=180)
    for rank, out in enumerate(results):
        row, pos = divmod(rank, 2)
        full = value(row)
        uneven = Layout.row_wise(SHAPE, [5, 2])
        layout, shard, offsets, placements, same_mesh, ranks, local_rank = out["scatter"]
        assert layout == uneven and local_rank == pos
        assert torch.equal(shard, full[:5] if pos == 0 else full[5:])
        assert offsets == ((0,) if pos == 0 else (5,))
        assert placements == (Shard(0),) and same_mesh
        assert ranks == [2 * row, 2 * row + 1]
        assert ("row0 only" in out) == (row == 0)
        assert torch.equal(out["full"], full)
        assert (out["gather"] is None) == (pos == 0)
        if pos == 1:
            assert torch.equal(out["gather"], full)
        cols_layout, cols_shard, cols_placements = out["cols"]
        assert cols_layout == Layout.column_wise(SHAPE, [3, 3])
        assert torch.equal(cols_shard, full[:, 3 * pos : 3 * pos + 3])
        assert cols_placements == (Shard(1),)
        assert out["back"] and out["equal"]
        built_layout, built_full, built_rank = out["from_local_shards"]
        assert built_layout == Layout.row_wise(SHAPE, [3, 4], ranks=[0, 0], world_size=2)
        assert torch.equal(built_full, full) and built_rank == pos
        shared, conv_full, again_full, conv_placements, conv_offsets = out["dtensor"]
        assert shared and torch.equal(conv_full, full) and torch.equal(again_full, full)
        assert conv_placements == (Shard(1),) and conv_offsets == (3 * pos,)
        whole_group, whole_full, whole_placements, whole_offsets = out["whole mesh"]
        assert whole_group is None and torch.equal(whole_full, value(0))
        assert whole_placements == (Replicate(), Shard(0))
        assert whole_offsets == (0, 4 * pos)
        legacy_layout, legacy_rank, legacy_full = out["legacy"]
        assert legacy_layout == Layout.chunked(SHAPE, 0, 2) and legacy_rank == pos
        assert torch.equal(legacy_full, torch.full(SHAPE, float(row + 1)))
        assert out["legacy reshard"] == Layout.chunked(SHAPE, 1, 2)
        ranks2, layout2, full2, placements2, offsets2 = out["2-d sub-mesh"]
        assert ranks2 == [2 * row, 2 * row + 1]
        assert layout2 == Layout.column_wise(SHAPE, [4, 2])
        assert torch.equal(full2, full)
        assert placements2 == (Replicate(), Shard(1))
        assert offsets2 == (0, 4 * pos)
        same_group, full3 = out["2-d sub-mesh again"]
        assert same_group and torch.equal(full3, full)


def test_from_shard_tensor_on_a_submesh():
    from tests.clients.conftest import require

    require("physicsnemo")
    from torch.distributed.tensor import Shard

    results = run_ranks(_shard_tensor_on_submesh, 4, timeout=180)
    for rank, out in enumerate(results):
        row, pos = divmod(rank, 2)
        assert out["layout"] == Layout.row_wise(SHAPE, [5, 2]) and out["shared"]
        assert torch.equal(out["full"], value(row)) and torch.equal(out["pn full"], value(row))
        assert out["offsets"] == ((5 * pos,), (5 * pos,))
        assert out["placements"] == (Shard(0),)
        assert torch.equal(out["back"], value(row))
        assert out["group"] == [2 * row, 2 * row + 1]
