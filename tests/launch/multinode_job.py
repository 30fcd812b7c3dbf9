"""One rank of a `torchrun` job (see test_multinode.py): save on 8 ranks or load on 6.

    python multinode_job.py save|load CHECKPOINT MARKERS

Every value is derived from global indices, so any rank checks any element without
communication. A rank that finds a wrong value exits non-zero; one that succeeds writes
`MARKERS/<mode>-<rank>` naming its rank, node, local rank and the elements it handled.
"""

from __future__ import annotations

import os
import signal
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import shardwise.checkpoint as swc
from shardwise import Layout, ShardedTensor

# A hung collective kills this rank instead of outliving the test (workers run in their
# own sessions, out of reach of the test's process-group kill).
ALARM_S = 200
SHAPES = {"emb": (40, 12), "proj": (10, 24), "bias": (16,)}
DTYPES = {"emb": torch.float32, "proj": torch.bfloat16, "bias": torch.int64}
OBJECT = {"step": 1234, "nodes": 2, "names": ["emb", "proj"]}
# Saved on 8 ranks: uneven rows with an empty rank 1, uneven columns with an empty rank 3.
EMB_ROWS = [7, 0, 5, 9, 3, 6, 4, 6]
PROJ_COLS = [2, 4, 3, 0, 5, 3, 4, 3]


def expected(key: str) -> torch.Tensor:
    """The whole tensor `key`, exactly representable in its dtype (bf16 holds
    integers up to 256)."""
    index = torch.arange(torch.Size(SHAPES[key]).numel(), dtype=torch.float64)
    values = {"emb": index * 0.25 + 1, "proj": index - 120, "bias": index * 1000 - 3}[key]
    return values.reshape(SHAPES[key]).to(DTYPES[key])


def sharded(key: str, layout: Layout, rank: int) -> ShardedTensor:
    """This rank's blocks of `key` in `layout`, cut from the expected values."""
    full = expected(key)
    shards = [full[block.slices()].clone() for block in layout.blocks_of(rank)]
    return ShardedTensor.from_layout(layout, shards, dtype=DTYPES[key])


def save(rank: int, path: str) -> int:
    """Save the 8-rank state; the number of tensor elements this rank holds."""
    layouts = {
        "emb": Layout.row_wise(SHAPES["emb"], EMB_ROWS),
        "proj": Layout.column_wise(SHAPES["proj"], PROJ_COLS),
    }
    state: dict = {key: sharded(key, lay, rank) for key, lay in layouts.items()}
    state["bias"] = expected("bias")  # a plain tensor: replicated on every rank
    state["meta"] = dict(OBJECT)
    swc.save(state, path)
    return sum(s.numel() for key in layouts for s in state[key].local_shards())


def load(rank: int, world: int, path: str) -> int:
    """Load into another layout on `world` ranks and check every element bit for bit;
    the number of elements checked."""
    layouts = {
        "emb": Layout.chunked(SHAPES["emb"], 1, world),  # rows -> columns
        "proj": Layout.chunked(SHAPES["proj"], 0, world),  # columns -> rows, rank 5 empty
    }
    state: dict = {
        key: ShardedTensor.full(lay, -7, dtype=DTYPES[key]) for key, lay in layouts.items()
    }
    state["bias"] = torch.zeros(SHAPES["bias"], dtype=DTYPES["bias"])
    state["meta"] = {"step": 0, "nodes": 0, "names": []}  # filled key by key, as dcp.load
    swc.load(state, path)
    checked = 0
    for key in layouts:
        full = expected(key)
        for shard, block in zip(state[key].local_shards(), state[key].local_blocks):
            want = full[block.slices()]
            if shard.dtype != want.dtype or not torch.equal(shard, want):
                sys.exit(f"rank {rank}: {key} {block} differs from the saved values")
            checked += shard.numel()
    if not torch.equal(state["bias"], expected("bias")):
        sys.exit(f"rank {rank}: bias differs from the saved values")
    if state["meta"] != OBJECT:
        sys.exit(f"rank {rank}: meta is {state['meta']!r}, saved {OBJECT!r}")
    return checked + state["bias"].numel()


def main(mode: str, path: str, markers: str) -> None:
    signal.alarm(ALARM_S)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        count = save(rank, path) if mode == "save" else load(rank, world, path)
    finally:
        dist.destroy_process_group()
    node, local = os.environ["GROUP_RANK"], os.environ["LOCAL_RANK"]
    Path(markers, f"{mode}-{rank}").write_text(
        f"{mode} rank={rank} world={world} node={node} local={local} elements={count}\n"
    )


if __name__ == "__main__":
    main(*sys.argv[1:])
