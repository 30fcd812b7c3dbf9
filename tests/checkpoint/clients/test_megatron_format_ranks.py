"""Megatron's side files across ranks (`megatron_format`): a FIFO planted as `metadata.json`
fails `swc.save(..., megatron=True)` on every rank, instead of blocking rank 0 while the
others wait for the process group's timeout. One process: test_megatron_format.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import shardwise.checkpoint as swc
from shardwise import Layout, ShardedTensor
from shardwise.errors import CheckpointExistsError
from shardwise.testing import run_ranks

pytestmark = pytest.mark.spawned


def _weights(rank: int, world: int) -> ShardedTensor:
    rows = 4 // world
    return ShardedTensor.from_layout(
        Layout.row_wise((4, 2), [rows] * world),
        [torch.arange(8.0).reshape(4, 2)[rank * rows : (rank + 1) * rows]],
        rank=rank,
    )


def _save_beside_a_fifo(rank: int, world: int, path: str) -> tuple[str, str]:
    try:
        swc.save({"w": _weights(rank, world), "step": 3}, path, megatron=True)
    except CheckpointExistsError as e:
        return type(e).__name__, str(e)
    return "saved", ""


def test_a_fifo_metadata_json_fails_the_save_on_every_rank(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    path.mkdir()
    os.mkfifo(path / "metadata.json")
    results = run_ranks(_save_beside_a_fifo, 2, str(path), timeout=120)
    why = f"{path / 'metadata.json'} is not a plain file (a folder, device or pipe): refused"
    message = f"rank 0: {why}; it is in the way of Megatron's metadata.json"
    assert results == [("CheckpointExistsError", message)] * 2
    assert sorted(p.name for p in path.iterdir()) == ["metadata.json"]
