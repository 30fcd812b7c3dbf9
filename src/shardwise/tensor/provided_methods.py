"""The methods of `ShardedTensor` whose code lives in the layers above it.

Collectives (`shardwise.comm`) and conversions (`shardwise.interop`) install
their functions in `provided`; these methods look them up there, so the tensor
type never imports the layers that move its data.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from .provided import provided

if TYPE_CHECKING:
    from ..layout import Layout
    from .sharded import ShardedTensor

__all__ = ["ProvidedMethods"]


class ProvidedMethods:
    """`ShardedTensor`'s collective, conversion and legacy-API methods."""

    __slots__ = ()

    @staticmethod
    def register_dispatch_handler(op: Any, handler: Any) -> None:
        """PhysicsNeMo's name for `shardwise.register_op` (aten-level handlers)."""
        provided("register_dispatch_handler")(op, handler)

    @classmethod
    def from_local_shards(
        cls,
        shards: Sequence[torch.Tensor],
        offsets: Sequence[Sequence[int]],
        global_shape: Sequence[int] | None = None,
        group: Any = None,
    ) -> ShardedTensor:
        """Collective: learn the layout from every rank's shards and offsets.

        See `shardwise.comm.from_local_shards`; a problem on any rank raises the
        same error on every rank.
        """
        return provided("from_local_shards")(shards, offsets, global_shape, group)

    # -- collectives (shardwise.comm) ---------------------------------------

    def full_tensor(self) -> torch.Tensor:
        """The whole tensor on every rank. Collective; differentiable."""
        return provided("full_tensor")(self)

    def redistribute(self, layout: Layout, *, stats: dict[str, int] | None = None) -> ShardedTensor:
        """The same values in `layout`. Collective; differentiable."""
        return provided("redistribute")(self, layout, stats=stats)

    def to_dtensor(self, mesh: Any, placements: Sequence[Any]) -> Any:
        """A DTensor sharing this rank's shard, when the layout is expressible."""
        return provided("to_dtensor")(self, mesh, placements)

    def to_shard_tensor(self, mesh: Any, placements: Sequence[Any]) -> Any:
        """A PhysicsNeMo ShardTensor wrapping this rank's shard (uneven sizes kept),
        when the layout is a grid `placements` express; see `shardwise.interop.physicsnemo`."""
        return provided("to_shard_tensor")(self, mesh, placements)

    def to_local(self) -> torch.Tensor:
        """This rank's single shard; differentiable (see `shardwise.from_local`)."""
        return provided("to_local")(self)

    # -- the legacy torch.distributed._shard API (shardwise.interop.legacy) --

    def to_torch_sharded_tensor(self, device: Any = None) -> Any:
        """A legacy `torch.distributed._shard` ShardedTensor sharing these shards."""
        return provided("to_torch_sharded_tensor")(self, device)

    def sharding_spec(self) -> Any:
        """The legacy `ChunkShardingSpec` / `EnumerableShardingSpec` of the layout."""
        return provided("sharding_spec")(self)

    def metadata(self) -> Any:
        """The legacy `ShardedTensorMetadata`: every shard, its placement."""
        return provided("metadata")(self)

    def local_tensor(self) -> torch.Tensor:
        """The one live local shard (error unless exactly one), as the legacy API."""
        return provided("local_tensor")(self)

    def reshard(self, spec: Any) -> ShardedTensor:
        """A new tensor in the layout of a legacy spec. Collective."""
        return provided("reshard")(self, spec)
