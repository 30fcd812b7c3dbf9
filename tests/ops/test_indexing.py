"""Indexing by an integer tensor on 3 gloo ranks (rows 4 : 0 : 3): what moves, what is
refused, what falls back; values against torch on the whole tensor."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import shardwise as sw
from shardwise import Block, Layout
from shardwise.ops import FALLBACK_OPS
from shardwise.testing import run_ranks

pytestmark = pytest.mark.spawned


def _indexing(rank: int, world: int) -> dict[str, Any]:
    full = torch.arange(42, dtype=torch.float64).reshape(7, 6)
    layout = Layout.row_wise((7, 6), [4, 0, 3])
    x = sw.ShardedTensor.from_layout(
        layout, [full[b.slices()].clone() for b in layout.blocks_of(rank)], dtype=full.dtype
    )
    idx = torch.tensor([6, 0, -2, 6])
    out: dict[str, Any] = {}
    FALLBACK_OPS.clear()
    rows = x[idx]  # along the sharded dim: each rank its rows, a pending sum
    picks = torch.tensor([5, 0, -2, 5])
    cols = x[:, picks]  # along an unsharded dim: per block, the rows' blocks kept
    out["rows"] = (rows.pending_reduce, torch.equal(rows.full_tensor(), full[idx]))
    out["cols"] = (
        cols.layout_spec == Layout.row_wise((7, 4), [4, 0, 3]),
        torch.equal(cols.full_tensor(), full[:, picks]),
    )
    out["fallbacks"] = sorted(map(str, FALLBACK_OPS))
    for name, bad in (("rows", lambda: x[torch.tensor([1, 7])]), ("cols", lambda: x[:, [-7]])):
        try:
            bad()
            out[f"out of range {name}"] = "no error"
        except IndexError as e:
            out[f"out of range {name}"] = str(e)
    # a boolean mask every rank holds: each block keeps its rows, placed by the mask's
    # running count (rows 2, 3 of rank 0's 4; rows 4..6 of rank 2's 3)
    mask = full[:, 0] > 10
    FALLBACK_OPS.clear()
    picked = x[mask]
    out["mask"] = (
        picked.layout_spec == Layout.row_wise((5, 6), [2, 0, 3]),
        torch.equal(picked.full_tensor(), full[mask]),
        sorted(map(str, FALLBACK_OPS)),
    )
    return out


def test_indexing_by_an_integer_tensor() -> None:
    for rank, out in enumerate(run_ranks(_indexing, 3, timeout=60)):
        assert out == {
            "rows": ("sum", True),
            "cols": (True, True),
            "fallbacks": [],
            "out of range rows": "index 7 is out of bounds for dimension with size 7",
            "out of range cols": "index -7 is out of bounds for dimension with size 6",
            "mask": (True, True, []),
        }, f"rank {rank}"


def _gather_scatter(rank: int, world: int) -> dict[str, Any]:
    full = torch.arange(42, dtype=torch.float64).reshape(7, 6).flip(1)
    rows = Layout.row_wise((7, 6), [4, 0, 3])
    x = sw.ShardedTensor.from_layout(
        rows, [full[b.slices()].clone() for b in rows.blocks_of(rank)], dtype=full.dtype
    )
    order = full.argsort(1)
    out: dict[str, Any] = {}
    FALLBACK_OPS.clear()
    # the index's layout from self's: rows of the sorted order, per block
    g = torch.gather(x, 1, order)
    out["plain index"] = (g.layout_spec == rows, torch.equal(g.full_tensor(), full.sort(1).values))
    # a replicated self brought to a sharded index's blocks: sliced, nothing sent
    whole = sw.ShardedTensor.from_layout(
        Layout.replicated((7, 6), world), [full.clone()], dtype=full.dtype
    )
    idx = x.argsort(1)  # row-sharded
    g2 = whole.gather(1, idx)  # torch's gather, not the legacy collective
    out["replicated self"] = (
        g2.layout_spec == rows,
        torch.equal(g2.full_tensor(), g.full_tensor()),
    )
    # a plain self written per block of the index's layout (what a backward does)
    s = torch.zeros(7, 6, dtype=torch.float64).scatter(1, idx, x)
    out["plain self"] = (
        isinstance(s, sw.ShardedTensor) and s.layout_spec == rows,
        torch.equal(
            s.full_tensor(), torch.zeros(7, 6, dtype=torch.float64).scatter(1, order, full)
        ),
    )
    x.scatter_(1, order[:, :1], -1.0)  # in place into the blocks
    want = full.clone().scatter_(1, order[:, :1], -1.0)
    out["in place"] = torch.equal(x.full_tensor(), want)
    out["fallbacks"] = sorted(map(str, FALLBACK_OPS))
    # along the sharded dim: the fallback, still exact
    g3 = torch.gather(x, 0, torch.zeros(1, 6, dtype=torch.int64))
    out["sharded dim"] = (torch.equal(g3.full_tensor(), want[:1]), sorted(map(str, FALLBACK_OPS)))
    # the legacy collective keeps its positional form: gather(dst, out)
    into = torch.empty(7, 6, dtype=torch.float64) if rank == 1 else None
    x.gather(1, into)
    out["legacy"] = torch.equal(into, want) if rank == 1 else None
    return out


def test_gather_and_scatter_along_a_dim_every_block_spans() -> None:
    for rank, out in enumerate(run_ranks(_gather_scatter, 3, timeout=60)):
        assert out == {
            "plain index": (True, True),
            "replicated self": (True, True),
            "plain self": (True, True),
            "in place": True,
            "fallbacks": [],
            "sharded dim": (True, ["aten.gather.default"]),
            "legacy": True if rank == 1 else None,
        }, rank


def _refused(rank: int, world: int) -> dict[str, str]:
    """What each call raised (type: message) on this rank, rows 4 : 0 : 3."""
    full = torch.arange(42, dtype=torch.float64).reshape(7, 6)
    rows = Layout.row_wise((7, 6), [4, 0, 3])
    x = sw.ShardedTensor.from_layout(
        rows, [full[b.slices()].clone() for b in rows.blocks_of(rank)], dtype=full.dtype
    )
    order = full.argsort(1)
    bad = order.clone()
    bad[0, 0] = 99  # a plain index every rank holds, out of range in row 0 (rank 0's)
    calls = {
        "gather dim 3": lambda: torch.gather(x, 3, order),
        "scatter dim -3": lambda: torch.zeros_like(x).scatter(-3, order, x),
        "flip dim 3": lambda: x.flip(3),
        "flip dim twice": lambda: x.flip(0, 0),
        "sort dim 3": lambda: x.sort(3),
        "topk dim 2": lambda: x.topk(1, 2),
        "gather index 99": lambda: torch.gather(x, 1, bad),
        "gather without index": lambda: x.gather(dim=1),
    }
    out = {}
    for name, call in calls.items():
        try:
            call()
            out[name] = "returned"
        except Exception as e:  # noqa: BLE001 - what each raised is the observation
            out[name] = type(e).__name__
    # torch.gather's form on an integer tensor: an index of another shape is no legacy `out`
    xi = sw.ShardedTensor.from_layout(
        rows, [full[b.slices()].long() for b in rows.blocks_of(rank)], dtype=torch.int64
    )
    picked = xi.gather(1, order[:, :2])
    out["integer gather"] = str(
        torch.equal(picked.full_tensor(), full.long().gather(1, order[:, :2]))
    )
    return out


def test_a_bad_dim_or_index_raises_torchs_error_on_every_rank() -> None:
    """A rank with no rows (rank 1) raises as the others do: the rules leave a bad dim, or
    an index every rank holds that is out of range, to the fallback, whose run on the
    whole tensors raises torch's error everywhere."""
    want = {}
    full = torch.zeros(7, 6)
    for name, call in {
        "gather dim 3": lambda: torch.gather(full, 3, full.long()),
        "scatter dim -3": lambda: full.scatter(-3, full.long(), full),
        "flip dim 3": lambda: full.flip(3),
        "flip dim twice": lambda: full.flip(0, 0),
        "sort dim 3": lambda: full.sort(3),
        "topk dim 2": lambda: full.topk(1, 2),
        "gather index 99": lambda: torch.gather(full, 1, torch.full((7, 6), 99)),
        "gather without index": lambda: full.gather(dim=1),
    }.items():
        with pytest.raises(Exception) as caught:  # noqa: PT011 - torch's own type, recorded
            call()
        want[name] = caught.type.__name__
    want["integer gather"] = "True"
    assert want["gather dim 3"] == "IndexError" and want["gather without index"] == "TypeError"
    for rank, out in enumerate(run_ranks(_refused, 3, timeout=60)):
        assert out == want, rank


