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


def _helper(
    name: str, fill: Callable[[torch.Tensor], Any] | None, doc: str
) -> Callable[..., ShardedTensor]:
    """One of legacy's `helper(spec, *size, **options)` creation functions: the tensor
    made by the legacy constructor, each local shard then filled by `fill`."""

    def create(
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
        st = ShardedTensor(
            sharding_spec,
            *size,
            dtype=dtype,
            layout=layout,
            requires_grad=requires_grad,
            pin_memory=pin_memory,
            memory_format=memory_format,
            process_group=process_group,
            init_rrefs=init_rrefs,
        )
        if fill is not None:
            with torch.no_grad():
                for shard in st._shards:
                    fill(shard)
        return st

    create.__name__ = create.__qualname__ = name
    create.__doc__ = doc
    return create


empty = _helper(
    "empty",
    None,
    "Uninitialised, as `sharded_tensor.empty(spec, *size)`; shards on their placements.",
)
zeros = _helper("zeros", torch.Tensor.zero_, "Zeros, as `sharded_tensor.zeros(spec, *size)`.")
ones = _helper("ones", lambda s: s.fill_(1), "Ones, as `sharded_tensor.ones(spec, *size)`.")
rand = _helper(
    "rand",
    lambda s: s.uniform_(0, 1),
    "Uniform [0, 1) from each rank's own generator, as `sharded_tensor.rand(spec, *size)`.",
)
randn = _helper(
    "randn",
    lambda s: s.normal_(0, 1),
    "Standard normal from each rank's own generator, as `sharded_tensor.randn(spec, *size)`.",
)


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
    filled = _helper("full", lambda s: s.fill_(fill_value), "")
    return filled(
        sharding_spec,
        size,
        dtype=dtype,
        layout=layout,
        requires_grad=requires_grad,
        pin_memory=pin_memory,
        memory_format=memory_format,
        process_group=process_group,
        init_rrefs=init_rrefs,
    )
