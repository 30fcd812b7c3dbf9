"""Scale: many blocks, many small tensors, load planning for many ranks (no timing asserts)."""

from __future__ import annotations

import pytest
import torch

import shardwise.checkpoint as swc
from shardwise import Layout, ShardedTensor, plan_transfers
from shardwise.testing import run_ranks

from .scale_sim import simulate_load_planning

pytestmark = pytest.mark.spawned


def test_100k_block_layout_round_trips_and_plans():
    layout = Layout.grid((4000, 400), (1000, 100))
    assert Layout.from_json(layout.to_json()) == layout
    rows = Layout.chunked((4000, 400), 0, 100_000 // 100)
    assert (
        sum(t.region.numel for t in plan_transfers(rows, Layout(rows.global_shape, rows.blocks)))
        == 4000 * 400
    )


def _many(rank: int, world: int, path: str, count: int) -> bool:
    layout = Layout.chunked((4, 16), 0, world)
    state = {
        f"t{i}": ShardedTensor.full(layout, float(i), dtype=torch.float32) for i in range(count)
    }
    swc.save(state, path)
    target = {
        k: ShardedTensor.zeros(Layout.chunked((4, 16), 1, world), dtype=torch.float32)
        for k in state
    }
    swc.load(target, path)
    return all(bool((s == float(k[1:])).all()) for k, v in target.items() for s in v.local_shards())


def test_thousands_of_small_tensors(tmp_path):
    assert run_ranks(_many, 2, str(tmp_path / "many"), 3000, timeout=300) == [True, True]


def test_load_planning_for_many_ranks_in_one_process():
    stats = simulate_load_planning(ranks=128, chunks=1000)
    # each rank's column band crosses every one of the 1000 row chunks: one read item each
    assert stats.read_items == 128 * 1000 and stats.ranks == 128 and stats.chunks == 1000
