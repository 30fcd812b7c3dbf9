"""Operands in different layouts: brought to one layout (redistributed) before the op,
on 3 gloo ranks; plain tensors copied from and into ShardedTensors."""

from __future__ import annotations

import pytest
import torch

import shardwise as sw
from shardwise import Layout
from shardwise.ops import FALLBACK_OPS
from shardwise.testing import run_ranks

pytestmark = pytest.mark.spawned


def _mixed(rank: int, world: int) -> dict[str, bool]:
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(7, 6, generator=g), torch.randn(7, 6, generator=g)
    rows = Layout.row_wise((7, 6), [4, 0, 3])
    cols = Layout.column_wise((7, 6), [1, 2, 3])
    a = sw.ShardedTensor.from_layout(rows, [x[b.slices()].clone() for b in rows.blocks_of(rank)])
    b = sw.ShardedTensor.from_layout(cols, [y[c.slices()].clone() for c in cols.blocks_of(rank)])
    FALLBACK_OPS.clear()
    out = {}
    s = a + b
    out["sum in the first layout"] = s.layout_spec == rows and torch.equal(s.full_tensor(), x + y)
    p = b * a
    out["product in the first layout"] = p.layout_spec == cols and torch.equal(
        p.full_tensor(), y * x
    )
    a.copy_(b)
    out["copy_ redistributes"] = torch.equal(a.full_tensor(), y)
    plain = torch.zeros(7, 6)
    plain.copy_(b)
    out["plain.copy_ gathers"] = torch.equal(plain, y)
    out["no fallback"] = sum(FALLBACK_OPS.values()) == 0
    return out


def test_mixed_layouts_are_redistributed() -> None:
    results = run_ranks(_mixed, 3, timeout=60)
    for rank, checks in enumerate(results):
        assert all(checks.values()), f"rank {rank}: {checks}"
