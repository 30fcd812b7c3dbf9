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


def _tables(rank: int, world: int) -> tuple[dict[str, dict[str, object]], dict[str, object]]:
    lookup = lambda w: F.embedding(INDICES, w)  # noqa: E731
    rows, cols = Layout.row_wise(TABLE, [4, 0, 6]), Layout.column_wise(TABLE, [1, 0, 3])
    out = {
        "row-wise": _check(rank, rows, lookup),
        "column-wise": _check(rank, cols, lookup),
    }
    # bags: 5 of them, the third empty; index 4 (twice) is the padding row where given
    flat, offsets = INDICES.reshape(-1), torch.tensor([0, 2, 2, 3, 5])
    weights = torch.tensor([0.5, -1.0, 2.0, 0.25, 1.5, 3.0], dtype=torch.float64)
    bags = {
        "sum": lambda w: F.embedding_bag(flat, w, offsets, mode="sum"),
        "mean": lambda w: F.embedding_bag(flat, w, offsets, mode="mean"),
        "mean, padding": lambda w: F.embedding_bag(flat, w, offsets, mode="mean", padding_idx=4),
        "sum, weights": lambda w: F.embedding_bag(
            flat, w, offsets, mode="sum", per_sample_weights=weights
        ),
        "sum, last offset": lambda w: F.embedding_bag(
            flat, w, torch.tensor([0, 2, 2, 3, 5, 6]), include_last_offset=True
        ),
        "2-d input": lambda w: F.embedding_bag(INDICES, w, mode="mean"),
    }
    for name, bag in bags.items():
        out[f"bag {name} row-wise"] = _check(rank, rows, bag)
        out[f"bag {name} column-wise"] = _check(rank, cols, bag)
    out["bag max column-wise"] = _check(
        rank, cols, lambda w: F.embedding_bag(flat, w, offsets, mode="max")
    )
    # a row-wise maximum has no rule: it gathers the table, never a wrong answer
    row_max = _check(rank, rows, lambda w: F.embedding_bag(flat, w, offsets, mode="max"))
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
    return out, row_max


def test_embeddings_match_the_whole_table() -> None:
    for rank, (results, row_max) in enumerate(run_ranks(_tables, 3, timeout=90)):
        assert row_max["values"] and row_max["grad"], f"rank {rank}: {row_max}"
        assert "aten._embedding_bag.default" in row_max["fallbacks"], row_max
        for name, r in results.items():
            assert r["values"] and r["grad"], f"rank {rank}, {name}: {r}"
        for name, r in results.items():  # every lookup and bag (and backward) by a rule
            assert r["fallbacks"] == [], f"rank {rank}, {name}: {r}"
        assert len(results) == 16


def _poisoned(rank: int, world: int) -> list[bool]:
    """A row-wise table with an inf and a nan row that no bag looks up: another rank's
    rows never count, not even as 0 · inf."""
    full = _table()
    full[3], full[2] = torch.inf, torch.nan
    layout = Layout.row_wise(TABLE, [4, 0, 6])
    w = sw.ShardedTensor.from_layout(
        layout, [full[b.slices()].clone() for b in layout.blocks_of(rank)], dtype=full.dtype
    )
    idx, offsets = torch.tensor([5, 6, 9, 5]), torch.tensor([0, 2])
    weights = torch.tensor([1.0, 2.0, 0.5, 1.0], dtype=torch.float64)
    return [
        torch.equal(F.embedding(idx, w).full_tensor(), F.embedding(idx, full)),
        torch.equal(
            F.embedding_bag(idx, w, offsets, mode="mean").full_tensor(),
            F.embedding_bag(idx, full, offsets, mode="mean"),
        ),
        torch.equal(
            F.embedding_bag(idx, w, offsets, mode="sum", per_sample_weights=weights).full_tensor(),
            F.embedding_bag(idx, full, offsets, mode="sum", per_sample_weights=weights),
        ),
    ]


def test_rows_a_rank_lacks_never_count() -> None:
    assert run_ranks(_poisoned, 3, timeout=60) == [[True] * 3] * 3
