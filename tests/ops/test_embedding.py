"""Embeddings on row-wise and column-wise tables and on sharded indices, values and weight
gradients against the whole table, on 3 gloo ranks (one of them holding nothing)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import shardwise as sw
from shardwise import Layout
from shardwise.ops import FALLBACK_OPS
from shardwise.testing import run_ranks

pytestmark = pytest.mark.spawned

TABLE = (10, 4)
INDICES = torch.tensor([[0, 9, 3], [4, 4, 7]])


def _table() -> torch.Tensor:
    return torch.randn(TABLE, generator=torch.Generator().manual_seed(5), dtype=torch.float64)


def _reference(fn: object) -> tuple[torch.Tensor, torch.Tensor]:
    w = _table().requires_grad_()
    out = fn(w)  # type: ignore[operator]
    cot = torch.arange(out.numel(), dtype=out.dtype).reshape(out.shape)
    (out * cot).sum().backward()
    return out.detach(), w.grad


def _check(rank: int, layout: Layout, fn: object) -> dict[str, object]:
    full = _table()
    w = sw.ShardedTensor.from_layout(
        layout, [full[b.slices()].clone() for b in layout.blocks_of(rank)], dtype=full.dtype
    ).requires_grad_()
    FALLBACK_OPS.clear()
    out = fn(w)  # type: ignore[operator]
    got = out.full_tensor()
    cot = torch.arange(got.numel(), dtype=got.dtype).reshape(got.shape)
    (got * cot).sum().backward()
    want, want_grad = _reference(fn)
    return {
        "values": torch.allclose(got, want, rtol=1e-12, atol=0),
        "grad": torch.allclose(w.grad.full_tensor(), want_grad, rtol=1e-12, atol=0),
        "fallbacks": sorted(map(str, FALLBACK_OPS)),
    }


def _tables(rank: int, world: int) -> dict[str, dict[str, object]]:
    lookup = lambda w: F.embedding(INDICES, w)  # noqa: E731
    bag = lambda w: F.embedding_bag(INDICES.reshape(-1), w, torch.tensor([0, 2]), mode="sum")  # noqa: E731
    out = {
        "row-wise": _check(rank, Layout.row_wise(TABLE, [4, 0, 6]), lookup),
        "column-wise": _check(rank, Layout.column_wise(TABLE, [1, 0, 3]), lookup),
        "bag row-wise": _check(rank, Layout.row_wise(TABLE, [4, 0, 6]), bag),
    }
    # sharded indices, a plain table (a domain-parallel lookup): the weight's gradient is
    # plain and summed over every rank's indices
    layout = Layout.row_wise((2, 3), [1, 0, 1])
    idx = sw.ShardedTensor.from_layout(
        layout, [INDICES[b.slices()].clone() for b in layout.blocks_of(rank)], dtype=INDICES.dtype
    )
    w = _table().requires_grad_()
    FALLBACK_OPS.clear()
    got = F.embedding(idx, w).full_tensor()
    cot = torch.arange(got.numel(), dtype=got.dtype).reshape(got.shape)
    (got * cot).sum().backward()
    want, want_grad = _reference(lambda t: F.embedding(INDICES, t))
    out["sharded indices"] = {
        "values": torch.allclose(got, want, rtol=1e-12, atol=0),
        "grad": type(w.grad) is torch.Tensor
        and torch.allclose(w.grad, want_grad, rtol=1e-12, atol=0),
        "fallbacks": sorted(map(str, FALLBACK_OPS)),
    }
    return out


def test_embeddings_match_the_whole_table() -> None:
    for rank, results in enumerate(run_ranks(_tables, 3, timeout=90)):
        for name, r in results.items():
            assert r["values"] and r["grad"], f"rank {rank}, {name}: {r}"
        assert results["row-wise"]["fallbacks"] == [], results["row-wise"]
        assert results["column-wise"]["fallbacks"] == [], results["column-wise"]
        assert results["sharded indices"]["fallbacks"] == [], results["sharded indices"]
        # embedding_bag has no rule: it gathers the table, never a wrong answer
        assert "aten._embedding_bag.default" in results["bag row-wise"]["fallbacks"]
