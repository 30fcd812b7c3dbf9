from __future__ import annotations

import pytest
import torch

import shardwise as sw
from shardwise import Layout, ShardedTensor
from shardwise.testing import shard_of

LAYOUTS = {
    "row-uneven-empty": Layout.row_wise((7, 5), [3, 0, 4]),
    "columns-two-per-rank": Layout.column_wise((7, 6), [1, 2, 1, 2], ranks=[0, 1, 0, 1]),
    "grid-3d": Layout.grid((4, 3, 5), (2, 1, 2)),
    "replicated": Layout.replicated((3, 4), 2),
    "scalar": Layout.replicated((), 2),
}


def each_rank(layout, full):
    return [
        ShardedTensor.from_layout(layout, shard_of(full, layout, r), rank=r, dtype=full.dtype)
        for r in range(layout.world_size)
    ]


def assert_matches(sts, full):
    for st in sts:
        assert isinstance(st, ShardedTensor)
        assert st.shape == full.shape and st.dtype == full.dtype
        for shard, block in zip(st.local_shards(), st.local_blocks):
            assert torch.equal(shard, full[block.slices()]), block


OPS = {
    "add-scalar": lambda x, y: x + 2,
    "radd": lambda x, y: 3 - x,
    "mul-tensor": lambda x, y: x * y,
    "div": lambda x, y: x / (y.abs() + 1),
    "unary": lambda x, y: torch.sqrt(x.abs()).neg(),
    "compare": lambda x, y: x > y,
    "where": lambda x, y: torch.where(x > 0, x, y),
    "pow": lambda x, y: x**2,
    "lerp": lambda x, y: torch.lerp(x, y, 0.3),
    "addcdiv": lambda x, y: torch.addcdiv(x, y, y.abs() + 1, value=-0.5),
    "clamp": lambda x, y: x.clamp(-0.5, 0.5),
    "to-double": lambda x, y: x.to(torch.float64),
    "clone": lambda x, y: x.clone(),
    "detach": lambda x, y: x.detach(),
    "zeros_like": lambda x, y: torch.zeros_like(x),
    "ones_like-int": lambda x, y: torch.ones_like(x, dtype=torch.int32),
    "full_like": lambda x, y: torch.full_like(x, 4.0),
    "view-same": lambda x, y: x.view(x.shape),
    "reshape-same": lambda x, y: x.reshape(x.shape),
}


@pytest.mark.parametrize("op", OPS, ids=list(OPS))
@pytest.mark.parametrize("name", LAYOUTS, ids=list(LAYOUTS))
def test_out_of_place_matches_full(op, name):
    layout = LAYOUTS[name]
    g = torch.Generator().manual_seed(0)
    x, y = (
        torch.randn(layout.global_shape, generator=g),
        torch.randn(layout.global_shape, generator=g),
    )
    expected = OPS[op](x, y)
    got = [OPS[op](a, b) for a, b in zip(each_rank(layout, x), each_rank(layout, y))]
    assert_matches(got, expected)


INPLACE = {
    "add_": lambda x, y: x.add_(y, alpha=2),
    "mul_-scalar": lambda x, y: x.mul_(0.5),
    "fill_": lambda x, y: x.fill_(1.25),
    "zero_": lambda x, y: x.zero_(),
    "copy_": lambda x, y: x.copy_(y),
    "addcmul_": lambda x, y: x.addcmul_(y, y, value=0.1),
    "lerp_": lambda x, y: x.lerp_(y, 0.9),
    "clamp_": lambda x, y: x.clamp_(min=0),
}


@pytest.mark.parametrize("op", INPLACE, ids=list(INPLACE))
@pytest.mark.parametrize("name", LAYOUTS, ids=list(LAYOUTS))
def test_in_place_matches_full(op, name):
    layout = LAYOUTS[name]
    g = torch.Generator().manual_seed(1)
    x, y = (
        torch.randn(layout.global_shape, generator=g),
        torch.randn(layout.global_shape, generator=g),
    )
    xs, ys = each_rank(layout, x), each_rank(layout, y)
    for a, b in zip(xs, ys):
        assert INPLACE[op](a, b) is a
    INPLACE[op](x, y)
    assert_matches(xs, x)


def test_plain_operands_broadcast_and_copy_from_full():
    layout = LAYOUTS["columns-two-per-rank"]
    x = torch.randn(7, 6)
    bias = torch.randn(6)
    assert_matches([a + bias for a in each_rank(layout, x)], x + bias)
    assert_matches([a * torch.tensor(3.0) for a in each_rank(layout, x)], x * 3)
    target = [ShardedTensor.zeros(layout, rank=r) for r in range(2)]
    for t in target:
        t.copy_(x)
    assert_matches(target, x)
    with pytest.raises(RuntimeError, match="broadcast"):  # torch's own error
        each_rank(layout, x)[0] + torch.randn(5)


