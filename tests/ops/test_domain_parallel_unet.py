"""A small U-Net on a field split along its height over 3 gloo ranks (rows 6 : 2 : 4, and
6 : 0 : 6 with a rank holding nothing), forward and backward with no fallback.

The model is what a PhysicsNeMo domain-parallel CNN is made of: a 3x3 convolution,
`GroupNorm`, `GELU`, a 2x2 max pool, a convolution, `BatchNorm2d` in training, a
bilinear upsampling by 2, the skip connection concatenated along the channels, a last
convolution and an MSE loss. Every op runs on the split field: the convolutions, the
pool and the upsampling exchange halo rows with the neighbours, the norms reduce their
statistics across ranks. In float64, the loss, the field's gradient and every
parameter's gradient equal those of a `copy.deepcopy` of the model on the whole field
(rtol 1e-9), and so do the batch norm's running statistics.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise import Layout
from shardwise.ops import FALLBACK_OPS
from shardwise.testing import run_ranks

pytestmark = pytest.mark.spawned

SHAPE = (2, 2, 12, 8)  # (N, C, H, W), split along H
SPLITS = {"6:2:4": [6, 2, 4], "6:0:6": [6, 0, 6]}


class UNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.down = nn.Conv2d(2, 4, 3, padding=1)
        self.gn = nn.GroupNorm(2, 4)
        self.mid = nn.Conv2d(4, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.out = nn.Conv2d(8, 1, 3, padding=1)

    def forward(self, x: Any) -> Any:
        skip = F.gelu(self.gn(self.down(x)))
        y = self.bn(self.mid(F.max_pool2d(skip, 2)))
        y = F.interpolate(y, scale_factor=2, mode="bilinear")
        return self.out(torch.cat([skip, y], dim=1))


def _run(rank: int, world: int, split: list[int]) -> dict[str, Any]:
    torch.manual_seed(0)
    model = UNet().double()
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    field = torch.randn(SHAPE, generator=g, dtype=torch.float64)
    target = torch.randn(SHAPE[0], 1, *SHAPE[2:], generator=g, dtype=torch.float64)
    layout = Layout.along(SHAPE, 2, split)
    x = sw.ShardedTensor.from_layout(
        layout, [field[b.slices()].clone() for b in layout.blocks_of(rank)], dtype=field.dtype
    ).requires_grad_()
    t_layout = Layout.along(tuple(target.shape), 2, split)
    t = sw.ShardedTensor.from_layout(
        t_layout, [target[b.slices()].clone() for b in t_layout.blocks_of(rank)], dtype=target.dtype
    )
    FALLBACK_OPS.clear()
    loss = F.mse_loss(model(x), t)
    loss.backward()
    fallbacks = {str(op): n for op, n in FALLBACK_OPS.items()}
    whole = field.clone().requires_grad_()
    want = F.mse_loss(ref(whole), target)
    want.backward()

    def close(a: torch.Tensor, b: torch.Tensor) -> bool:
        return torch.allclose(a, b, rtol=1e-9, atol=1e-12)

    params = {}
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        grad = p.grad.full_tensor() if isinstance(p.grad, sw.ShardedTensor) else p.grad
        params[name] = close(grad, q.grad)
    return {
        "loss": close(loss.full_tensor(), want.detach()),
        "field grad": close(x.grad.full_tensor(), whole.grad),
        "params": params,
        "running stats": close(model.bn.running_mean, ref.bn.running_mean)
        and close(model.bn.running_var, ref.bn.running_var),
        "fallbacks": fallbacks,
    }


@pytest.mark.parametrize("split", list(SPLITS))
def test_unet_on_a_split_field_matches_the_whole_field(split: str) -> None:
    for rank, got in enumerate(run_ranks(_run, 3, SPLITS[split], timeout=180)):
        assert got["fallbacks"] == {}, (rank, got["fallbacks"])
        assert got["loss"] and got["field grad"] and got["running stats"], (rank, got)
        assert all(got["params"].values()), (rank, got["params"])
        assert len(got["params"]) == 10
