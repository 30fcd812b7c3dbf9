"""PhysicsNeMo's calls on shardwise: function-level handlers, `scatter_tensor`, `offsets()`.

The handlers here are real ones, written as a PhysicsNeMo user writes them
(`handler(func, types, args, kwargs)`): a per-shard softmax / gelu, and a sum /
mean over every element (one all_reduce, on 2 spawned gloo ranks). The real
PhysicsNeMo comparison is tests/clients/test_physicsnemo_calls.py.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import shardwise as sw
from shardwise import Layout, LayoutError, ShardedTensor
from shardwise.testing import run_ranks

pytestmark = pytest.mark.spawned

SHAPE = (7, 6)
FULL = torch.arange(42, dtype=torch.float64).reshape(SHAPE) / 7 - 3
WHOLE = torch.arange(42, dtype=torch.float64).reshape(SHAPE)
LAYOUT = Layout.row_wise(SHAPE, [5, 2])

CALLS: list[object] = []


def _on_rank(layout: Layout, full: torch.Tensor, rank: int) -> ShardedTensor:
    shards = [full[b.slices()].clone() for b in layout.blocks_of(rank)]
    return ShardedTensor.from_layout(layout, shards, rank=rank, dtype=full.dtype)


def by_shard(func, types, args, kwargs):
    """A halo-free function applied shard by shard (right when no sharded dim is touched)."""
    CALLS.append(func)
    x, *rest = args
    shards = [func(s, *rest, **kwargs) for s in x.local_shards()]
    return ShardedTensor.from_layout(
        x.layout_spec, shards, rank=x.rank, group=x.group, dtype=x.dtype, device=x.device
    )


def global_sum(func, types, args, kwargs):
    """Every element once (a block held by several ranks counts on its first holder)."""
    x = args[0]
    mine = [
        s.sum()
        for s, b in zip(x.local_shards(), x.local_blocks)
        if x.layout_spec.ranks_holding(b)[0] == x.rank
    ]
    total = torch.stack(mine).sum() if mine else torch.zeros((), dtype=x.dtype)
    dist.all_reduce(total, group=x.group)
    return total


def global_mean(func, types, args, kwargs):
    return global_sum(func, types, args, kwargs) / args[0].numel()


@pytest.fixture
def registered():
    """Register handlers for one test; remove every one afterwards."""
    names: list[object] = []

    def register(func, handler):
        if isinstance(func, str):
            sw.register_named_function_handler(func, handler)
        else:
            sw.register_function_handler(func, handler)
        names.append(func)

    CALLS.clear()
    yield register
    for func in names:
        with contextlib.suppress(KeyError):  # a test may have removed it already
            sw.unregister_function_handler(func)


def test_softmax_along_an_unsharded_dim_runs_through_its_handler(registered):
    st = _on_rank(LAYOUT, FULL, 1)
    local = F.softmax(st, dim=1)  # the aten-level rule: local along an unsharded dimension
    assert torch.equal(local.local_shards()[0], F.softmax(FULL, dim=1)[5:]) and CALLS == []
    registered(F.softmax, by_shard)
    out = F.softmax(st, dim=1)
    assert isinstance(out, ShardedTensor) and out.layout_spec == LAYOUT and out.rank == 1
    assert torch.equal(out.local_shards()[0], F.softmax(FULL, dim=1)[5:])
    assert CALLS == [F.softmax]


def test_gelu_handler_is_asked_first_and_removal_restores_the_aten_path(registered):
    st = _on_rank(LAYOUT, FULL, 0)
    registered(F.gelu, by_shard)
    out = F.gelu(st, approximate="tanh")
    assert CALLS == [F.gelu]
    assert out.layout_spec == LAYOUT
    # bit for bit as on the block alone; the full tensor's SIMD tail may round 1 ulp apart
    assert torch.equal(out.local_shards()[0], F.gelu(FULL[:5].clone(), approximate="tanh"))
    torch.testing.assert_close(out.local_shards()[0], F.gelu(FULL, approximate="tanh")[:5])
    sw.unregister_function_handler(F.gelu)
    again = F.gelu(st)  # pointwise at aten level, as before any handler
    assert CALLS == [F.gelu] and torch.equal(again.local_shards()[0], F.gelu(FULL[:5].clone()))


def test_without_a_handler_everything_falls_through_unchanged(registered):
    registered(F.softmax, by_shard)  # an unrelated handler is registered
    st = _on_rank(LAYOUT, FULL, 0)
    total = st * 2 + 1
    assert isinstance(total, ShardedTensor) and torch.equal(
        total.local_shards()[0], FULL[:5] * 2 + 1
    )
    assert st.shape == SHAPE and st.dtype == torch.float64 and CALLS == []
    with pytest.raises(sw.UsageError, match="needs a process group"):
        torch.sum(st)  # the built-in rule: a sum over both ranks' blocks


@torch.library.custom_op("shardwise_test::twice", mutates_args=())
def twice(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@twice.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def test_named_handler_matches_a_custom_op_by_name(registered):
    st = _on_rank(LAYOUT, FULL, 0)
    with pytest.raises(sw.UsageError, match="needs a process group"):
        twice(st)  # no rule: the fallback gathers the whole tensor over the group
    registered("shardwise_test.twice.default", by_shard)
    for out in (twice(st), torch.ops.shardwise_test.twice(st)):
        assert torch.equal(out.local_shards()[0], FULL[:5] * 2)
    assert [str(f) for f in CALLS] == ["shardwise_test.twice.default", "shardwise_test.twice"]


def test_dispatch_handler_is_register_op_under_physicsnemo_name():
    aten = torch.ops.aten
    seen = []

    def neg(x):
        seen.append(x.rank)
        return x

    ShardedTensor.register_dispatch_handler(aten.neg.default, neg)
    try:
        st = _on_rank(LAYOUT, FULL, 1)
        assert -st is st and seen == [1]
    finally:
        sw.unregister_op(aten.neg.default)
    assert torch.equal((-st).local_shards()[0], -FULL[5:])


def test_registration_refuses_what_it_cannot_key(registered):
    with pytest.raises(TypeError, match="register_named_function_handler"):
        sw.register_function_handler("torch.sum", global_sum)
    with pytest.raises(TypeError, match="register_function_handler for a function"):
        sw.register_named_function_handler(torch.sum, global_sum)
    with pytest.raises(TypeError, match="must be callable"):
        sw.register_function_handler(torch.sum, None)
    with pytest.raises(KeyError, match="no function handler registered for 'nope'"):
        sw.unregister_function_handler("nope")
    assert ShardedTensor.register_function_handler is sw.register_function_handler


def test_offsets_come_from_the_layout_on_a_1d_mesh_over_the_group():
    from torch.distributed.tensor import Shard

    st = _on_rank(LAYOUT, FULL, 1)
    assert st.offsets() == (5,) and st.offsets(mesh_dim=0) == 5
    assert st.placements == (Shard(0),) and st.mesh_shape == (2,)
    two_per_rank = Layout.column_wise(SHAPE, [1, 2, 1, 2], ranks=[0, 1, 0, 1], world_size=2)
    odd = _on_rank(two_per_rank, FULL, 0)
    with pytest.raises(
        LayoutError, match=r"Layout\(7x6, 4 blocks on 2 ranks\) cannot be expressed"
    ):
        odd.offsets()


# -- on 2 spawned ranks -------------------------------------------------------


def _reductions(rank: int, world: int) -> list[float]:
    sw.register_function_handler(torch.sum, global_sum)
    sw.register_function_handler(torch.Tensor.sum, global_sum)
    sw.register_function_handler(torch.mean, global_mean)
    out = []
    for layout in (LAYOUT, Layout.replicated(SHAPE, 2), Layout.table_wise(SHAPE, 1, 2)):
        st = _on_rank(layout, WHOLE, rank)  # whole numbers: every summation order is exact
        out += [torch.sum(st).item(), st.sum().item(), torch.mean(st).item()]
    return out


def test_sum_and_mean_over_all_elements_are_one_collective():
    got = run_ranks(_reductions, 2, timeout=60)
    want = [861.0, 861.0, 20.5] * 3  # sum(range(42)), its mean; each block counted once
    assert got == [want, want]


def _mesh(shape):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", shape)


def _scatter(rank: int, world: int) -> dict:
    from torch.distributed.tensor import Replicate, Shard

    mesh, out = _mesh((2,)), {}
    src = FULL if rank == 1 else None
    forms = {
        "chunk": "chunk",
        "infer": "infer",
        "ints": {0: [2, 5]},
        "shapes": {0: [(2, 6), (5, 6)]},
        "zero": {0: [7, 0]},
    }
    for name, form in forms.items():
        st = sw.scatter_tensor(src, 1, mesh, (Shard(0),), sharding_shapes=form)
        out[name] = (st.local_offsets(), st.offsets(), st.offsets(mesh_dim=0))
        assert torch.equal(st.full_tensor(), FULL)
    cols = sw.scatter_tensor(src, 1, mesh, [Shard(1)], global_shape=SHAPE, dtype=torch.float64)
    out["cols"] = (cols.local_shards()[0], cols.offsets(), F.gelu(cols).offsets())
    rep = sw.scatter_tensor(src, 1, mesh, (Replicate(),), requires_grad=True)
    out["rep"] = (rep.layout_spec, rep.offsets(), rep.requires_grad, rep.is_leaf)
    out["errors"] = [
        _refused(lambda bad=bad: sw.scatter_tensor(src, 1, mesh, (Shard(0),), sharding_shapes=bad))
        for bad in ({0: [3, 3]}, {1: [5, 2]}, "even", {0: [7]})
    ]
    out["errors"].append(
        _refused(lambda: sw.scatter_tensor(src, 1, mesh, (Shard(0),), global_shape=(7, 5)))
    )
    out["errors"].append(
        _refused(lambda: sw.scatter_tensor(src, 1, mesh, (Shard(0),), dtype=torch.float32))
    )
    out["errors"].append(_refused(lambda: sw.scatter_tensor(None, 1, mesh, (Shard(0),))))
    out["errors"].append(
        _refused(
            lambda: sw.scatter_tensor(
                src, 1, mesh, (Shard(0),), sharding_shapes={0: [rank + 3, 4 - rank]}
            )
        )
    )
    for bad in ({0: [9, -2]}, {0: [(9, 6), (-2, 6)]}, {0: [3.5, 3.5]}):
        out["errors"].append(
            _refused(
                lambda bad=bad: sw.scatter_tensor(src, 1, mesh, (Shard(0),), sharding_shapes=bad)
            )
        )
    # a piece shape with no entry at the sharded dimension (was a bare IndexError)
    out["errors"].append(
        _refused(
            lambda: sw.scatter_tensor(src, 1, mesh, (Shard(1),), sharding_shapes={0: [(3,), (3,)]})
        )
    )
    # sizes int() truncated (2.9 -> 2) or failed on with a bare ValueError
    for shape in ((7.9, 6.2), ("a", 6)):
        out["errors"].append(
            _refused(
                lambda shape=shape: sw.scatter_tensor(src, 1, mesh, (Shard(0),), global_shape=shape)
            )
        )
    return out


def _refused(call) -> tuple[str, str]:
    try:
        call()
        outcome = ("returned", "")
    except Exception as e:  # noqa: BLE001 - the test compares what every rank raised
        outcome = (type(e).__name__, str(e))
    ok = torch.ones(1)
    dist.all_reduce(ok)  # the group still works
    return outcome


def test_scatter_tensor_with_every_sharding_shapes_form():
    r0, r1 = run_ranks(_scatter, 2, timeout=90)
    chunk = ([torch.Size([0, 0])], (0,), 0), ([torch.Size([4, 0])], (4,), 4)
    assert (r0["chunk"], r1["chunk"]) == chunk
    assert (r0["infer"], r1["infer"]) == chunk
    uneven = ([torch.Size([0, 0])], (0,), 0), ([torch.Size([2, 0])], (2,), 2)
    assert (r0["ints"], r1["ints"]) == uneven and (r0["shapes"], r1["shapes"]) == uneven
    assert (r0["zero"], r1["zero"]) == (([torch.Size([0, 0])], (0,), 0), ([], (7,), 7))
    for rank, r in enumerate((r0, r1)):
        shard, offsets, after_gelu = r["cols"]
        assert torch.equal(shard, FULL[:, 3 * rank : 3 * rank + 3])
        assert offsets == after_gelu == (3 * rank,)
        assert r["rep"] == (Layout.replicated(SHAPE, 2), (0,), True, True)
    assert r0["errors"] == r1["errors"]
    kinds = [kind for kind, _ in r0["errors"]]
    assert (
        kinds
        == ["LayoutError", "LayoutError", "InvalidArgumentError", "LayoutError"]
        + [
            "ArgumentMismatchError",
            "ArgumentMismatchError",
            "InvalidTypeError",
            "LayoutError",
        ]
        + ["InvalidArgumentError"] * 6
    )
    messages = [m for _, m in r0["errors"]]
    assert "add up to 6, not the tensor's 7" in messages[0]
    assert "names mesh dimensions [1]" in messages[1]
    assert "'chunk' or 'infer'" in messages[2]
    assert "lists 1 pieces for mesh dimension 0 of size 2" in messages[3]
    assert "ranks [0, 1] passed global_shape=(7, 5)" in messages[4]
    assert "dtype=torch.float32" in messages[5]
    assert "rank 1: the source rank must pass a plain tensor, got None" in messages[6]
    assert "other placements or sharding_shapes" in messages[7]
    assert (
        "sharding_shapes[0] gives size -2 for mesh coordinate 1: a size must be an int, 0 or more"
        in messages[8]
    )
    assert "sharding_shapes[0] gives size -2 for mesh coordinate 1" in messages[9]
    assert "sharding_shapes[0] gives size 3.5 for mesh coordinate 0" in messages[10]
    assert (
        "rank 0: sharding_shapes[0] gives shape (3,) for mesh coordinate 0, of 1 dimensions, "
        "but the tensor has 2; give each piece's full shape, or its size along dimension 1 as "
        "an int" in messages[11]
    )
    assert (
        "rank 0: global_shape=(7.9, 6.2) gives size 7.9 for dimension 0: a size must be an "
        "int, 0 or more" in messages[12]
    )
    assert "rank 1: global_shape=('a', 6) gives size 'a' for dimension 0" in messages[13]