def test_a_replicated_operand_takes_its_blocks_locally():
    """Mixing a replicated operand with a sharded one needs no communication: each rank
    slices its blocks (layouts that need a transfer are covered in tests/ops/test_mixed.py)."""
    x, y = torch.randn(7, 6), torch.randn(7, 6)
    rows = Layout.row_wise((7, 6), [3, 4])
    whole = Layout.replicated((7, 6), 2)
    for r in range(2):
        a = ShardedTensor.from_layout(rows, shard_of(x, rows, r), rank=r)
        b = ShardedTensor.from_layout(whole, [y.clone()], rank=r)
        out = a + b
        assert out.layout_spec == rows
        assert torch.equal(out.local_shards()[0], (x + y)[rows.blocks_of(r)[0].slices()])
        assert (b * a).layout_spec == rows  # the sharded layout wins, whatever the order
        a.copy_(b)
        assert torch.equal(a.local_shards()[0], y[rows.blocks_of(r)[0].slices()])
    plain = torch.zeros(7, 6)
    with pytest.raises(NotImplementedError, match="full_tensor"):
        plain.add_(ShardedTensor.from_layout(rows, shard_of(x, rows, 0), rank=0))


def test_equal_is_local_and_layout_aware():
    x = torch.randn(7, 6)
    a = each_rank(Layout.chunked((7, 6), 0, 2), x)
    b = each_rank(Layout.chunked((7, 6), 1, 2), x)
    assert torch.equal(a[0], a[0].clone())
    assert not torch.equal(a[0], b[0])  # same data, different layouts
    assert torch.equal(a[1], x)  # against a full tensor: this rank's blocks
    changed = a[0].clone()
    changed.local_shards()[0][0, 0] += 1
    assert not torch.equal(a[0], changed)


def _assemble(st: ShardedTensor) -> torch.Tensor:
    """The whole tensor of a one-rank ShardedTensor, from its blocks (no collective)."""
    out = torch.empty(st.shape, dtype=st.dtype)
    for shard, block in zip(st.local_shards(), st.local_blocks):
        out[block.slices()] = shard
    return out


@pytest.mark.parametrize(
    "op",
    [
        lambda x: x.sum(),
        lambda x: x.t() * 1,
        lambda x: x.view(-1) * 1,
        lambda x: x @ x.T,
        lambda x: x.new_zeros((2,)),
        lambda x: torch.sort(x, dim=0).values,
        lambda x: torch.cumprod(x, 0),
    ],
    ids=["sum", "t", "view-flat", "matmul", "new_zeros-other-size", "sort", "cumprod"],
)
def test_ops_match_the_whole_tensor_on_one_rank(op):
    """One process, two blocks: rules and the whole-tensor fallback give torch's values."""
    from shardwise.ops import FALLBACK_OPS

    layout = Layout.row_wise((7, 5), [3, 4], ranks=[0, 0])
    x = torch.randn(7, 5)
    st = ShardedTensor.from_layout(layout, shard_of(x, layout, 0), rank=0)
    FALLBACK_OPS.clear()
    out = op(st)
    assert isinstance(out, ShardedTensor)
    assert torch.allclose(_assemble(out), op(x), rtol=1e-5, atol=1e-5)  # float32 sums


def test_an_op_without_a_rule_falls_back_and_says_so(caplog):
    from shardwise.ops import FALLBACK_OPS

    layout = Layout.row_wise((7, 5), [3, 4], ranks=[0, 0])
    x = torch.randn(7, 5)
    st = ShardedTensor.from_layout(layout, shard_of(x, layout, 0), rank=0)
    FALLBACK_OPS.clear()
    with caplog.at_level("DEBUG", logger="shardwise.ops"):
        out = torch.sort(st, dim=0).values
    assert FALLBACK_OPS == {torch.ops.aten.sort.default: 1}
    assert "aten.sort.default has no sharded rule" in caplog.text
    assert out.layout_spec == layout  # the whole result comes back in the input's layout
    assert torch.equal(_assemble(out), torch.sort(x, dim=0).values)


def test_register_op():
    x = each_rank(LAYOUTS["row-uneven-empty"], torch.ones(7, 5))[0]
    calls = []

    def local_sum(t, *args, **kwargs):
        calls.append((args, kwargs))
        return sum(s.sum() for s in t.local_shards())

    sw.register_op(torch.ops.aten.sum.default, local_sum)
    try:
        assert x.sum() == 15  # rank 0 holds 3 rows of 5
        assert calls == [((), {})]
    finally:
        sw.unregister_op(torch.ops.aten.sum.default)
    with pytest.raises(TypeError, match="OpOverload"):
        sw.register_op(torch.add, local_sum)


def test_unregister_op_restores_the_built_in_behaviour():
    x = each_rank(LAYOUTS["row-uneven-empty"], torch.ones(7, 5))[0]
    sum_op, add_op = torch.ops.aten.sum.default, torch.ops.aten.add.Tensor
    sw.register_op(sum_op, lambda t: torch.tensor(-1.0))
    sw.register_op(add_op, lambda a, b: torch.tensor(-2.0))  # overrides the pointwise handler
    try:
        assert x.sum() == -1 and (x + x) == -2
    finally:
        sw.unregister_op(sum_op)
        sw.unregister_op(add_op)
    with pytest.raises(sw.UsageError, match="needs a process group"):
        x.sum()  # the built-in rule again: it sums over every rank's blocks
    one = ShardedTensor.from_layout(Layout.row_wise((7, 5), [7]), [torch.ones(7, 5)], rank=0)
    assert one.sum().local_shards()[0].item() == 35.0
    assert_matches([x + x], torch.full((7, 5), 2.0))
    with pytest.raises(KeyError, match=r"aten\.sum\.default"):
        sw.unregister_op(sum_op)


