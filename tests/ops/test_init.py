"""`torch.nn.init.*` in place on ShardedTensors: every shard drawn, replicas equal,
bounds from the global shape (fan-in of the whole weight), on 3 gloo ranks."""

from __future__ import annotations

import math

import pytest
import torch

import shardwise as sw
from shardwise import Block, Layout
from shardwise.testing import run_ranks

pytestmark = pytest.mark.spawned

SHAPE = (9, 8)
LAYOUTS = {
    "rows": Layout.row_wise(SHAPE, [4, 0, 5]),
    "replicated": Layout.replicated(SHAPE, 3),
    # rows 0-3 on ranks 0 and 1 (replicas), rows 4-8 on rank 2
    "replicas": Layout(
        SHAPE,
        {0: [Block((0, 0), (4, 8))], 1: [Block((0, 0), (4, 8))], 2: [Block((4, 0), (5, 8))]},
        3,
    ),
}


def _init(rank: int, world: int) -> dict[str, str]:
    torch.manual_seed(100 + rank)  # each rank its own stream, as in a real job
    problems: dict[str, str] = {}
    inits = {
        "uniform": lambda t: torch.nn.init.uniform_(t, -0.5, 0.5),
        "normal": lambda t: torch.nn.init.normal_(t, 3.0, 0.1),
        "kaiming_uniform": lambda t: torch.nn.init.kaiming_uniform_(t, a=math.sqrt(5)),
        "xavier_uniform": torch.nn.init.xavier_uniform_,
        "trunc_normal": lambda t: torch.nn.init.trunc_normal_(t, std=0.02),
        "constant": lambda t: torch.nn.init.constant_(t, 0.25),
    }
    # bounds from the global (9, 8) shape: fan_in 8, fan_out 9
    bounds = {
        "uniform": (-0.5, 0.5),
        "normal": (2.0, 4.0),
        "kaiming_uniform": (-1 / math.sqrt(8), 1 / math.sqrt(8)),
        "xavier_uniform": (-math.sqrt(6 / 17), math.sqrt(6 / 17)),
        "trunc_normal": (-2.0, 2.0),
        "constant": (0.25, 0.25),
    }
    for lname, layout in LAYOUTS.items():
        for name, init in inits.items():
            st = sw.ShardedTensor.zeros(layout, dtype=torch.float64)
            out = init(st)
            full = st.full_tensor()
            mine = [full[b.slices()] for b in layout.blocks_of(rank)]
            lo, hi = bounds[name]
            if out is not st:
                problems[f"{lname}/{name}"] = "not in place"
            elif not all(torch.equal(s, m) for s, m in zip(st.local_shards(), mine)):
                problems[f"{lname}/{name}"] = "a replica differs from the block's first holder"
            elif not (full.min() >= lo and full.max() <= hi):
                problems[f"{lname}/{name}"] = f"out of [{lo}, {hi}]: {full.min()}, {full.max()}"
            elif name != "constant" and full.unique().numel() < full.numel() // 2:
                problems[f"{lname}/{name}"] = "values repeat: not drawn per element"
    return problems


def test_nn_init_in_place_keeps_replicas_equal() -> None:
    for rank, problems in enumerate(run_ranks(_init, 3, timeout=90)):
        assert problems == {}, f"rank {rank}: {problems}"
