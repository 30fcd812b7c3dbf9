"""Indexing by an integer tensor on 3 gloo ranks (rows 4 : 0 : 3): what moves, what is
refused, what falls back; values against torch on the whole tensor."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import shardwise as sw
from shardwise import Layout
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
    mask = full[:, 0] > 10  # a boolean mask: its result's size depends on its values
    FALLBACK_OPS.clear()
    picked = x[mask]
    out["mask"] = (
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
            "mask": (True, ["aten.index.Tensor"]),
        }, f"rank {rank}"
