"""The state `shardwise demo` saves and checks: shapes, layouts and values.

Every value is a function of (tensor, global index), so each loading rank
recomputes what it should have received for its own blocks, the optimizer
step included, without the full tensors.
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["ADAM", "expected_block", "load_layouts", "save_layouts", "shapes", "values"]

ADAM: dict[str, Any] = {"lr": 0.01, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}


def shapes(size: int) -> dict[str, tuple[int, ...]]:
    """Parameter shapes whose float32 bytes add up to about `size`."""
    floats = max(size // 4, 4096)
    dim = 64
    return {
        "emb.user": (max(1, floats * 15 // 100 // dim), dim),
        "emb.item": (max(1, floats * 15 // 100 // dim), dim),
        "emb.query": (max(1, floats * 30 // 100 // dim), dim),
        "emb.ads": (max(1, floats * 25 // 100 // (2 * dim)), 2 * dim),
        "dense.weight": (max(2, int(math.sqrt(floats * 15 // 100))),) * 2,
        "dense.bias": (max(2, int(math.sqrt(floats * 15 // 100))),),
    }


def _grid(world: int) -> tuple[int, int]:
    a = max(d for d in range(1, int(math.isqrt(world)) + 1) if world % d == 0)
    return a, world // a


def save_layouts(world: int, size: int) -> dict[str, Any]:
    from shardwise import Layout

    s = shapes(size)
    rows = s["emb.query"][0]
    if world == 1:
        query = [rows]
    else:
        weights = [5] + [0] + [3 + (r % 3) for r in range(world - 2)] if world > 2 else [5, 3]
        query = [rows * w // sum(weights) for w in weights]
        query[-1] += rows - sum(query)
    cols = s["emb.ads"][1]
    blocks = 2 * world
    ads = [cols // blocks + (1 if i < cols % blocks else 0) for i in range(blocks)]
    return {
        "emb.user": Layout.table_wise(s["emb.user"], 1 % world, world),
        "emb.item": Layout.table_wise(s["emb.item"], world - 1, world),
        "emb.query": Layout.row_wise(s["emb.query"], query),
        "emb.ads": Layout.column_wise(
            s["emb.ads"], ads, ranks=[i % world for i in range(blocks)], world_size=world
        ),
        "dense.weight": Layout.grid(s["dense.weight"], _grid(world)),
        "dense.bias": Layout.replicated(s["dense.bias"], world),
    }


def load_layouts(world: int, size: int) -> dict[str, Any]:
    from shardwise import Layout

    s = shapes(size)
    return {
        "emb.user": Layout.chunked(s["emb.user"], 0, world),
        "emb.item": Layout.chunked(s["emb.item"], 1, world),
        "emb.query": Layout.chunked(s["emb.query"], 1, world),
        "emb.ads": Layout.chunked(s["emb.ads"], 0, world),
        "dense.weight": Layout.chunked(s["dense.weight"], 1, world),
        "dense.bias": Layout.table_wise(s["dense.bias"], 0, world),
    }


def values(name: str, block: Any, shape: tuple[int, ...], salt: int) -> torch.Tensor:
    """Deterministic float32 values of `block` of tensor `name`, from global indices."""
    index = torch.zeros(block.sizes, dtype=torch.int64)
    stride = 1
    for d in reversed(range(len(shape))):
        view = [1] * len(shape)
        view[d] = block.sizes[d]
        index += (torch.arange(block.offsets[d], block.ends[d], dtype=torch.int64) * stride).view(
            view
        )
        stride *= shape[d]
    seed = (sum(map(ord, name)) * 7919 + salt * 104729) % 2**20
    mixed = (index * 2654435761 + seed) % 2**31
    return (mixed.to(torch.float64) / 2**31 - 0.5).to(torch.float32)


def expected_block(name: str, block: Any, shape: tuple[int, ...]) -> dict[str, torch.Tensor]:
    """Parameter and Adam moments of `block` after one step: the same elementwise math."""
    param = torch.nn.Parameter(values(name, block, shape, 0))
    param.grad = values(name, block, shape, 1)
    opt = torch.optim.Adam([param], foreach=False, **ADAM)
    opt.step()
    return {"param": param.detach(), **{k: v for k, v in opt.state[param].items() if k != "step"}}


# -- the ranks ------------------------------------------------------------------------------
