"""Real processes at scale: W gloo ranks save and load N row-sharded tensors with
stock DCP and shardwise in one run, then fewer ranks load shardwise's checkpoint
split by columns (issue 22, "Real processes").

Run: `python benchmarks/scale_processes.py [--world 32] [--reshard-world 24]
[--tensors 1000] [--dir /dev/shm] [--repeat 2]`, or `run_processes(...)` from
another benchmark.

Every tensor is float32 of `tensor_kib` KiB (64: the issue's "N = 1,000 tensors
of 64 KiB"), 32 columns wide, split by rows over all ranks (at least one row
each: 2 KiB per rank at 32 ranks, so metadata, not bandwidth, is measured), values exact
functions of the global (tensor, row, column), so every load is checked
bit-exact. Times are taken inside the ranks after a barrier (process start-up
stays out), slowest rank, best of `repeat`; the two engines write to sibling
folders of one target, one after the other, and load into the same
preallocated targets, spoiled with -1 before each run. The reshard load (each
tensor split by columns over `reshard_world` ranks) is
compared with shardwise's same-layout load on `world` ranks.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the modules beside this file

import checkpoint_cases as cases  # noqa: E402

COLS = 32  # 128 B rows: 24 column bands of one or two elements per row stay non-empty


def _values(i: int, row0: int, rows: int, col0: int, cols: int) -> torch.Tensor:
    """Block [row0:+rows, col0:+cols] of tensor `i`: below 2**16, exact in float32."""
    r = torch.arange(row0, row0 + rows).unsqueeze(1) * 1031
    c = torch.arange(col0, col0 + cols).unsqueeze(0) * 7
    return ((r + c + i * 131) % 65521).to(torch.float32)


def _state(rank: int, world: int, tensors: int, shape: tuple[int, int], dim: int, fill: bool):
    """`tensors` ShardedTensors of `shape` split along `dim` over `world` ranks."""
    import shardwise as sw

    layout = sw.Layout.chunked(shape, dim, world)
    blocks = layout.blocks_of(rank)
    state = {}
    for i in range(tensors):
        shards = [
            _values(i, b.offsets[0], b.sizes[0], b.offsets[1], b.sizes[1])
            if fill
            else torch.full(b.sizes, -1.0)
            for b in blocks
        ]
        state[f"layer{i}.weight"] = sw.ShardedTensor.from_layout(layout, shards)
    return state


def _exact(what: str, state: dict) -> None:
    for i, v in enumerate(state.values()):
        for b, s in zip(v.local_blocks, v.local_shards(), strict=True):
            if not torch.equal(s, _values(i, b.offsets[0], b.sizes[0], b.offsets[1], b.sizes[1])):
                raise AssertionError(f"{what}: tensor {i} block {b} loaded wrong values")


def _one_thread() -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)  # W ranks share this machine's cores


def same_layout_rank(
    rank: int, world: int, base: str, tensors: int, shape: tuple[int, int], repeat: int
) -> dict:
    """Stock then shardwise: save, load into the same layout, check; keeps shardwise's folder."""
    import torch.distributed.checkpoint as dcp

    import shardwise.checkpoint as swc

    _one_thread()
    state = _state(rank, world, tensors, shape, 0, fill=True)
    targets = _state(rank, world, tensors, shape, 0, fill=False)
    out: dict[str, Any] = {"state bytes": cases.max_over_ranks(cases._local_bytes(state))[0]}
    stock, ours = Path(base) / "stock", Path(base) / "shardwise"
    engines: list[tuple[str, Path, Callable[[], Any], Callable[[], Any]]] = [
        (
            "stock",
            stock,
            lambda: dcp.save(state, checkpoint_id=stock),
            lambda: dcp.load(targets, checkpoint_id=stock),
        ),
        ("sw", ours, lambda: swc.save(state, ours), lambda: swc.load(targets, ours)),
    ]
    for name, path, save, load in engines:
        out[f"{name}_save"], _ = cases.timed(save, repeat, lambda: cases.clean(path))
        out[f"{name}_load"], _ = cases.timed(load, repeat, lambda: cases._spoil(targets))
        _exact(f"{name}, {world} ranks, same layout", targets)
        if path == stock:  # before shardwise writes: one checkpoint in memory at a time
            cases.clean(stock)  # shardwise's stays for the reshard load
    return out


def reshard_rank(
    rank: int, world: int, path: str, tensors: int, shape: tuple[int, int], repeat: int
) -> dict:
    """Load the row-wise checkpoint with every tensor split by columns over `world` ranks."""
    import shardwise.checkpoint as swc

    _one_thread()
    targets = _state(rank, world, tensors, shape, 1, fill=False)
    seconds, _ = cases.timed(lambda: swc.load(targets, path), repeat, lambda: cases._spoil(targets))
    _exact(f"shardwise, {world} ranks, columns", targets)
    return {"reshard_load": seconds}


