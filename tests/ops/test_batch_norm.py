"""`nn.BatchNorm2d` in training on 3 gloo ranks whose input is sharded by samples (3 : 0 : 2,
and replicas of the first samples): the statistics are the whole batch's, as
SyncBatchNorm's, so the output, the input's and the parameters' gradients and the
running statistics after two steps equal one `BatchNorm2d` on the whole batch; then a
batch in eval mode, on those running statistics. No fallback."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import shardwise as sw
from shardwise import Block, Layout
from shardwise.ops import FALLBACK_OPS
from shardwise.testing import run_ranks

pytestmark = pytest.mark.spawned

SHAPE = (5, 3, 4, 2)  # (N, C, H, W)
LAYOUTS = {
    "uneven samples": Layout.along(SHAPE, 0, [3, 0, 2]),
    # ranks 0 and 2 hold the first two samples (replicas: counted once), rank 1 the rest
    "replicas": Layout(
        SHAPE,
        {
            0: [Block((0, 0, 0, 0), (2, 3, 4, 2))],
            1: [Block((2, 0, 0, 0), (3, 3, 4, 2))],
            2: [Block((0, 0, 0, 0), (2, 3, 4, 2))],
        },
        3,
    ),
    # split along H: every block still holds every channel
    "rows of each image": Layout.along(SHAPE, 2, [1, 2, 1]),
}


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randn(SHAPE, generator=g, dtype=torch.float64) * 2 + 1 for _ in range(3)]


def _module() -> nn.BatchNorm2d:
    bn = nn.BatchNorm2d(3, momentum=0.3).double()
    with torch.no_grad():
        bn.weight.copy_(torch.tensor([0.5, 1.5, -1.0]))
        bn.bias.copy_(torch.tensor([0.1, 0.0, -0.2]))
    return bn


def _run(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    cot = torch.linspace(-1, 1, SHAPE[0] * 24, dtype=torch.float64).reshape(SHAPE)
    for name, layout in LAYOUTS.items():
        ours, ref = _module(), _module()
        FALLBACK_OPS.clear()
        grads = []
        inputs = []
        for x in _batches():
            st = sw.ShardedTensor.from_layout(
                layout, [x[b.slices()].clone() for b in layout.blocks_of(rank)], dtype=x.dtype
            )
            inputs.append((st.requires_grad_(), x.clone().requires_grad_()))
        for st, plain in inputs[:2]:  # two training steps
            (ours(st).full_tensor() * cot).sum().backward()
            (ref(plain) * cot).sum().backward()
            grads.append(torch.allclose(st.grad.full_tensor(), plain.grad, rtol=1e-10, atol=1e-12))
        ours.eval()
        ref.eval()
        with torch.no_grad():  # the third batch on the running statistics
            st, plain = inputs[2]
            evaluated = torch.allclose(ours(st).full_tensor(), ref(plain), rtol=1e-10, atol=1e-12)
        out[name] = {
            "input grads": grads,
            "eval output": evaluated,
            "weight grad": torch.allclose(ours.weight.grad, ref.weight.grad, rtol=1e-10),
            "bias grad": torch.allclose(ours.bias.grad, ref.bias.grad, rtol=1e-10),
            "weight grad is plain": type(ours.weight.grad) is torch.Tensor,
            "running mean": torch.allclose(ours.running_mean, ref.running_mean, rtol=1e-12),
            "running var": torch.allclose(ours.running_var, ref.running_var, rtol=1e-12),
            "running var moved": not torch.allclose(ref.running_var, torch.ones(3).double()),
            "batches tracked": (int(ours.num_batches_tracked), int(ref.num_batches_tracked)),
            "fallbacks": {str(op): n for op, n in FALLBACK_OPS.items()},
        }
    return out


@pytest.fixture(scope="module")
def outcomes() -> list[dict[str, Any]]:
    return run_ranks(_run, 3, timeout=180)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_training_uses_the_whole_batch_statistics(outcomes: Any, name: str) -> None:
    for rank, per_layout in enumerate(outcomes):
        got = per_layout[name]
        assert got["input grads"] == [True, True], (rank, got)
        assert got["eval output"] is True, (rank, got)
        assert got["weight grad"] and got["bias grad"] and got["weight grad is plain"], (rank, got)
        assert got["running mean"] and got["running var"] and got["running var moved"], (rank, got)
        assert got["batches tracked"] == (2, 2), (rank, got)
        assert got["fallbacks"] == {}, (rank, got)
