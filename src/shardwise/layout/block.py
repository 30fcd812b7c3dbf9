"""`Block`: an axis-aligned box of a global tensor, the one unit of N-d geometry.

Every other piece of shardwise that reasons about "which elements" (layout
validation, transfer planning, DCP chunk lists, load planning) goes through
`Block.intersect`, so there is exactly one place where off-by-ones can live.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from ..errors import InvalidTypeError, LayoutError

__all__ = ["Block"]


def _int_tuple(values: Iterable[int], what: str) -> tuple[int, ...]:
    values = tuple(values)
    for v in values:
        if type(v) is not int:  # the common case stays a single type check
            if isinstance(v, bool) or not hasattr(v, "__index__"):
                raise InvalidTypeError(f"{what} must be integers, got {v!r}")
            return tuple(v.__index__() for v in values)
    return values


class Block:
    """A box `[offsets, offsets + sizes)` in global coordinates.

    Immutable and hashable, so identical blocks held by several ranks (replicas)
    compare equal and can key dictionaries. Zero sizes are allowed: such a block
    holds no element and intersects nothing.
    """

    # A hand-written slotted class rather than a frozen dataclass: layouts of
    # 100,000 blocks build one per block, and this is twice as fast to create.
    __slots__ = ("offsets", "sizes", "ends", "_hash")
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    ends: tuple[int, ...]
    """Exclusive upper corner, `offsets + sizes`."""
    _hash: int

    def __init__(self, offsets: Iterable[int], sizes: Iterable[int]) -> None:
        offsets = _int_tuple(offsets, "Block offsets")
        sizes = _int_tuple(sizes, "Block sizes")
        if len(offsets) != len(sizes):
            raise LayoutError(
                f"Block offsets {offsets} and sizes {sizes} have different lengths (ndim); "
                f"give one offset and one size per dimension"
            )
        if offsets and (min(offsets) < 0 or min(sizes) < 0):
            which = "offsets" if min(offsets) < 0 else "sizes"
            raise LayoutError(
                f"Block offsets {offsets} and sizes {sizes}: {which} must be non-negative "
                f"(a block lies inside the tensor, and a size of 0 is an empty block)"
            )
        init = object.__setattr__
        init(self, "offsets", offsets)
        init(self, "sizes", sizes)
        init(self, "ends", tuple(map(int.__add__, offsets, sizes)))
        init(self, "_hash", hash((offsets, sizes)))

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"Block is immutable; cannot set {name!r}")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Block):
            return NotImplemented
        return self.offsets == other.offsets and self.sizes == other.sizes

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self) -> tuple[type[Block], tuple[tuple[int, ...], tuple[int, ...]]]:
        return Block, (self.offsets, self.sizes)

    def __repr__(self) -> str:
        return f"Block(offsets={self.offsets!r}, sizes={self.sizes!r})"

    @property
    def ndim(self) -> int:
        """The number of dimensions (0 for the single element of a scalar)."""
        return len(self.sizes)

    @property
    def numel(self) -> int:
        """The number of elements in the box."""
        return math.prod(self.sizes)

    def is_empty(self) -> bool:
        """True when the block holds no element (some size is 0)."""
        return self.numel == 0

    def intersect(self, other: Block) -> Block | None:
        """The common box, or `None` when the two share no element.

        Blocks that merely touch share no element, and a zero-size block
        shares none with anything.
        """
        if other.ndim != self.ndim:
            raise LayoutError(
                f"cannot intersect {self}, a {self.ndim}-d block, with {other}, a "
                f"{other.ndim}-d block (ndim); both must index the same tensor"
            )
        common = overlap(self.offsets, self.sizes, other.offsets, other.sizes)
        if common is None:
            return None
        if self.ndim == 0:
            return self  # a 0-d block is the single element of a scalar
        return Block(*common)

    def contains(self, other: Block) -> bool:
        """True when every element of `other` lies inside this block."""
        if other.ndim != self.ndim:
            return False
        return all(
            a0 <= b0 and b0 + bn <= a0 + an
            for a0, an, b0, bn in zip(self.offsets, self.sizes, other.offsets, other.sizes)
        )

    def relative_to(self, outer: Block) -> Block:
        """This block in the local coordinates of `outer`, which must contain it."""
        if not outer.contains(self):
            raise LayoutError(
                f"{self} (offsets {self.offsets}) is not inside {outer} (offsets "
                f"{outer.offsets}), so it has no coordinates relative to it"
            )
        return Block(tuple(o - p for o, p in zip(self.offsets, outer.offsets)), self.sizes)

    def slices(self) -> tuple[slice, ...]:
        """Index a tensor with these slices to get the block's elements."""
        return tuple(slice(o, o + s) for o, s in zip(self.offsets, self.sizes))

    def __str__(self) -> str:
        return "[" + ", ".join(f"{o}:{o + s}" for o, s in zip(self.offsets, self.sizes)) + "]"


def overlap(
    a_offsets: Sequence[int],
    a_sizes: Sequence[int],
    b_offsets: Sequence[int],
    b_sizes: Sequence[int],
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The common box (offsets, sizes) of two boxes of one tensor, or None when they
    share no element (touching boxes and zero-size ones share none): the one
    intersection, for `Block.intersect` and for callers holding boxes as tuples
    (a load's pieces and stored chunks, a save's chunk check), who skip building
    Blocks in their inner loops."""
    offsets = []
    sizes = []
    for a0, an, b0, bn in zip(a_offsets, a_sizes, b_offsets, b_sizes):
        lo = a0 if a0 > b0 else b0
        hi = min(a0 + an, b0 + bn)
        if hi <= lo:
            return None
        offsets.append(lo)
        sizes.append(hi - lo)
    return tuple(offsets), tuple(sizes)
