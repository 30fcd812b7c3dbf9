"""PhysicsNeMo 2.2.2's `scatter_tensor` call sequence, on shardwise and on the real package.

The same call a PhysicsNeMo user writes, `scatter_tensor(tensor, global_src,
mesh, placements, ...)`, is made with `physicsnemo.domain_parallel.scatter_tensor`
and with `shardwise.scatter_tensor` on the same meshes (1-d and 2-d, 4 gloo
ranks): local pieces and `offsets()` must be identical. PhysicsNeMo's
`scatter_tensor` has no `sharding_shapes`; explicit sizes are compared with the
real `ShardTensor.from_local(..., sharding_shapes=...)` (PhysicsNeMo's own spec
passed as it is) and with `from_shard_tensor(...).offsets()`.
"""

from __future__ import annotations

from tests.clients.conftest import require

pn = require("physicsnemo.domain_parallel")

import pytest  # noqa: E402
import torch  # noqa: E402

import shardwise as sw  # noqa: E402
from shardwise.testing import run_ranks  # noqa: E402

pytestmark = pytest.mark.spawned


def _physicsnemo_manager(rank: int, world: int) -> None:
    """PhysicsNeMo's `scatter_tensor` asks its DistributedManager for the rank; the ranks
    are already up (gloo, CPU), so its state is set as `initialize()` would leave it."""
    from physicsnemo.distributed import DistributedManager

    DistributedManager._shared_state.update(
        _rank=rank,
        _world_size=world,
        _local_rank=rank,
        _distributed=True,
        _device=torch.device("cpu"),
        _cuda=False,
        _is_initialized=True,
    )


def _compare(rank: int, world: int) -> list[str]:
    from physicsnemo.domain_parallel import scatter_tensor
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    from tests.clients.physicsnemo_harness import full, shard_tensor

    _physicsnemo_manager(rank, world)
    bad: list[str] = []

    def same(what: str, theirs, mine) -> None:
        held = mine.local_shards()
        local = held[0] if held else None
        if local is None or not torch.equal(theirs._local_tensor, local):
            bad.append(f"rank {rank} {what}: local {theirs._local_tensor.shape} vs {local}")
        if tuple(theirs.offsets()) != mine.offsets():
            bad.append(f"rank {rank} {what}: offsets {theirs.offsets()} vs {mine.offsets()}")
        for m in range(theirs._spec.mesh.ndim):
            if theirs.offsets(mesh_dim=m) != mine.offsets(mesh_dim=m):
                bad.append(f"rank {rank} {what}: offsets(mesh_dim={m}) differ")

    line, grid = init_device_mesh("cpu", (4,)), init_device_mesh("cpu", (2, 2))
    cases = [
        ("1-d Shard(0)", line, (Shard(0),), (7, 6)),
        ("1-d Shard(1)", line, (Shard(1),), (3, 10)),
        ("2-d Shard(0), Shard(1)", grid, (Shard(0), Shard(1)), (5, 3)),
        ("2-d Replicate, Shard(0)", grid, (Replicate(), Shard(0)), (5, 3)),
        ("2-d Shard(1), Replicate", grid, (Shard(1), Replicate()), (4, 7)),
    ]
    for what, mesh, placements, shape in cases:
        value = full(shape, seed=len(what))
        src = value if rank == 2 else None
        theirs = scatter_tensor(src, 2, mesh, placements)
        for form in ("chunk", "infer"):
            same(
                f"{what} {form}",
                theirs,
                sw.scatter_tensor(src, 2, mesh, placements, sharding_shapes=form),
            )
        mine = sw.scatter_tensor(src, 2, mesh, placements, global_shape=shape, dtype=value.dtype)
        same(f"{what} global_shape+dtype", theirs, mine)
        if not torch.equal(mine.full_tensor(), value):
            bad.append(f"rank {rank} {what}: full tensor differs")

    # Explicit uneven sizes (zero included): PhysicsNeMo's from_local with the same sizes.
    value = full((7, 6), seed=3)
    src = value if rank == 0 else None
    explicit = [
        ("1-d sizes", line, (Shard(0),), {0: [3, 0, 4, 0]}),
        ("2-d sizes", grid, (Shard(0), Shard(1)), {0: [6, 1], 1: [0, 6]}),
        ("2-d replicated sizes", grid, (Replicate(), Shard(1)), {1: [5, 1]}),
    ]
    for what, mesh, placements, sizes in explicit:
        theirs = shard_tensor(value, mesh, placements, sizes)
        recorded = theirs._spec.sharding_shapes()  # PhysicsNeMo's piece shapes, as they are
        for form, shapes in (("ints", sizes), ("piece shapes", recorded)):
            mine = sw.scatter_tensor(src, 0, mesh, placements, sharding_shapes=shapes)
            if theirs._local_tensor.numel():
                same(f"{what} {form}", theirs, mine)
            elif mine.local_shards() or tuple(theirs.offsets()) != mine.offsets():
                bad.append(f"rank {rank} {what} {form}: empty piece held or offsets differ")
        converted = sw.from_shard_tensor(theirs)
        if converted.offsets() != tuple(theirs.offsets()):
            bad.append(f"rank {rank} {what}: from_shard_tensor offsets {converted.offsets()}")
    return bad


def test_scatter_tensor_matches_physicsnemo_on_1d_and_2d_meshes():
    assert run_ranks(_compare, 4, timeout=180) == [[], [], [], []]
