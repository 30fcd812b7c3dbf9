"""Redistribute and full_tensor against DTensor and raw collectives, same payload, one run.

Run: `shardwise bench redistribute [--mib 512] [--repeat 3]`. Two local ranks
(gloo on CPU) move a float32 tensor of `--mib` MiB from Shard(0) to Shard(1),
a layout all three can express:

* raw all_to_all_single: each rank's half already packed contiguously, the floor;
* DTensor.redistribute(Shard(0) -> Shard(1));
* ShardedTensor.redistribute(chunked dim 0 -> chunked dim 1);

and gathers the whole tensor on every rank:

* raw all_gather_into_tensor, DTensor.full_tensor(), ShardedTensor.full_tensor().

and overlaps a move with other work (`async_op=True`): the same redistribute,
then the work, then the first read of the result, each system once
synchronously and once with `async_op=True` (DTensor: its AsyncCollectiveTensor
waited on). Two kinds of work: `--matmuls` 1024x1024 float32 matmuls on the
host CPU, and an idle host for as long (a sleep: what a rank's CPU does while
its GPU computes). "Hidden" is how much of the shorter of the move and the work
the async run saved against the synchronous one: 1.00 is full overlap, the
physical limit. Host compute can hide nothing where the ranks' compute and
gloo's worker threads already need every core (2 ranks on 2 cores).

Each figure is the median over `--repeat` timed runs after one warm-up, the
slowest rank's time; ratios are to the raw collective.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from shardwise.testing import seconds_across_ranks as timed


def _rank(rank: int, world: int, mib: int, repeat: int, matmuls: int) -> dict[str, float]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import shardwise as sw

    torch.set_num_threads(1)
    cols = 4096
    rows = mib * 2**20 // 4 // cols
    shape = (rows, cols)
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(rank)
    row_layout = sw.Layout.chunked(shape, 0, world)
    col_layout = sw.Layout.chunked(shape, 1, world)
    (block,) = row_layout.blocks_of(rank)
    local = torch.randn(block.sizes, generator=g)
    st = sw.ShardedTensor.from_layout(row_layout, [local])
    dt = distribute_tensor(torch.empty(shape), mesh, (Shard(0),))
    dt._local_tensor.copy_(local)

    packed = local.reshape(-1).clone()
    received = torch.empty_like(packed)
    gathered = torch.empty(shape)
    results = {
        "raw all_to_all_single": timed(lambda: dist.all_to_all_single(received, packed), repeat),
        "DTensor.redistribute": timed(lambda: dt.redistribute(mesh, (Shard(1),)), repeat),
        "shardwise redistribute": timed(lambda: st.redistribute(col_layout), repeat),
        "raw all_gather_into_tensor": timed(
            lambda: dist.all_gather_into_tensor(gathered, local), repeat
        ),
        "DTensor.full_tensor": timed(lambda: dt.full_tensor(), repeat),
        "shardwise full_tensor": timed(lambda: st.full_tensor(), repeat),
    }
    # correctness of what was timed
    assert torch.equal(st.redistribute(col_layout).full_tensor(), dt.full_tensor())
    mine = st.redistribute(col_layout, async_op=True)
    assert torch.equal(mine.to_local(), dt.redistribute(mesh, (Shard(1),)).to_local())

    a = torch.randn(1024, 1024, generator=g)

    def compute() -> None:
        for _ in range(matmuls):
            a @ a

    results["matmuls"] = timed(compute, repeat)
    idle = results["matmuls"]
    works = {"matmuls": compute, "idle host": lambda: time.sleep(idle)}
    results["idle host"] = idle

    def dtensor(work: Callable[[], Any], async_op: bool) -> None:
        out = dt.redistribute(mesh, (Shard(1),), async_op=async_op)
        work()
        local = out.to_local()
        if hasattr(local, "wait"):  # DTensor's AsyncCollectiveTensor
            local.wait()

    def shardwise(work: Callable[[], Any], async_op: bool) -> None:
        out = st.redistribute(col_layout, async_op=async_op)
        work()
        out.local_shards()  # the first read: waits for the messages

    for kind, work in works.items():
        for name, run in (("DTensor", dtensor), ("shardwise", shardwise)):
            for mode in (False, True):
                results[f"{kind} {name} {mode}"] = timed(
                    lambda run=run, work=work, mode=mode: run(work, mode), repeat
                )
    return results


def main() -> None:
    from shardwise.testing import run_ranks

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mib", type=int, default=512, help="global tensor size in MiB")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--matmuls", type=int, default=20, help="compute overlapped")
    args = parser.parse_args()
    results = run_ranks(_rank, args.world_size, args.mib, args.repeat, args.matmuls, timeout=1800)[
        0
    ]
    print(f"{args.mib} MiB float32, {args.world_size} ranks (gloo, CPU), median of {args.repeat}")
    for base, names in (
        ("raw all_to_all_single", ["DTensor.redistribute", "shardwise redistribute"]),
        ("raw all_gather_into_tensor", ["DTensor.full_tensor", "shardwise full_tensor"]),
    ):
        floor = results[base]
        print(f"  {base:<28} {floor:8.3f} s   1.00x")
        for name in names:
            print(f"  {name:<28} {results[name]:8.3f} s   {results[name] / floor:.2f}x")
    for kind in ("matmuls", "idle host"):
        work = results[kind]
        print(
            f"overlap: the move, then {kind} ({args.matmuls} matmuls 1024x1024 "
            f"{'or as long idle' if kind == 'idle host' else 'on the CPU'}), then the first read"
        )
        print(f"  {kind + ' alone':<28} {work:8.3f} s")
        for name, move in (
            ("DTensor", results["DTensor.redistribute"]),
            ("shardwise", results["shardwise redistribute"]),
        ):
            sync, overlapped = results[f"{kind} {name} False"], results[f"{kind} {name} True"]
            hidden = (sync - overlapped) / min(move, work)
            print(f"  {name + ' synchronous':<28} {sync:8.3f} s")
            print(f"  {name + ' async_op=True':<28} {overlapped:8.3f} s   hidden {hidden:.2f}")


if __name__ == "__main__":
    main()
