"""`shardwise demo`: save a sharded state on N ranks, load it on M ranks in other layouts.

This first version exercises the foundation with stock DCP: two kinds of
uneven layouts saved by `torch.distributed.checkpoint.save` on
`--world-size` ranks, loaded by `torch.distributed.checkpoint.load` on
`--load-world-size` ranks into different layouts, checked bit for bit.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import torch

__all__ = ["add_parser", "main"]

SHAPE = (1000, 64)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="save a sharded state on N ranks and load it on M ranks in other layouts",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example: shardwise demo --world-size 2 --load-world-size 3",
    )
    p.add_argument("--world-size", type=int, default=2, help="ranks that save (default 2)")
    p.add_argument("--load-world-size", type=int, default=3, help="ranks that load (default 3)")
    p.add_argument("--dir", type=Path, default=None, help="checkpoint folder (default: a temp dir)")
    p.set_defaults(func=main)


def reference_state() -> dict[str, torch.Tensor]:
    """The full tensors every rank can rebuild without communication."""
    g = torch.Generator().manual_seed(0)
    return {
        "emb.row_wise": torch.randn(SHAPE, generator=g),
        "emb.column_wise": torch.randn(SHAPE, generator=g),
    }


def save_layouts(world_size: int) -> dict:
    from shardwise import Layout

    rows = [0] * world_size
    rows[0], rows[-1] = 600, 400  # uneven, middle ranks empty
    if world_size == 1:
        rows = [1000]
    cols = [16, 16, 16, 16]
    return {
        "emb.row_wise": Layout.row_wise(SHAPE, rows),
        "emb.column_wise": Layout.column_wise(
            SHAPE, cols, ranks=[i % world_size for i in range(4)], world_size=world_size
        ),
    }


def load_layouts(world_size: int) -> dict:
    from shardwise import Layout

    return {
        "emb.row_wise": Layout.column_wise(
            SHAPE, [64 // world_size] * (world_size - 1) + [64 - 64 // world_size * (world_size - 1)]
        ),
        "emb.column_wise": Layout.chunked(SHAPE, 0, world_size),
    }


def _save_rank(rank: int, world_size: int, path: str) -> float:
    import torch.distributed.checkpoint as dcp

    from shardwise import ShardedTensor
    from shardwise.testing import shard_of

    full = reference_state()
    state = {
        k: ShardedTensor.from_layout(layout, shard_of(full[k], layout, rank))
        for k, layout in save_layouts(world_size).items()
    }
    t = time.perf_counter()
    dcp.save(state, checkpoint_id=path)
    return time.perf_counter() - t


def _load_rank(rank: int, world_size: int, path: str) -> tuple[float, int]:
    import torch.distributed.checkpoint as dcp

    from shardwise import ShardedTensor

    full = reference_state()
    state = {
        k: ShardedTensor.full(layout, float("nan"), dtype=torch.float32)
        for k, layout in load_layouts(world_size).items()
    }
    t = time.perf_counter()
    dcp.load(state, checkpoint_id=path)
    elapsed = time.perf_counter() - t
    wrong = 0
    for k, st in state.items():
        for shard, block in zip(st.local_shards(), st.local_blocks):
            wrong += int((shard != full[k][block.slices()]).sum())
    return elapsed, wrong


def main(args: argparse.Namespace) -> int:
    from shardwise.testing import run_ranks

    tmp = None
    path = args.dir
    if path is None:
        tmp = tempfile.mkdtemp(prefix="shardwise-demo-")
        path = Path(tmp) / "ckpt"
    try:
        total = sum(t.numel() * t.element_size() for t in reference_state().values())
        print(f"state: {len(reference_state())} tensors of {SHAPE}, {total / 2**20:.1f} MiB")
        for k, layout in save_layouts(args.world_size).items():
            print(f"  save {k}: {layout}")
        times = run_ranks(_save_rank, args.world_size, str(path), timeout=300)
        print(f"saved on {args.world_size} ranks with stock DCP in {max(times):.3f}s -> {path}")
        for k, layout in load_layouts(args.load_world_size).items():
            print(f"  load {k}: {layout}")
        results = run_ranks(_load_rank, args.load_world_size, str(path), timeout=300)
        wrong = sum(w for _, w in results)
        print(f"loaded on {args.load_world_size} ranks in {max(t for t, _ in results):.3f}s")
        print("PASS: every element bit for bit" if wrong == 0 else f"FAIL: {wrong} wrong elements")
        return 0 if wrong == 0 else 1
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