def _broadcasts(rank: int, world: int) -> dict[str, bool]:
    """A sharded `s[:, None]` against `x` laid out off a grid, and with an empty block
    written with a box: right on every rank."""
    full = torch.arange(42, dtype=torch.float64).reshape(7, 6)
    s = torch.arange(7, dtype=torch.float64) - 3
    layouts = {
        # rank 0 rows 0-3 of columns 0-2, rank 1 columns 3-5, rank 2 rows 4-6 of 0-2
        "off a grid": Layout(
            (7, 6),
            {0: [Block((0, 0), (4, 3))], 1: [Block((0, 3), (7, 3))], 2: [Block((4, 0), (3, 3))]},
            3,
        ),  # fmt: skip
        "empty with a box": Layout(
            (7, 6),
            {0: [Block((0, 0), (4, 6))], 1: [Block((4, 0), (0, 6))], 2: [Block((4, 0), (3, 6))]},
            3,
        ),  # fmt: skip
    }
    rows = Layout.row_wise((7,), [4, 0, 3])
    st = sw.ShardedTensor.from_layout(
        rows, [s[b.slices()].clone() for b in rows.blocks_of(rank)], dtype=s.dtype
    )
    out = {}
    for name, layout in layouts.items():
        x = sw.ShardedTensor.from_layout(
            layout, [full[b.slices()].clone() for b in layout.blocks_of(rank)], dtype=full.dtype
        )
        y = x * st[:, None]
        out[name] = torch.equal(y.full_tensor(), full * s[:, None]) and all(
            torch.equal(shard, (full * s[:, None])[b.slices()])
            for shard, b in zip(y.local_shards(), y.layout_spec.blocks_of(rank))
        )
    return out


def test_a_smaller_sharded_operand_broadcasts_in_any_layout() -> None:
    for rank, out in enumerate(run_ranks(_broadcasts, 3, timeout=60)):
        assert out == {"off a grid": True, "empty with a box": True}, rank
