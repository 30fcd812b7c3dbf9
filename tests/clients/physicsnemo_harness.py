"""Building real PhysicsNeMo ShardTensors with uneven pieces on CPU ranks.

PhysicsNeMo's `sharding_shapes="infer"` gathers shapes through pinned memory
and CUDA, so the tests state the sizes explicitly, in PhysicsNeMo's own
convention: `sharding_shapes[m]` lists, for each coordinate `k` along mesh
dimension `m`, the piece shape of the rank at this rank's coordinates with the
`m`-th replaced by `k`. Written here independently of shardwise's code.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def full(shape: Sequence[int] = (7, 6), seed: int = 0) -> torch.Tensor:
    """The global value: random float32, the same in every process."""
    return torch.randn(tuple(shape), generator=torch.Generator().manual_seed(seed))


def _piece(
    shape: tuple[int, ...],
    placements: Sequence[Any],
    sizes: dict[int, list[int]],
    coords: Sequence[int],
):
    """(slices, piece shape) of the rank at `coords`."""
    slices, extent = [slice(None)] * len(shape), list(shape)
    for m, p in enumerate(placements):
        if p.is_shard():
            lo = sum(sizes[m][: coords[m]])
            slices[p.dim], extent[p.dim] = slice(lo, lo + sizes[m][coords[m]]), sizes[m][coords[m]]
    return tuple(slices), tuple(extent)


def shard_tensor(
    value: torch.Tensor,
    mesh: Any,
    placements: Sequence[Any],
    sizes: dict[int, list[int]],
    recorded: dict[int, list[int]] | None = None,
) -> Any:
    """A ShardTensor of `value` whose pieces along each sharded mesh dim `m` have `sizes[m]`.

    `recorded` (default `sizes`) is what this rank's spec claims: pass other
    sizes to build a ShardTensor with stale sharding shapes.
    """
    from physicsnemo.domain_parallel import ShardTensor

    shape, coords = tuple(value.shape), tuple(mesh.get_coordinate())
    recorded = sizes if recorded is None else recorded
    slices, _ = _piece(shape, placements, sizes, coords)
    local = value[slices].clone()
    shapes = {}
    for m, p in enumerate(placements):
        if p.is_shard():
            moved = [list(coords) for _ in recorded[m]]
            for k, c in enumerate(moved):
                c[m] = k
            shapes[m] = [_piece(shape, placements, recorded, c)[1] for c in moved]
    return ShardTensor.from_local(local, mesh, placements, sharding_shapes=shapes)
