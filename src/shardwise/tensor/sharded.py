"""`ShardedTensor`: a `torch.Tensor` whose shape is global and whose data is
this rank's blocks of a `Layout`.

The wrapper holds no storage of its own; `__torch_dispatch__` sends each op to
`shardwise.ops`, which applies it shard by shard. Nothing in this module
communicates: building from a layout is local, and the collective and
conversion methods call the code `shardwise.comm` and `shardwise.interop`
install in `shardwise.tensor.provided` (they sit above this module).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, SupportsIndex

import torch

from ..errors import LayoutError, ShardMismatchError
from ..layout import Block, Layout
from . import dcp_hooks, functions
from .provided import provided

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        MetadataIndex,
        TensorStorageMetadata,
    )
    from torch.distributed.checkpoint.planner import WriteItem

__all__ = ["ShardedTensor"]


class ShardedTensor(torch.Tensor):
    """A tensor split into blocks held by the ranks of a group.

    `shape`, `dtype` and `device` are those of the global tensor; the data on
    this rank is `local_shards()`, one tensor per block of
    `layout_spec.blocks_of(rank)`, in that order. Build one with
    `from_layout`, `empty`, `zeros` or `full`.
    """

    _layout: Layout
    _rank: int
    _shards: list[torch.Tensor]
    _group: Any
    # Per mesh dimension, this rank's offset along the tensor dimension it shards (PhysicsNeMo's
    # `offsets()`), when built on a device mesh (`scatter_tensor`, `from_shard_tensor`); else None.
    _mesh_offsets: tuple[int, ...] | None

    @classmethod
    def __torch_function__(
        cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        # A function handler (shardwise.register_function_handler) if one is registered,
        # otherwise straight to __torch_dispatch__ (as for DTensor).
        return functions.torch_function(func, types, args, kwargs)

    # PhysicsNeMo's ShardTensor registration classmethods, under the same names.
    register_function_handler = staticmethod(functions.register_function_handler)
    register_named_function_handler = staticmethod(functions.register_named_function_handler)

    @staticmethod
    def register_dispatch_handler(op: Any, handler: Any) -> None:
        """PhysicsNeMo's name for `shardwise.register_op` (aten-level handlers)."""
        provided("register_dispatch_handler")(op, handler)

    @staticmethod
    def __new__(
        cls,
        layout: Layout,
        shards: list[torch.Tensor],
        rank: int,
        *,
        dtype: torch.dtype,
        device: torch.device,
        group: Any = None,
        requires_grad: bool = False,
    ) -> ShardedTensor:
        # Internal: callers go through from_layout, which validates.
        out = torch.Tensor._make_wrapper_subclass(
            cls,
            layout.global_shape,
            dtype=dtype,
            device=device,
            requires_grad=requires_grad,
        )
        out._layout = layout
        out._rank = rank
        out._shards = shards
        out._group = group
        out._mesh_offsets = None
        return out

    # -- construction ---------------------------------------------------------

    @classmethod
    def from_layout(
        cls,
        layout: Layout,
        shards: Sequence[torch.Tensor],
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        group: Any = None,
        rank: int | None = None,
        requires_grad: bool | None = None,
    ) -> ShardedTensor:
        """Wrap this rank's shards, one per block of `layout.blocks_of(rank)`.

        No communication: every rank calls it with its own shards, and the
        caller vouches that the ranks agree on `layout`. `dtype` / `device`
        are needed only on a rank that holds no shard. The rank is `rank`, or
        this process's rank in `group` (or the default group), or 0.
        """
        if rank is None:
            rank = provided("current_rank")(group, layout)
        if not 0 <= rank < layout.world_size:
            raise ShardMismatchError(
                f"rank {rank} is outside the layout's world size {layout.world_size}"
            )
        shards = list(shards)
        blocks = layout.blocks_of(rank)
        if len(shards) != len(blocks):
            raise ShardMismatchError(
                f"rank {rank} holds {len(blocks)} blocks in the layout but was given "
                f"{len(shards)} shards"
            )
        for i, (shard, block) in enumerate(zip(shards, blocks)):
            if not isinstance(shard, torch.Tensor) or isinstance(shard, ShardedTensor):
                raise TypeError(
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
            raise TypeError(
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
        if requires_grad is None:
            requires_grad = any(s.requires_grad for s in shards)
        return cls(
            layout,
            shards,
            rank,
            dtype=dtypes.pop() if dtypes else torch.get_default_dtype(),
            device=devices.pop() if devices else torch.device("cpu"),
            group=group,
            requires_grad=requires_grad,
        )

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
    def empty(
        cls,
        layout: Layout,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        group: Any = None,
        rank: int | None = None,
        requires_grad: bool = False,
    ) -> ShardedTensor:
        """Uninitialised shards for this rank's blocks (default dtype as `torch.empty`)."""
        return cls._filled(torch.empty, (), layout, dtype, device, group, rank, requires_grad)

    @classmethod
    def zeros(
        cls,
        layout: Layout,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        group: Any = None,
        rank: int | None = None,
        requires_grad: bool = False,
    ) -> ShardedTensor:
        return cls._filled(torch.zeros, (), layout, dtype, device, group, rank, requires_grad)

    @classmethod
    def full(
        cls,
        layout: Layout,
        fill_value: Any,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        group: Any = None,
        rank: int | None = None,
        requires_grad: bool = False,
    ) -> ShardedTensor:
        """Like `torch.full`: the dtype is inferred from `fill_value` when not given."""
        if dtype is None:
            dtype = torch.full((), fill_value).dtype
        return cls._filled(
            torch.full, (fill_value,), layout, dtype, device, group, rank, requires_grad
        )

    @classmethod
    def _filled(
        cls,
        factory: Any,
        extra: tuple[Any, ...],
        layout: Layout,
        dtype: torch.dtype | None,
        device: torch.device | str | None,
        group: Any,
        rank: int | None,
        requires_grad: bool,
    ) -> ShardedTensor:
        if rank is None:
            rank = provided("current_rank")(group, layout)
        dtype = dtype or torch.get_default_dtype()
        device = torch.device(device) if device is not None else torch.device("cpu")
        shards = [
            factory(b.sizes, *extra, dtype=dtype, device=device) for b in layout.blocks_of(rank)
        ]
        return cls.from_layout(
            layout,
            shards,
            dtype=dtype,
            device=device,
            group=group,
            rank=rank,
            requires_grad=requires_grad,
        )

    def _with_shards(
        self,
        shards: list[torch.Tensor],
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | None = None,
    ) -> ShardedTensor:
        """A new ShardedTensor of this layout, rank and group around `shards`."""
        if shards:
            dtype, device = shards[0].dtype, shards[0].device
        out = ShardedTensor(
            self._layout,
            shards,
            self._rank,
            dtype=dtype or self.dtype,
            device=device or self.device,
            group=self._group,
        )
        out._mesh_offsets = self._mesh_offsets  # same layout, same rank: same mesh offsets
        return out

    # -- what this rank holds ----------------------------------------------

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

    @property
    def local_chunks(self) -> list[ChunkStorageMetadata]:
        """DCP chunks of this rank's blocks, in local-shard order."""
        return dcp_hooks.chunks_of(self.local_blocks)

    def storage_metadata(self) -> TensorStorageMetadata:
        """DCP's description of this tensor: global size, this rank's chunks."""
        return dcp_hooks.storage_metadata(self)

    def is_empty_shard(self) -> bool:
        """True when this rank holds no element of the tensor."""
        return all(b.is_empty() for b in self.local_blocks)

    def is_pinned(self, device: Any = None) -> bool:
        return bool(self._shards) and all(s.is_pinned() for s in self._shards)

    # -- collectives (shardwise.comm) ---------------------------------------

    def full_tensor(self) -> torch.Tensor:
        """The whole tensor on every rank. Collective; differentiable."""
        return provided("full_tensor")(self)

    # Shadows torch.Tensor.gather (an indexing op) with the legacy ShardedTensor's collective.
    def gather(  # type: ignore[override]
        self, dst: int = 0, out: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """The whole tensor on rank `dst`, None on the others. Collective.

        With `out` (on `dst` only, as the legacy API) it is filled and returned."""
        if out is None:
            return provided("gather")(self, dst)
        return provided("gather_into")(self, dst, out)

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

    # -- DCP's _Checkpointable protocol ------------------------------------

    def __create_write_items__(self, fqn: str, object: Any) -> list[WriteItem]:
        return dcp_hooks.create_write_items(self, fqn)

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return dcp_hooks.create_chunk_list(self)

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        return dcp_hooks.get_tensor_shard(self, index)

    # -- ops, printing, pickling ---------------------------------------------

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        return provided("dispatch")(func, args, kwargs or {})

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return (
            f"ShardedTensor(shape={tuple(self.shape)}, dtype={self.dtype}, "
            f"device={self.device}, rank={self._rank}, layout={self._layout}, "
            f"local_shards={len(self._shards)})"
        )

    def __reduce_ex__(self, protocol: SupportsIndex) -> tuple[Any, ...]:
        # The group is process-local and is not pickled: a loaded tensor has none.
        return (
            _rebuild,
            (
                self._layout,
                self._shards,
                self._rank,
                self.dtype,
                str(self.device),
                self.requires_grad,
            ),
        )

    def __deepcopy__(self, memo: dict[int, Any]) -> ShardedTensor:
        with torch.no_grad():
            out = self._with_shards([s.clone() for s in self._shards])
        out.requires_grad_(self.requires_grad)
        memo[id(self)] = out
        return out


def _rebuild(
    layout: Layout,
    shards: list[torch.Tensor],
    rank: int,
    dtype: torch.dtype,
    device: str,
    requires_grad: bool,
) -> ShardedTensor:
    return ShardedTensor(
        layout,
        shards,
        rank,
        dtype=dtype,
        device=torch.device(device),
        requires_grad=requires_grad,
    )
