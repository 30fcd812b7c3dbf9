"""Gradients through from_local / to_local / redistribute / full_tensor match full-tensor math."""

from __future__ import annotations

import pytest
import torch

import shardwise as sw
from shardwise import Layout
from shardwise.testing import run_ranks

pytestmark = pytest.mark.spawned

SHAPE = (7, 4)


def _grads(rank: int, world: int) -> list[str]:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(SHAPE, generator=g)
    weight = torch.randn(SHAPE, generator=g)
    rows = Layout.row_wise(SHAPE, [5, 2] + [0] * (world - 2))  # uneven, empty ranks
    cols = Layout.chunked(SHAPE, 1, world)
    bad = []

    # reference: the same computation on the full tensor
    ref = w.clone().requires_grad_()
    expected = torch.autograd.grad(((ref * 2).sin() * weight).sum(), ref)[0]

    # sharded: from_local -> op -> redistribute -> full_tensor -> loss
    block = rows.blocks_of(rank)
    local = (w[block[0].slices()] if block else torch.empty(0, 4)).clone().requires_grad_()
    st = sw.from_local(local, rows)
    y = (st * 2).sin().redistribute(cols)
    loss = (y.full_tensor() * weight).sum()
    (grad,) = torch.autograd.grad(loss, local)
    if block and not torch.equal(grad, expected[block[0].slices()]):
        bad.append(f"rank {rank} from_local grad")
    if not block and grad.shape != (0, 4):
        bad.append(f"rank {rank} empty grad {grad.shape}")

    # to_local after redistribute: each rank's grad is its own slice
    local2 = (w[block[0].slices()] if block else torch.empty(0, 4)).clone().requires_grad_()
    piece = sw.from_local(local2, rows).redistribute(cols).to_local()
    mine = cols.blocks_of(rank)  # torch.chunk(4, 3): the last rank holds nothing
    (piece * (weight[mine[0].slices()] if mine else torch.zeros(0))).sum().backward()
    if block and not torch.equal(local2.grad, weight[block[0].slices()]):
        bad.append(f"rank {rank} to_local grad")

    # from_local along a dimension, sizes inferred
    sizes = [3, 4] if world == 2 else [3, 0, 4]
    start = sum(sizes[:rank])
    part = w[start : start + sizes[rank]].clone().requires_grad_()
    st3 = sw.from_local(part, 0, "infer")
    if st3.shape != SHAPE:
        bad.append(f"rank {rank} inferred shape {st3.shape}")
    (st3.full_tensor() ** 2).sum().backward()
    if not torch.allclose(part.grad, 2 * part.detach()):
        bad.append(f"rank {rank} infer grad")
    return bad


def test_gradients_match_full_tensor_computation():
    assert run_ranks(_grads, 2, timeout=60) == [[], []]
    assert run_ranks(_grads, 3, timeout=60) == [[], [], []]


def _chunk_check(rank: int, world: int) -> str:
    piece = torch.ones(3 if rank < 2 else 1, 2)  # torch.chunk(7, 3) -> 3, 3, 1
    st = sw.from_local(piece, 0, "chunk")
    try:
        sw.from_local(torch.ones(2 + rank, 2), 0, "chunk")  # 2, 3, 4 is not a chunk pattern
    except sw.LayoutError as e:
        return f"{tuple(st.shape)} {e}"
    return "no error"


def test_from_local_chunk_checks_sizes():
    out = run_ranks(_chunk_check, 3, timeout=60)
    assert all(o.startswith("(7, 2)") and "torch.chunk" in o for o in out), out
