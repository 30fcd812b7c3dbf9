"""`max(dim)`, `min(dim)`, `argmax`, `argmin` and `topk` along a split dim on 3 gloo
ranks: torch's values (and first indices; `topk`'s wherever torch's are defined, no ties)
exactly, with ties across ranks, NaN (torch's first NaN wins), -inf everywhere in a
column, integers at their extremes, replicas, several blocks a rank, a rank holding
nothing, and a layout split along both dims; no fallback."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import shardwise as sw
from shardwise import Block, Layout
from shardwise.ops import FALLBACK_OPS
from shardwise.testing import run_ranks

pytestmark = pytest.mark.spawned

SHAPE = (9, 5)
LAYOUTS = {
    "uneven rows, an empty rank": Layout.row_wise(SHAPE, [4, 0, 5]),
    "replicas and several blocks": Layout(
        SHAPE,
        {
            0: [Block((0, 0), (3, 5)), Block((6, 0), (3, 5))],
            1: [Block((3, 0), (3, 5))],
            2: [Block((0, 0), (3, 5))],
        },
        3,
    ),
    "split along both dims": Layout(
        SHAPE,
        {0: [Block((0, 0), (5, 3))], 1: [Block((5, 0), (4, 3))], 2: [Block((0, 3), (9, 2))]},
        3,
    ),
    # rank 0's blocks seen along dim 1 cover rows 0-3 and rows 2-3: partly the same slices
    "a rank's blocks partly over the same slices": Layout(
        SHAPE,
        {
            0: [Block((0, 0), (4, 3)), Block((2, 3), (2, 2))],
            1: [Block((0, 3), (2, 2))],
            2: [Block((4, 0), (5, 5))],
        },
        3,
    ),
}


def _inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 4, SHAPE, generator=g).double()  # many ties
    x[3, 1] = x[7, 1] = x[6, 2] = float("nan")
    x[:, 4] = -float("inf")
    ints = torch.randint(-3, 3, SHAPE, generator=g)
    ints[2, 0] = ints[8, 0] = torch.iinfo(torch.int64).min
    ints[1, 3] = torch.iinfo(torch.int64).max
    zeros = torch.zeros(SHAPE, dtype=torch.float64)
    zeros[::2] = -0.0  # -0.0 and 0.0 tie: torch's value is the element at its index
    return {
        "float64": x,
        "int64": ints,
        "float32": torch.randn(SHAPE, generator=g),
        "signed zeros": zeros,
    }


CALLS = {
    "max": lambda t: t.max(0),
    "min keepdim": lambda t: t.min(0, keepdim=True),
    "argmax": lambda t: t.argmax(0),
    "argmin keepdim": lambda t: torch.argmin(t, 0, keepdim=True),
    "max dim 1": lambda t: torch.max(t, 1),
    "argmin dim -1": lambda t: t.argmin(-1),
}


def _run(rank: int, world: int) -> dict[Any, Any]:
    out = {}
    for name, layout in LAYOUTS.items():
        for kind, full in _inputs().items():
            shards = [full[b.slices()].clone() for b in layout.blocks_of(rank)]
            st = sw.ShardedTensor.from_layout(layout, shards, dtype=full.dtype)
            for call, f in CALLS.items():
                FALLBACK_OPS.clear()
                got, want = f(st), f(full)
                if isinstance(want, torch.Tensor):
                    same = torch.equal(got.full_tensor(), want)
                else:
                    values, indices = got[0].full_tensor(), got[1].full_tensor()
                    real = ~torch.isnan(want[0])
                    same = (
                        torch.equal(indices, want[1])
                        and torch.allclose(values, want[0], equal_nan=True)
                        and torch.equal(torch.signbit(values[real]), torch.signbit(want[0][real]))
                    )
                out[(name, kind, call)] = (same, {str(k): v for k, v in FALLBACK_OPS.items()})
    return out


def test_extrema_along_a_split_dim_match_torch_values_and_first_indices() -> None:
    per_rank = run_ranks(_run, 3, timeout=120)
    assert len(per_rank[0]) == len(LAYOUTS) * len(_inputs()) * len(CALLS)
    for rank, got in enumerate(per_rank):
        for key, (same, fallbacks) in got.items():
            assert same, (rank, key)
            assert fallbacks == {}, (rank, key, fallbacks)


def _topk(rank: int, world: int) -> dict[Any, Any]:
    g = torch.Generator().manual_seed(1)
    inputs = dict(_inputs(), distinct=torch.randn(SHAPE, generator=g, dtype=torch.float64))
    out = {}
    for name, layout in LAYOUTS.items():
        for kind, full in inputs.items():
            shards = [full[b.slices()].clone() for b in layout.blocks_of(rank)]
            st = sw.ShardedTensor.from_layout(layout, shards, dtype=full.dtype)
            for d, k, largest in TOPK:
                FALLBACK_OPS.clear()
                values, indices = st.topk(k, d, largest=largest)
                values, indices = values.full_tensor(), indices.full_tensor()
                want, want_at = full.topk(k, d, largest=largest)
                picked = full.gather(d, indices)  # the values at the indices returned
                rows = indices.movedim(d, -1).reshape(-1, k) if k else []
                distinct = all(len(set(row.tolist())) == k for row in rows)
                out[(name, kind, d, k, largest)] = (
                    torch.allclose(values, want, equal_nan=True)
                    and torch.allclose(picked, values, equal_nan=True)
                    and distinct
                    and (kind != "distinct" or torch.equal(indices, want_at)),
                    {str(op): n for op, n in FALLBACK_OPS.items()},
                )
    return out


TOPK = [
    (d, k, largest)
    for d in (0, 1)
    for k in (0, 1, 3, 5, SHAPE[0])
    for largest in (True, False)
    if k <= SHAPE[d]
]


def test_topk_along_a_split_dim_matches_torch() -> None:
    per_rank = run_ranks(_topk, 3, timeout=120)
    assert len(per_rank[0]) == len(LAYOUTS) * 5 * len(TOPK)
    for rank, got in enumerate(per_rank):
        for key, (same, fallbacks) in got.items():
            assert same, (rank, key)
            assert fallbacks == {}, (rank, key, fallbacks)


HOLES = Layout(
    (4, 2), {0: [Block((0, 0), (2, 1))], 1: [Block((2, 0), (2, 1))]}, 2, allow_holes=True
)


def _holes(rank: int, world: int) -> list[str]:
    full = torch.arange(8.0).reshape(4, 2)
    shards = [full[b.slices()].clone() for b in HOLES.blocks_of(rank)]
    st = sw.ShardedTensor.from_layout(HOLES, shards, dtype=full.dtype)
    out = []
    for f in (lambda t: t.argmax(0), lambda t: t.max(0), lambda t: t.topk(3, 0)):
        try:
            f(st)
            out.append("returned")
        except sw.LayoutError as e:
            out.append(type(e).__name__)
    return out


def test_a_layout_with_holes_is_refused_on_every_rank() -> None:
    # column 1 is a hole: there is no maximum to give, on any rank
    assert run_ranks(_holes, 2, timeout=60) == [["LayoutError"] * 3] * 2
