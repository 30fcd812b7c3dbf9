"""The methods of `ShardedTensor` whose code lives in the layers above it.

Collectives (`shardwise.comm`) and conversions (`shardwise.interop`) install
their functions in `provided`; these methods look them up there, so the tensor
type never imports the layers that move its data.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from ..layout import Layout
from .provided import provided

if TYPE_CHECKING:
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

    @classmethod
    def from_local(
        cls,
        local: torch.Tensor,
        device_mesh: Any,
        placements: Sequence[Any] | None = None,
        *,
        sharding_shapes: str | dict[int, Sequence[Any]] = "infer",
        global_shape: Sequence[int] | None = None,
    ) -> ShardedTensor:
        """This rank's piece of a tensor with `placements` on `device_mesh` (any mesh or
        sub-mesh), as `DTensor.from_local` / PhysicsNeMo's `ShardTensor.from_local`:
        `sharding_shapes` "infer" (one exchange of piece shapes; uneven pieces),
        "chunk" (torch.chunk pieces of `global_shape`, no communication) or
        `{mesh_dim: [piece shapes]}`. Differentiable; see
        `shardwise.interop.placements.from_local_placements`."""
        return provided("from_local_placements")(
            local,
            device_mesh,
            placements,
            sharding_shapes=sharding_shapes,
            global_shape=global_shape,
        )

    # -- collectives (shardwise.comm) ---------------------------------------

    def full_tensor(self, *, grad_placements: Sequence[Any] | None = None) -> torch.Tensor:
        """The whole tensor on every rank. Collective; differentiable.

        As DTensor's: the gradient of the result is taken as identical on every
        rank (each shard takes its slice), unless `grad_placements` says otherwise
        (`[Partial()]`: the ranks' gradients are summed first)."""
        if grad_placements is None:
            return provided("full_tensor")(self)
        me: Any = self  # a ShardedTensor
        replicated = Layout.replicated(tuple(me.shape), me.layout_spec.world_size)
        whole = provided("redistribute")(self, replicated)
        return whole.to_local(grad_placements=grad_placements)

    def redistribute(
        self,
        device_mesh: Any = None,
        placements: Sequence[Any] | None = None,
        *,
        async_op: bool = False,
        stats: dict[str, int] | None = None,
    ) -> ShardedTensor:
        """The same values in another layout. Collective; differentiable.

        `st.redistribute(layout)` takes any `shardwise.Layout` (`stats` then receives
        the bytes this rank sent and received); `st.redistribute(device_mesh,
        placements)` takes DTensor's form (`device_mesh` None with placements: its
        own mesh; a mesh without placements: its current ones), DTensor's
        torch.chunk sizes for a new placement, the tensor's own (uneven) sizes
        for its own. With `async_op` (either form) it returns once the messages are
        posted; the first read of the result (any op on it) waits for them, so the
        move overlaps what runs in between; the source must not be written until then."""
        mesh_form = placements is not None or hasattr(device_mesh, "get_coordinate")
        if not mesh_form:  # a Layout, or what the Layout form refuses on every rank alike
            return provided("redistribute")(self, device_mesh, stats=stats, async_op=async_op)
        return provided("redistribute_placements")(self, device_mesh, placements, async_op=async_op)

    def to_dtensor(self, mesh: Any, placements: Sequence[Any]) -> Any:
        """A DTensor sharing this rank's shard, when the layout is expressible."""
        return provided("to_dtensor")(self, mesh, placements)

    def to_shard_tensor(self, mesh: Any, placements: Sequence[Any]) -> Any:
        """A PhysicsNeMo ShardTensor wrapping this rank's shard (uneven sizes kept),
        when the layout is a grid `placements` express; see `shardwise.interop.physicsnemo`."""
        return provided("to_shard_tensor")(self, mesh, placements)

    def to_local(self, *, grad_placements: Sequence[Any] | None = None) -> torch.Tensor:
        """This rank's single shard; differentiable (see `shardwise.from_local`).

        `grad_placements`, as DTensor's: the placements of the gradient that will
        flow into the result (default: the tensor's own); `Partial()` on a mesh
        dimension means the ranks along it hold addends, summed in backward."""
        plan = None if grad_placements is None else provided("grad_plan")(self, grad_placements)
        return provided("to_local")(self, plan)

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
        """This tensor, moved in place to the layout of a legacy spec and returned, as
        legacy `reshard` (`redistribute` returns a new tensor instead). Collective."""
        return provided("reshard")(self, spec)
