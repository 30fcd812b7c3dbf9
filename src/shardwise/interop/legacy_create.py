"""The legacy creation helpers that take a sharding spec, as
`torch.distributed._shard.sharded_tensor`'s: `empty`, `zeros`, `ones`, `full`, `rand`
(re-exported as `shardwise.legacy`). Each shard is made on its placement's device."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharding_spec import (
    ChunkShardingSpec,
    EnumerableShardingSpec,
    ShardingSpec,
)
from torch.distributed.remote_device import _remote_device as _RemoteDevice

from ..comm.group import current_rank
from ..errors import LayoutError
from ..layout import Layout
from ..tensor import ShardedTensor

__all__ = ["empty", "full", "ones", "rand", "spec_layout", "zeros"]


def _sizes(size: tuple[Any, ...]) -> tuple[int, ...]:
    if len(size) == 1 and isinstance(size[0], Sequence):
        return tuple(int(s) for s in size[0])
    return tuple(int(s) for s in size)


def _create(
    fill: Callable[[torch.Tensor], Any],
    spec: ShardingSpec,
    size: tuple[Any, ...],
    dtype: torch.dtype | None,
    requires_grad: bool,
    process_group: Any,
) -> ShardedTensor:
    shape = _sizes(size)
    world = dist.get_world_size(process_group)
    layout = spec_layout(spec, shape, world, process_group)
    rank = current_rank(process_group, layout)
    me = dist.get_global_rank(process_group, rank) if process_group is not None else rank
    placements = (
        spec.placements
        if isinstance(spec, ChunkShardingSpec)
        else [m.placement for m in spec.shards]  # type: ignore[attr-defined]
    )
    devices = [p.device() for p in placements if not isinstance(p, str) and p.rank() == me]
    st = ShardedTensor.empty(
        layout,
        dtype=dtype,
        device=devices[0] if devices else "cpu",
        group=process_group,
        rank=rank,
    )
    with torch.no_grad():
        for shard in st.local_shards():
            fill(shard)
    st.requires_grad_(requires_grad)
    return st


def empty(
    spec: ShardingSpec,
    *size: Any,
    dtype: torch.dtype | None = None,
    requires_grad: bool = False,
    process_group: Any = None,
) -> ShardedTensor:
    """Uninitialised, as `sharded_tensor.empty(spec, *size)`; shards on their placement devices."""
    return _create(lambda s: None, spec, size, dtype, requires_grad, process_group)


def zeros(
    spec: ShardingSpec,
    *size: Any,
    dtype: torch.dtype | None = None,
    requires_grad: bool = False,
    process_group: Any = None,
) -> ShardedTensor:
    """Zeros, as `sharded_tensor.zeros(spec, *size)`."""
    return _create(torch.Tensor.zero_, spec, size, dtype, requires_grad, process_group)


def ones(
    spec: ShardingSpec,
    *size: Any,
    dtype: torch.dtype | None = None,
    requires_grad: bool = False,
    process_group: Any = None,
) -> ShardedTensor:
    """Ones, as `sharded_tensor.ones(spec, *size)`."""
    return _create(lambda s: s.fill_(1), spec, size, dtype, requires_grad, process_group)


def full(
    spec: ShardingSpec,
    size: Sequence[int],
    fill_value: Any,
    *,
    dtype: torch.dtype | None = None,
    requires_grad: bool = False,
    process_group: Any = None,
) -> ShardedTensor:
    """`fill_value` everywhere, as `sharded_tensor.full(spec, size, fill_value)`
    (the dtype inferred from `fill_value` when not given)."""
    if dtype is None:
        dtype = torch.full((), fill_value).dtype
    return _create(
        lambda s: s.fill_(fill_value), spec, (size,), dtype, requires_grad, process_group
    )


def rand(
    spec: ShardingSpec,
    *size: Any,
    dtype: torch.dtype | None = None,
    requires_grad: bool = False,
    process_group: Any = None,
) -> ShardedTensor:
    """Uniform [0, 1) from each rank's own generator, as `sharded_tensor.rand(spec, *size)`."""
    return _create(lambda s: s.uniform_(0, 1), spec, size, dtype, requires_grad, process_group)


def spec_layout(spec: ShardingSpec, shape: tuple[int, ...], world: int, group: Any) -> Layout:
    """The layout of a legacy spec on `group`: its placements name global ranks (as
    legacy ones do), which become the group's ranks (`LayoutError` for one outside it)."""
    if group is None or list(dist.get_process_group_ranks(group)) == list(range(world)):
        return Layout.from_sharding_spec(spec, shape, world)
    ranks = list(dist.get_process_group_ranks(group))

    def local(placement: Any) -> Any:
        if isinstance(placement, str):
            placement = _RemoteDevice(placement)
        rank = placement.rank()
        if rank not in ranks:
            raise LayoutError(
                f"placement {placement} names global rank {rank}, which is not in the process "
                f"group of ranks {ranks}"
            )
        return _RemoteDevice(f"rank:{ranks.index(rank)}/{placement.device()}")

    if isinstance(spec, ChunkShardingSpec):
        spec = ChunkShardingSpec(spec.dim, [local(p) for p in spec.placements])
    else:
        spec = EnumerableShardingSpec(
            [
                ShardMetadata(list(m.shard_offsets), list(m.shard_sizes), local(m.placement))
                for m in spec.shards  # type: ignore[attr-defined]
            ]
        )
    return Layout.from_sharding_spec(spec, shape, world)
