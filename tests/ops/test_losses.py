"""`cross_entropy` / `nll_loss` on 3 gloo ranks whose logits are sharded by rows (4 : 0 :
3, and replicas of row halves): the loss a pending sum, targets plain or sharded alike,
values and gradients against torch on the whole tensors, no fallback."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

import shardwise as sw
from shardwise import Block, Layout
from shardwise.ops import FALLBACK_OPS
from shardwise.testing import run_ranks

pytestmark = pytest.mark.spawned

FULL = torch.linspace(-3, 3, 42, dtype=torch.float64).reshape(7, 6).sin()
TARGET = torch.tensor([0, 5, 2, 2, 1, 3, 4])
WEIGHT = torch.tensor([0.5, 1.0, 2.0, 1.5, 0.25, 3.0], dtype=torch.float64)
LAYOUTS = {
    "uneven rows": Layout.row_wise((7, 6), [4, 0, 3]),
    # ranks 0 and 2 hold the top rows (replicas: counted once), rank 1 the bottom
    "replicas": Layout(
        (7, 6),
        {0: [Block((0, 0), (3, 6))], 1: [Block((3, 0), (4, 6))], 2: [Block((0, 0), (3, 6))]},
        3,
    ),
}


def _losses(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, layout in LAYOUTS.items():
        rows = Layout(
            (7,), {r: [Block(b.offsets[:1], b.sizes[:1]) for b in layout.blocks_of(r)]
                   for r in range(world)}, world,
        )  # fmt: skip
        for kind in ("plain target", "sharded target"):
            x = sw.ShardedTensor.from_layout(
                layout, [FULL[b.slices()].clone() for b in layout.blocks_of(rank)],
                dtype=FULL.dtype,
            ).requires_grad_()  # fmt: skip
            target: Any = TARGET
            if kind == "sharded target":
                target = sw.ShardedTensor.from_layout(
                    rows, [TARGET[b.slices()].clone() for b in rows.blocks_of(rank)],
                    dtype=TARGET.dtype,
                )  # fmt: skip
            FALLBACK_OPS.clear()
            loss = F.cross_entropy(x, target, weight=WEIGHT, ignore_index=2)
            pending = loss.pending_reduce
            loss.backward()
            ref = FULL.clone().requires_grad_()
            want = F.cross_entropy(ref, TARGET, weight=WEIGHT, ignore_index=2)
            want.backward()
            out[(name, kind)] = (
                pending,
                torch.allclose(loss.full_tensor(), want.detach(), rtol=1e-12, atol=0),
                torch.allclose(x.grad.full_tensor(), ref.grad, rtol=1e-12, atol=1e-15),
                sorted(map(str, FALLBACK_OPS)),
            )
    return out


def test_cross_entropy_on_row_sharded_logits() -> None:
    for rank, out in enumerate(run_ranks(_losses, 3, timeout=60)):
        assert out == {
            (name, kind): ("sum", True, True, [])
            for name in LAYOUTS
            for kind in ("plain target", "sharded target")
        }, rank


def _out_of_range(rank: int, world: int) -> str:
    x = sw.ShardedTensor.from_layout(
        LAYOUTS["uneven rows"],
        [FULL[b.slices()].clone() for b in LAYOUTS["uneven rows"].blocks_of(rank)],
        dtype=FULL.dtype,
    )
    bad = TARGET.clone()
    bad[5] = 9  # rank 2's row: a target every rank holds is checked on every rank
    try:
        F.cross_entropy(x, bad).full_tensor()
    except IndexError as e:
        return str(e)
    return "no error"


def test_a_target_out_of_range_raises_on_every_rank() -> None:
    assert run_ranks(_out_of_range, 3, timeout=60) == ["Target 9 is out of bounds."] * 3
