"""A reduction whose combine across ranks has not run yet (DTensor's `Partial`).

A sum along a sharded dimension leaves each rank a part of the result: the
value is the sum (or maximum, minimum) of the ranks' parts. DTensor returns
such a result as `Partial` and combines it only when it is used, so a loss
that is only differentiated, or a weight gradient that is accumulated and
then applied, costs no collective at the reduction itself. A `ShardedTensor`
does the same: its `_pending` holds the parts and, once combined, the values.

A record stands for storage, as a tensor's storage does: the tensor and its
aliases (`detach`) share one record, so the combine runs once for all of
them; a view of a pending tensor (`view`, `t`, `select`, ...) has a record of
its own whose parts are that view of its base's parts, and whose values are
that view of its base's values, so a write through either is seen by the
other before and after the combine. In-place ops that keep a result pending
(`add_`, `mul_`, `zero_`) write into the parts.

A move posted with `async_op=True` is another value not known yet: its
shards are allocated, their remote elements still in flight. `Arriving`
holds the wait; the first read of the shards runs it (no collective: every
rank posted its messages when it called the move).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["Arriving", "Pending"]


class Pending:
    """This rank's parts of a result, combined across the group by `op` on first use; for
    a view, its `base`'s record and the view (`derive`) taken of the base's parts."""

    __slots__ = ("op", "parts", "combined", "base", "derive")

    def __init__(
        self,
        op: str,
        parts: list[torch.Tensor],
        base: Pending | None = None,
        derive: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        self.op = op
        self.parts = parts
        # the values, once some holder of the record (or of its base) has read them
        self.combined: list[torch.Tensor] | None = None
        self.base, self.derive = base, derive

    @property
    def done(self) -> bool:
        """Whether the values are known without a collective."""
        return self.combined is not None or (self.base is not None and self.base.done)

    def values(self, combine: Callable[[Pending], list[torch.Tensor]]) -> list[torch.Tensor]:
        """The values: a view's are its view of its base's; a base's, `combine(self)`
        (collective) the first time."""
        if self.combined is None:
            if self.base is not None and self.derive is not None:
                self.combined = [self.derive(self.base.values(combine)[0])]
            else:
                self.combined = combine(self)
        return self.combined

    def __repr__(self) -> str:
        state = "combined" if self.done else "not combined"
        return f"Pending({self.op!r}, {state})"


class Arriving:
    """The messages of a move still in flight into a tensor's shards: `wait()` (once;
    later calls return at once) waits for them and unpacks them into the shards."""

    __slots__ = ("_finish",)

    def __init__(self, finish: Callable[[], None]) -> None:
        self._finish: Callable[[], None] | None = finish

    @property
    def done(self) -> bool:
        return self._finish is None

    def wait(self) -> None:
        finish, self._finish = self._finish, None
        if finish is not None:
            finish()

    def __repr__(self) -> str:
        return f"Arriving({'landed' if self.done else 'in flight'})"
