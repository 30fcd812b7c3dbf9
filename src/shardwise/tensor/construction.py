"""The checks `ShardedTensor.from_layout` runs on a rank's shards before wrapping them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..errors import InvalidTypeError, ShardMismatchError
from ..layout import Layout

__all__ = ["check_shards", "filled_shards"]


def check_shards(
    layout: Layout,
    shards: Sequence[torch.Tensor],
    rank: int,
    dtype: torch.dtype | None,
    device: torch.device | str | None,
    wrapper: type,
) -> tuple[torch.dtype, torch.device]:
    """The dtype and device of `shards`, the blocks of `rank` in `layout`: one plain
    tensor of the block's sizes per block, one dtype, one device (`dtype` / `device`
    given for a rank that holds no shard); never a `wrapper` (a ShardedTensor) itself."""
    if not 0 <= rank < layout.world_size:
        raise ShardMismatchError(
            f"rank {rank} is outside the layout's world size {layout.world_size}"
        )
    blocks = layout.blocks_of(rank)
    if len(shards) != len(blocks):
        raise ShardMismatchError(
            f"rank {rank} holds {len(blocks)} blocks in the layout but was given "
            f"{len(shards)} shards"
        )
    for i, (shard, block) in enumerate(zip(shards, blocks)):
        if not isinstance(shard, torch.Tensor) or isinstance(shard, wrapper):
            raise InvalidTypeError(
                f"rank {rank}, shard {i}: expected a plain tensor, got {type(shard).__name__}"
            )
        if tuple(shard.shape) != block.sizes:
            raise ShardMismatchError(
                f"rank {rank}, shard {i} has shape {tuple(shard.shape)} but its block "
                f"{block} has sizes {block.sizes}"
            )
    dtypes = {s.dtype for s in shards}
    if dtype is not None:
        dtypes.add(dtype)
    if len(dtypes) > 1:
        raise InvalidTypeError(
            f"rank {rank}: shards have mixed dtypes {sorted(map(str, dtypes))}; "
            f"convert them to one dtype"
        )
    devices = {s.device for s in shards}
    if device is not None:
        devices.add(torch.device(device))
    if len(devices) > 1:
        raise ShardMismatchError(
            f"rank {rank}: shards are on several devices {sorted(map(str, devices))}"
        )
    return (
        dtypes.pop() if dtypes else torch.get_default_dtype(),
        devices.pop() if devices else torch.device("cpu"),
    )


def filled_shards(
    factory: Callable[..., torch.Tensor],
    extra: tuple[Any, ...],
    layout: Layout,
    rank: int,
    dtype: torch.dtype | None,
    device: torch.device | str | None,
) -> tuple[list[torch.Tensor], torch.dtype, torch.device]:
    """New shards for `rank`'s blocks from `factory` (`torch.empty`, `torch.full`, ...),
    with their dtype and device (defaults as `torch.empty`)."""
    dtype = dtype or torch.get_default_dtype()
    device = torch.device(device) if device is not None else torch.device("cpu")
    shards = [factory(b.sizes, *extra, dtype=dtype, device=device) for b in layout.blocks_of(rank)]
    return shards, dtype, device
