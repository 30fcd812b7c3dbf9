"""Per-rank records (`use_collectives=False`) load through `swc.load`'s one path."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

import shardwise.checkpoint as swc
from shardwise import Layout, ShardedTensor
from shardwise.testing import run_ranks, shard_of

pytestmark = pytest.mark.spawned


def _per_rank(rank: int, world: int, folder: str) -> bool:
    layout = Layout.row_wise((8, 2), [5, 3])
    full = torch.arange(16.0).reshape(8, 2)
    state = {"st": ShardedTensor.from_layout(layout, shard_of(full, layout, rank))}
    dcp.save(state, storage_writer=swc.Writer(folder), use_collectives=False)
    out = {"st": ShardedTensor.zeros(layout)}
    swc.load(out, folder)
    return torch.equal(out["st"].local_shards()[0], state["st"].local_shards()[0])


def test_per_rank_records_load_through_the_engine(tmp_path):
    assert run_ranks(_per_rank, 2, str(tmp_path / "ck"), timeout=60) == [True, True]
