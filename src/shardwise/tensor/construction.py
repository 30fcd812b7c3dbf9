"""How a `ShardedTensor` is built: the checks `from_layout` runs on a rank's shards
before wrapping them, and `PendingLayout`, the layout of a tensor built from its
own blocks alone (`ShardedTensor.from_local_blocks`) until it is learned."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..errors import InvalidTypeError, ShardMismatchError, UsageError
from ..layout import Block, Layout

__all__ = ["PendingLayout", "check_shards", "filled_shards", "learned"]


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


# -----------------------------------------------------------------------------
# A layout learned on first need.
#
# `LocalShardsWrapper(shards, offsets)` needs no process group: it knows its own
# blocks and nothing else. `ShardedTensor.from_local_blocks` is built the same
# way, and its tensor must still answer for the whole layout when an operation
# spans ranks. `PendingLayout` is a `Layout` whose other ranks' blocks are not
# known yet: it answers the global shape, ndim, `blocks_of(its rank)`, `str` and
# `repr` locally; anything else (another rank's blocks, `world_size`, equality
# with another layout, hashing, JSON) first learns the layout, collectively
# (`learn`, installed by `shardwise.comm`: one all-gather of block metadata over
# the tensor's group, validated as `from_local_shards` validates, a problem
# raised on every rank). Learning fills this object's own `Layout` slots, so
# every tensor sharing it (the results of local ops: `_with_shards` passes the
# layout object on) learns at once, and from then on it is an ordinary `Layout`
# at the cost of one attribute hook that no longer fires.
#
# SPMD: learning happens where an operation reads the global layout; which
# operations do so is decided by the operation and the tensor's kind, never by
# what one rank holds, so every rank learns at the same call.
# -----------------------------------------------------------------------------

# The `Layout` slots a learned layout fills; reading one while pending learns.
_LEARNED_SLOTS = ("_blocks", "_allow_holes", "_holders", "_covered", "_hash")


class PendingLayout(Layout):
    """The layout of a tensor built from this rank's blocks only, learned on first need.

    `learn(pending) -> Layout` is collective over the tensor's group (every rank
    must reach it at the same point); None on a pickled copy, which has no group.
    """

    __slots__ = ("_rank", "_own", "_learn", "_learned")

    def __init__(
        self,
        global_shape: Sequence[int],
        rank: int,
        own_blocks: Sequence[Block],
        learn: Callable[[PendingLayout], Layout] | None,
    ) -> None:
        # Layout.__init__ is not called: the slots in _LEARNED_SLOTS stay unset until learned.
        self._shape = tuple(int(s) for s in global_shape)
        self._rank = rank
        self._own = tuple(own_blocks)
        self._learn = learn
        self._learned: Layout | None = None

    def __getattr__(self, name: str) -> Any:
        # Called only for an unset attribute: a `Layout` slot read before learning.
        # Anything else raises AttributeError from the plain lookup.
        if name in _LEARNED_SLOTS:
            self.learn()
        return object.__getattribute__(self, name)

    @property
    def is_learned(self) -> bool:
        return self._learned is not None

    def learn(self) -> Layout:
        """The whole layout, learned now if not yet. Collective the first time."""
        if self._learned is None:
            if self._learn is None:
                raise UsageError(
                    f"the layout of this tensor (global shape {self._shape}, rank {self._rank}'s "
                    f"blocks {', '.join(map(str, self._own)) or 'none'}) was never learned and "
                    f"it has no process group (it was unpickled); rebuild it with "
                    f"ShardedTensor.from_local_blocks(..., group=...) on every rank"
                )
            learned = self._learn(self)
            if learned.global_shape != self._shape or learned.blocks_of(self._rank) != self._own:
                raise ShardMismatchError(  # the learner checks this on every rank first
                    f"rank {self._rank} learned {learned} but holds {self._own}"
                )
            for slot in _LEARNED_SLOTS:
                setattr(self, slot, getattr(learned, slot))
            self._learned = learned
            self._learn = None  # the group and the learner are not needed any more
        return self._learned

    def blocks_of(self, rank: int) -> tuple[Block, ...]:
        if rank == self._rank:
            return self._own
        return super().blocks_of(rank)

    def __eq__(self, other: object) -> bool:
        # The same object (one family of tensors) is equal without learning.
        return other is self or super().__eq__(other)

    __hash__ = Layout.__hash__

    def __repr__(self) -> str:
        if self._learned is not None:
            return repr(self._learned)
        return (
            f"PendingLayout(global_shape={self._shape}, rank={self._rank}, "
            f"blocks={list(self._own)})"
        )

    def __str__(self) -> str:
        if self._learned is not None:
            return str(self._learned)
        shape = "x".join(map(str, self._shape)) or "scalar"
        return f"Layout({shape}, rank {self._rank}'s {len(self._own)} blocks; others not learned)"

    def __reduce__(self) -> tuple[Any, ...]:
        if self._learned is not None:
            return self._learned.__reduce__()
        # the learner holds a process group, which does not pickle
        return (PendingLayout, (self._shape, self._rank, self._own, None))


def learned(layout: Layout) -> bool:
    """Whether every rank's blocks of `layout` are known (reading them needs no exchange)."""
    return not isinstance(layout, PendingLayout) or layout.is_learned
