"""Edge cases of the rules along a split dim, on 3 gloo ranks (one of them empty where the
split says so), each against torch on the whole tensor:

- an integer max pool (rows past the edges hold the integer minimum);
- a max pool whose window at the edge holds only -inf: torch's index is the window's
  first row in the tensor, so the gradient goes there;
- `cumsum` after a slice leaves a rank an empty block;
- nearest upsampling by 41, whose map torch computes with a rounded reciprocal (output
  41 reads input 0): the fallback's, equal to torch's;
- bfloat16 average pooling and group norm: rounded once, bit for bit as torch's.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

import shardwise as sw
from shardwise import Layout
from shardwise.ops import FALLBACK_OPS
from shardwise.testing import run_ranks

pytestmark = pytest.mark.spawned


def _sharded(full: torch.Tensor, layout: Layout, rank: int) -> sw.ShardedTensor:
    shards = [full[b.slices()].clone() for b in layout.blocks_of(rank)]
    return sw.ShardedTensor.from_layout(layout, shards, dtype=full.dtype)


def _run(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    g = torch.Generator().manual_seed(0)

    full = torch.arange(9 * 2).view(1, 1, 9, 2)
    x = _sharded(full, Layout.along(full.shape, 2, [3, 0, 6]), rank)
    got, idx = F.max_pool2d(x, 3, 1, 1, return_indices=True)
    want, want_idx = F.max_pool2d(full, 3, 1, 1, return_indices=True)
    out["int max pool"] = torch.equal(got.full_tensor(), want) and torch.equal(
        idx.full_tensor(), want_idx
    )

    full = torch.tensor([float("-inf"), float("-inf"), 1.0, 2.0, 0.5], dtype=torch.float64)
    full = full.view(1, 1, 5, 1)
    x = _sharded(full, Layout.along(full.shape, 2, [2, 0, 3]), rank).requires_grad_()
    plain = full.clone().requires_grad_()
    got, idx = F.max_pool2d(x, (3, 1), 1, (1, 0), return_indices=True)
    want, want_idx = F.max_pool2d(plain, (3, 1), 1, (1, 0), return_indices=True)
    got.full_tensor().sum().backward()
    want.sum().backward()
    out["-inf window"] = (
        torch.equal(idx.full_tensor(), want_idx),
        torch.equal(x.grad.full_tensor(), plain.grad),
    )

    full = torch.randn(7, 2, generator=g, dtype=torch.float64)
    x = _sharded(full, Layout.row_wise((7, 2), [3, 0, 4]), rank)
    out["cumsum after a slice"] = torch.allclose(x[4:].cumsum(0).full_tensor(), full[4:].cumsum(0))

    full = torch.arange(3.0).view(1, 1, 3)
    x = _sharded(full, Layout.along(full.shape, 2, [1, 1, 1]), rank)
    FALLBACK_OPS.clear()
    got = F.interpolate(x, scale_factor=41).full_tensor()
    out["nearest by 41"] = (
        torch.equal(got, F.interpolate(full, scale_factor=41)),
        sum(FALLBACK_OPS.values()),
    )

    full = (torch.randn(2, 6, 16, 8, generator=g, dtype=torch.float64) * 10 + 8).bfloat16()
    x = _sharded(full, Layout.along(full.shape, 2, [7, 0, 9]), rank)
    out["bf16 avg pool"] = torch.equal(
        F.avg_pool2d(x, 5, 1, 2, count_include_pad=False).full_tensor(),
        F.avg_pool2d(full, 5, 1, 2, count_include_pad=False),
    )
    out["bf16 group norm"] = torch.equal(F.group_norm(x, 2).full_tensor(), F.group_norm(full, 2))
    return out


def test_rules_along_a_split_dim_at_their_edges() -> None:
    for rank, got in enumerate(run_ranks(_run, 3, timeout=120)):
        assert got["int max pool"], rank
        assert got["-inf window"] == (True, True), rank
        assert got["cumsum after a slice"], rank
        assert got["nearest by 41"] == (True, 1), rank  # one op, through the fallback
        assert got["bf16 avg pool"] and got["bf16 group norm"], (rank, got)


def _refused(rank: int, world: int) -> list[str]:
    layout = Layout.row_wise((6, 3), [2, 0, 4])  # rank 1 holds nothing
    st = _sharded(torch.zeros(6, 3, dtype=torch.bool), layout, rank)
    out = []
    for f in (lambda t: t.argmin(1), lambda t: t.float().max(1), lambda t: t.float().softmax(1)):
        try:
            f(st)
            out.append("returned")
        except RuntimeError as e:
            out.append(str(e).split(":")[0])
    st.float().sum().full_tensor()  # a collective after: no rank was left behind
    return out


def test_an_op_torch_refuses_raises_on_a_rank_holding_nothing_too() -> None:
    # found by review: the empty rank returned and the others waited at the next collective
    assert run_ranks(_refused, 3, timeout=60) == [["argmin()", "returned", "returned"]] * 3


def _grid_edges(rank: int, world: int) -> dict[str, bool]:
    g = torch.Generator().manual_seed(0)
    out = {}
    # a padding wider than the kernel reaches: the 1-wide blocks' windows lie wholly in it
    x = torch.randn(1, 1, 4, 6, dtype=torch.float64, generator=g)
    w = torch.randn(1, 1, 1, 3, dtype=torch.float64, generator=g)
    b = torch.ones(1, dtype=torch.float64)
    layout = Layout.grid(x.shape, (1, 1, 2, 2), sizes=[[1], [1], [2, 2], [1, 5]])
    st = _sharded(x, layout, rank).requires_grad_()
    got = F.conv2d(st, w, b, padding=(0, 4))
    ref_in = x.clone().requires_grad_()
    ref = F.conv2d(ref_in, w, b, padding=(0, 4))
    out["conv, padding past the kernel's reach"] = torch.equal(got.full_tensor(), ref) and all(
        tuple(s.shape) == blk.sizes for s, blk in zip(got.local_shards(), got.local_blocks)
    )
    got.full_tensor().sum().backward()
    ref.sum().backward()
    out["its backward"] = torch.allclose(st.grad.full_tensor(), ref_in.grad, rtol=1e-12)
    # float32 averages on a 2 x 2 grid: each window's sum divided once, as torch's
    x32 = torch.randn(2, 2, 7, 9, generator=g)
    grid = Layout.grid(x32.shape, (1, 1, 2, 2), sizes=[[2], [2], [3, 4], [5, 4]])
    for include in (True, False):
        pooled = F.avg_pool2d(_sharded(x32, grid, rank), 3, 2, 1, True, include)
        out[f"avg_pool2d float32, count_include_pad={include}"] = torch.equal(
            pooled.full_tensor(), F.avg_pool2d(x32, 3, 2, 1, True, include)
        )
    # int16, which gloo neither reduces nor sends: bytes, or the fallback
    i16 = torch.arange(2 * 6 * 8, dtype=torch.int16).reshape(1, 2, 6, 8) * 7 % 23
    out["int16 max_pool2d on a grid"] = torch.equal(
        F.max_pool2d(
            _sharded(i16, Layout.grid(i16.shape, (1, 1, 2, 2)), rank), 3, 2, 1
        ).full_tensor(),
        F.max_pool2d(i16, 3, 2, 1),
    )
    along = Layout.along(i16.shape, 3, [2, 2, 2, 2])
    out["int16 argmax along the split dim"] = torch.equal(
        _sharded(i16, along, rank).argmax(3).full_tensor(), i16.argmax(3)
    )
    # amax keeps a NaN, which gloo's MAX drops
    v = torch.tensor([1.0, 2.0, float("nan"), 0.5, 3.0, -1.0, 0.0, 4.0])
    vs = _sharded(v, Layout.row_wise((8,), [2, 2, 2, 2]), rank)
    out["amax with a NaN"] = bool(vs.amax().full_tensor().isnan())
    out["amin with a NaN"] = bool(vs.amin().full_tensor().isnan())
    out["amax without"] = vs[3:].amax().full_tensor().item() == 4.0
    return out


def test_grids_paddings_dtypes_and_nans_found_by_review() -> None:
    per_rank = run_ranks(_grid_edges, 4, timeout=120)
    for rank, got in enumerate(per_rank):
        assert len(got) == 9
        assert all(got.values()), (rank, got)
