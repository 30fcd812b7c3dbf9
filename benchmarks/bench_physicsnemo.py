"""shardwise redistribute against PhysicsNeMo's ShardTensor.redistribute, same uneven data, one run.

Run: `shardwise bench physicsnemo [--mib 256] [--repeat 3] [--quick]`. Two local
ranks (gloo on CPU) hold a float32 tensor of `--mib` MiB as a PhysicsNeMo
ShardTensor sharded unevenly along dim 0 (60% / 40% of the rows) and move it
to Shard(1):

* PhysicsNeMo: `ShardTensor.redistribute(mesh, (Shard(1),))`;
* shardwise: `ShardedTensor.redistribute(layout)` on `sw.from_shard_tensor(st)`
  to the same target layout (the one PhysicsNeMo produces);
* shardwise, door to door: `sw.from_shard_tensor(st).redistribute(layout)
  .to_shard_tensor(mesh, (Shard(1),))`, what a PhysicsNeMo user would call.

Each figure is the median over `--repeat` timed runs after one warm-up, the
slowest rank's time; ratios are to PhysicsNeMo. The results are checked equal,
bit for bit, before anything is printed.
"""

from __future__ import annotations

import argparse
import warnings

import torch

from shardwise.testing import seconds_across_ranks as timed

PHYSICSNEMO = "PhysicsNeMo redistribute"
NAMES = (PHYSICSNEMO, "shardwise redistribute", "shardwise from+redistribute+to")


def _rank(rank: int, world: int, mib: float, repeat: int) -> dict[str, float]:
    from physicsnemo.domain_parallel import ShardTensor
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    import shardwise as sw

    warnings.simplefilter("ignore", FutureWarning)  # PhysicsNeMo's funcol deprecation notes
    torch.set_num_threads(1)
    cols = 4096
    rows = max(int(mib * 2**20) // 4 // cols, world)
    shape = (rows, cols)
    sizes = [rows * 3 // 5] + [0] * (world - 1)  # uneven: 60% on rank 0, the rest spread
    rest = rows - sizes[0]
    for r in range(1, world):
        sizes[r] = rest // (world - 1) + (1 if r - 1 < rest % (world - 1) else 0)
    mesh = init_device_mesh("cpu", (world,))
    local = torch.randn((sizes[rank], cols), generator=torch.Generator().manual_seed(rank))
    st = ShardTensor.from_local(
        local, mesh, (Shard(0),), sharding_shapes={0: [(s, cols) for s in sizes]}
    )
    ours = sw.from_shard_tensor(st)
    theirs = st.redistribute(mesh, (Shard(1),))
    target = sw.from_shard_tensor(theirs).layout_spec  # PhysicsNeMo's target layout
    mine = ours.redistribute(target)
    door = sw.from_shard_tensor(st).redistribute(target).to_shard_tensor(mesh, (Shard(1),))
    # correctness of what is timed: the same bytes on every rank, the same recorded sizes
    assert torch.equal(mine.local_shards()[0], theirs._local_tensor)
    assert torch.equal(door._local_tensor, theirs._local_tensor)
    assert door._spec.sharding_shapes() == theirs._spec.sharding_shapes()
    del mine, door, theirs
    return {
        "shape": shape,
        "sizes": sizes,
        PHYSICSNEMO: timed(lambda: st.redistribute(mesh, (Shard(1),)), repeat),
        NAMES[1]: timed(lambda: ours.redistribute(target), repeat),
        NAMES[2]: timed(
            lambda: (
                sw.from_shard_tensor(st).redistribute(target).to_shard_tensor(mesh, (Shard(1),))
            ),
            repeat,
        ),
    }


def main() -> None:
    from shardwise.testing import run_ranks

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mib", type=float, default=256, help="global tensor size in MiB")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="4 MiB, one repeat: a smoke run")
    args = parser.parse_args()
    if args.quick:
        args.mib, args.repeat = 4, 1
    results = run_ranks(_rank, args.world_size, args.mib, args.repeat, timeout=1800)[0]
    print(
        f"{args.mib:g} MiB float32 {results['shape']}, Shard(0) rows {results['sizes']} -> Shard(1), "
        f"{args.world_size} ranks (gloo, CPU), median of {args.repeat}; results equal"
    )
    base = results[PHYSICSNEMO]
    for name in NAMES:
        print(f"  {name:<32} {results[name]:8.3f} s   {results[name] / base:.2f}x")


if __name__ == "__main__":
    main()
