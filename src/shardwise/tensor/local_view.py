"""What one rank of a `ShardedTensor` holds: its blocks, shards, offsets, group."""

from __future__ import annotations

from typing import Any

import torch

from ..errors import LayoutError
from ..layout import Block, Layout

__all__ = ["LocalView"]


class LocalView:
    """`ShardedTensor`'s view of this rank's part; the state is set by `ShardedTensor.__new__`."""

    __slots__ = ()

    _layout: Layout
    _rank: int
    _shards: list[torch.Tensor]
    _group: Any
    # Per mesh dimension, this rank's offset along the tensor dimension it shards (PhysicsNeMo's
    # `offsets()`), when built on a device mesh (`scatter_tensor`, `from_shard_tensor`); else None.
    _mesh_offsets: tuple[int, ...] | None

    @property
    def layout_spec(self) -> Layout:
        """The global `Layout` (named so to leave `Tensor.layout` alone)."""
        return self._layout

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def group(self) -> Any:
        return self._group

    @property
    def local_blocks(self) -> tuple[Block, ...]:
        return self._layout.blocks_of(self._rank)

    def local_shards(self) -> list[torch.Tensor]:
        """The live shard tensors (in-place edits are visible), in block order."""
        return self._shards

    def local_offsets(self) -> list[torch.Size]:
        return [torch.Size(b.offsets) for b in self.local_blocks]

    def local_sizes(self) -> list[torch.Size]:
        return [torch.Size(b.sizes) for b in self.local_blocks]

    def offsets(self, mesh_dim: int | None = None) -> tuple[int, ...] | int:
        """PhysicsNeMo's `ShardTensor.offsets`: per mesh dimension, this rank's offset along
        the tensor dimension it shards (0 where it replicates); one int for `mesh_dim`.

        Only a tensor built on a device mesh has them; `local_offsets()` gives every
        tensor's block offsets per tensor dimension.
        """
        if self._mesh_offsets is None:
            raise LayoutError(
                f"rank {self._rank}: this ShardedTensor was not built on a device mesh, so it "
                f"has no per-mesh-dimension offsets; shardwise.scatter_tensor and "
                f"from_shard_tensor record them, and st.local_offsets() gives its block offsets"
            )
        if mesh_dim is None:
            return self._mesh_offsets
        return self._mesh_offsets[mesh_dim]

    def is_empty_shard(self) -> bool:
        """True when this rank holds no element of the tensor."""
        return all(b.is_empty() for b in self.local_blocks)

    def is_pinned(self, device: Any = None) -> bool:
        return bool(self._shards) and all(s.is_pinned() for s in self._shards)
