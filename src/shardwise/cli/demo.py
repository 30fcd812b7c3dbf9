"""`shardwise demo`: save a sharded training state on N ranks, load it on M ranks
in other layouts, check every element bit for bit.

The state is what a recommendation model's trainer holds: embedding tables
sharded table-wise (most ranks hold none), row-wise with uneven sizes and an
empty rank, column-wise with two blocks per rank; a grid-sharded dense weight;
a replicated bias; Adam's moments after a real optimizer step, in the same
layouts; a step counter. Every value is a function of (tensor, global index),
so each loading rank recomputes what it should have received for its own
blocks — including the optimizer step — without the full tensors.

Under `torchrun` (RANK/WORLD_SIZE set) the same command runs one rank per
process across machines; the load then uses the job's world size.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from .demo_state import ADAM, expected_block, load_layouts, save_layouts, shapes, values
from .sizes import parse_size

if TYPE_CHECKING:
    from ..tensor import ShardedTensor

__all__ = ["add_parser", "main"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="save a sharded training state on N ranks, load it on M in other layouts",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example: shardwise demo --world-size 4 --load-world-size 3 --size 256MiB",
    )
    p.add_argument("--world-size", type=int, default=4, help="ranks that save (default 4)")
    p.add_argument("--load-world-size", type=int, default=3, help="ranks that load (default 3)")
    p.add_argument(
        "--size", default="128MiB", help="parameter bytes, e.g. 256MiB, 2GiB (default 128MiB)"
    )
    p.add_argument(
        "--dir", type=Path, default=None, help="folder for the checkpoint (default: a temp dir)"
    )
    p.add_argument("--keep", action="store_true", help="keep the checkpoint afterwards")
    p.set_defaults(func=main)


def _timed(fn: Any) -> float:
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    fn()
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)


def _progress(rank: int, total: int, desc: str) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, disable=rank != 0 or None, file=sys.stderr, leave=False)


def save_rank(rank: int, world: int, path: str, size: int) -> dict[str, Any]:
    import shardwise.checkpoint as swc
    from shardwise import ShardedTensor

    layouts = save_layouts(world, size)
    with _progress(rank, len(layouts) + 2, "save") as bar:
        params = {}
        for name, layout in layouts.items():
            shards = [values(name, b, layout.global_shape, 0) for b in layout.blocks_of(rank)]
            params[name] = torch.nn.Parameter(
                ShardedTensor.from_layout(layout, shards, dtype=torch.float32)
            )
            bar.update()
        opt = torch.optim.Adam(list(params.values()), foreach=False, **ADAM)
        for name, p in params.items():
            layout = layouts[name]
            p.grad = ShardedTensor.from_layout(
                layout,
                [values(name, b, layout.global_shape, 1) for b in layout.blocks_of(rank)],
                dtype=torch.float32,
            )
        opt.step()  # a real optimizer step, shard by shard
        bar.update()
        state = {
            "model": params,
            "optim": opt.state_dict(),
            "trainer": {"step": 1, "note": "shardwise demo"},
        }
        seconds = _timed(lambda: swc.save(state, path))
        bar.update()
    local = sum(s.nbytes for p in params.values() for s in _local_shards(p)) * 3
    return {"seconds": seconds, "local_bytes": local}


def _local_shards(t: torch.Tensor) -> list[torch.Tensor]:
    """This rank's shards of a ShardedTensor, or of a Parameter over one."""
    return cast("ShardedTensor", t.detach()).local_shards()


def load_rank(rank: int, world: int, path: str, size: int, saved_world: int) -> dict[str, Any]:
    import shardwise.checkpoint as swc
    from shardwise import ShardedTensor

    layouts = load_layouts(world, size)
    params = {
        n: torch.nn.Parameter(ShardedTensor.zeros(layout, dtype=torch.float32))
        for n, layout in layouts.items()
    }
    opt = torch.optim.Adam(list(params.values()), foreach=False, **ADAM)
    for n, p in params.items():
        p.grad = ShardedTensor.zeros(layouts[n], dtype=torch.float32)
    opt.step()  # materialise the optimizer state the checkpoint fills
    target = {"model": params, "optim": opt.state_dict(), "trainer": {"step": 0, "note": ""}}
    reader: list[Any] = []
    seconds = _timed(lambda: reader.append(swc.load(target, path)))
    wrong = 0
    with _progress(rank, len(layouts), "verify") as bar:
        state_of = target["optim"]["state"]
        for i, (name, p) in enumerate(params.items()):
            moments = state_of[i]
            shape = layouts[name].global_shape
            for j, block in enumerate(layouts[name].blocks_of(rank)):
                want = expected_block(name, block, shape)
                got = {
                    "param": _local_shards(p)[j],
                    **{k: moments[k].local_shards()[j] for k in ("exp_avg", "exp_avg_sq")},
                }
                wrong += sum(int((got[k] != want[k]).sum()) for k in want)
            if float(moments["step"]) != 1.0:
                wrong += 1
            bar.update()
    if target["trainer"] != {"step": 1, "note": "shardwise demo"}:
        wrong += 1
    local = sum(s.nbytes for p in params.values() for s in _local_shards(p)) * 3
    return {
        "seconds": seconds,
        "wrong": wrong,
        "local_bytes": local,
        "bytes_read": reader[0].bytes_read,
    }


