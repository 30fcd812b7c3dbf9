"""DTensor's surface on ShardedTensor, side by side with torch's DTensor and PhysicsNeMo.

Each case runs the same inputs through `torch.distributed.tensor.DTensor` (or the
real PhysicsNeMo 2.2.2 `ShardTensor`, where uneven pieces are the point) and
through shardwise on 2 spawned gloo ranks, and compares values and gradients
exactly: `device_mesh`, `placements`, `redistribute(mesh, placements)`,
`to_local(grad_placements=)`, `full_tensor(grad_placements=)`,
`ShardedTensor.from_local(local, mesh, placements, sharding_shapes=)`, `offsets()`,
and gradients through `from_dtensor` / `from_shard_tensor` / `from_local` of non-leaves.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.distributed as dist

import shardwise as sw
from shardwise import Layout
from shardwise.testing import run_ranks

pytestmark = pytest.mark.spawned

SHAPE = (7, 6)
FULL = torch.arange(42, dtype=torch.float64).reshape(SHAPE) / 8 - 2
WEIGHT = torch.arange(42, dtype=torch.float64).reshape(SHAPE) % 5 - 1.5  # a non-uniform dL/dy


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.clone().requires_grad_(True)


def _surface(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    out: dict = {}

    # placements, device_mesh, offsets of a converted DTensor
    dt = distribute_tensor(FULL, mesh, (Shard(0),))
    st = sw.from_dtensor(dt)
    out["placements"] = (st.placements == dt.placements, st.device_mesh is mesh, st.offsets())

    # redistribute(mesh, placements) against DTensor's, Shard(-1) included
    for target in ((Shard(1),), (Shard(-1),), (Replicate(),), (Shard(0),)):
        mine = st.redistribute(mesh, target)
        theirs = dt.redistribute(mesh, target)
        out[f"redistribute {target}"] = (
            torch.equal(mine.to_local(), theirs.to_local()),
            mine.placements == theirs.placements,
        )
    out["async_op"] = torch.equal(
        st.redistribute(mesh, (Shard(1),), async_op=True).to_local(),
        dt.redistribute(mesh, (Shard(1),)).to_local(),
    )

    # gradients through redistribute + to_local, DTensor vs ShardedTensor.from_local
    piece = FULL.chunk(world)[rank]
    w_cols = WEIGHT[:, 3 * rank : 3 * rank + 3]
    a, b = _leaf(piece), _leaf(piece)
    ref = (
        DTensor.from_local(a, mesh, (Shard(0),), shape=SHAPE, stride=(6, 1))
        .redistribute(mesh, (Shard(1),))
        .to_local()
    )
    (ref * w_cols).sum().backward()
    got = sw.ShardedTensor.from_local(
        b, mesh, (Shard(0),), sharding_shapes="chunk", global_shape=SHAPE
    )
    got = got.redistribute(mesh, (Shard(1),)).to_local()
    (got * w_cols).sum().backward()
    out["grad redistribute"] = (torch.equal(ref, got), torch.equal(a.grad, b.grad))

    # full_tensor(grad_placements=[Partial()]): every rank's gradient is an addend
    for grad_placements in (None, (Partial(),), (Replicate(),)):
        a, b = _leaf(piece), _leaf(piece)
        scale = rank + 1.0
        ref_full = DTensor.from_local(a, mesh, (Shard(0),), shape=SHAPE, stride=(6, 1)).full_tensor(
            grad_placements=grad_placements
        )
        (ref_full * WEIGHT * scale).sum().backward()
        got_full = sw.ShardedTensor.from_local(b, mesh, (Shard(0),)).full_tensor(
            grad_placements=grad_placements
        )
        (got_full * WEIGHT * scale).sum().backward()
        out[f"full_tensor grad {grad_placements}"] = (
            torch.equal(ref_full, got_full),
            torch.equal(a.grad, b.grad),
            b.grad.clone(),
        )

    # to_local(grad_placements=[Partial()]) of a replicated tensor
    a, b = _leaf(FULL), _leaf(FULL)
    scale = rank + 1.0
    ref_local = DTensor.from_local(a, mesh, (Replicate(),)).to_local(grad_placements=(Partial(),))
    (ref_local * scale).sum().backward()
    got_local = sw.ShardedTensor.from_local(b, mesh, (Replicate(),)).to_local(
        grad_placements=(Partial(),)
    )
    (got_local * scale).sum().backward()
    out["to_local partial"] = (torch.equal(a.grad, b.grad), b.grad.clone())

    # a non-leaf DTensor: from_dtensor keeps its graph
    a = _leaf(piece)
    leaf = DTensor.from_local(a, mesh, (Shard(0),), shape=SHAPE, stride=(6, 1))
    y = sw.from_dtensor(leaf * 2)
    (y.full_tensor() * WEIGHT).sum().backward()
    out["from_dtensor non-leaf"] = a.grad.clone()

    # a non-leaf plain tensor: from_local keeps its graph (both forms)
    a = _leaf(piece)
    y = sw.from_local(a * 3, Layout.chunked(SHAPE, 0, world))
    (y.full_tensor() * WEIGHT).sum().backward()
    b = _leaf(piece)
    z = sw.from_local(b * 3, mesh, (Shard(0),))
    (z.full_tensor() * WEIGHT).sum().backward()
    out["from_local non-leaf"] = (a.grad.clone(), torch.equal(a.grad, b.grad))

    # a tensor built on a process group, no mesh: a 1-d mesh over its group
    uneven = Layout.row_wise(SHAPE, [5, 2])
    plain = sw.ShardedTensor.from_layout(
        uneven, [FULL[b.slices()].clone() for b in uneven.blocks_of(rank)]
    )
    out["group only"] = (
        plain.device_mesh.mesh.tolist(),
        plain.placements,
        plain.offsets(),
        torch.equal(plain.redistribute(plain.device_mesh, (Replicate(),)).to_local(), FULL),
        plain.redistribute(None, (Shard(0),)).layout_spec,  # its own placements: its own sizes
        plain.redistribute(plain.device_mesh, (Shard(1),)).layout_spec,
    )

    # refusals: Partial target, a mesh of other ranks, an inexpressible layout
    errors = []
    try:
        st.redistribute(mesh, (Partial(),))
    except sw.LayoutError as e:
        errors.append(str(e))
    two = Layout.column_wise(SHAPE, [1, 2, 1, 2], ranks=[0, 1, 0, 1], world_size=2)
    odd = sw.ShardedTensor.from_layout(two, [FULL[b.slices()].clone() for b in two.blocks_of(rank)])
    for call in (lambda: odd.placements, lambda: odd.offsets()):
        try:
            call()
        except sw.LayoutError as e:
            errors.append(str(e))
    out["errors"] = errors
    ok = torch.ones(1)
    dist.all_reduce(ok)
    return out


def test_dtensor_surface_matches_dtensor():
    from torch.distributed.tensor import Partial, Replicate, Shard

    results = run_ranks(_surface, 2, timeout=180)
    for rank, out in enumerate(results):
        assert out["placements"] == (True, True, (4 * rank,))
        for target in ((Shard(1),), (Shard(-1),), (Replicate(),), (Shard(0),)):
            assert out[f"redistribute {target}"] == (True, True), target
        assert out["async_op"]
        assert out["grad redistribute"] == (True, True)
        for gp in (None, (Partial(),), (Replicate(),)):
            same_value, same_grad, grad = out[f"full_tensor grad {gp}"]
            assert same_value and same_grad, gp
            rows = slice(4 * rank, 4 * rank + (4 if rank == 0 else 3))
            # Partial: the ranks' gradients (scales 1 and 2) summed; else this rank's own
            want = WEIGHT[rows] * (3.0 if gp == (Partial(),) else rank + 1.0)
            assert torch.equal(grad, want), gp
        same, grad = out["to_local partial"]
        assert same and torch.equal(grad, torch.full(SHAPE, 3.0, dtype=torch.float64))
        rows = slice(4 * rank, 4 * rank + (4 if rank == 0 else 3))
        assert torch.equal(out["from_dtensor non-leaf"], 2 * WEIGHT[rows])
        grad, same = out["from_local non-leaf"]
        assert same and torch.equal(grad, 3 * WEIGHT[rows])
        ranks, placements, offsets, replicated, own, chunked = out["group only"]
        assert ranks == [0, 1] and placements == (Shard(0),) and offsets == ((0,), (5,))[rank]
        assert replicated
        assert own == Layout.row_wise(SHAPE, [5, 2])
        assert chunked == Layout.chunked(SHAPE, 1, 2)
        partial, placements_error, offsets_error = out["errors"]
        assert "Partial" in partial and "only as a reduction's result" in partial
        assert "cannot be expressed as placements on a mesh of shape (2,)" in placements_error
        assert "Layout(7x6, 4 blocks on 2 ranks)" in placements_error
        assert offsets_error == placements_error


def _physicsnemo(rank: int, world: int) -> dict:
    from physicsnemo.domain_parallel import ShardTensor
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial, Shard

    mesh = init_device_mesh("cpu", (world,))
    sizes = [5, 2]
    piece = FULL[:5] if rank == 0 else FULL[5:]
    shapes = {0: [(5, 6), (2, 6)]}
    out: dict = {}
    for form in ("infer", "dict", "ints"):
        a, b = _leaf(piece), _leaf(piece)
        pn = ShardTensor.from_local(a, mesh, (Shard(0),), sharding_shapes=shapes)
        given = {"infer": "infer", "dict": shapes, "ints": {0: sizes}}[form]
        st = sw.ShardedTensor.from_local(b, mesh, (Shard(0),), sharding_shapes=given)
        ref_full, got_full = pn.full_tensor(), st.full_tensor()
        (ref_full * WEIGHT).sum().backward()
        (got_full * WEIGHT).sum().backward()
        out[form] = (
            torch.equal(ref_full, got_full),
            torch.equal(a.grad, b.grad),
            tuple(pn.offsets()) == st.offsets(),
            st.layout_spec,
            st.placements == tuple(pn.placements),
        )
    # full_tensor(grad_placements=[Partial()]) on uneven pieces (PhysicsNeMo 2.2.2's own
    # backward fails here: its reduce-scatter returns torch.chunk pieces, (4, 6) for (5, 6))
    b = _leaf(piece)
    scale = rank + 1.0
    st = sw.ShardedTensor.from_local(b, mesh, (Shard(0),), sharding_shapes=shapes)
    (st.full_tensor(grad_placements=(Partial(),)) * WEIGHT * scale).sum().backward()
    out["partial"] = (True, b.grad.clone())
    # a non-leaf ShardTensor: from_shard_tensor keeps its graph
    a, b = _leaf(piece), _leaf(piece)
    pn = ShardTensor.from_local(a, mesh, (Shard(0),), sharding_shapes=shapes)
    (pn * 2).full_tensor().mul(WEIGHT).sum().backward()
    pn2 = ShardTensor.from_local(b, mesh, (Shard(0),), sharding_shapes=shapes)
    mine = sw.from_shard_tensor(pn2 * 2)
    (mine.full_tensor() * WEIGHT).sum().backward()
    out["non-leaf"] = (torch.equal(a.grad, b.grad), b.grad.clone())
    # a piece that fits no grid: the same error on every rank
    try:
        sw.ShardedTensor.from_local(FULL[:3] if rank == 0 else FULL[:3, :2], mesh, (Shard(0),))
        out["bad"] = ("returned", "")
    except Exception as e:  # noqa: BLE001 - compared across ranks
        out["bad"] = (type(e).__name__, str(e))
    ok = torch.ones(1)
    dist.all_reduce(ok)
    return out


@pytest.mark.skipif(
    importlib.util.find_spec("physicsnemo") is None, reason="physicsnemo is not installed"
)
def test_uneven_from_local_matches_physicsnemo():
    results = run_ranks(_physicsnemo, 2, timeout=180)
    for rank, out in enumerate(results):
        for form in ("infer", "dict", "ints"):
            same_full, same_grad, same_offsets, layout, same_placements = out[form]
            assert same_full and same_grad and same_offsets and same_placements, form
            assert layout == Layout.row_wise(SHAPE, [5, 2])
        same, grad = out["partial"]
        rows = slice(0, 5) if rank == 0 else slice(5, 7)
        assert same and torch.equal(grad, 3.0 * WEIGHT[rows])
        same, grad = out["non-leaf"]
        assert same and torch.equal(grad, 2 * WEIGHT[rows])
    assert results[0]["bad"] == results[1]["bad"]
    kind, message = results[0]["bad"]
    assert kind == "LayoutError"
    assert "rank 1: its local tensor has shape (3, 2)" in message and "form no grid" in message