def _spawn(label: str, fn, world: int, *args: Any) -> tuple[dict, float]:
    """Rank 0's result and the wall seconds of the whole spawn (start-up included)."""
    from shardwise.testing import run_ranks

    start = time.perf_counter()
    print(f"  {label} ...", end="", flush=True, file=sys.stderr)
    result = run_ranks(fn, world, *args, timeout=3600)[0]
    wall = time.perf_counter() - start
    print(f" {wall:.0f}s", flush=True, file=sys.stderr)
    return result, wall


def run_processes(
    world: int = 32,
    reshard_world: int = 24,
    tensors: int = 1000,
    tensor_kib: int = 64,
    folder: str = "/dev/shm",
    repeat: int = 2,
) -> dict:
    """Seconds (slowest rank, best of `repeat`) and the ratios save_x, load_x
    (stock / shardwise: > 1 means shardwise is faster) and reshard_over_same
    (reshard load / same-layout shardwise load: <= 1.5 is the target)."""
    if reshard_world > COLS or world < 1 or tensors < 1 or repeat < 1:
        raise ValueError(f"need 1 <= reshard_world <= {COLS}, world, tensors, repeat >= 1")
    os.environ["OMP_NUM_THREADS"] = "1"  # a forkserver started from here inherits it
    shape = (max(world, tensor_kib * 1024 // (4 * COLS)), COLS)
    base = tempfile.mkdtemp(prefix="shardwise-scale-", dir=folder)
    try:
        same, same_wall = _spawn(
            f"{world} ranks, {tensors:,} tensors: stock and shardwise save/load",
            same_layout_rank,
            world,
            base,
            tensors,
            shape,
            repeat,
        )
        moved, moved_wall = _spawn(
            f"{reshard_world} ranks: shardwise load by columns",
            reshard_rank,
            reshard_world,
            str(Path(base) / "shardwise"),
            tensors,
            shape,
            repeat,
        )
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return {
        **{k: same[k] for k in ("stock_save", "sw_save", "stock_load", "sw_load")},
        "reshard_load": moved["reshard_load"],
        "save_x": same["stock_save"] / same["sw_save"],
        "load_x": same["stock_load"] / same["sw_load"],
        "reshard_over_same": moved["reshard_load"] / same["sw_load"],
        "world": world,
        "reshard_world": reshard_world,
        "tensors": tensors,
        "shape": shape,
        "state_bytes_per_rank": same["state bytes"],
        "wall_same_layout": same_wall,
        "wall_reshard": moved_wall,
    }


def _print(r: dict, folder: str, repeat: int) -> None:
    rows, cols = r["shape"]
    print(
        f"\n{r['world']} gloo ranks, {r['tensors']:,} float32 tensors of {rows} x {cols} "
        f"row-sharded ({r['state_bytes_per_rank'] / 2**20:.1f} MiB per rank), {folder}, "
        f"slowest rank, best of {repeat}"
    )
    print(f"  {'':34}{'stock s':>9}{'shardwise s':>13}{'stock/sw':>10}")
    print(f"  {'save':34}{r['stock_save']:9.3f}{r['sw_save']:13.3f}{r['save_x']:9.2f}x")
    print(
        f"  {'load, same layout':34}{r['stock_load']:9.3f}{r['sw_load']:13.3f}{r['load_x']:9.2f}x"
    )
    label = f"load on {r['reshard_world']} ranks, by columns"
    print(
        f"  {label:34}{'':9}{r['reshard_load']:13.3f}   "
        f"{r['reshard_over_same']:.2f}x the same-layout load"
    )
    print(
        f"  targets: save and load >= 10x stock: {r['save_x']:.2f}x / {r['load_x']:.2f}x; "
        f"reshard <= 1.5x same layout: {r['reshard_over_same']:.2f}x"
    )
    print(f"  wall (start-up included): {r['wall_same_layout']:.0f}s + {r['wall_reshard']:.0f}s")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world", type=int, default=32, help="ranks that save (default 32)")
    parser.add_argument(
        "--reshard-world", type=int, default=24, help="ranks that load by columns (default 24)"
    )
    parser.add_argument("--tensors", type=int, default=1000, help="tensors (default 1000)")
    parser.add_argument("--tensor-kib", type=int, default=64, help="KiB per tensor")
    parser.add_argument("--dir", default="/dev/shm", help="target folder (default /dev/shm)")
    parser.add_argument("--repeat", type=int, default=2, help="runs, best kept (default 2)")
    args = parser.parse_args(argv)
    result = run_processes(
        args.world, args.reshard_world, args.tensors, args.tensor_kib, args.dir, args.repeat
    )
    _print(result, args.dir, args.repeat)


if __name__ == "__main__":
    main()