def test_autograd_through_local_ops():
    layout = LAYOUTS["columns-two-per-rank"]
    x = each_rank(layout, torch.randn(7, 6))[1].requires_grad_()
    y = (x * 3 + 1).clamp(min=-10)
    y.backward(ShardedTensor.full(layout, 1.0, rank=1, dtype=torch.float32))
    assert_matches([x.grad], torch.full((7, 6), 3.0))


OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1),
    "sgd-momentum-wd-nesterov": lambda ps: torch.optim.SGD(
        ps, lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=True
    ),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01, foreach=False),
    "adam-amsgrad-wd": lambda ps: torch.optim.Adam(
        ps, lr=0.01, amsgrad=True, weight_decay=0.1, foreach=False
    ),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01, foreach=False),
}


@pytest.mark.parametrize("make_opt", OPTIMIZERS, ids=list(OPTIMIZERS))
@pytest.mark.parametrize("name", ["row-uneven-empty", "columns-two-per-rank", "grid-3d", "scalar"])
def test_optimizers_step_exactly_as_on_full_tensors(make_opt, name):
    layout = LAYOUTS[name]
    g = torch.Generator().manual_seed(2)
    w = torch.randn(layout.global_shape, generator=g)
    grads = [torch.randn(layout.global_shape, generator=g) for _ in range(3)]
    full_param = torch.nn.Parameter(w.clone())
    full_opt = OPTIMIZERS[make_opt]([full_param])
    for grad in grads:
        full_param.grad = grad.clone()
        full_opt.step()
    for rank in range(layout.world_size):
        param = torch.nn.Parameter(
            ShardedTensor.from_layout(layout, shard_of(w, layout, rank), rank=rank, dtype=w.dtype)
        )
        opt = OPTIMIZERS[make_opt]([param])
        for grad in grads:
            param.grad = ShardedTensor.from_layout(
                layout, shard_of(grad, layout, rank), rank=rank, dtype=w.dtype
            )
            opt.step()
        assert_matches([param.detach()], full_param.detach())
        for key, value in opt.state[param].items():
            if isinstance(value, ShardedTensor):
                assert_matches([value], full_opt.state[full_param][key])


def test_an_ops_tensors_are_found_as_pytree_finds_them() -> None:
    """`ops.per_shard.tensors_in` looks at flat arguments directly (no pytree walk) and
    hands anything else to pytree: the same tensors, in the same order, either way."""
    from collections import OrderedDict, namedtuple

    from torch.utils._pytree import tree_flatten

    from shardwise.ops.per_shard import flat, tensors_in

    layout = Layout.chunked((4, 2), 0, 2)
    a, b = (ShardedTensor.from_layout(layout, shard_of(torch.ones(4, 2), layout, 0), rank=0),) * 2
    c, d = torch.zeros(2), torch.ones(3)
    pair = namedtuple("pair", "x y")
    cases = [
        ((a, 2, c), {"alpha": 1.5}),
        ((a,), {"out": c}),
        (([a, c, None, 3],), {"dim": 0}),
        (((c, a),), {"other": d}),
        ((a, [1, [c, d]]), {}),
        ((pair(c, a),), {"b": d}),
        ((OrderedDict(x=c, y=a),), {}),
        ((torch.Size([2, 3]), a), {"memory_format": torch.contiguous_format, "z": d}),
        ((a, torch.float32, torch.device("cpu"), "mean", None, True), {"w": b}),
    ]
    for args, kwargs in cases:
        leaves, _ = tree_flatten((args, kwargs))
        want = [x for x in leaves if isinstance(x, torch.Tensor)]
        got = tensors_in(args, kwargs)
        assert len(got) == len(want) and all(g is w for g, w in zip(got, want)), (args, kwargs)
    assert [flat(a, k) for a, k in cases] == [True, True] + [False] * 6 + [True]


def test_flip_keeps_a_layout_with_holes_and_mirrors_its_blocks():
    # rows 0-1 on rank 0, rows 5-6 on rank 1; rows 2-4 held by no rank
    layout = Layout(
        (7, 3),
        {0: [sw.Block((0, 0), (2, 3))], 1: [sw.Block((5, 0), (2, 3))]},
        2,
        allow_holes=True,
    )
    full = torch.arange(21.0).reshape(7, 3)
    for st in each_rank(layout, full):
        flipped = st.flip(0)
        assert flipped.layout_spec.allow_holes
        mine = layout.blocks_of(st.rank)[0]
        (block,) = flipped.local_blocks
        assert block.offsets == (7 - mine.offsets[0] - 2, 0)
        assert torch.equal(flipped.local_shards()[0], full.flip(0)[block.slices()])
