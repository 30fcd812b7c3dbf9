"""The legacy creation helpers that take a sharding spec, as
`torch.distributed._shard.sharded_tensor`'s: `empty`, `zeros`, `ones`, `full`, `rand`,
`randn` (re-exported as `shardwise.legacy`).

Each returns a `shardwise.legacy.ShardedTensor` made by its constructor (shards on their
placements' devices, legacy's argument checks), then filled shard by shard as legacy's
`nn.init` ops fill it: in the spec's order, each rank from its own generator, so a
seeded legacy program draws the same values.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed._shard.sharding_spec import ShardingSpec

from .legacy_tensor import ShardedTensor

__all__ = ["empty", "full", "ones", "rand", "randn", "zeros"]


def _create(
    fill: Callable[[torch.Tensor], Any] | None,
    spec: ShardingSpec,
    size: tuple[Any, ...],
    options: dict[str, Any],
) -> ShardedTensor:
    st = ShardedTensor(spec, *size, **options)
    if fill is not None:
        with torch.no_grad():
            for shard in st._shards:
                fill(shard)
    return st


def _options(
    dtype: torch.dtype | None,
    layout: torch.layout,
    requires_grad: bool,
    pin_memory: bool,
    memory_format: torch.memory_format,
    process_group: Any,
    init_rrefs: bool,
) -> dict[str, Any]:
    return {
        "dtype": dtype,
        "layout": layout,
        "requires_grad": requires_grad,
        "pin_memory": pin_memory,
        "memory_format": memory_format,
        "process_group": process_group,
        "init_rrefs": init_rrefs,
    }


def empty(
    sharding_spec: ShardingSpec,
    *size: Any,
    dtype: torch.dtype | None = None,
    layout: torch.layout = torch.strided,
    requires_grad: bool = False,
    pin_memory: bool = False,
    memory_format: torch.memory_format = torch.contiguous_format,
    process_group: Any = None,
    init_rrefs: bool = False,
) -> ShardedTensor:
    """Uninitialised, as `sharded_tensor.empty(spec, *size)`; shards on their placement devices."""
    options = _options(
        dtype, layout, requires_grad, pin_memory, memory_format, process_group, init_rrefs
    )
    return _create(None, sharding_spec, size, options)


def zeros(
    sharding_spec: ShardingSpec,
    *size: Any,
    dtype: torch.dtype | None = None,
    layout: torch.layout = torch.strided,
    requires_grad: bool = False,
    pin_memory: bool = False,
    memory_format: torch.memory_format = torch.contiguous_format,
    process_group: Any = None,
    init_rrefs: bool = False,
) -> ShardedTensor:
    """Zeros, as `sharded_tensor.zeros(spec, *size)`."""
    options = _options(
        dtype, layout, requires_grad, pin_memory, memory_format, process_group, init_rrefs
    )
    return _create(torch.Tensor.zero_, sharding_spec, size, options)


def ones(
    sharding_spec: ShardingSpec,
    *size: Any,
    dtype: torch.dtype | None = None,
    layout: torch.layout = torch.strided,
    requires_grad: bool = False,
    pin_memory: bool = False,
    memory_format: torch.memory_format = torch.contiguous_format,
    process_group: Any = None,
    init_rrefs: bool = False,
) -> ShardedTensor:
    """Ones, as `sharded_tensor.ones(spec, *size)`."""
    options = _options(
        dtype, layout, requires_grad, pin_memory, memory_format, process_group, init_rrefs
    )
    return _create(lambda s: s.fill_(1), sharding_spec, size, options)


def full(
    sharding_spec: ShardingSpec,
    size: Sequence[int],
    fill_value: Any,
    *,
    dtype: torch.dtype | None = None,
    layout: torch.layout = torch.strided,
    requires_grad: bool = False,
    pin_memory: bool = False,
    memory_format: torch.memory_format = torch.contiguous_format,
    process_group: Any = None,
    init_rrefs: bool = False,
) -> ShardedTensor:
    """`fill_value` everywhere, as `sharded_tensor.full(spec, size, fill_value)`: the
    default dtype when `dtype` is None (legacy's, unlike `torch.full`, which infers it)."""
    options = _options(
        dtype, layout, requires_grad, pin_memory, memory_format, process_group, init_rrefs
    )
    return _create(lambda s: s.fill_(fill_value), sharding_spec, (size,), options)


def rand(
    sharding_spec: ShardingSpec,
    *size: Any,
    dtype: torch.dtype | None = None,
    layout: torch.layout = torch.strided,
    requires_grad: bool = False,
    pin_memory: bool = False,
    memory_format: torch.memory_format = torch.contiguous_format,
    process_group: Any = None,
    init_rrefs: bool = False,
) -> ShardedTensor:
    """Uniform [0, 1) from each rank's own generator, as `sharded_tensor.rand(spec, *size)`."""
    options = _options(
        dtype, layout, requires_grad, pin_memory, memory_format, process_group, init_rrefs
    )
    return _create(lambda s: s.uniform_(0, 1), sharding_spec, size, options)


def randn(
    sharding_spec: ShardingSpec,
    *size: Any,
    dtype: torch.dtype | None = None,
    layout: torch.layout = torch.strided,
    requires_grad: bool = False,
    pin_memory: bool = False,
    memory_format: torch.memory_format = torch.contiguous_format,
    process_group: Any = None,
    init_rrefs: bool = False,
) -> ShardedTensor:
    """Standard normal from each rank's own generator, as `sharded_tensor.randn(spec, *size)`."""
    options = _options(
        dtype, layout, requires_grad, pin_memory, memory_format, process_group, init_rrefs
    )
    return _create(lambda s: s.normal_(0, 1), sharding_spec, size, options)
