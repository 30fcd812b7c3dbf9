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
from typing import Any, SupportsIndex

import torch

from ..layout import Layout
from .checkpointable import Checkpointable
from .construction import check_shards, filled_shards
from .functions import register_function_handler, register_named_function_handler, torch_function
from .local_view import LocalView
from .provided import provided
from .provided_methods import ProvidedMethods

__all__ = ["ShardedTensor"]


class ShardedTensor(LocalView, ProvidedMethods, Checkpointable, torch.Tensor):
    """A tensor split into blocks held by the ranks of a group.

    `shape`, `dtype` and `device` are those of the global tensor; the data on
    this rank is `local_shards()`, one tensor per block of
    `layout_spec.blocks_of(rank)`, in that order. Build one with
    `from_layout`, `empty`, `zeros` or `full`. Its collective and conversion
    methods are `ProvidedMethods`, what this rank holds `LocalView`.
    """

    @classmethod
    def __torch_function__(
        cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        # A function handler (shardwise.register_function_handler) if one is registered,
        # otherwise straight to __torch_dispatch__ (as for DTensor).
        return torch_function(func, types, args, kwargs)

    # PhysicsNeMo's ShardTensor registration classmethods, under the same names.
    register_function_handler = staticmethod(register_function_handler)
    register_named_function_handler = staticmethod(register_named_function_handler)

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
        shards = list(shards)
        dtype, device = check_shards(layout, shards, rank, dtype, device, ShardedTensor)
        if requires_grad is None:
            requires_grad = any(s.requires_grad for s in shards)
        return cls(
            layout,
            shards,
            rank,
            dtype=dtype,
            device=device,
            group=group,
            requires_grad=requires_grad,
        )

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
        rank = provided("current_rank")(group, layout) if rank is None else rank
        shards, dtype, device = filled_shards(factory, extra, layout, rank, dtype, device)
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

    # Shadows torch.Tensor.gather (so not in `ProvidedMethods`: mypy checks bases agree).
    # Its legacy ShardedTensor's collective, not the indexing op.
    def gather(  # type: ignore[override]
        self, dst: int = 0, out: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """The whole tensor on rank `dst`, None on the others. Collective.

        With `out` (on `dst` only, as the legacy API) it is filled and returned."""
        if out is None:
            return provided("gather")(self, dst)
        return provided("gather_into")(self, dst, out)

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