# -- the report -------------------------------------------------------------------------------


def _describe(layout: Any) -> str:
    counts = [len(b) for b in layout.blocks]
    empty = sum(1 for c in counts if c == 0)
    from shardwise.checkpoint.offline import describe_sharding

    blocks = list(dict.fromkeys(b for bs in layout.blocks for b in bs))
    what = describe_sharding(layout.global_shape, blocks)
    if len(blocks) == 1 and any(c == 0 for c in counts):
        what = f"table-wise on rank {next(r for r, c in enumerate(counts) if c)}"
    elif layout.replica_groups:
        what = f"replicated on {len(layout.replica_groups[blocks[0]])} ranks"
    extra = f", {max(counts)} blocks on one rank" if max(counts) > 1 else ""
    return f"{what}{extra}" + (
        f", {empty} empty ranks" if empty and "table-wise" not in what else ""
    )


def _report_layouts(title: str, layouts: dict[str, Any]) -> None:
    print(title)
    for name, layout in layouts.items():
        shape = "x".join(map(str, layout.global_shape))
        print(f"  {name:<13} {shape:>12}  {_describe(layout)}")


def _gbps(nbytes: int, seconds: float) -> str:
    return f"{nbytes / seconds / 1e9:.2f} GB/s" if seconds > 0 else "-"


def main(args: argparse.Namespace) -> int:
    size = parse_size(args.size)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return _main_torchrun(args, size)
    from shardwise.testing import run_ranks

    base = args.dir or Path(tempfile.mkdtemp(prefix="shardwise-demo-"))
    path = base / "step_1"
    try:
        total = sum(math.prod(s) for s in shapes(size).values()) * 4 * 3
        print(
            f"shardwise demo: training state of {total / 2**20:.1f} MiB "
            f"(parameters + Adam moments), saved on {args.world_size} ranks, "
            f"loaded on {args.load_world_size}"
        )
        _report_layouts(
            f"saved layouts ({args.world_size} ranks):", save_layouts(args.world_size, size)
        )
        saved = run_ranks(save_rank, args.world_size, str(path), size, timeout=1800)
        save_s = saved[0]["seconds"]
        print(
            f"saved   {total / 2**20:8.1f} MiB in {save_s:.3f}s ({_gbps(total, save_s)}) -> {path}"
        )
        _report_layouts(
            f"loaded layouts ({args.load_world_size} ranks):",
            load_layouts(args.load_world_size, size),
        )
        loaded = run_ranks(
            load_rank, args.load_world_size, str(path), size, args.world_size, timeout=1800
        )
        load_s = loaded[0]["seconds"]
        read = sum(r["bytes_read"] for r in loaded)
        print(
            f"loaded  {total / 2**20:8.1f} MiB in {load_s:.3f}s ({_gbps(total, load_s)}), "
            f"{read / 2**20:.1f} MiB read from disk by all ranks"
        )
        wrong = sum(r["wrong"] for r in loaded)
        print(
            "PASS: every element of every parameter and optimizer moment matches, bit for bit"
            if wrong == 0
            else f"FAIL: {wrong} elements differ"
        )
        return 0 if wrong == 0 else 1
    finally:
        if args.keep:
            print(f"kept {path}")
        elif args.dir is None:
            shutil.rmtree(base, ignore_errors=True)
        else:
            shutil.rmtree(path, ignore_errors=True)


def _main_torchrun(args: argparse.Namespace, size: int) -> int:
    import torch.distributed as dist

    if torch.cuda.is_available():  # NCCL for CUDA tensors, gloo for the CPU ones this demo reduces
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("cpu:gloo,cuda:nccl")
    else:
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    base = args.dir or Path(tempfile.gettempdir()) / "shardwise-demo"
    path = str(base / "step_1")
    saved = save_rank(rank, world, path, size)
    loaded = load_rank(rank, world, path, size, world)
    wrong = torch.tensor([loaded["wrong"]])
    dist.all_reduce(wrong)
    if rank == 0:
        print(
            f"saved in {saved['seconds']:.3f}s, loaded in other layouts in "
            f"{loaded['seconds']:.3f}s on {world} ranks"
        )
        print("PASS" if int(wrong) == 0 else f"FAIL: {int(wrong)} elements differ")
    dist.destroy_process_group()
    return 0 if int(wrong) == 0 else 1
