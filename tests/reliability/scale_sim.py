"""Load planning at scale, simulated in one process: DCP's planning is a pure function
of the checkpoint metadata and one rank's targets, so every rank of a large job
can be planned here, on meta tensors, without a process group or any data."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint.default_planner import create_default_local_load_plan
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)

from shardwise.layout import Layout
from shardwise.tensor import ShardedTensor

__all__ = ["PlanningStats", "simulate_load_planning"]


@dataclass
class PlanningStats:
    ranks: int
    chunks: int
    read_items: int
    seconds: float


def simulate_load_planning(ranks: int, chunks: int, cols: int = 1024) -> PlanningStats:
    """Plan loading a tensor saved as `chunks` row blocks into `ranks` column blocks."""
    shape = (chunks * 8, cols)
    saved = Layout.chunked(shape, 0, chunks)
    metadata = Metadata(
        state_dict_metadata={
            "w": TensorStorageMetadata(
                TensorProperties(dtype=torch.float32),
                torch.Size(shape),
                [
                    ChunkStorageMetadata(torch.Size(b.offsets), torch.Size(b.sizes))
                    for bs in saved.blocks
                    for b in bs
                ],
            )
        }
    )
    target = Layout.chunked(shape, 1, ranks)
    start = time.perf_counter()
    items = 0
    for rank in range(ranks):
        st = ShardedTensor.empty(target, dtype=torch.float32, device="meta", rank=rank)
        items += len(create_default_local_load_plan({"w": st}, metadata).items)
    return PlanningStats(ranks, chunks, items, time.perf_counter() - start)
