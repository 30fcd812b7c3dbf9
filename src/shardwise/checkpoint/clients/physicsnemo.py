"""PhysicsNeMo ShardTensors in `swc.save`/`swc.load` state dicts.

`swc.save` writes a ShardTensor as the ShardedTensor over its local tensor, and
`swc.load` fills a ShardTensor in place through such a ShardedTensor (DCP
writes into the shared local tensor, so nothing is left to copy back).
"""

from __future__ import annotations

from typing import Any

from ...interop.physicsnemo import from_shard_tensor
from ...tensor import ShardedTensor
from ..engine import ValueAdapter, register_value_adapter

__all__: list[str] = []


def _for_save(value: Any) -> ShardedTensor:
    return from_shard_tensor(value)


def _for_load(value: Any) -> tuple[ShardedTensor, None]:
    return from_shard_tensor(value), None


# Named, not imported: shardwise never imports PhysicsNeMo (without it, no value is one).
_SHARD_TENSOR = "physicsnemo.domain_parallel.shard_tensor.ShardTensor"
register_value_adapter(ValueAdapter("physicsnemo", _SHARD_TENSOR, _for_save, _for_load))
